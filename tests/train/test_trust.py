"""Outputs that can be trusted (issue 11): rewards that fail stop the run with exit code 3 after saving the last
completed step; validation reports per-source accuracy with mean@n <= pass@n and logs (prompt, response, score)
samples; rows without a ground truth are dropped and counted, never scored. Two real runs (tiny model, vLLM on
CPU, ~1 min each) plus in-process checks."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from grpo_lib.config import Config, DataConfig
from tests.conftest import HF_ENGINE, read_metrics, run_train, tiny_overrides

# --------------------------------------------------------------------------------------- in-process checks


class FakeScorer:
    """Scores `accuracy` 1.0 when the response is the ground truth; a 0.5 format bonus for every response."""

    def score(self, *, responses, data_sources, ground_truths, extra_infos):
        from grpo_lib.rewards import RewardOutput

        acc = [float(r == g) for r, g in zip(responses, ground_truths)]
        return RewardOutput(scores=[a + 0.5 for a in acc], per_function={"accuracy": acc, "format": [1.0] * len(acc)},
                            extra={}, num_errors=0, num_timeouts=0)


def fake_batch(groups: list[tuple[str, str, list[str]]]):
    """[(source, answer, [responses of one prompt])] -> a RolloutBatch with the fields validation reads."""
    from grpo_lib.core.types import RolloutBatch

    rows = [(f"p{p}", src, answer, resp) for p, (src, answer, responses) in enumerate(groups) for resp in responses]
    B = len(rows)
    zeros = torch.zeros((B, 2))  # [B, 2]
    return RolloutBatch(input_ids=zeros.long(), attention_mask=zeros.long(), response_mask=zeros, loss_mask=zeros, rollout_logprobs=zeros,
                        group_ids=[r[0] for r in rows], response_texts=[r[3] for r in rows], data_sources=[r[1] for r in rows],
                        ground_truths=[r[2] for r in rows], extra_infos=[{}] * B, truncated=torch.zeros(B, dtype=torch.bool))


def test_val_metrics_mean_and_pass_at_n_by_hand():
    from grpo_lib.rollout.validation import val_metrics

    batch = fake_batch([("a", "1", ["1", "0", "0", "0"]),   # 1 of 4 correct
                        ("a", "2", ["0", "0", "0", "0"]),   # none
                        ("b", "3", ["3", "3", "3", "0"])])  # 3 of 4
    m = val_metrics(FakeScorer(), batch, sources=["a", "b"], n=4)
    # source a: acc = 1/8; mean@4 = (1/4 + 0) / 2 = 0.125; pass@4 = (1 + 0) / 2 = 0.5; reward = 1/8 + 0.5 (format bonus)
    assert m["val/a/acc"] == 0.125 and m["val/a/mean@4"] == 0.125 and m["val/a/pass@4"] == 0.5, m
    assert m["val/a/reward_mean"] == 0.625, "reward includes the format bonus; accuracy does not"
    # source b: acc = mean@4 = 3/4, pass@4 = 1
    assert m["val/b/acc"] == 0.75 and m["val/b/mean@4"] == 0.75 and m["val/b/pass@4"] == 1.0, m
    single = val_metrics(FakeScorer(), fake_batch([("a", "1", ["1"])]), sources=["a"], n=1)
    assert "val/a/pass@1" not in single and single["val/a/acc"] == 1.0, "n = 1: no @n metrics"


def test_check_reward_errors_stops_past_the_fraction():
    from grpo_lib.trainer.step import RunAborted, check_reward_errors

    cfg = Config()
    ok = {"reward/error_fraction": 0.5, "reward/errors": 8.0, "reward/timeouts": 0.0}
    check_reward_errors(cfg, ok, step=1)  # exactly the limit: not more than it
    with pytest.raises(RunAborted, match="step 2: 100% of responses could not be scored") as info:
        check_reward_errors(cfg, {**ok, "reward/error_fraction": 1.0}, step=2, samples=["accuracy on response 0: error: boom"])
    assert info.value.exit_code == 3 and "boom" in str(info.value)


@pytest.fixture(scope="module")
def tokenizer():
    from data_prep.tiny_model import build_tokenizer

    return build_tokenizer([f"What is {a} + {b}? #### {a + b}" for a in range(10) for b in range(10)])


@pytest.mark.parametrize("bad", [None, float("nan"), "", "  ", []])
def test_rows_without_ground_truth_dropped_and_counted(tokenizer, tmp_path, bad, caplog):
    from grpo_lib.rollout.data import DataError, load_prompts

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": bad if i in (1, 3) else str(i + 1)}} for i in range(5)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_prompts([str(path)], tokenizer, DataConfig(train_files=["x"]))
    assert len(data) == 3 and data.num_invalid == 2, f"2 rows without a ground truth dropped: {data.num_invalid}"
    assert data.ground_truths == ["1", "3", "5"], "only rows with an answer remain (never scored)"
    assert "dropped 2 of 5 rows whose ground truth is missing" in caplog.text
    with pytest.raises(DataError, match=r"rows\.jsonl' row 1 \(0-based\): reward_model.ground_truth is"):
        load_prompts([str(path)], tokenizer, dataclasses.replace(DataConfig(train_files=["x"]), invalid_rows="error"))


# ---------------------------------------------------------------------------------------------- real runs
# Rows 0-3 (the first batch, no shuffle) score normally; rows 4-7 get a ground truth the reward returns None for.
FAILING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "broken":
        return None  # what a buggy reward does: no number
    return 0.5
"""


