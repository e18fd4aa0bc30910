"""Data and rewards inside real training runs (train_grpo.py, tiny model, real vLLM on CPU; ~30 s per run).

(a) data_prep/gsm8k.py run as a script on made-up GSM8K rows -> parquet -> 2 training steps; the overlong
    prompt is dropped, counted in metrics.jsonl and reported on the console; validation reads test.parquet.
(b) a parquet in verl's schema written with pandas + a verl-signature custom reward file -> 2 steps; the
    custom function was used with verl's keyword arguments (every response scores its distinctive 0.3).
(c) a custom reward that raises for some responses and sleeps past reward.timeout_s for others: the run
    finishes, errors and timeouts are counted, every other response is still scored.
Plus one cheap run (no engine starts): a missing data file exits 2 with a message, not a traceback.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import HF_ENGINE, REPO, read_metrics, run_train, tiny_overrides

pytestmark = pytest.mark.slow  # tiers: conftest.py

TWO_STEPS = ["trainer.total_training_steps=2", "data.max_prompt_length=192"]


def write_gsm8k_style(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def write_custom_reward(path: Path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


# ------------------------------------------------------------------------------ (a) gsm8k data_prep
GSM8K_TRAIN = [
    {"question": "Tom has 12 apples and buys 5 more. How many?", "answer": "12+5=<<12+5=17>>17\n#### 17"},
    {"question": "A pen costs $2. What do 4 pens cost?", "answer": "4*2=<<4*2=8>>8\n#### 8"},
    {"question": "Ann has 7 cats. Bob has 2 fewer. How many?", "answer": "7-2=5\n#### 5"},
    {"question": "How many days are in 3 weeks?", "answer": "3*7=21\n#### 21"},
    {"question": "Half of 9 liters is how much?", "answer": "9/2=4.5\n#### 4.5"},
    {"question": "One thousand plus 234?", "answer": "1000+234=1234\n#### 1,234"},
    {"question": "A very long story. " * 40 + "How many?", "answer": "1+1=2\n#### 2"},  # overlong: filtered
]
GSM8K_TEST = [
    {"question": "What is 2 + 2?", "answer": "2+2=4\n#### 4"},
    {"question": "What is 3 + 3?", "answer": "3+3=6\n#### 6"},
]


def test_gsm8k_prep_script_output_trains(tiny_model_dir, tmp_path):
    train = write_gsm8k_style(tmp_path / "gsm8k_train.jsonl", GSM8K_TRAIN)
    test = write_gsm8k_style(tmp_path / "gsm8k_test.jsonl", GSM8K_TEST)
    prep = subprocess.run([sys.executable, str(REPO / "data_prep" / "gsm8k.py"), "--input-train", train, "--input-test", test,
                           "--out", str(tmp_path / "gsm8k")], capture_output=True, text=True, cwd="/", timeout=120)
    assert prep.returncode == 0, f"data_prep/gsm8k.py failed: {prep.stderr}"
    data = {"train": tmp_path / "gsm8k" / "train.parquet", "test": tmp_path / "gsm8k" / "test.parquet"}
    out = tmp_path / "run"
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, data, out, *TWO_STEPS, HF_ENGINE,
                      "trainer.val_before_train=true")])
    rows = metric_rows(out)
    summary = next(r for r in rows if "data/train_prompts" in r)
    assert summary["data/filtered_overlong"] == 1 and summary["data/train_prompts"] == 6, \
        f"the overlong GSM8K question is dropped and counted: {summary}"
    console = proc.stdout + proc.stderr
    assert "dropped 1 of 7 prompts longer than data.max_prompt_length=192" in console, "a console line says how many"
    steps = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2], f"2 training steps: {steps}"
    for r in steps:
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["actor/pg_loss"]), r
        assert r["reward/errors"] == 0 and r["reward/timeouts"] == 0, f"the gsm8k rule scores every response: {r}"
    assert any("val/openai/gsm8k/acc" in r for r in rows), f"validation on test.parquet, by data_source: {rows}"


# --------------------------------------------------------------------- (b) verl schema + custom reward
VERL_REWARD = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # 0.3 only when verl's keyword arguments arrive intact. The built-in rule scores 0 or 1, so its batch mean
        # is a multiple of 1/16 here (16 responses): it can never be 0.3
        ok = (data_source == "openai/gsm8k" and isinstance(solution_str, str)
              and ground_truth == str(100 + extra_info["index"]) and extra_info["split"] == "train")
        return {"score": 0.3 if ok else 0.0, "acc": float(ok)}
"""


