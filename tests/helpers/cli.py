"""`train_grpo.main(argv)` in the test process: the fail-early and command-line checks need no interpreter of their own.

A problem that must be found before anything heavy loads is checked by refusing the heavy part: with
`setup=False` (the default) `GRPOTrainer.setup` raises if the run reaches it, so a passing test proves the exit
came first (the CPU-time limit a subprocess needed to show the same). `setup=True` lets setup run but refuses the
engine (`grpo_lib.rollout.engines.build_engine`): for data and reward problems that setup itself finds.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

from tests.conftest import REPO


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_main(monkeypatch, *args: str, setup: bool = False) -> Result:
    """Exit code and output of `python train_grpo.py ARGS...`, run from the repository root in this process."""
    import train_grpo
    from grpo_lib.rollout import engines

    def refuse(*_a, **_k):
        raise AssertionError("the run got past the point where this problem must already have stopped it")

    monkeypatch.chdir(REPO)
    if not setup:
        monkeypatch.setattr(train_grpo.GRPOTrainer, "setup", refuse)
    monkeypatch.setattr(engines, "build_engine", refuse)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = train_grpo.main(list(args))
    return Result(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