@pytest.mark.slow
def test_reward_failing_on_every_response_exits_3_after_saving(tiny_model_dir, tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": "broken" if i >= 4 else "ok"}} for i in range(8)]
    data = {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    pd.DataFrame(rows).to_parquet(data["train"])
    pd.DataFrame(rows[:2]).to_parquet(data["test"])
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent(FAILING_REWARD))
    out = tmp_path / "run"
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, data, out, HF_ENGINE, "data.shuffle=false",
                      "trainer.total_training_steps=3", "data.max_prompt_length=192", f"reward.custom.path={reward}")],
                     check=False)
    assert proc.returncode == 3, f"exit 3 expected, got {proc.returncode}: {proc.stderr[-3000:]}"
    assert "step 2: 100% of responses could not be scored" in proc.stderr and "reward.max_error_fraction=0.5" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "reward/error_fraction" in r}
    assert by_step[1]["reward/error_fraction"] == 0.0 and by_step[2]["reward/error_fraction"] == 1.0, by_step
    assert "actor/pg_loss" not in by_step[2], "the failing step trained nothing"
    assert (out / "global_step_1" / "actor" / "config.json").exists(), "the last completed step is saved"
    assert not (out / "global_step_2").exists() and not (out / "global_step_3").exists()
    sampler = json.loads((out / "global_step_1" / "trainer_state.json").read_text())["sampler"]
    assert (sampler["epoch"], sampler["position"]) == (0, 4), f"a resume must redraw the aborted step's 4 prompts: {sampler}"


