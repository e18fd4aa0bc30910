"""Clean stops (SIGTERM / SIGINT), the agreement of all processes on when to stop, and the fault-injection
test hooks.

A scheduler pre-empting a job sends SIGTERM; Ctrl-C sends SIGINT. The first one only sets a flag: the
training loop finishes the current step, saves a checkpoint and exits 0. A second signal aborts at once
(the default action of that signal). Every process checks the flag at the end of each step through one
all-reduce (`stop_requested`), so all processes stop after the same step even when only one of them got
the signal.

Test hooks (environment variables, read only here; nothing else in the code looks at them):

- `GRPO_TEST_SIGNAL="<SIGNAL> <point> <step> [rank]"`: send SIGNAL (KILL, TERM, INT) to this process when the
  run reaches `point` of `step` (on every process, or only on process `rank`); `ENOSPC` instead of a signal
  raises the OSError of a full disk there. Points: `update` (right after the actor update of that step, before its metrics
  are logged), `save` (in the middle of that step's checkpoint: the sharded weights and optimizer are
  written, the rest is not). Example: `GRPO_TEST_SIGNAL="KILL save 4"`.
- `GRPO_TEST_NAN_STEPS="2,3"`: the actor's loss is multiplied by NaN on those steps (counted by
  `Actor.steps_done + 1`), so the update must be skipped.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

import torch
import torch.distributed as dist

from grpo_lib.distributed import is_on

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []  # signal numbers received since install_stop_handlers


def _on_signal(signum: int, _frame) -> None:
    if _received:  # second signal: give up on the clean stop, abort now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)
    print(f"\n{signal.Signals(signum).name} received: finishing this step, then saving a checkpoint and exiting "
          "(send it again to abort at once)", file=sys.stderr, flush=True)


def install_stop_handlers() -> None:
    """First SIGTERM/SIGINT: stop after the current step with a checkpoint; second: abort."""
    _received.clear()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def stop_requested() -> bool:
    """True on every process when any process has received a stop signal (one all-reduce; call on all ranks)."""
    flag = 1.0 if _received else 0.0
    if is_on():
        t = torch.tensor([flag])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag = float(t.item())
    return flag > 0


# ------------------------------------------------------------------------------------------ test hooks
def test_signal_point(point: str, step: int) -> None:
    """Test hook: send the signal named by GRPO_TEST_SIGNAL when the run reaches (point, step)."""
    spec = os.environ.get("GRPO_TEST_SIGNAL")
    if not spec:
        return
    name, where, at_step, *only_rank = spec.split()
    if where == point and int(at_step) == step and (not only_rank or int(only_rank[0]) == int(os.environ.get("RANK", "0"))):
        if name == "ENOSPC":  # a full disk: the write fails with the error a full disk gives
            print(f"test hook: ENOSPC at {point} of step {step}", file=sys.stderr, flush=True)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "test hook")
        print(f"test hook: SIG{name} at {point} of step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


def test_nan_steps() -> set[int]:
    """Test hook: steps (1-based) whose loss is corrupted to NaN, from GRPO_TEST_NAN_STEPS="2,3"."""
    spec = os.environ.get("GRPO_TEST_NAN_STEPS", "")
    return {int(s) for s in spec.split(",") if s.strip()}
