"""Clean stops (SIGTERM / SIGINT) and the agreement of all processes on when to stop.

A scheduler pre-empting a job sends SIGTERM; Ctrl-C sends SIGINT. The first one only sets a flag: the
training loop finishes the current step, saves a checkpoint and exits 0. A second signal aborts at once
(the default action of that signal), unless it is the same signal again within `REPEAT_WINDOW_S` of the first:
a scheduler that signals every process (SLURM's scancel) reaches each trainer twice within milliseconds under
`accelerate launch`, directly and again forwarded by the launcher, and that is one request, not an abort.
Every process checks the flag at the end of each step through one all-reduce (`stop_requested`), so all
processes stop after the same step even when only one of them got the signal.

Under torch elastic (`accelerate launch`) the launcher SIGKILLs its workers `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`
seconds (default 30) after it forwarded a stop signal: `launcher_timeout_warning` says so at start when that
is shorter than `MIN_LAUNCHER_TIMEOUT_S`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from grpo_lib.core.distributed import is_on

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 5.0  # the same signal again this soon after the first is the same stop request, not an abort
MIN_LAUNCHER_TIMEOUT_S = 300  # a launcher grace period shorter than this gets a warning (a step plus a save takes longer)
_received: list[tuple[int, float]] = []  # (signal number, monotonic time) of the first stop signal


def _on_signal(signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    if _received:
        first, at = _received[0]
        if signum == first and time.monotonic() - at < REPEAT_WINDOW_S:  # e.g. scancel's and the launcher's copy
            print(f"{name} received again within {REPEAT_WINDOW_S:g} s: the same stop request (send it again later "
                  "to abort at once)", file=sys.stderr, flush=True)
            return
        signal.signal(signum, signal.SIG_DFL)  # a real second request: give up on the clean stop, abort now
        os.kill(os.getpid(), signum)
        return
    _received.append((signum, time.monotonic()))
    print(f"\n{name} received: finishing this step, then saving a checkpoint and exiting "
          f"(send it again, {REPEAT_WINDOW_S:g} s or more later, to abort at once)", file=sys.stderr, flush=True)


def install_stop_handlers() -> None:
    """First SIGTERM/SIGINT: stop after the current step with a checkpoint; a second one (not a repeat of the first
    within REPEAT_WINDOW_S): abort."""
    _received.clear()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def launcher_timeout_warning(environ=os.environ) -> str | None:
    """A warning when torch elastic (`accelerate launch`, TORCHELASTIC_RUN_ID set) would SIGKILL this process less
    than MIN_LAUNCHER_TIMEOUT_S seconds after forwarding a stop signal: too short to finish a real step and save."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    raw = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    try:
        timeout_s = int(raw) if raw is not None else 30  # torch's default (torch/distributed/launcher/api.py)
    except ValueError:
        return None  # the launcher itself refuses such a value
    if timeout_s >= MIN_LAUNCHER_TIMEOUT_S:
        return None
    where = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT unset: torch's default" if raw is None else f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw}"
    return (f"warning: a Ctrl-C or SIGTERM to the launcher gives the processes only {timeout_s} s ({where}) to finish "
            "the step and save before they are killed; export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1800 (seconds, more than a "
            "step plus a checkpoint) before accelerate launch")


def stop_requested() -> bool:
    """True on every process when any process has received a stop signal (one all-reduce; call on all ranks)."""
    flag = 1.0 if _received else 0.0
    if is_on():
        t = torch.tensor([flag])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag = float(t.item())
    return flag > 0
