"""Load a user reward function from a Python file (verl's `custom_reward_function.path` / `.name`).

The function has verl's signature and is called with keywords, exactly as verl calls it, so verl users'
files work unchanged:

    # my_reward.py
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip().endswith(str(ground_truth)) else 0.0   # or {"score": ..., "acc": ...}

    fn = load_custom_reward("my_reward.py", "compute_score", import_timeout_s=120)

The file is imported and run as the user's own code, with the trainer's permissions (in the trainer and in each
reward worker): it is trusted, like the training script itself. Its import is bounded by `import_timeout_s` (a
file that waits at import, for a download, a lock or input(), would otherwise hang setup with no output): SIGALRM
interrupts the import in the main thread, as the reward workers' watchdog interrupts a call (grpo_lib/rewards/pool.py);
a hang inside C code that never returns to Python is beyond it, and the pool's parent kills such a worker.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable


class ImportTimeoutError(ImportError):
    """The reward file did not finish importing within reward.import_timeout_s."""


class _ImportDeadline(BaseException):
    """Raised into the import by SIGALRM; a BaseException, so the file's own `except Exception` cannot swallow it."""


@contextmanager
def _deadline(seconds: float | None):
    """Interrupt the block after `seconds` with _ImportDeadline (main thread only; elsewhere, or None: no bound)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _ImportDeadline()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load_custom_reward(path: str, name: str = "compute_score", *, import_timeout_s: float | None = None) -> Callable:
    """Import `path` as a module and return its callable `name`.

    Raises FileNotFoundError (file missing), ImportError (the file raised while importing; the original
    error is chained), ImportTimeoutError (an ImportError: the import took longer than `import_timeout_s` seconds;
    None: no bound), AttributeError (no callable `name`; the message lists the functions the file has).
    """
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(resolved):
        raise FileNotFoundError(f"custom reward file not found: {path!r} (resolved to {resolved})")
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:12]
    module_name = f"grpo_custom_reward_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, resolved)
        assert spec is not None and spec.loader is not None, f"cannot build an import spec for {resolved}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses / pickling inside the file need the module registered
        try:
            with _deadline(import_timeout_s):
                spec.loader.exec_module(module)
        except _ImportDeadline:
            del sys.modules[module_name]
            raise ImportTimeoutError(
                f"custom reward file {resolved} did not finish importing within reward.import_timeout_s={import_timeout_s} s "
                "(it waits or computes at import time: a download, a lock, input(), a long setup); move that work into "
                "the reward function or a cache it fills on first call, or raise reward.import_timeout_s"
            ) from None
        except Exception as error:
            del sys.modules[module_name]
            raise ImportError(
                f"custom reward file {resolved} raised while importing: {type(error).__name__}: {error}"
            ) from error
    function = getattr(module, name, None)
    if function is None or not callable(function) or inspect.isclass(function):
        found = sorted(
            attr for attr, value in vars(module).items()
            if not attr.startswith("_") and (inspect.isfunction(value) or inspect.isbuiltin(value))
        )
        raise AttributeError(
            f"custom reward file {resolved} has no function {name!r}; functions found: {found}"
        )
    return function
