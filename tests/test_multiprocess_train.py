"""The number of processes is a memory knob only: 2 processes (gloo, one vLLM engine each, or one tensor-parallel
engine over both) train exactly like 1.

Per-request sampling seeds make the samples independent of which process runs a prompt, and every loss is
normalised by the global token / sequence counts, so the metrics of both runs agree step by step.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import read_metrics, run_train, tiny_overrides

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied, deterministic reward so advantages and the policy gradient are non-zero on a random model
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
'''


def test_two_processes_match_one(tiny_model_dir, arith_data, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    runs = {}
    for procs, tp in ((1, 1), (2, 1), (2, 2)):  # (2, 2): one tensor-parallel engine over both processes
        out = tmp_path / f"p{procs}tp{tp}"
        overrides = tiny_overrides(tiny_model_dir, arith_data, out) + [
            f"reward.custom.path={reward}", "actor.use_kl_loss=true", "actor.lr=1e-3", "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size_per_gpu=3", "trainer.check_weight_sync=true", f"rollout.tensor_model_parallel_size={tp}",
        ]
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(procs), "--num_machines", "1",
                    "--mixed_precision", "no", "--dynamo_backend", "no"] + (["--multi_gpu"] if procs > 1 else [])
        run_train(["recipes/tiny_cpu.yaml", *overrides], launcher=launcher)
        runs[procs, tp] = read_metrics(out)
    one = runs[1, 1]
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in one), "the policy loss never moved: the test would prove nothing"
    for two in (runs[2, 1], runs[2, 2]):
        assert len(one) == len(two) == 3
        for a, b in zip(one, two):
            for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"step {a['step']} {key}: 1 process {a[key]} vs 2 {b[key]}"
            assert b["debug/weight_sync_max_abs_diff"] < 1e-4