VARIED_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied, deterministic reward: advantages and so the update are non-zero at step 1 on the random tiny model
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
"""


def push_skipping_run(tiny_model_dir, arith_data, tmp_path, engine: str, steps: int, extra: tuple[str, ...] = (),
                      skip: bool = True, expect_exit: int = 3, skipped: str = "model.layers.0.mlp.down_proj.weight"):
    """A run whose every push leaves out one parameter, `skipped` (the engine keeps the stale copy it loaded from
    model.path; tests/scripts/train_with_faults.py --push-skips), actor.lr 1e-3 unless `extra` sets it: far above the
    float32 tolerance (about 6e-6 here)."""
    reward = tmp_path / "reward.py"
    reward.write_text(VARIED_REWARD)
    out = tmp_path / "run"
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(
        tiny_model_dir, arith_data, out, f"rollout.name={engine}", f"reward.custom.path={reward}", "actor.lr=1e-3",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.logger=[console,jsonl]",
        *extra)], faults=["--push-skips", skipped] if skip else [], check=False)
    assert proc.returncode == expect_exit, f"exit {expect_exit} expected, got {proc.returncode}: {proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc, out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_push_that_skips_a_parameter_is_caught_by_the_weight_probe_and_stops_after_saving(tiny_model_dir, arith_data,
                                                                                            tmp_path, engine):
    """Issue 20: the stale-weights class. The weight probe, on by default, sees in step 2's generation (the first after a
    push) the engine's logprobs of the probe away from the actor's after step 1's update and stops the run before step
    2's update: step 1 is saved (the actor's weights are right), exit 3, a message saying what happened and that
    rollout/weight_probe_abs_diff shows it; step 1's probe (the weights both loaded from model.path) passed."""
    proc, out = push_skipping_run(tiny_model_dir, arith_data, tmp_path, engine, steps=2)
    assert "step 2: the engine does not serve the actor's weights" in proc.stderr, proc.stderr[-3000:]
    assert "This step's rollouts came from other weights" in proc.stderr, proc.stderr[-3000:]
    first, row = read_metrics(out)
    assert first["step"] == 1 and first["rollout/weight_probe_abs_diff"] <= first["rollout/weight_probe_tolerance"], first
    assert row["step"] == 2 and row["rollout/weight_probe_abs_diff"] > row["rollout/weight_probe_tolerance"], row
    assert "actor/pg_loss" not in row, "step 2 trained on the rollouts of the wrong weights"
    assert (out / "global_step_1" / "COMPLETE").is_file(), "the last completed step is saved (its actor weights are right)"
    assert not (out / "global_step_2").exists()


BF16 = ("actor.fsdp_config.param_dtype=bfloat16", "rollout.dtype=bfloat16")


@pytest.mark.slow
def test_a_skipped_parameter_is_caught_in_bf16_and_a_healthy_bf16_run_never_alarms(tiny_model_dir, arith_data, tmp_path):
    """Issue 28 item 8, the GPU default: bf16 compute on both sides (the hf engine and the actor). Issue 41: the
    tolerance is 3 x the largest difference of the first 3 probes, at least 3 x the bf16 noise floor (0.039 at this
    probe's scale), so a mismatch must be larger than one bf16 rounding of the logprobs to be seen: the push leaving out
    layers.1.self_attn.o_proj at lr 1e-2 (measured 0.031 at step 2, under 0.039 and taken as noise; 0.12 at step 3,
    above 3 x 0.031) is caught by step 3 on the AVX-512 EPYC; on an AMX Xeon (2026-12-06: bf16 rounds otherwise there)
    0.032 at step 2 and 0.081 at step 3 are both taken as noise and 0.31 at step 4, above 3 x 0.081, is caught: by step
    4, the run's last, on either; the fixed bf16 bound (0.42) alone never fired. (layers.0.mlp.down_proj at lr
    1e-3 moves the probe by 2.7e-3 to 5.1e-3: under the floor, no longer caught in bf16; caught in float32 above.) The
    same run without the skipped parameter trains 4 steps with every probe's ratio under 1 (measured at most 1.5e-3:
    a ratio of 0.04)."""
    (tmp_path / "stale").mkdir()
    (tmp_path / "healthy").mkdir()
    proc, out = push_skipping_run(tiny_model_dir, arith_data, tmp_path / "stale", "hf", steps=4, extra=(*BF16, "actor.lr=1e-2"),
                                  skipped="model.layers.1.self_attn.o_proj.weight")
    rows = read_metrics(out)
    assert rows[-1]["step"] <= 4 and rows[-1]["rollout/weight_probe_ratio"] > 1, rows
    assert "the engine does not serve the actor's weights" in proc.stderr, proc.stderr[-3000:]
    proc, out = push_skipping_run(tiny_model_dir, arith_data, tmp_path / "healthy", "hf", steps=4, extra=(*BF16, "actor.lr=1e-2"),
                                  skip=False, expect_exit=0)
    ratios = [r["rollout/weight_probe_ratio"] for r in read_metrics(out)]
    assert len(ratios) == 4 and max(ratios) < 1, ratios


