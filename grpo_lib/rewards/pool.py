"""Run many short reward calls in worker processes, each call bounded by a timeout.

Why processes: reward code (sympy, user files) can hang or crash; the trainer must not. The pool uses the
`forkserver` start method (`spawn` where unavailable): workers start from a clean interpreter, never a
fork of the trainer's torch / vLLM threads. Workers live across calls, so their start-up (importing the
reward code, ~1 s) is paid once; calls are sent in chunks so thousands of tiny calls cost little overhead.

Two timeout layers, both per call:
1. soft (in the worker): a watchdog thread sends SIGUSR1 to the worker's main thread at the deadline; the
   handler raises `CallTimeout` (a BaseException, so a user's `except Exception` cannot swallow it). This
   stops Python-level hangs (`time.sleep`, loops, sympy) and the worker goes on with the next call.
2. hard (in the parent): each worker publishes which call it runs and since when (shared memory). A call
   still running `timeout_s + HARD_GRACE_S` after it started (a hang in C code that ignores signals) gets
   every worker killed and a fresh pool; the stuck call scores as a timeout, unfinished calls are re-run.
A worker that dies (segfault, os._exit) breaks the pool too: the calls it was running count as errors
(with the pool's other in-flight calls, which cannot be told apart), the rest are re-run on a fresh pool.

Like every spawn/forkserver pool, each worker imports the entry script once as `__mp_main__`: keep its
work under `if __name__ == "__main__":` (train_grpo.py does), or the workers would run the script.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable

HARD_GRACE_S = 2.0  # seconds past timeout_s before the parent kills a worker stuck in C code
MAX_ROUNDS = 4  # fresh pools per `run` call before the remaining calls are given up as errors
MAX_CHUNK = 64  # calls per task sent to a worker

# One call: (call_id, function_name, kwargs). One result: (status, value, message), status in ok/error/timeout.
Call = tuple[int, str, dict]
Result = tuple[str, Any, str]


class CallTimeout(BaseException):
    """Raised inside a worker's main thread when the running call passes its deadline."""


def call_safely(function: Callable, kwargs: dict) -> Result:
    """Run one call in this process, no timeout: ("ok", value, "") or ("error", None, message)."""
    try:
        return "ok", function(**kwargs), ""
    except Exception as error:  # a reward that raises scores 0; the caller counts it
        return "error", None, f"{type(error).__name__}: {error}"


# ----------------------------------------------------------------------------------------- worker side
class _Watchdog:
    """Sends SIGUSR1 to the main thread when the armed deadline passes."""

    def __init__(self):
        self._condition = threading.Condition()
        self._deadline: float | None = None
        self._main_thread_id = threading.main_thread().ident
        threading.Thread(target=self._loop, name="reward-watchdog", daemon=True).start()

    @staticmethod
    def _raise_timeout(signum, frame):
        raise CallTimeout()

    def arm(self, seconds: float):
        signal.signal(signal.SIGUSR1, self._raise_timeout)  # re-installed per call: user code may change it
        with self._condition:
            self._deadline = time.monotonic() + seconds
            self._condition.notify()

    def disarm(self):
        with self._condition:
            self._deadline = None
            self._condition.notify()

    def _loop(self):
        with self._condition:
            while True:
                if self._deadline is None:
                    self._condition.wait()
                    continue
                remaining_s = self._deadline - time.monotonic()
                if remaining_s > 0:
                    self._condition.wait(remaining_s)
                    continue
                self._deadline = None
                signal.pthread_kill(self._main_thread_id, signal.SIGUSR1)


_WORKER: dict = {}  # per worker process: slot, shared arrays, watchdog, functions


def _init_worker(slot_counter, busy_since, busy_call, factory: Callable[..., dict], factory_args: tuple):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    with slot_counter.get_lock():
        slot = slot_counter.value
        slot_counter.value += 1
    _WORKER.update(slot=slot, busy_since=busy_since, busy_call=busy_call, watchdog=_Watchdog(),
                   functions=factory(*factory_args))


