"""What the checkpoint tests share (tests/checkpoints/): the 6-step run's overrides on the hf engine (`checkpoint_args`),
runs killed by tests/scripts/train_with_faults.py, metric and weight comparisons, and checkpoints of a tiny module
written by checkpoint.save with train_grpo.main run in this process up to GRPOTrainer.setup."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import HF_ENGINE, REPO, run_script, tiny_overrides

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied, deterministic reward so advantages and the policy gradient are non-zero on a random model
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
'''
STEPS = 6


def checkpoint_args(tiny_model_dir, arith_data, tmp_path_factory):
    """Overrides of a 6-step run (without the run folder), on the hf engine: this file's subject is the checkpoint,
    not the engine (tests/conftest.py HF_ENGINE says where vLLM still proves each behaviour)."""
    reward = tmp_path_factory.mktemp("reward") / "reward.py"
    reward.write_text(REWARD)

    def overrides(out: Path, *extra: str) -> list[str]:
        return ["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, f"reward.custom.path={reward}",
                "actor.lr=1e-3", "actor.ppo_mini_batch_size=2", f"trainer.total_training_steps={STEPS}",
                "trainer.val_before_train=false", "trainer.logger=[console,jsonl,tensorboard]", HF_ENGINE, *extra)]
    return overrides


def eos_run_args(eos_model_dir, arith_data, tmp_path_factory, *base: str):
    """Overrides of a 4-step run on the tiny model whose eos is likely (varied lengths: the long tail carry-over and
    one-step-off are about), with REWARD's varied reward so the policy moves; `base` added to every run's overrides."""
    reward = tmp_path_factory.mktemp("reward") / "reward.py"
    reward.write_text(REWARD)

    def overrides(out: Path, *extra: str) -> list[str]:
        return ["recipes/tiny_cpu.yaml", *tiny_overrides(
            eos_model_dir, arith_data, out, f"reward.custom.path={reward}", "actor.lr=1e-3", "actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=4", "trainer.val_before_train=false", "trainer.save_freq=-1", *base, *extra)]
    return overrides


def run_killed(args: list[str], faults: list[str], log: Path, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """A run that the test hook SIGKILLs (`faults`: arguments of tests/scripts/train_with_faults.py): output goes to
    files, not pipes (a pipe stays open while any reward worker it leaves behind lives, and run_train would wait for it)."""
    script = [str(REPO / "tests" / "scripts" / "train_with_faults.py"), *faults, "--"]
    if launcher is None:  # one process, forked (tests/conftest.py's run_script): its output goes to files anyway
        proc = run_script([*script, *args])
        log.write_text(proc.stdout + proc.stderr)
        return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), log.read_text())
    with open(log, "w") as fh:
        proc = subprocess.run([*(launcher or [sys.executable]), *script, *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), log.read_text())


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "actor" / "model.safetensors")


def assert_same_steps(a_rows: list[dict], b_rows: list[dict], steps: list[int]) -> None:
    a_by, b_by = {r["step"]: r for r in a_rows}, {r["step"]: r for r in b_rows}
    for step in steps:
        keys = sorted(k for k in a_by[step] if not k.startswith(("timing_s/", "memory/")))
        assert keys == sorted(k for k in b_by[step] if not k.startswith(("timing_s/", "memory/"))), f"step {step}: different metric keys"
        for k in keys:
            assert b_by[step][k] == pytest.approx(a_by[step][k], rel=1e-6, abs=1e-6), \
                f"step {step} {k}: straight run {a_by[step][k]} vs killed + resumed {b_by[step][k]}"


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}



# train_grpo.main(argv) in this process up to GRPOTrainer.setup (recorded, not run), over real checkpoints written by
# checkpoint.save for a tiny module (tests/helpers/tiny_checkpoint.py) with the config of the same command line: the folder
# rules, the checks of every file and the fallback all happen before setup, so before the engine.
def resume_args(model: Path, data: dict, out: Path, *extra: str) -> list[str]:
    return ["recipes/tiny_cpu.yaml", *tiny_overrides(model, data, out, *extra)]


def checkpoints_of(args: list[str], out: Path, steps) -> None:
    """The checkpoints of `steps` in `out` (metrics.jsonl with a line per step), recording the config of `args`."""
    from grpo_lib.config import load_config
    from tests.helpers.tiny_checkpoint import save_tiny

    for step in steps:
        save_tiny(out, step, seed=step, cfg=load_config(args[0], args[1:]))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(max(steps) + 1)))


def main_until_setup(monkeypatch, args: list[str]):
    """(exit code and output of train_grpo.main(args), the ResumePlan setup was given or None if it was not reached)."""
    import train_grpo
    from tests.helpers.cli import run_main

    plans = []
    monkeypatch.setattr(train_grpo.GRPOTrainer, "setup", lambda self: plans.append(self.resume))
    monkeypatch.setattr(train_grpo.GRPOTrainer, "train", lambda self: 0)
    result = run_main(monkeypatch, *args, setup=True)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result, (plans[0] if plans else None)