@pytest.mark.slow
def test_the_push_after_the_last_update_is_probed_too(tiny_model_dir, arith_data, tmp_path):
    """A 1-step run: no generation follows its push, so the engine scores the probe at once; the mismatch stops the run
    with exit 3, the step saved, the row holding the failed probe."""
    proc, out = push_skipping_run(tiny_model_dir, arith_data, tmp_path, "hf", steps=1)
    assert "step 1: the engine does not serve the actor's weights" in proc.stderr, proc.stderr[-3000:]
    assert "The last update's push left the engine with other weights" in proc.stderr, proc.stderr[-3000:]
    (row,) = read_metrics(out)
    assert row["rollout/weight_probe_abs_diff"] > row["rollout/weight_probe_tolerance"] and "actor/pg_loss" in row, row
    assert (out / "global_step_1" / "COMPLETE").is_file()


@pytest.mark.slow
def test_dynamic_sampling_without_a_usable_group_exits_3_without_a_traceback(tiny_model_dir, arith_data, tmp_path):
    """The stops raised while collecting rollouts (DAPO finding no group whose scores differ, or rewards that all
    fail under filter_groups) reach train_grpo's exit-3 path: they used to escape it as a traceback with exit 1."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    out = tmp_path / "run"
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, HF_ENGINE, "trainer.total_training_steps=2",
                      "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2",
                      f"reward.custom.path={reward}", "reward.num_workers=0")], check=False)
    assert proc.returncode == 3, f"exit 3 expected, got {proc.returncode}: {proc.stderr[-3000:]}"
    assert "step 1: dynamic sampling found no group with different scores in 2 rounds" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (out / "global_step_1").exists(), "nothing completed, nothing saved"


@pytest.mark.slow
def test_val_only_reports_pass_at_n_and_logs_generations(tiny_model_dir, arith_data, tmp_path):
    out = tmp_path / "run"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, HF_ENGINE, "trainer.val_only=true",
               "rollout.val_kwargs.n=4", "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0",
               "trainer.val_generations_to_log=5")])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = next(r for r in rows if "val/reward_mean" in r)
    assert "val/synthetic/arithmetic/acc" in val, f"per-source metrics: {val}"
    for key in [k for k in val if k.endswith("/acc")]:
        prefix = key[: -len("/acc")]
        mean_n, pass_n = val[f"{prefix}/mean@4"], val[f"{prefix}/pass@4"]
        assert 0.0 <= mean_n <= pass_n <= 1.0, f"pass@4 >= mean@4 on {prefix}: {val}"
        assert math.isclose(mean_n, val[key]), "every prompt has 4 responses: mean@4 equals acc"
        assert f"{prefix}/reward_mean" in val
    generations = [json.loads(line) for line in (out / "val_generations.jsonl").read_text().splitlines()]
    assert len(generations) == 5, f"trainer.val_generations_to_log=5 rows: {len(generations)}"
    assert all(set(g) >= {"step", "prompt", "response", "score", "ground_truth"} and g["prompt"] for g in generations)
    assert not list(out.glob("global_step_*")), "val_only trains and saves nothing"
    assert not any("actor/pg_loss" in r for r in rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "val/generations/text_summary" in events.Tags()["tensors"], events.Tags()


HANGING_REWARD = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    open(os.path.join({marks!r}, str(os.getpid())), "w").close()  # "a worker is inside a call"
    time.sleep(300)
    return 0.0
"""


