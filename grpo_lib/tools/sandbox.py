"""Running untrusted Python (the model's code) in a locked-in child process: the parent side of grpo_lib/tools/
sandbox_child.py, which lists the kernel layers that lock it in (rlimits, user + network namespaces, Landlock, seccomp).

    result = run_python("print(6 * 7)", limits=Limits(cpu_s=5, wall_s=10, memory_mb=512))
    result.output == "42\\n"; result.status == "ok"

What the parent adds: a fresh temporary working directory per run (removed after), a clean environment (PATH, LANG,
HOME and TMPDIR = the directory, one thread for BLAS; none of the trainer's variables, so no token or key), no file
descriptor but the pipes, a session of its own (the whole process group is killed), the wall clock (SIGKILL at wall_s),
and the output cap: it reads at most output_bytes of stdout + stderr, then kills the child, so printing 10 MB costs
the trainer output_bytes of memory. `status` says how the run ended:

    ok           exited 0                                  error       exited non-zero (a traceback, sys.exit(1))
    timeout      still running at wall_s (killed)          cpu_limit   used cpu_s of CPU time (SIGXCPU)
    output_limit printed more than output_bytes (killed)   killed      ended by another signal
    sandbox_error a required isolation layer could not be set; no code ran (the output says which)

Which layer stops which escape (tests/test_tools_python.py tries each):

    fork bomb, os.system, subprocess         seccomp (fork / clone of a process / execve: EPERM)
    while True                               RLIMIT_CPU (SIGXCPU), the wall clock (time.sleep: SIGKILL)
    a 10 GB allocation                       RLIMIT_AS (MemoryError)
    reading the run folder, ~, other tmp     Landlock (read only under the Python installation, /usr, /lib*)
    writing outside its directory            Landlock (write only under its directory); RLIMIT_FSIZE bounds a file
    filling the disk with many files         its directory is a tmpfs of dir_mb (a mount namespace of its own)
    a socket to 127.0.0.1                    seccomp (socket(): EPERM); the network namespace (no route); Landlock TCP
    os.kill of the trainer                   seccomp (a signal to another pid: EPERM); Landlock signal scope (ABI 6)
    printing 10 MB                           the parent's read cap (output_bytes, then SIGKILL)
    ctypes around all of it                  nothing to go around: every layer above is the kernel's
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
SANDBOX_FAILED = 97  # sandbox_child.SANDBOX_FAILED (not imported: the child module is a script)


@dataclass(frozen=True)
class Limits:
    """The bounds of one run; each in its unit."""

    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 20.0  # wall-clock seconds from the child's start
    memory_mb: int = 1024  # address space, MiB (RLIMIT_AS): the interpreter takes ~30 of it
    output_bytes: int = 65536  # stdout + stderr read back; more kills the run
    file_mb: int = 16  # largest file it may write, MiB (RLIMIT_FSIZE)
    dir_mb: int = 64  # all it may write, MiB (its directory is a tmpfs of this size where a mount namespace is allowed)
    max_open_files: int = 64  # RLIMIT_NOFILE
    strict: bool = True  # refuse to run (status sandbox_error) when Landlock or seccomp cannot be set


@dataclass
class RunResult:
    output: str  # stdout + stderr as read (at most output_bytes, decoded with replacement)
    status: str  # ok | error | timeout | cpu_limit | output_limit | killed | sandbox_error
    returncode: int | None
    wall_s: float


def read_roots() -> list[str]:
    """Where the child may read (and execute): the Python installation (its prefixes and library dirs, symlinks
    resolved) and the system's /usr, /lib, /lib64. Not /: the run folder, home, /tmp, /etc stay out."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "/usr", "/lib", "/lib64",
             *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return sorted({os.path.realpath(r) for r in roots if r and os.path.exists(r)})


def clean_env(workdir: str) -> dict[str, str]:
    """The child's whole environment: nothing of the trainer's (no HF_TOKEN, WANDB_API_KEY, AWS_* ...)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_python(code: str, *, limits: Limits, report_layers: bool = False) -> RunResult:
    """Run `code` in a fresh sandboxed interpreter; never raises for anything the code does."""
    workdir = tempfile.mkdtemp(prefix="grpo-python-")
    os.chmod(workdir, 0o700)
    spec = {"cpu_s": int(limits.cpu_s), "memory_bytes": int(limits.memory_mb) << 20, "file_bytes": int(limits.file_mb) << 20,
            "dir_bytes": int(limits.dir_mb) << 20,
            "max_open_files": int(limits.max_open_files), "read_roots": read_roots(), "strict": bool(limits.strict),
            "report_layers": report_layers}
    started = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-B", str(CHILD), json.dumps(spec)], cwd=workdir,
                                env=clean_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died before reading (a sandbox failure): its output says why
        output, cut, late = _read_capped(proc, limit=limits.output_bytes, deadline=started + limits.wall_s)
        if not (cut or late):  # the pipe closed: the child is exiting, or closed its stdout and runs on
            try:
                proc.wait(timeout=max(0.0, started + limits.wall_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                late = True
        _kill(proc)
        returncode = proc.wait()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return RunResult(output.decode("utf-8", "replace"), _status(returncode, cut=cut, late=late), returncode,
                     time.monotonic() - started)


def isolation_layers() -> dict:
    """What the child can set up here: {"landlock_abi": int, "missing": {layer: why}} ({} missing: all layers)."""
    result = run_python("", limits=Limits(strict=False), report_layers=True)
    try:
        return json.loads(result.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"landlock_abi": 0, "missing": {"sandbox": result.output.strip() or f"exit {result.returncode}"}}


def _read_capped(proc: subprocess.Popen, *, limit: int, deadline: float) -> tuple[bytes, bool, bool]:
    """(output, cut at the limit, still running at the deadline), reading the pipe until it closes."""
    chunks, size = [], 0
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), False, True
            if not sel.select(timeout=left):
                continue
            data = os.read(fd, 65536)
            if not data:
                return b"".join(chunks), False, False
            chunks.append(data)
            size += len(data)
            if size > limit:
                return b"".join(chunks)[:limit], True, False


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (a no-op once it has exited and been reaped)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.stdout.close()


def _status(returncode: int, *, cut: bool, late: bool) -> str:
    if cut:
        return "output_limit"
    if late:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == SANDBOX_FAILED:
        return "sandbox_error"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL we did not send: the CPU hard limit
        return "cpu_limit"
    return "error" if returncode > 0 else "killed"
