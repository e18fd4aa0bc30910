"""Trainer runs forked from a warm interpreter: the suite's one-process runs of train_grpo.py without paying the
heavy imports each time.

A `python tests/scripts/...` run spends ~2.5 s importing torch / transformers / accelerate / pandas before it does
anything, and a vLLM run ~7 s more for `from vllm import LLM` (measured on a 2-core machine); the suite starts ~100
trainer runs. `run_forked` sends the run (argv, working directory, environment, three file descriptors) to a server
that imported those libraries once and forks a child per run. The child takes the run's environment, argv, cwd and
stdio, and runs the script as `__main__` (runpy), exactly as `python SCRIPT ARGS` would from there; its exit status
(a signal's too: -9 for SIGKILL) comes back as the CompletedProcess's returncode. Nothing of grpo_lib is imported
before the fork: the code under test, and whatever it reads from the environment at import, is fresh in every run.

A run never outlives the test that asked for it: the server dies with its pytest process (PR_SET_PDEATHSIG), and
each run's waiter kills the run's process group when its client's socket closes before the run ends (the pytest
process killed, however); a test that stops waiting (its timeout, an interrupt) kills the run itself.

What differs from a fresh interpreter: third-party modules were imported under the server's environment (the test
session's, which the suite keeps to OMP_NUM_THREADS, no GPU, no hub access), and the child is in a process group of
its own. The CLI itself (`python train_grpo.py`: imports, argv, exit codes) stays proven by the tests that run it as
a plain subprocess (tests/core/test_fail_early.py, tests/config/test_config.py, tests/checkpoints/test_checkpoint.py's runs under a real
`accelerate launch`: its signals, SIGKILL of a launched run, its exit summary) and by `make demo`.
GRPO_TEST_FORK=0 runs every trainer run as a plain subprocess instead.

    proc = run_forked([sys.executable, "train_grpo.py", "recipes/tiny_cpu.yaml", ...], cwd=REPO, env=env, timeout=600)
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
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


# variables read at interpreter start or when the warm modules are imported (PYTHONPATH's sitecustomize, hub and
# cache paths, tempfile's folder, inductor's settings, the loader's): a run that changes one needs a fresh interpreter
IMPORT_TIME = ("PYTHON", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "LD_",
               "MALLOC_", "TMPDIR", "TEMP", "TMP")
_START_ENV = dict(os.environ)  # the server's environment: the session's, before any test changed os.environ


def can_fork(env: dict[str, str]) -> bool:
    """Whether a run with environment `env` can be forked from the warm server: forking is on (GRPO_TEST_FORK) and
    env agrees on every IMPORT_TIME variable with the server's environment, either as the server started (the
    session's) or as its imports left it: importing vllm sets TORCHINDUCTOR_COMPILE_THREADS, TORCHINDUCTOR_CACHE_DIR
    and LD_LIBRARY_PATH in os.environ, and a test that imported it in its pytest process passes those on in every
    environment it copies from os.environ (a fresh interpreter started with them imports the same modules as the
    server did). The server is asked (and started) only about values this pytest process's os.environ holds now."""
    if not enabled():
        return False
    start = _START_ENV
    keys = {k for k in (*env, *start) if k.startswith(IMPORT_TIME) and k != "PYTHONUNBUFFERED"}  # the server's is 1
    differ = [k for k in keys if env.get(k) != start.get(k)]
    if not differ:
        return True
    if any(env.get(k) != os.environ.get(k) for k in differ):  # the run's own setting: no server asked (nor started)
        return False
    imported = server_import_env()  # LD_LIBRARY_PATH too: a user's run never starts with what an import added to it
    return all(k in imported and env.get(k) == imported[k] for k in differ)


def server_import_env() -> dict[str, str]:
    """The variables the server's warm imports set or changed in its os.environ (starting the server if need be)."""
    _server_path()
    return dict(_server["imported"])


