"""One-step-off on split processes (rollout.n_gpus_per_node, grpo_lib/trainer/split.py): 2 gloo processes, the last one the
engine, the first the trainer, on the tiny model with the varied reward of the checkpoint tests.

- the engine generates step k+1 with the weights of step k-1 (batch 1 and 2 with version 0): every batch is at most one
  version stale and says so (rollout/staleness_max, actor/stale_token_fraction), the probe proves every push, and the
  policy moves;
- the same run on vLLM;
- SIGTERM: the checkpoint holds the batch in hand and the resumed run continues exactly as the uninterrupted one;
- the engine process killed mid-run: the trainer stops within seconds with a message naming the engine (no hang);
  the trainer killed: the engine exits too.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.conftest import read_metrics, run_train
from tests.helpers.checkpoint_runs import assert_same_steps, eos_run_args, hf_weights

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SPLIT = ("rollout.n_gpus_per_node=1",)


@pytest.fixture(scope="module")
def args(eos_model_dir, arith_data, tmp_path_factory):
    return eos_run_args(eos_model_dir, arith_data, tmp_path_factory, "data.max_response_length=32", *SPLIT)


def check_one_step_off(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0], "batch k comes from version k - 2 (0 first)"
    assert rows[0]["actor/stale_token_fraction"] == 0.0 and all(r["actor/stale_token_fraction"] == 1.0 for r in rows[1:])
    assert all(r["rollout/weight_probe_abs_diff"] <= r["rollout/weight_probe_tolerance"] for r in rows), "a push unproven"
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in rows), "the policy never moved"
    assert all(r["timing_s/engine_gen"] > 0 for r in rows)
    # the behaviour logprobs are the engine's own: step 1's batch comes from the weights it trains (version 0), where
    # engine and trainer agree to float32 round-off (a logprob the engine did not send reads 0: a gap of nats)
    assert rows[0]["rollout/logprob_abs_diff_mean"] < 1e-3, rows[0]["rollout/logprob_abs_diff_mean"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_one_step_off_trains_on_batches_one_version_stale(args, engine, tmp_path):
    out = tmp_path / "run"
    proc = run_train(args(out, f"rollout.name={engine}", "trainer.test_freq=2"), procs=2, timeout=900)
    assert "engine process 0: ready" in proc.stderr
    rows = read_metrics(out)
    check_one_step_off(rows)
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val if any(k.startswith("val/") for k in r)] == [2, 4], "validation on the engine's processes"


def test_sigterm_saves_the_batch_in_hand_and_the_resume_is_exact(args, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_train(args(straight, "rollout.name=hf", "trainer.save_freq=4"), procs=2)
    proc = run_train(args(stopped, "rollout.name=hf", "trainer.save_freq=4"), procs=2, faults=["--signal", "TERM update 2 0"])
    assert "SIGTERM received" in proc.stderr
    held = json.loads((stopped / "global_step_2" / "carry" / "rank_0.json").read_text())
    assert [e["step"] for e in held["entries"]] == [3], "the checkpoint of step 2 holds step 3's batch"
    run_train(args(stopped, "rollout.name=hf", "trainer.save_freq=4"), procs=2)
    a, b = read_metrics(straight), read_metrics(stopped)
    check_one_step_off(a)
    assert_same_steps(a, b, [1, 2, 3, 4])
    wa, wb = hf_weights(straight / "global_step_4"), hf_weights(stopped / "global_step_4")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the final weights differ after stop + resume"


def test_a_stop_signal_to_the_engine_process_is_the_trainers_to_act_on(args, tmp_path):
    """SIGTERM reaches the engine process (a launcher sends it to every process): the engine goes on serving until the
    trainer, which acts on its own signal, says stop; alone it changes nothing: the run trains its 4 steps."""
    out = tmp_path / "run"
    run_train(args(out, "rollout.name=hf"), procs=2, faults=["--signal", "TERM generate 2 1"])
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_an_engine_that_dies_stops_the_trainer_within_seconds_and_the_run_resumes(args, tmp_path):
    """The engine killed as it starts step 3's batch (during step 2's update): the trainer finds out in step 2's push,
    after its update, so step 2 is saved (not step 1 with step 2's weights) with step 3 to be asked for again; the same
    command then resumes and trains steps 3-6 once each."""
    out = tmp_path / "run"
    start = time.monotonic()
    proc = run_train(args(out, "rollout.name=hf", "trainer.total_training_steps=6"), procs=2, check=False,
                     faults=["--signal", "KILL generate 3 1"], timeout=300)
    assert proc.returncode != 0
    assert "one-step-off: the engine processes stopped answering" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 120
    state = json.loads((out / "global_step_2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["actor_steps_done"] == 2, "the step whose update ran is the one saved"
    assert state["sampler"]["position"] == 8, "step 3's prompts are drawn again on resume, not skipped"
    held = json.loads((out / "global_step_2" / "carry" / "rank_0.json").read_text())
    assert held["entries"] == []
    run_train(args(out, "rollout.name=hf", "trainer.total_training_steps=6"), procs=2)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_validation_with_fewer_prompts_than_trainer_processes(args, arith_data, tmp_path):
    """2 trainers + 1 engine and a 1-prompt validation set: the trainer process without a prompt still takes part."""
    import pandas as pd

    one = tmp_path / "one.parquet"
    pd.read_parquet(arith_data["test"]).head(1).to_parquet(one)
    out = tmp_path / "run"
    run_train(args(out, "rollout.name=hf", f"data.val_files=[{one}]", "trainer.val_before_train=true",
                   "trainer.total_training_steps=2", "trainer.n_gpus_per_node=3"), procs=3, timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val/reward_mean" in r and r["step"] == 0 for r in rows)


def test_a_trainer_that_dies_takes_the_engine_with_it(args, tmp_path):
    out = tmp_path / "run"
    proc = run_train(args(out, "rollout.name=hf", "trainer.total_training_steps=6"), procs=2, check=False,
                     faults=["--signal", "KILL update 2 0"], timeout=300)
    assert proc.returncode != 0
    assert "test hook: SIGKILL at update of step 2" in proc.stderr
    assert "Traceback" not in proc.stderr.split("test hook")[-1] or "engine process 0" in proc.stderr


def test_a_tensor_parallel_engine_on_two_processes(args, tmp_path):
    """1 trainer + an engine over 2 processes (vLLM tensor parallel 2): the weights reach both engine processes."""
    out = tmp_path / "run"
    proc = run_train(args(out, "rollout.name=vllm", "rollout.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2",
                          "trainer.n_gpus_per_node=3"), procs=3, timeout=900)
    assert proc.stderr.count("engine process") >= 2
    check_one_step_off(read_metrics(out))
