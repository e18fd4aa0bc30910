"""Run many short reward calls in worker processes: a hung call costs at most about `timeout_s` per batch.

Why processes: reward code (sympy, user files) can hang or crash; the trainer must not. Workers are forked
from a `forkserver` (a clean interpreter with the reward modules preloaded, never a fork of the trainer's
torch / vLLM threads; `spawn` where forkserver is unavailable) and live across calls, so start-up is paid once.

The parent sends each free worker a chunk of calls; the worker sends results back every `RESULT_FLUSH_S`, so
the parent knows which call runs and since when (to 10 ms). Time limits:
1. soft, per call (in the worker): a watchdog thread sends SIGUSR1 to the worker's main thread after
   `timeout_s`; the handler raises `CallTimeout` (a BaseException, so a user's `except Exception` cannot
   swallow it). This stops Python-level hangs (`time.sleep`, loops, sympy); the worker takes the next call.
2. hard, per call (in the parent): a call still running `timeout_s + HARD_GRACE_S` after it started (a hang
   in C code that ignores signals) gets its worker killed and replaced; the call scores as a timeout.
3. per batch: a worker busy on one call for more than `STALL_S` may be hung: the rest of its chunk goes back
   to the queue and helper processes (at most `MAX_HELPERS` extra) take over the queue, so the other calls
   keep running in parallel. The first call that runs past `timeout_s / 2` sets the batch's deadline: every
   call must end by that call's start + `timeout_s` + `HARD_GRACE_S`; calls still running then are killed,
   calls not started are not run, both count as timeouts. So 56 hung responses cost about one `timeout_s`
   (4 s with timeout_s=2), not 56 of them (tests/rewards/test_rewards.py). The price: a batch of legitimately slow
   calls (over timeout_s / 2 each) is also cut at that deadline; raise reward.timeout_s for such rewards.
A worker that dies (segfault, os._exit) costs only the call it was running (an error); a fresh one replaces it.

Calls may also arrive over time (`open_batch` -> `PoolBatch`: the responses of a generation, each as it finishes):
`add` and `poll` hand out and collect without waiting, `drain` waits for the rest. Limits 1 and 2 hold from a call's
hand-out; the batch deadline (3) is armed only in `drain`, from max(the slow call's start, the drain's start), so a
hang while responses still arrive never cuts the ones that arrive later, and the batch still ends about one timeout_s
after its last call came. `run(calls)` is `open_batch`, `add(calls)`, `drain`.

Start-up is bounded too (`import_timeout_s`: the reward files a worker imports may hang at import). `start()` starts
the workers and waits until each has built its functions: a worker whose factory raises (the custom file's import
timed out, in the worker, or raised there only) reports the error and exits; one not ready `import_timeout_s` +
`START_GRACE_S` after it was started (a hang in C code) is killed; either way `start()` raises WorkerStartError with
the message, so the trainer exits 2 at setup. A replacement started mid-run that fails the same way counts as a
failed start (after MAX_FAILED_STARTS the calls score as errors, which stops the run via reward.max_error_fraction).

Workers never outlive the trainer: each asks Linux to SIGKILL it when its parent (the forkserver, which exits
with the trainer) dies (`prctl(PR_SET_PDEATHSIG)`), and a thread also exits the worker within a second once the
trainer's pid is gone (the fallback elsewhere). The trainer's `close()` kills them on a normal exit.
Stop signals (SIGTERM, SIGINT) are the trainer's: torch elastic forwards them to the trainer's whole process group,
so the forkserver and the workers start with them blocked (the workers also ignore them) and keep serving the
trainer's last step (tests/rewards/test_rewards.py).

Like every spawn/forkserver pool, each worker imports the entry script once as `__mp_main__`: keep its
work under `if __name__ == "__main__":` (train_grpo.py does), or the workers would run the script.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # registers multiprocessing's exit handler first, so ours (below) runs before it
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection, resource_tracker

_SPAWNED: list = []  # every worker process this interpreter started
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # the trainer's to handle (grpo_lib/core/stopping.py), never the pool's


@atexit.register
def _kill_workers_at_exit() -> None:
    """SIGKILL workers still alive at interpreter exit. They ignore SIGTERM (the trainer owns stop signals), so
    multiprocessing's own exit handler, which terminates daemonic children with SIGTERM and then joins them,
    would wait forever for one that a path out of the trainer did not close."""
    for process in _SPAWNED:
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
from typing import Any, Callable

from grpo_lib.core.processes import die_with_parent

HARD_GRACE_S = 2.0  # seconds past timeout_s before the parent kills a worker stuck in C code
STALL_S = 0.25  # a call running longer than this (or timeout_s / 4) gets its worker a helper
MAX_HELPERS = 8  # extra worker processes at most, while calls hang
MAX_CHUNK = 32  # calls sent to a worker at once
RESULT_FLUSH_S = 0.01  # a worker sends its finished calls' results at least this often
MAX_FAILED_STARTS = 8  # workers dying before they are ready, per pool, before calls are given up as errors
START_GRACE_S = 30.0  # seconds past import_timeout_s for a worker's own start (interpreter, forkserver, preload) before it is killed
POLL_S = 0.05  # parent's wait between checks of the workers
TRAINER_POLL_S = 1.0  # how often a worker checks that the trainer is alive (fallback to PDEATHSIG)

# One call: (call_id, function_name, kwargs). One result: (status, value, message), status in ok/error/timeout.
Call = tuple[int, str, dict]
Result = tuple[str, Any, str]


class CallTimeout(BaseException):
    """Raised inside a worker's main thread when the running call passes its deadline."""