def run_forked(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for cmd =
    [sys.executable, SCRIPT, *args], run in a child forked from the warm server (module docstring)."""
    run = _Run(cmd, cwd=cwd, env=env)
    return run.result(run.wait(timeout))


def launch(cmd: list[str], *, procs: int, cwd: Path, env: dict[str, str], timeout: float, port: int,
           accelerate: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch --num_processes procs --multi_gpu SCRIPT ARGS` (accelerate=False: `torch.distributed.run
    --nproc_per_node procs`) for cmd = [sys.executable, SCRIPT, *args]: each process forked from the warm server with
    the environment those launchers give it (rank, world size, rendezvous on 127.0.0.1:port, accelerate's settings of
    tests/conftest.py's accelerate_launch). As the launchers do, the first process to fail has the others stopped
    (SIGTERM, SIGKILL 10 s later). The result: the processes' stdout and stderr, one after the other in rank order,
    and the first failure's exit status (0 when all exit 0)."""
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(procs), "LOCAL_WORLD_SIZE": str(procs),
              "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(procs),
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
              "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    if accelerate:
        common.update({"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
                       "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False"})
    runs: list[_Run] = []
    deadline = time.monotonic() + timeout
    codes: dict[int, int] = {}
    first_failure, stop_at = None, None
    try:
        for r in range(procs):
            runs.append(_Run(cmd, cwd=cwd, env={**env, **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}))
        while len(codes) < procs:
            waiting = [r for r in range(procs) if r not in codes]
            limit = min(deadline, stop_at + STOP_GRACE_S if stop_at else deadline) - time.monotonic()
            if limit <= 0 and stop_at is not None and time.monotonic() < deadline:
                for r in waiting:
                    _kill_group(runs[r].pid)
                limit = deadline - time.monotonic()
            if limit <= 0:
                for r in waiting:
                    _kill_group(runs[r].pid)
                output = [run.result(None) for run in runs]
                raise subprocess.TimeoutExpired(cmd, timeout, "".join(p.stdout for p in output),
                                                "".join(p.stderr for p in output))
            ready, _, _ = select.select([runs[r].conn for r in waiting], [], [], limit)
            for r in waiting:
                if runs[r].conn in ready:
                    codes[r] = runs[r].wait(None)
                    if codes[r] != 0 and first_failure is None:
                        first_failure, stop_at = r, time.monotonic()
                        for other in range(procs):
                            if other not in codes and other != r:
                                _signal_group(runs[other].pid, signal.SIGTERM)
    finally:
        for r, run in enumerate(runs):
            if r not in codes:
                _kill_group(run.pid)
    results = [run.result(codes[r]) for r, run in enumerate(runs)]
    returncode = 0 if first_failure is None else codes[first_failure]
    return subprocess.CompletedProcess(cmd, returncode, "".join(p.stdout for p in results), "".join(p.stderr for p in results))


STOP_GRACE_S = 10.0


class _Run:
    """One forked run: its connection to its waiter, its pid and its captured stdout / stderr."""

    def __init__(self, cmd: list[str], *, cwd: Path, env: dict[str, str]):
        assert cmd[0] == sys.executable and len(cmd) >= 2, cmd
        self.cmd = cmd
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(_server_path())
        request = json.dumps({"argv": cmd[1:], "cwd": str(cwd), "env": env}).encode()
        self.conn.sendall(len(request).to_bytes(8, "big"))
        with open(os.devnull, "rb") as null:
            socket.send_fds(self.conn, [request], [null.fileno(), self.out.fileno(), self.err.fileno()])
        self.conn.settimeout(SERVER_START_S)
        said = self._line()
        if not said:
            raise RuntimeError(f"the warm trainer server did not fork {cmd[1]} (its log: {_server.get('log')})")
        self.pid = int(said)

    def _line(self) -> str:
        """One line from the waiter, read a byte at a time (nothing of the next line is buffered away from select)."""
        data = b""
        while not data.endswith(b"\n"):
            byte = self.conn.recv(1)
            if not byte:
                return ""
            data += byte
        return data.decode()

    def wait(self, timeout: float | None) -> int:
        """The run's exit status (-N for signal N); TimeoutExpired (the run killed) after timeout seconds."""
        self.conn.settimeout(timeout)
        try:
            line = self._line()
        except TimeoutError:
            _kill_group(self.pid)
            output = self.result(None)
            raise subprocess.TimeoutExpired(self.cmd, timeout, output.stdout, output.stderr) from None
        except BaseException:  # an interrupted test (Ctrl-C, a pytest timeout): the run does not outlive it
            _kill_group(self.pid)
            raise
        if not line:  # the waiter died: the server went away
            _kill_group(self.pid)
            raise RuntimeError(f"the forked run of {self.cmd[1]} lost its server")
        return int(line)

    def result(self, returncode: int | None) -> subprocess.CompletedProcess:
        texts = []
        for f in (self.out, self.err):
            if f.closed:
                texts.append("")
                continue
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
            f.close()
        self.conn.close()
        return subprocess.CompletedProcess(self.cmd, returncode, *texts)


def _kill_group(pid: int) -> None:
    _signal_group(pid, signal.SIGKILL)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):  # gone, or (before its setpgrp) not yet a group of its own
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _server_path() -> str:
    with _lock:
        proc = _server.get("proc")
        if proc is not None and proc.poll() is None:
            return _server["path"]
        folder = tempfile.mkdtemp(prefix="grpo-fork-")
        path, log = os.path.join(folder, "server.sock"), os.path.join(folder, "server.log")
        ready_r, ready_w = os.pipe()
        with open(log, "wb") as log_file:
            proc = subprocess.Popen([sys.executable, "-u", __file__, path, str(ready_w)], pass_fds=(ready_w,),
                                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                    env={**_START_ENV, "PYTHONUNBUFFERED": "1"})
        os.close(ready_w)
        atexit.register(_stop, proc, folder)
        with os.fdopen(ready_r) as ready:
            readable, _, _ = select.select([ready], [], [], SERVER_START_S)
            said = ready.read() if readable else ""
        if not said.startswith("ready\n"):
            proc.kill()
            raise RuntimeError(f"the warm trainer server did not start in {SERVER_START_S:.0f} s: {said!r}; its "
                               f"output: {Path(log).read_text(errors='replace')[-4000:]}")
        _server.update(proc=proc, path=path, log=log, imported=json.loads(said.removeprefix("ready\n")))
        return path


