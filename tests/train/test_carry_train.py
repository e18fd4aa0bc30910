"""Carry-over rollouts in the trainer (rollout.partial_rollout, grpo_lib/rollout/carry.py), on the tiny model whose eos
is likely (tests/conftest.py eos_model_dir: about half its responses end within a few tokens, the rest run to the cap,
the long tail carry-over is for), with a varied custom reward so the policy moves.

- staleness 0 (the pool no larger than the batch: nothing is ever carried) is today's synchronous step: every metric
  the synchronous run logs, and the final weights, bit for bit, on the hf engine and on vLLM;
- carried responses are resumed under newer weights, no trained token older than K, on vLLM (TP 1 and TP 2) and hf,
  the weight probe passing every step;
- a SIGTERM saves the responses in flight with the checkpoint and the resumed run continues exactly as the
  uninterrupted one; a resume on another process count is refused (exit 2) naming the carry/ folder.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import read_metrics, run_train
from tests.helpers.checkpoint_runs import assert_same_steps, eos_run_args, hf_weights

pytestmark = pytest.mark.slow

CARRY = ("rollout.partial_rollout.enable=true", "rollout.partial_rollout.active_batch_size=8")


@pytest.fixture(scope="module")
def args(eos_model_dir, arith_data, tmp_path_factory):
    return eos_run_args(eos_model_dir, arith_data, tmp_path_factory, "data.max_response_length=48")


def same(a_rows: list[dict], b_rows: list[dict]) -> None:
    """Every metric of run a (timings and memory aside) equal in run b, bit for bit."""
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows]
    for a, b in zip(a_rows, b_rows):
        for k, v in a.items():
            if not k.startswith(("timing_s/", "memory/", "perf/")):
                assert b[k] == v, f"step {a['step']} {k}: {v} vs {b.get(k)}"


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_staleness_zero_is_the_synchronous_step_bit_for_bit(args, engine, tmp_path):
    sync, carry = tmp_path / "sync", tmp_path / "carry"
    run_train(args(sync, f"rollout.name={engine}", "trainer.save_freq=4"))
    run_train(args(carry, f"rollout.name={engine}", "trainer.save_freq=4", "rollout.partial_rollout.enable=true",
                   "rollout.partial_rollout.active_batch_size=4"))
    a, b = read_metrics(sync), read_metrics(carry)
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in a), "the policy never moved: the test would prove little"
    same(a, b)
    assert all(r["rollout/carried_responses"] == 0 and r["rollout/staleness_0"] == 1.0 for r in b)
    wa, wb = hf_weights(sync / "global_step_4"), hf_weights(carry / "global_step_4")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the final weights differ"


def check_carried(rows: list[dict], k: int) -> None:
    assert sum(r["rollout/carried_responses"] for r in rows) > 0, "nothing was carried: the test would prove little"
    assert sum(r["rollout/resumed_responses"] for r in rows) > 0, "no carried response was resumed"
    assert all(r["rollout/staleness_max"] <= k for r in rows)
    assert any(r["rollout/staleness_1"] > 0 for r in rows), "no token of older weights was trained"
    assert any(r["actor/stale_token_fraction"] > 0 for r in rows)
    assert all(r["rollout/weight_probe_ok"] == 1.0 for r in rows if "rollout/weight_probe_ok" in r)


def test_carried_responses_resume_under_newer_weights_on_vllm(args, tmp_path):
    out = tmp_path / "run"
    run_train(args(out, "rollout.name=vllm", *CARRY))
    check_carried(read_metrics(out), k=1)


@pytest.mark.multiprocess
def test_carry_over_with_a_tensor_parallel_engine(args, tmp_path):
    out = tmp_path / "tp2"
    run_train(args(out, "rollout.name=vllm", "rollout.tensor_model_parallel_size=2", "data.train_batch_size=4", *CARRY),
              procs=2, timeout=900)
    check_carried(read_metrics(out), k=1)


def test_sigterm_saves_the_responses_in_flight_and_the_resume_is_exact(args, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_train(args(straight, "rollout.name=hf", *CARRY, "trainer.save_freq=4"))
    proc = run_train(args(stopped, "rollout.name=hf", *CARRY, "trainer.save_freq=4"), faults=["--signal", "TERM update 2"])
    assert "SIGTERM received" in proc.stderr
    pool = json.loads((stopped / "global_step_2" / "carry" / "rank_0.json").read_text())
    a = read_metrics(straight)
    in_flight = [s for g in pool["groups"] for s in g["samples"] if s["finish_reason"] is None]
    assert len(pool["groups"]) == 4, "the checkpoint holds the groups in flight"
    assert len(in_flight) == a[1]["rollout/carried_responses"], "the checkpoint holds the responses step 2 carried"
    resumed = run_train(args(stopped, "rollout.name=hf", *CARRY, "trainer.save_freq=4"))
    assert "resumed from" in resumed.stderr
    b = read_metrics(stopped)
    check_carried(a, k=1)
    assert_same_steps(a, b, [1, 2, 3, 4])  # as every exact-resume test (the probe's noise is measured anew at setup)
    wa, wb = hf_weights(straight / "global_step_4"), hf_weights(stopped / "global_step_4")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the final weights differ after stop + resume"


@pytest.mark.multiprocess
def test_a_resume_on_another_process_count_is_refused_naming_the_pool(args, tmp_path):
    out = tmp_path / "run"
    run_train(args(out, "rollout.name=hf", *CARRY, "trainer.total_training_steps=2", "trainer.save_freq=2"))
    proc = run_train(args(out, "rollout.name=hf", *CARRY, "trainer.total_training_steps=3", "trainer.save_freq=2"),
                     procs=2, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "carried responses were saved by 1 processes" in proc.stderr and "carry/ folder" in proc.stderr