class WorkerStartError(RuntimeError):
    """A reward worker could not build its functions at `TimeoutPool.start` (the message says why)."""


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


def _die_with_trainer(trainer_pid: int) -> None:
    """Make this worker exit when the trainer dies, however it dies (SIGKILL included)."""
    die_with_parent()  # Linux: the kernel SIGKILLs us when our parent (the forkserver; it exits with the trainer) dies

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a SIGKILLed trainer not yet reaped by its parent is a zombie: gone for our purpose
            with open(f"/proc/{pid}/stat") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def watch():
        while alive(trainer_pid):
            time.sleep(TRAINER_POLL_S)
        os._exit(0)

    if not alive(trainer_pid):
        os._exit(0)
    threading.Thread(target=watch, name="trainer-watch", daemon=True).start()


def _worker_main(conn, trainer_pid: int, factory: Callable[..., dict], factory_args: tuple) -> None:
    """A worker's life: build the functions, say ready, then run one call per message until told to stop."""
    _die_with_trainer(trainer_pid)
    # Ctrl-C and a scheduler's SIGTERM (often sent to the whole process group) are the trainer's to handle: it
    # finishes its step, so its reward calls must still be answered. Workers end by SIGKILL (close(), PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        watchdog, functions = _Watchdog(), factory(*factory_args)
    except BaseException as error:  # e.g. the custom file's import raised or timed out here: the parent reports it
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send("ready")
    outbox = _Outbox(conn)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer closed the pipe (or died)
            os._exit(0)
        if message is None:
            return
        chunk, timeout_s = message
        for call_id, name, kwargs in chunk:
            try:
                watchdog.arm(timeout_s)
                try:
                    result = call_safely(functions[name], kwargs)
                finally:
                    watchdog.disarm()
            except CallTimeout:
                result = ("timeout", None, f"took longer than {timeout_s} s")
            outbox.put(call_id, result)
        outbox.flush()


class _Outbox:
    """Results of finished calls, sent to the parent every RESULT_FLUSH_S by a thread (and at a chunk's end), so
    the parent knows which call runs even when the next one hangs, without one message per call."""

    def __init__(self, conn):
        self._conn, self._lock, self._done = conn, threading.Lock(), []
        threading.Thread(target=self._loop, name="reward-outbox", daemon=True).start()

    def put(self, call_id: int, result: Result) -> None:
        with self._lock:
            self._done.append((call_id, result))

    def flush(self) -> None:
        with self._lock:
            done, self._done = self._done, []
            if not done:
                return
            try:
                self._conn.send(done)
            except (BrokenPipeError, EOFError):  # the trainer is gone
                os._exit(0)
            except Exception:  # a value that cannot be pickled (a dict with a lambda ...): one by one
                for call_id, result in done:
                    try:
                        self._conn.send([(call_id, result)])
                    except Exception as error:
                        message = f"reward returned a value that cannot be sent back: {error}"
                        self._conn.send([(call_id, ("error", None, message))])

    def _loop(self) -> None:
        while True:
            time.sleep(RESULT_FLUSH_S)
            self.flush()