SERVER_START_S = 300.0  # its imports take ~10 s on an idle 2-core machine


def _stop(proc: subprocess.Popen, folder: str) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


# -- the server's side ------------------------------------------------------------------------------------------------

def _serve(path: str, ready_fd: int) -> None:
    import ctypes
    import importlib
    import importlib.util

    os.set_inheritable(ready_fd, False)  # no subprocess of the warm imports holds the pipe open
    parent = os.getppid()
    try:  # the server dies with its pytest worker, however that ends (PR_SET_PDEATHSIG = 1)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return
    before = dict(os.environ)
    for name in WARM_IMPORTS + WARM_VLLM:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    if importlib.util.find_spec("vllm") is not None:
        from vllm import LLM  # noqa: F401 - the ~7 s import of a vLLM run
    try:  # inductor's probe of this CPU's vector ISA (10 test subprocesses, 1.2 s in every vLLM run; cached per process)
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
    except Exception:  # noqa: BLE001 - a run that needs it probes for itself
        pass
    gc.freeze()  # the imported modules' objects: never scanned by the runs' collections (nor copied by them)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}
    os.write(ready_fd, b"ready\n" + json.dumps(imported).encode())
    os.close(ready_fd)
    while True:
        conn, _ = listener.accept()
        conn.settimeout(10.0)  # one client that stops half-way does not stall the others
        try:
            size = int.from_bytes(_exactly(conn, 8), "big")
            request, fds, _, _ = socket.recv_fds(conn, size, 3)
            request += _exactly(conn, size - len(request))
        except (OSError, EOFError):
            conn.close()
            continue
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        if os.fork() == 0:  # the waiter: forks the run, reports its pid, then its exit status
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            conn.settimeout(None)
            try:
                _wait_for_run(conn, json.loads(request), fds)
            finally:  # never back into the server's loop (a client gone before its pid was sent)
                os._exit(0)
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
    try:  # the child's own group before its pid is reported (it calls setpgrp too: whichever runs first)
        os.setpgid(pid, pid)
    except OSError:
        pass
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:  # nobody waits for it
        os.killpg(pid, signal.SIGKILL)
        raise
    _, status = _wait_or_client_gone(pid, conn)
    try:
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    finally:
        os._exit(0)


def _wait_or_client_gone(pid: int, conn: socket.socket) -> tuple[int, int]:
    """os.waitpid(pid, 0), but a client that goes away first (its socket closed: the pytest process killed, however)
    has the run's group killed: a run never outlives the test that asked for it. The run's exit wakes the wait through
    a pidfd; where os.pidfd_open is refused (Linux < 5.3, a sandbox's seccomp) it is polled every 0.2 s."""
    try:
        exited = os.pidfd_open(pid)
    except (AttributeError, OSError):
        exited = None
    try:
        while True:
            ready, _, _ = select.select([conn] + ([exited] if exited is not None else []), [], [],
                                        None if exited is not None else 0.2)
            done = os.waitpid(pid, os.WNOHANG)
            if done[0] == pid:
                return done
            if conn in ready:
                try:
                    gone = conn.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    gone = True
                if gone:
                    _kill_group(pid)
                    return os.waitpid(pid, 0)
                time.sleep(0.05)  # a client never sends more; should it, it is not read, and not spun on
    finally:
        if exited is not None:
            os.close(exited)


def _run(request: dict, fds: list[int]) -> None:
    """The run's child: its own process group, the request's stdio / cwd / environment / argv, the script as __main__."""
    import runpy
    import traceback

    code, signum = 1, 0
    try:
        os.setpgrp()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # chosen again from this run's TMPDIR
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
            signum = signal.SIGINT
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
        if signum:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        os._exit(code & 0xFF)


if __name__ == "__main__":  # sys.path[0] is tests/: each run puts its own script's folder there
    _serve(sys.argv[1], int(sys.argv[2]))
