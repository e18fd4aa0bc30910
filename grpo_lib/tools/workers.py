"""Killable worker processes for plain (sync) tool calls: a call past its timeout is ended by killing its worker, so
no thread or CPU of the trainer is left running it (a thread cannot be killed).

    pool = WorkerPool({"slow": pickle.dumps(tool)}, max_workers=16, start_timeout_s=120)
    kind, value = await pool.call("slow", "execute", ("ep0", {"x": 1}), {}, timeout_s=30)   # on the tool loop
    # ("ok", (text, reward, metrics)) | ("timeout", False) | ("error", WorkerError("ValueError: ..."))
    await pool.close()

A worker is `python -m grpo_lib.tools.workers` (a fresh interpreter, never a fork of the trainer with its engine
threads and CUDA state), in a session of its own. It gets the trainer's sys.path and the pickled tools once, rebuilds
them, and then answers one call at a time over its stdin / stdout (8-byte length + pickle frames; the tool's own
prints go to stderr). The pool starts workers as calls need them (up to max_workers, then calls wait for a free one;
the timeout clock starts when a worker takes the call) and keeps them for the run. At a timeout the worker's whole
process group is killed (SIGKILL: a sleeping call, a CPU loop, its own subprocesses) and reaped; the next call that
needs a worker starts a fresh one. A worker that dies on its own (os._exit, a segfault) is that call's error.

What runs here: the `execute` of a tool whose ToolBox placement is "process" (grpo_lib/tools/calls.py decides it).
The worker's copy of the tool is rebuilt from the pickle taken at start-up: whatever `execute` changes on `self` stays
in that worker (which is why tools that keep per-episode state run in a thread unless they opt in).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import struct
import sys
from pathlib import Path

from grpo_lib.core.processes import die_with_parent

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding grpo_lib
_HEADER = struct.Struct(">Q")  # the byte length of the pickle that follows


class WorkerError(Exception):
    """A failure inside a worker, carried as its text ("ValueError: bad", "SystemExit: 3", "the worker died ...")."""


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def send(self, obj) -> None:
        data = pickle.dumps(obj)
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()

    async def receive(self):
        (size,) = _HEADER.unpack(await self.proc.stdout.readexactly(_HEADER.size))
        return pickle.loads(await self.proc.stdout.readexactly(size))

    async def kill(self) -> None:
        """SIGKILL its process group (the tool's own children too) and reap it."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # already gone (reaped below)
                pass
        await self.proc.wait()

    def died(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"its worker process was killed by signal {signal.Signals(-code).name}"
        return f"its worker process exited (status {code})"


class WorkerPool:
    """Worker processes for the tools in `blobs` (name -> pickled tool); every method runs on the tool loop."""

    def __init__(self, blobs: dict[str, bytes], *, max_workers: int, start_timeout_s: float):
        assert max_workers >= 1, f"max_workers must be >= 1, got {max_workers}"
        self.blobs, self.max_workers, self.start_timeout_s = dict(blobs), max_workers, start_timeout_s
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None  # made on the loop at the first call
        self.started = 0  # workers started in all (a fresh one after each kill)
        self.killed = 0  # workers killed at a call's timeout
        self.outstanding = 0  # calls taken and not yet answered, waiting for a worker or in one (read by ToolBox.run)

    @property
    def alive(self) -> int:
        """Idle workers (a busy one is counted by the call that holds it)."""
        return len(self._idle)

    async def call(self, name: str, method: str, args: tuple, kwargs: dict, *, timeout_s: float) -> tuple[str, object]:
        """tool `name`'s `method`(*args, **kwargs) in a worker, under timeout_s from when a worker takes it."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_workers)
        self.outstanding += 1
        try:
            return await self._call_in_slot(name, method, args, kwargs, timeout_s=timeout_s)
        finally:
            self.outstanding -= 1

    async def _call_in_slot(self, name: str, method: str, args: tuple, kwargs: dict, *, timeout_s: float) -> tuple[str, object]:
        async with self._slots:
            try:
                worker = self._idle.pop() if self._idle else await self._start()
            except WorkerError as error:
                return "error", error
            try:
                await worker.send((name, method, args, kwargs))
                kind, value = await asyncio.wait_for(worker.receive(), timeout_s)
            except asyncio.TimeoutError:
                self.killed += 1
                await worker.kill()
                return "timeout", False
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
                await worker.kill()
                return "error", WorkerError(f"{worker.died()} during the call")
            except Exception as error:  # noqa: BLE001 - a reply this process cannot unpickle: the worker goes too
                await worker.kill()
                return "error", WorkerError(f"its reply could not be read ({type(error).__name__}: {error})")
            except BaseException:  # cancelled (the turn's bound passed, or the loop stops): the worker goes
                await asyncio.shield(worker.kill())
                raise
            self._idle.append(worker)
            return kind, (WorkerError(value) if kind == "error" else value)

    async def _start(self) -> _Worker:
        self.started += 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "grpo_lib.tools.workers", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=None, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                 # `-m grpo_lib.tools.workers` imports grpo_lib before it reads the trainer's sys.path: the folder
                 # holding grpo_lib first, whatever the trainer's working directory
                 "PYTHONPATH": os.pathsep.join([_PROJECT_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])})
        worker = _Worker(proc)
        try:
            await worker.send({"sys_path": list(sys.path), "tools": self.blobs})
            ready = await asyncio.wait_for(worker.receive(), self.start_timeout_s)
        except asyncio.TimeoutError:
            await worker.kill()
            raise WorkerError(f"its worker process did not start within {self.start_timeout_s:g} s") from None
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
            await worker.kill()
            raise WorkerError(f"{worker.died()} while starting") from None
        except BaseException:  # cancelled while starting (the turn's bound passed, or the loop stops): it goes too
            await asyncio.shield(worker.kill())
            raise
        assert ready == "ready", f"a tool worker answered {ready!r} at start-up"
        return worker

    async def close(self) -> None:
        """Kill the idle workers (busy ones are killed by their calls when the loop cancels them)."""
        idle, self._idle = self._idle, []
        for worker in idle:
            await worker.kill()


# -- the worker's side ------------------------------------------------------------------------------------------------

def _read(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the trainer closed the pipe: exit
    (size,) = _HEADER.unpack(header)
    return pickle.loads(stream.read(size))


def _write(stream, obj) -> None:
    try:
        data = pickle.dumps(obj)
    except Exception as error:  # noqa: BLE001 - a return value that cannot travel is the call's error
        data = pickle.dumps(("error", f"{type(obj[1]).__name__} returned by the tool cannot be sent back from its worker "
                                      f"process ({type(error).__name__}: {error})"))
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the trainer's thread that started it ends (the trainer killed, or it exits
    without ToolBox.close while a call runs); an idle worker exits anyway when its stdin closes."""
    die_with_parent()  # not Linux: the stdin EOF is the only signal


def serve() -> None:
    """The worker's loop: hello (sys.path, tools), "ready", then one (name, method, args, kwargs) -> reply at a time."""
    import inspect

    _die_with_parent()
    inp, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # the tool's prints go to stderr, never into the replies
    sys.stdout = sys.stderr
    hello = _read(inp)
    if hello is None:
        return
    sys.path[:] = hello["sys_path"]
    tools, broken = {}, {}
    for name, blob in hello["tools"].items():
        try:
            tools[name] = pickle.loads(blob)
        except BaseException as error:  # noqa: BLE001 - every call of that tool answers with it
            broken[name] = f"it cannot be rebuilt in its worker process ({type(error).__name__}: {error})"
    _write(out, "ready")
    while (request := _read(inp)) is not None:
        name, method, args, kwargs = request
        try:
            if name in broken:
                raise WorkerError(broken[name])
            value = getattr(tools[name], method)(*args, **kwargs)
            if inspect.isawaitable(value):
                async def wait(awaitable=value):
                    return await awaitable

                value = asyncio.run(wait())
            reply = ("ok", value)
        except WorkerError as error:
            reply = ("error", str(error))
        except BaseException as error:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: the call's error, never our exit
            reply = ("error", f"{type(error).__name__}: {error}")
        _write(out, reply)


if __name__ == "__main__":
    serve()