@pytest.mark.slow
def test_no_reward_worker_survives_sigkill_of_the_trainer(tiny_model_dir, arith_data, tmp_path):
    """SIGKILL train_grpo.py while its reward workers hang inside calls: every process it started is gone within
    a few seconds (the forkserver and the workers alike)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    marks = tmp_path / "marks"
    marks.mkdir()
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent(HANGING_REWARD.format(marks=str(marks))))
    args = [*tiny_overrides(tiny_model_dir, arith_data, tmp_path / "run", HF_ENGINE, f"reward.custom.path={reward}",
            "reward.timeout_s=250", "reward.num_workers=2", "trainer.val_before_train=false")]
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(repo / "train_grpo.py"), "recipes/tiny_cpu.yaml", *args], cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 400
        while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert len(list(marks.iterdir())) >= 2, "both reward workers should be inside a hanging call"
        descendants = psutil.Process(proc.pid).children(recursive=True)
        workers = {int(p.name) for p in marks.iterdir()}
        assert workers <= {p.pid for p in descendants}, "the marked workers are the trainer's descendants"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        alive, gone_by = descendants, time.monotonic() + 10
        while alive and time.monotonic() < gone_by:
            time.sleep(0.2)
            alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"outlived the SIGKILLed trainer: {[(p.pid, ' '.join(p.cmdline())[:120]) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dynamic_sampling_with_a_failing_reward_stops_with_exit_3():
    """With DAPO's filter_groups, rewards that all fail make every group all-equal (zeros): the run stops as
    untrustworthy (RunAborted, exit 3) instead of 'no group with different scores'."""
    from grpo_lib.config import load_config
    from grpo_lib.rewards import RewardOutput
    from grpo_lib.trainer import rounds
    from grpo_lib.trainer import step
    from tests.train.test_algorithm_recipes import CyclingSampler, FakeData, FakeEngine

    class FailingScorer:
        last_error_samples = ["accuracy on response 0: error: TypeError: float() argument must be ... not 'NoneType'"]

        def score(self, *, responses, data_sources, ground_truths, extra_infos):
            n = len(responses)
            return RewardOutput(scores=[0.0] * n, per_function={"accuracy": [0.0] * n}, extra={}, num_errors=n, num_timeouts=0,
                                num_failed_responses=n)

    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused.parquet]", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=3",
                             "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"])
    with pytest.raises(step.RunAborted, match="100% of responses could not be scored") as info:
        rounds.collect_rollouts(cfg, FakeEngine(), FailingScorer(), FakeData(), CyclingSampler(), step=1, world_size=1, rank=0,
                              timings={})
    assert info.value.exit_code == 3


def test_preemptions_of_a_tensor_parallel_engine_are_counted_once():
    """Both processes of a TP-2 group see every preemption of their one engine (each runs the scheduler): only the
    group's first process counts them, so the summed rollout/preemptions is the engine's count, not twice it."""
    from grpo_lib.config import load_config
    from grpo_lib.trainer import rounds
    from tests.train.test_algorithm_recipes import CyclingSampler, FakeData, FakeEngine, FakeScorer

    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused.parquet]", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=2",
                             "rollout.tensor_model_parallel_size=2"], world_size=2)
    engine = FakeEngine()
    engine.preemptions_per_generate = 5
    counted = []
    for rank in (0, 1):  # no process group here: each rank's local count is what it adds to the all-reduce
        _, metrics = rounds.collect_rollouts(cfg, engine, FakeScorer(), FakeData(), CyclingSampler(), step=1, world_size=2,
                                           rank=rank, timings={})
        counted.append(metrics["rollout/preemptions"])
    assert counted == [5.0, 0.0], counted


def test_a_process_without_validation_prompts_still_reports_the_metrics():
    """A validation set smaller than the process count leaves some processes without prompts: they take part in the
    metric reductions with empty batches (it raised on max() of nothing while the others waited in a reduction)."""
    from grpo_lib.config import load_config
    from grpo_lib.trainer import rounds
    from tests.train.test_algorithm_recipes import FakeData, FakeEngine, FakeScorer

    class OnePrompt(FakeData):
        data_sources = ["fake"]

        def __len__(self):
            return 1

    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused.parquet]", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=2"], world_size=2)
    engine = FakeEngine()
    metrics, rows = rounds.validate(cfg, engine, FakeScorer(), OnePrompt(), world_size=2, rank=1)
    assert engine.calls == [], "nothing to generate on process 1"
    assert rows == [] and metrics["val/reward_mean"] == 0.0 and "val/fake/acc" not in metrics, metrics
    metrics, rows = rounds.validate(cfg, engine, FakeScorer(), OnePrompt(), world_size=2, rank=0)
    assert engine.calls == [[100]] and metrics["val/fake/acc"] == 0.0, (engine.calls, metrics)