# ----------------------------------------------------------------------------------------- parent side
@dataclass
class _Worker:
    process: Any
    conn: Any
    ready: bool = False
    pending: list = field(default_factory=list)  # calls sent and not answered, in the order the worker runs them
    started: float = 0.0  # monotonic start of pending[0]: when it was sent or the previous result came back
    ignore: set = field(default_factory=set)  # calls taken back from this worker (re-queued); their results are dropped
    spawned: float = field(default_factory=time.monotonic)  # when the process was started (its start-up is bounded)

    @property
    def free(self) -> bool:
        return self.ready and not self.pending and not self.ignore


class TimeoutPool:
    """Worker processes that run `Call`s by function name; every worker builds its functions once with
    `factory(*factory_args)` (a picklable module-level function returning {name: callable})."""

    def __init__(self, *, num_workers: int, timeout_s: float, factory: Callable[..., dict], factory_args: tuple,
                 import_timeout_s: float | None = None):
        assert num_workers >= 1, f"TimeoutPool needs num_workers >= 1, got {num_workers}"
        assert timeout_s > 0, f"timeout_s must be > 0, got {timeout_s}"
        self.num_workers, self.timeout_s = num_workers, timeout_s
        # seconds from a worker's start until it must be ready (None: unbounded): the factory's imports plus the grace
        self.start_limit_s = None if import_timeout_s is None else import_timeout_s + START_GRACE_S
        self.last_start_failure = ""  # why the latest worker failed to start
        self._factory, self._factory_args = factory, factory_args
        methods = multiprocessing.get_all_start_methods()
        self._context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            self._context.set_forkserver_preload(["grpo_lib.rewards"])  # helpers start in ~0.1 s, imports done
        self._workers: list[_Worker] = []
        self._failed_starts = 0  # workers that died before they were ready (a factory that crashes them)
        self._open: PoolBatch | None = None  # the batch in flight (one at a time)

    def _spawn(self) -> None:
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(target=_worker_main, name="reward-worker", daemon=True,
                                        args=(child_end, os.getpid(), self._factory, self._factory_args))
        # The first start also starts the forkserver, in the trainer's process group. torch elastic forwards a stop
        # signal to the whole group (os.killpg), and the forkserver dies of SIGTERM (taking the workers with it via
        # PDEATHSIG) while the trainer is still finishing its step. A blocked mask is inherited through fork and exec,
        # so the forkserver and the workers never act on these signals; the trainer gets them once unblocked here.
        # multiprocessing's resource tracker is started first, by itself: starting it ends with an UNBLOCK of exactly
        # these two signals, which would undo ours before the forkserver starts (it is started by process.start()).
        resource_tracker.ensure_running()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _SPAWNED.append(process)
        child_end.close()
        self._workers.append(_Worker(process, parent_end))

    def _retire(self, worker: _Worker) -> None:
        """Kill one worker (it may be stuck) and forget it."""
        worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        self._workers.remove(worker)

    def start(self) -> None:
        """Start the workers and wait until every one has built its functions; WorkerStartError (all workers stopped)
        when one fails to (its factory raised, it died, or it was not ready within start_limit_s)."""
        while len(self._workers) < self.num_workers:
            self._spawn()
        while not all(w.ready for w in self._workers):
            failed_before = self._failed_starts
            starting = [w for w in self._workers if not w.ready]
            for conn in connection.wait([w.conn for w in starting], timeout=POLL_S):
                worker = next(w for w in starting if w.conn is conn)
                while worker in self._workers and not worker.ready and worker.conn.poll():
                    self._receive(worker, deque(), {})
            self._kill_stuck_starts()
            if self._failed_starts > failed_before or len(self._workers) < self.num_workers:
                self.close()
                raise WorkerStartError(self.last_start_failure)

    def _kill_stuck_starts(self) -> None:
        """Kill workers still not ready start_limit_s after they were started (each counts as a failed start)."""
        if self.start_limit_s is None:
            return
        now = time.monotonic()
        for worker in [w for w in self._workers if not w.ready and now - w.spawned > self.start_limit_s]:
            self._failed_starts += 1
            self.last_start_failure = (f"a reward worker was not ready {self.start_limit_s:g} s after it started (building its "
                                       "reward functions: importing the reward files); killed")
            self._retire(worker)

    def run(self, calls: list[Call]) -> dict[int, Result]:
        """Run every call; returns {call_id: (status, value, message)}. Never raises for a call's failure."""
        batch = self.open_batch()
        batch.add(calls)
        return batch.drain()

    def open_batch(self) -> PoolBatch:
        """A batch whose calls arrive over time (`PoolBatch`): add them as they come, drain at the end."""
        assert self._open is None, "TimeoutPool: a batch is still open; drain or cancel it before opening the next"
        self._open = PoolBatch(self)
        return self._open

    def _advance(self, batch: PoolBatch, *, wait_s: float) -> None:
        """One round of the dispatch loop: hand out queued calls, read results, enforce the time limits (module
        docstring). The batch deadline is armed only while draining (`batch.drain_start`): a call that hangs while
        calls still arrive must not cut the calls that arrive later."""
        queue, results = batch.queue, batch.results
        stall_s = min(STALL_S, self.timeout_s / 4)
        if self._failed_starts > MAX_FAILED_STARTS:  # workers cannot even start: give up on the rest
            for call_id, _, _ in queue:
                results[call_id] = ("error", None, f"reward workers died {self._failed_starts} times while starting "
                                    f"(last: {self.last_start_failure})")
            queue.clear()
        now = time.monotonic()
        chunk_size = max(1, min(MAX_CHUNK, len(queue) // (4 * self.num_workers)))
        for worker in self._workers:  # hand out chunks to free workers
            if worker.free and queue:
                worker.pending = [queue.popleft() for _ in range(min(chunk_size, len(queue)))]
                worker.started = now
                try:
                    worker.conn.send((worker.pending, self.timeout_s))
                except OSError:  # the worker died while idle: its calls go back to the queue
                    queue.extendleft(reversed(worker.pending))
                    worker.pending, worker.ready = [], False
        busy = [w for w in self._workers if w.pending]
        for worker in busy:
            if now - worker.started > stall_s and len(worker.pending) > 1:  # maybe hung: take back the rest
                queue.extendleft(reversed(worker.pending[1:]))
                worker.ignore.update(call[0] for call in worker.pending[1:])
                worker.pending = worker.pending[:1]
        stalled = sum(now - w.started > stall_s for w in busy)
        if queue:
            room = self.num_workers + MAX_HELPERS - len(self._workers)
            want = self.num_workers - len(self._workers)  # workers killed or dead: replace them
            if stalled and len(self._workers) - stalled < self.num_workers:
                # possibly hung workers: start helpers for what is queued at once (one per stall would start them
                # one generation at a time, and every generation may meet hangs of its own)
                want = max(want, len(queue))
            for _ in range(min(want, room)):
                self._spawn()
        slow = [w.started for w in busy if now - w.started > self.timeout_s / 2]
        if batch.deadline is None and slow and batch.drain_start is not None:
            batch.deadline = max(min(slow), batch.drain_start) + self.timeout_s + HARD_GRACE_S
        deadline = batch.deadline
        waiting = [w.conn for w in self._workers if w.pending or w.ignore or not w.ready]
        for conn in connection.wait(waiting, timeout=wait_s):
            worker = next(w for w in self._workers if w.conn is conn)
            while worker in self._workers and worker.conn.poll():  # drain: one message per finished call
                self._receive(worker, queue, results)
        self._kill_stuck_starts()
        now = time.monotonic()
        for worker in [w for w in self._workers if w.pending]:
            overdue = now - worker.started > self.timeout_s + HARD_GRACE_S
            if overdue or (deadline is not None and now > deadline):
                results[worker.pending[0][0]] = ("timeout", None, f"took longer than {self.timeout_s} s (worker killed)"
                                                 if overdue else "stopped at the batch's reward deadline (another call "
                                                 "hung; worker killed)")
                queue.extendleft(reversed(worker.pending[1:]))
                self._retire(worker)
        if deadline is not None and now > deadline:
            for call_id, _, _ in queue:
                results[call_id] = ("timeout", None, "not run: the batch's reward deadline passed (a call hung for "
                                    f"reward.timeout_s={self.timeout_s} s)")
            queue.clear()

    def _end_batch(self) -> None:
        """After a batch: replace workers still busy with taken-back (maybe hung) calls or dead; helpers go."""
        for worker in [w for w in self._workers if w.ignore or not w.process.is_alive()]:
            self._retire(worker)  # still busy with taken-back calls (maybe hung): replaced by the next batch
        for worker in self._workers[self.num_workers:]:  # helpers go; the next batch starts them again if needed
            self._retire(worker)
        self._open = None

    def _cancel_batch(self) -> None:
        """Give up a batch (its caller failed): workers still running its calls are killed, so no stale result can
        reach the next batch; the next batch starts their replacements."""
        for worker in [w for w in self._workers if w.pending or w.ignore]:
            self._retire(worker)
        self._end_batch()

    def _receive(self, worker: _Worker, queue: deque, results: dict[int, Result]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):  # the worker died: only the call it was running is lost
            if not worker.ready:
                self._failed_starts += 1
                worker.process.join(timeout=5)
                self.last_start_failure = f"a reward worker exited while starting (exit code {worker.process.exitcode})"
            if worker.pending:
                code = worker.process.exitcode
                results[worker.pending[0][0]] = ("error", None, f"reward worker process died (exit code {code})")
                queue.extendleft(reversed(worker.pending[1:]))
            self._retire(worker)
            return
        if message == "ready":
            worker.ready = True
            return
        if isinstance(message, tuple) and message[0] == "failed":  # its factory raised: see _worker_main
            self._failed_starts += 1
            self.last_start_failure = f"a reward worker could not build its reward functions: {message[1]}"
            self._retire(worker)
            return
        for call_id, result in message:
            if call_id in worker.ignore:  # a taken-back call, run elsewhere
                worker.ignore.discard(call_id)
                continue
            results[call_id] = result
        answered = {call_id for call_id, _ in message}
        worker.pending = [call for call in worker.pending if call[0] not in answered]
        worker.started = time.monotonic()

    def close(self):
        """Stop the workers (kills any still running; idempotent)."""
        for worker in list(self._workers):
            self._retire(worker)


class PoolBatch:
    """One batch of calls that arrive over time (the responses of a generation, as each finishes).

        batch = pool.open_batch()
        batch.add(calls)        # any number of times; hands out what it can, never waits
        batch.poll()            # between additions: read results, hand out more (never waits)
        results = batch.drain() # wait for the rest, with the batch deadline; {call_id: Result}, as TimeoutPool.run

    Per-call limits (soft and hard timeouts, helpers for stalled workers) hold from the moment a call is handed out;
    the batch deadline (module docstring, 3.) is armed only in `drain`, from max(the slow call's start, the drain's
    start): calls still arriving are never cut by a hang that began before them, and a batch whose calls hang still
    costs about one timeout_s after its last call arrived. `cancel()` (the caller failed mid-batch) kills the workers
    still running its calls.
    """

    def __init__(self, pool: TimeoutPool):
        self.pool = pool
        self.queue: deque = deque()  # calls not handed out yet
        self.results: dict[int, Result] = {}
        self.deadline: float | None = None
        self.drain_start: float | None = None

    def add(self, calls: list[Call]) -> None:
        self.queue.extend(calls)
        self.poll()

    def poll(self) -> None:
        self.pool._advance(self, wait_s=0.0)

    def drain(self) -> dict[int, Result]:
        self.drain_start = time.monotonic()
        while self.queue or any(w.pending for w in self.pool._workers):
            self.pool._advance(self, wait_s=POLL_S)
        self.pool._end_batch()
        return self.results

    def cancel(self) -> None:
        self.pool._cancel_batch()
