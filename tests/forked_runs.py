"""Trainer runs forked from a warm interpreter: the suite's one-process runs of train_grpo.py without paying the
heavy imports each time.

A `python tests/scripts/...` run spends ~2.5 s importing torch / transformers / accelerate / pandas before it does
anything, and a vLLM run ~7 s more for `from vllm import LLM` (measured on a 2-core machine); the suite starts ~100
trainer runs. `run_forked` sends the run (argv, working directory, environment, three file descriptors) to a server
that imported those libraries once and forks a child per run. The child takes the run's environment, argv, cwd and
stdio, and runs the script as `__main__` (runpy), exactly as `python SCRIPT ARGS` would from there; its exit status
(a signal's too: -9 for SIGKILL) comes back as the CompletedProcess's returncode. Nothing of grpo_lib is imported
before the fork: the code under test, and whatever it reads from the environment at import, is fresh in every run.

What differs from a fresh interpreter: third-party modules were imported under the server's environment (the test
session's, which the suite keeps to OMP_NUM_THREADS, no GPU, no hub access), and the child is in a process group of
its own. The CLI itself (`python train_grpo.py`: imports, argv, exit codes) stays proven by the tests that run it as
a plain subprocess (tests/test_fail_early.py, tests/test_config.py, every multi-process launch) and by `make demo`.
GRPO_TEST_FORK=0 runs every trainer run as a plain subprocess instead.

    proc = run_forked([sys.executable, "train_grpo.py", "recipes/tiny_cpu.yaml", ...], cwd=REPO, env=env, timeout=600)
"""

from __future__ import annotations

import array
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# what the server imports before it forks (the heavy imports of a trainer run; vllm only where it imports)
WARM_IMPORTS = ("torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "accelerate", "pandas", "pyarrow",
                "pyarrow.parquet", "safetensors.torch", "yaml", "peft", "torch.distributed.checkpoint",
                "torch.distributed.fsdp")
WARM_VLLM = ("vllm",)

_server: dict = {}  # "proc", "path": the one server of this pytest process
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("GRPO_TEST_FORK", "1") != "0"


def run_forked(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for cmd =
    [sys.executable, SCRIPT, *args], run in a child forked from the warm server (module docstring)."""
    assert cmd[0] == sys.executable and len(cmd) >= 2, cmd
    path = _server_path()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        request = json.dumps({"argv": cmd[1:], "cwd": str(cwd), "env": env}).encode()
        conn.sendall(len(request).to_bytes(8, "big"))
        socket.send_fds(conn, [request], [null.fileno(), out.fileno(), err.fileno()])
        reader = conn.makefile("r")
        pid = int(reader.readline())
        conn.settimeout(timeout)
        try:
            line = reader.readline()
        except TimeoutError:
            _kill_group(pid)
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        if not line:  # the waiter died: the server went away
            _kill_group(pid)
            raise RuntimeError(f"the forked run of {cmd[1]} lost its server")
        returncode = int(line)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode("utf-8", "replace") for f in (out, err))
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _server_path() -> str:
    with _lock:
        proc = _server.get("proc")
        if proc is not None and proc.poll() is None:
            return _server["path"]
        folder = tempfile.mkdtemp(prefix="grpo-fork-")
        path = os.path.join(folder, "server.sock")
        ready_r, ready_w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-u", __file__, path, str(ready_w)], pass_fds=(ready_w,),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(ready_w)
        with os.fdopen(ready_r) as ready:
            said = ready.read()
        if said != "ready":
            proc.kill()
            raise RuntimeError(f"the warm trainer server did not start: {said!r}")
        _server.update(proc=proc, path=path)
        atexit.register(_stop, proc)
        return path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# -- the server's side ------------------------------------------------------------------------------------------------

def _serve(path: str, ready_fd: int) -> None:
    import importlib
    import importlib.util

    for name in WARM_IMPORTS + WARM_VLLM:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    if importlib.util.find_spec("vllm") is not None:
        from vllm import LLM  # noqa: F401 - the ~7 s import of a vLLM run
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.write(ready_fd, b"ready")
    os.close(ready_fd)
    while True:
        conn, _ = listener.accept()
        size = int.from_bytes(_exactly(conn, 8), "big")
        request, fds, _, _ = socket.recv_fds(conn, size, 3)
        while len(request) < size:
            request += conn.recv(size - len(request))
        if os.fork() == 0:  # the waiter: forks the run, reports its pid, then its exit status
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _wait_for_run(conn, json.loads(request), fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _wait_for_run(conn: socket.socket, request: dict, fds: list[int]) -> None:
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request, fds)  # never returns
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    finally:
        os._exit(0)


def _run(request: dict, fds: list[int]) -> None:
    """The run's child: its own process group, the request's stdio / cwd / environment / argv, the script as __main__."""
    import runpy
    import traceback

    code = 1
    try:
        os.setpgrp()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "OMP_NUM_THREADS" in os.environ:
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import random

        random.seed()  # a fresh interpreter's seeds, not the server's state copied into every run
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except KeyboardInterrupt:  # python's exit for it: killed by SIGINT
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 - what python prints for an uncaught exception, and its exit status
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as the interpreter's exit: wait for the run's non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


if __name__ == "__main__":  # sys.path[0] is tests/: each run puts its own script's folder there
    _serve(sys.argv[1], int(sys.argv[2]))