def _run_chunk(chunk: list[Call], timeout_s: float) -> list[tuple[int, Result]]:
    slot, busy_since, busy_call = _WORKER["slot"], _WORKER["busy_since"], _WORKER["busy_call"]
    watchdog, functions = _WORKER["watchdog"], _WORKER["functions"]
    results = []
    for call_id, name, kwargs in chunk:
        busy_call[slot] = call_id
        busy_since[slot] = time.monotonic()
        try:
            watchdog.arm(timeout_s)
            try:
                result = call_safely(functions[name], kwargs)
            finally:
                watchdog.disarm()
        except CallTimeout:
            result = ("timeout", None, f"took longer than {timeout_s} s")
        busy_since[slot] = 0.0
        results.append((call_id, result))
    return results


# ----------------------------------------------------------------------------------------- parent side
class TimeoutPool:
    """A process pool that runs `Call`s by function name; every worker builds its functions once with
    `factory(*factory_args)` (a picklable module-level function returning {name: callable})."""

    def __init__(self, *, num_workers: int, timeout_s: float, factory: Callable[..., dict], factory_args: tuple):
        assert num_workers >= 1, f"TimeoutPool needs num_workers >= 1, got {num_workers}"
        assert timeout_s > 0, f"timeout_s must be > 0, got {timeout_s}"
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self._factory, self._factory_args = factory, factory_args
        methods = multiprocessing.get_all_start_methods()
        self._context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        self._executor: ProcessPoolExecutor | None = None

    def _start(self):
        ctx = self._context
        self._busy_since = ctx.RawArray("d", self.num_workers)  # monotonic start of the running call, 0 = idle
        self._busy_call = ctx.RawArray("q", self.num_workers)  # call_id of the running call
        self._executor = ProcessPoolExecutor(
            max_workers=self.num_workers, mp_context=ctx, initializer=_init_worker,
            initargs=(ctx.Value("i", 0), self._busy_since, self._busy_call, self._factory, self._factory_args),
        )

    def _in_flight(self, older_than_s: float = 0.0) -> list[int]:
        now = time.monotonic()
        return [self._busy_call[slot] for slot in range(self.num_workers)
                if self._busy_since[slot] > 0 and now - self._busy_since[slot] > older_than_s]

    def _kill(self):
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list((getattr(executor, "_processes", None) or {}).values())
        for process in processes:
            process.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(timeout=5)

    def run(self, calls: list[Call]) -> dict[int, Result]:
        """Run every call; returns {call_id: (status, value, message)}. Never raises for a call's failure."""
        results: dict[int, Result] = {}
        remaining = list(calls)
        for _ in range(MAX_ROUNDS):
            if not remaining:
                break
            remaining = self._run_round(remaining, results)
        for call_id, _, _ in remaining:
            results[call_id] = ("error", None, f"reward worker pool broke {MAX_ROUNDS} times")
        return results

    def _run_round(self, calls: list[Call], results: dict[int, Result]) -> list[Call]:
        """One pass on one pool; returns the calls to re-run if the pool had to be replaced."""
        if self._executor is None:
            self._start()
        chunk_size = max(1, min(MAX_CHUNK, math.ceil(len(calls) / (4 * self.num_workers))))
        chunks = [calls[i : i + chunk_size] for i in range(0, len(calls), chunk_size)]
        try:
            pending = {self._executor.submit(_run_chunk, chunk, self.timeout_s) for chunk in chunks}
        except Exception:  # the pool broke while idle (e.g. a worker was OOM-killed): start afresh
            self._kill()
            return calls
        failure = None
        while pending and failure is None:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            for future in done:
                try:
                    results.update(future.result())
                except Exception as error:  # BrokenProcessPool: a worker died
                    failure = ("error", f"reward worker process died ({type(error).__name__})")
            stuck = self._in_flight(older_than_s=self.timeout_s + HARD_GRACE_S)
            if failure is None and stuck:
                failure = ("timeout", f"took longer than {self.timeout_s} s (worker killed)")
        if failure is None:
            return []
        for future in pending:  # keep what finished before the pool is killed
            if future.done() and not future.cancelled() and future.exception() is None:
                results.update(future.result())
        status, message = failure
        culprits = self._in_flight(older_than_s=self.timeout_s + HARD_GRACE_S if status == "timeout" else 0.0)
        self._kill()
        for call_id in culprits:
            results.setdefault(call_id, (status, None, message))
        return [call for call in calls if call[0] not in results]

    def close(self):
        """Stop the workers (kills any still running)."""
        self._kill()
