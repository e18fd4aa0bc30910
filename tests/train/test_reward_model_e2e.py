"""A reward model in the trainer's processes end to end (reward_model.enable, grpo_lib/model/reward_model.py): the reward is
the formula docs/TRAINING.md states (rules + weight x the reward model's score), validation scores with it too, and 2
processes (the reward model sharded over both, each process's share scored with micro-batch counts agreed) log the
1-process run's metrics."""

from __future__ import annotations

import pytest

import json

from tests.conftest import read_metrics, run_train, tiny_overrides
from tests.model.test_reward_model import tiny_rm_dir  # noqa: F401  (the module-scoped fixture: a one-label head on the tiny model)

RM = ["reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=3", "trainer.test_freq=3", "trainer.val_before_train=true",
      "actor.lr=1e-3"]
FUNCTIONS = "reward.functions=[{name: accuracy, weight: 1.0}, {name: reward_model, weight: 0.5}]"


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tiny_rm_dir, arith_data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("rm_e2e") / "p1"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, *RM, f"reward_model.model.path={tiny_rm_dir}",
                                                        FUNCTIONS)], procs=1)
    return read_metrics(out), [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_reward_is_the_rules_plus_the_weighted_reward_model_score(one_process):
    steps, rows = one_process
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["reward/reward_model/mean"] != 0.0, "the reward model scored nothing: the formula below proves nothing"
        # means are linear: mean(1.0 x accuracy + 0.5 x rm) = mean(accuracy) + 0.5 x mean(rm), up to float32 sums
        assert r["reward/mean"] == pytest.approx(r["reward/accuracy/mean"] + 0.5 * r["reward/reward_model/mean"], abs=1e-5), r
        assert r["reward_model/truncated"] == 0.0 and r["timing_s/reward_model"] > 0, r
    val = [r for r in rows if "val/synthetic/arithmetic/reward_mean" in r]
    assert [r["step"] for r in val] == [0, 3], "validation before training and at test_freq"
    assert any(r["val/synthetic/arithmetic/reward_mean"] != r["val/synthetic/arithmetic/acc"] for r in val), \
        "validation's reward holds the reward model's term (else it would equal the rule's accuracy)"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_log_the_one_process_metrics(one_process, tiny_model_dir, tiny_rm_dir, arith_data, tmp_path):  # noqa: F811
    out = tmp_path / "p2"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, *RM, f"reward_model.model.path={tiny_rm_dir}",
                                                        FUNCTIONS)], procs=2)
    one, two = one_process[1], [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(two) == len(one)
    for a, b in zip(one, two):
        for key in ("reward/mean", "reward/reward_model/mean", "actor/pg_loss", "actor/grad_norm", "val/synthetic/arithmetic/reward_mean"):
            if key in a:
                # the reward model's score of a row does not depend on which process (or micro-batch) scores it, up to
                # float32 round-off of the padded forward (test_reward_model.py: rel 1e-5); the update as the 2-process
                # LoRA / full runs (rel 1e-4)
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), f"step {a['step']} {key}: 1 process {a[key]} vs 2 {b[key]}"