@pytest.fixture
def verl_parquet(tmp_path) -> dict[str, Path]:
    """Rows exactly as verl's examples/data_preprocess/gsm8k.py writes them (pandas -> parquet)."""
    paths = {}
    for split, count in (("train", 8), ("test", 2)):
        rows = []
        for index in range(count):
            messages = [{"role": "user", "content": f"What is {index} + 100? Let's think step by step and output the final answer after \"####\"."}]
            if index % 2:
                messages.insert(0, {"role": "system", "content": "You are a careful solver."})
            rows.append({"data_source": "openai/gsm8k", "prompt": messages, "ability": "math",
                         "reward_model": {"style": "rule", "ground_truth": str(100 + index)},
                         "extra_info": {"split": split, "index": index}})
        paths[split] = tmp_path / f"verl_{split}.parquet"
        pd.DataFrame(rows).to_parquet(paths[split])
    return paths


def test_verl_schema_parquet_with_custom_reward_trains(tiny_model_dir, verl_parquet, tmp_path):
    reward_file = write_custom_reward(tmp_path / "verl_reward.py", VERL_REWARD)
    out = tmp_path / "run"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, verl_parquet, out, *TWO_STEPS, HF_ENGINE,
               f"reward.custom.path={reward_file}", "reward.custom.name=compute_score")])
    steps = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2], f"2 training steps: {steps}"
    for r in steps:
        assert r["reward/mean"] == pytest.approx(0.3, abs=1e-6), \
            f"every response scored by the custom function with verl's arguments: {r}"
        assert r["reward/errors"] == 0 and r["reward/timeouts"] == 0, r


# ----------------------------------------------------------------------- (c) raising / slow rewards
FLAKY_REWARD = """
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "raise":
            raise ValueError("this reward function is broken for this row")
        if ground_truth == "sleep":
            time.sleep(60)  # far past reward.timeout_s
        return 0.5
"""


def test_raising_and_slow_rewards_are_counted_and_run_finishes(tiny_model_dir, tmp_path):
    rows = []
    for index, kind in enumerate(["raise", "sleep", "ok", "ok"] * 2):  # no shuffle: each batch of 4 holds one of each
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {index} + 1?"}],
                     "reward_model": {"style": "rule", "ground_truth": kind}, "extra_info": {"split": "train", "index": index}})
    data = {"train": tmp_path / "flaky_train.parquet", "test": tmp_path / "flaky_test.parquet"}
    pd.DataFrame(rows).to_parquet(data["train"])
    pd.DataFrame(rows[:2]).to_parquet(data["test"])
    reward_file = write_custom_reward(tmp_path / "flaky_reward.py", FLAKY_REWARD)
    out = tmp_path / "run"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, data, out, *TWO_STEPS, HF_ENGINE, "data.shuffle=false",
               f"reward.custom.path={reward_file}", "reward.timeout_s=1", "reward.num_workers=2")])
    steps = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2], f"the run finishes its 2 steps: {steps}"
    for r in steps:  # per step: 4 prompts x rollout.n=4 -> 4 raising, 4 sleeping, 8 scored responses
        assert r["reward/errors"] == 4 and r["reward/timeouts"] == 4, f"failures counted: {r}"
        assert r["reward/mean"] == 0.25, f"the 8 other responses still score 0.5 each (8 x 0.5 / 16): {r}"
        assert r["timing_s/reward"] < 30, f"a sleeping reward is cut at reward.timeout_s: {r['timing_s/reward']} s"


# ------------------------------------------------------------------------------- data errors, no engine
def test_missing_data_file_exits_2_without_traceback(tiny_model_dir, tmp_path):
    data = {"train": tmp_path / "nope" / "train.parquet", "test": tmp_path / "nope" / "test.parquet"}
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, data, tmp_path / "run")], check=False, timeout=300)
    assert proc.returncode == 2, f"expected exit code 2, got {proc.returncode}: {proc.stderr[-3000:]}"
    assert "nope/train.parquet" in proc.stderr and "does not exist" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, f"a clear message, not a traceback: {proc.stderr[-3000:]}"
