"""The Python code tool (grpo_lib.tools.builtin.PythonTool) tried as a hostile model would: each escape fails with an
observation the model reads, and the trainer (this test process) and its files are untouched.

The sandbox needs bubblewrap's namespaces, Landlock and the x86_64 seccomp filter (grpo_lib/tools/sandbox.py); on a
machine without them the escape tests skip (saying which layer is missing) and the strict tool's refusal to load is
tested instead. The second round's escapes (other processes, IPC, file metadata, tasks, forged outcomes, host facts)
are tests/tools/test_tools_python_escapes.py.
"""

from __future__ import annotations

import os
import time

import pytest

from grpo_lib.tools import sandbox
from grpo_lib.tools.base import ToolSchema
from grpo_lib.tools.builtin import PythonTool
from grpo_lib.tools.calls import ToolBox

SCHEMA = ToolSchema({"type": "function", "function": {"name": "python", "description": "Run Python code",
                                                       "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                                      "required": ["code"]}}})
LAYERS = sandbox.isolation_layers()
isolated = pytest.mark.skipif(bool(set(sandbox.REQUIRED) & set(LAYERS["missing"])),
                              reason=f"the sandbox's layers are missing here: {LAYERS['missing']}")


@pytest.fixture(scope="module")
def tool():
    # small limits keep the slow escapes short: 2 s of CPU, 4 s of wall time, 256 MiB, 4 KiB of output
    return PythonTool({"cpu_time_s": 2, "wall_time_s": 4, "memory_mb": 256, "max_output_bytes": 4096, "file_mb": 1}, SCHEMA)


def run(tool, code: str) -> str:
    text, step_reward, _ = tool.execute("ep", {"code": code})
    assert step_reward == 0.0
    return text


@isolated
def test_plain_code_runs_and_prints(tool):
    assert run(tool, "x = 6 * 7\nprint(x)") == "42\n"
    assert run(tool, "2 ** 10") == "1024\n"  # a last bare expression is shown, as a REPL shows it
    assert run(tool, "import math\nmath.comb(5, 2)") == "10\n"
    assert run(tool, "y = 1") == "(no output)"
    assert run(tool, "open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())").startswith("hi")  # its own dir


@isolated
def test_a_traceback_is_the_answer(tool):
    text = run(tool, "1 / 0")
    assert "ZeroDivisionError: division by zero" in text and "sandbox_child" not in text  # no frame of ours shown


@isolated
def test_fork_bomb_is_refused(tool):
    text = run(tool, "import os\nwhile True:\n    os.fork()")
    assert "PermissionError: [Errno 1] Operation not permitted" in text  # seccomp: fork is EPERM


@isolated
def test_subprocess_and_os_system_are_refused(tool):
    assert "PermissionError" in run(tool, "import subprocess\nsubprocess.run(['id'])")  # seccomp: clone / execve
    assert run(tool, "import os\nos.system('touch /tmp/owned')") == "32512\n"  # glibc: the spawn failed, status 127
    assert not os.path.exists("/tmp/owned")


@isolated
def test_busy_loop_is_stopped_by_cpu_time():
    # 1 CPU second against 60 s of wall time: RLIMIT_CPU stops it first even on a loaded machine (at load 7 on 2
    # cores a CPU second takes ~3.5 s of wall time)
    tool = PythonTool({"cpu_time_s": 1, "wall_time_s": 60}, SCHEMA)
    started = time.monotonic()
    assert run(tool, "while True:\n    pass") == "Error: the code used its 1 s of CPU time and was stopped."
    assert time.monotonic() - started < 60


@isolated
@pytest.mark.wallclock  # a bound of seconds: `make test` runs it alone
def test_sleeping_code_is_stopped_by_the_wall_clock():
    tool = PythonTool({"cpu_time_s": 2, "wall_time_s": 1.5}, SCHEMA)  # the module's tool would wait 4 s
    started = time.monotonic()
    assert run(tool, "import time\ntime.sleep(60)") == "Error: the code ran past its 1.5 s time limit and was stopped."
    assert time.monotonic() - started < 3.5  # killed at 1.5 s, not 60


@isolated
def test_a_10_gb_allocation_is_a_memory_error(tool):
    text = run(tool, "x = bytearray(10 * 2**30)")
    assert "MemoryError" in text and "the memory limit is 256 MiB" in text  # RLIMIT_AS


@isolated
def test_threads_cannot_take_the_machine(tool):
    # each thread reserves an 8 MiB stack: RLIMIT_AS stops the spawning long before the machine notices
    text = run(tool, "import threading, time\nfor _ in range(100000):\n"
                     "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()")
    assert "can't start new thread" in text


@isolated
def test_the_run_folder_and_home_are_unreadable(tool, tmp_path):
    secret = tmp_path / "run" / "metrics.jsonl"  # stands for the run folder, checkpoints, other temp files
    secret.parent.mkdir()
    secret.write_text("secret-step-1")
    for path in (secret, os.path.expanduser("~/.bashrc"), "/etc/passwd", __file__):  # not in its mount namespace
        text = run(tool, f"print(open({str(path)!r}).read())")
        assert "FileNotFoundError: [Errno 2] No such file" in text and "secret-step" not in text, (path, text)
    assert "FileNotFoundError" in run(tool, f"import os\nprint(os.listdir({str(tmp_path)!r}))")
    assert "PermissionError" in run(tool, "import os\nprint(os.listdir('/'))")  # Landlock: no READ_DIR of its root


@isolated
def test_writing_outside_its_directory_is_refused(tool, tmp_path):
    target = tmp_path / "planted.txt"
    text = run(tool, f"open({str(target)!r}, 'w').write('x')")
    assert "FileNotFoundError" in text and not target.exists()  # no such folder in its mount namespace
    assert "FileNotFoundError" in run(tool, f"import os\nos.remove({__file__!r})") and os.path.exists(__file__)
    for path in ("/planted", "/opt/planted", "/usr/planted"):  # its root and the binds: read-only; Landlock
        text = run(tool, f"open({path!r}, 'w').write('x')")
        assert "PermissionError" in text or "OSError: [Errno 30] Read-only file system" in text, (path, text)
    # a file within its directory stops at file_mb (RLIMIT_FSIZE): 1 MiB here
    text = run(tool, "f = open('big', 'wb')\nf.write(b'x' * (2 << 20))\nf.flush()")
    assert "OSError: [Errno 27] File too large" in text, text  # Python ignores SIGXFSZ: the write fails


@isolated
def test_no_network_even_to_localhost(tool):
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        text = run(tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert "PermissionError: [Errno 1] Operation not permitted" in text  # seccomp: socket() is EPERM
        text = run(tool, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                         "print(libc.socket(2, 2, 0), ctypes.get_errno())")  # UDP through libc itself
        assert text == "-1 1\n"
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()  # nobody came
    finally:
        server.close()


@isolated
def test_the_trainer_cannot_be_signalled(tool):
    me = os.getpid()  # this test process stands for the trainer; a SIGKILL that landed would end the test run
    assert "PermissionError: [Errno 1] Operation not permitted" in run(tool, f"import os\nos.kill({me}, 9)")
    assert "PermissionError" in run(tool, "import os\nos.kill(os.getppid(), 9)")
    assert run(tool, f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     f"print(libc.kill({me}, 9), ctypes.get_errno())") == "-1 1\n"  # ctypes meets the same filter
    assert "PermissionError" in run(tool, "import os\nos.killpg(1, 9)")


@isolated
@pytest.mark.wallclock  # a bound of seconds: `make test` runs it alone
def test_printing_10_mb_is_cut_inside_the_tool(tool):
    started = time.monotonic()
    text = run(tool, "print('x' * 10_000_000)")
    assert text == "x" * 4096 + "\n...(output cut at 4096 bytes; the code was stopped)"
    assert time.monotonic() - started < 4


@isolated
def test_the_environment_is_clean(tool, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret")
    text = run(tool, "import os\nprint(sorted(os.environ))")
    assert "HF_TOKEN" not in text and "WANDB" not in text and "PATH" in text
    assert "secret" not in run(tool, "print(open('/proc/self/environ').read())")
    assert "hf_secret" not in run(tool, f"print(open('/proc/{os.getpid()}/environ').read())")  # the trainer's


@isolated
def test_each_call_is_a_fresh_directory(tool):
    run(tool, "open('left.txt', 'w').write('x')")
    assert run(tool, "import os\nprint(os.listdir('.'))") == "[]\n"


@isolated
def test_through_the_toolbox_the_observation_is_truncated():
    tool = PythonTool({"wall_time_s": 4}, SCHEMA)
    box = ToolBox({"python": tool}, timeout_s=10, max_response_chars=32, truncate_side="left")
    from grpo_lib.tools.hermes import ToolCall

    try:
        box.start([("ep", {})])
        [out] = box.run([("ep", ToolCall("python", {"code": "print('y' * 1000)"}))])
        assert out.kind == "ok" and out.truncated and out.text == "y" * 32 + "...(truncated)"
    finally:
        box.close()


def test_strict_refuses_to_load_without_the_layers(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_layers", lambda limits: {"landlock_abi": 0, "container": "bubblewrap",
                                                                      "missing": {"landlock": "not available"}})
    with pytest.raises(ValueError, match=r"cannot isolate code on this machine \(isolation: strict\): landlock: not "
                                         r"available \(to enable: Linux >= 5.13.*lsm=.*best_effort"):
        PythonTool({}, SCHEMA)
    PythonTool({"isolation": "best_effort"}, SCHEMA)  # asked for: runs with what there is


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match=r"unknown PythonTool config key\(s\) \['cpu_seconds'\]"):
        PythonTool({"cpu_seconds": 3}, SCHEMA)
    with pytest.raises(ValueError, match="memory_mb=0: must be > 0"):
        PythonTool({"memory_mb": 0}, SCHEMA)
    with pytest.raises(ValueError, match="dir_files='many': must be a number"):
        PythonTool({"dir_files": "many"}, SCHEMA)


@isolated
def test_many_files_cannot_fill_the_disk():
    if "tmpfs" in LAYERS["missing"]:
        pytest.skip(reason=f"no mount namespace here ({LAYERS['missing']['tmpfs']}): only file_mb bounds each file")
    tool = PythonTool({"file_mb": 4, "dir_mb": 8, "wall_time_s": 20}, SCHEMA)
    # 100 files of 3 MiB (each under file_mb): the 8 MiB tmpfs of its directory is full at the third
    text = run(tool, "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))")
    assert "OSError: [Errno 28] No space left on device" in text, text


@isolated
def test_the_limits_cannot_be_lifted_from_inside(tool):
    for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE"):  # hard limits: raising needs a capability it has not
        text = run(tool, f"import resource\nresource.setrlimit(resource.{name}, (-1, -1))")
        assert "ValueError: not allowed to raise maximum limit" in text, (name, text)
    # the raw syscalls through ctypes meet seccomp: clone of a process (SIGCHLD, no CLONE_THREAD) and mount
    assert run(tool, "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
                     "print(l.syscall(56, 17, 0, 0, 0, 0), ctypes.get_errno())") == "-1 1\n"
    assert run(tool, "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
                     "print(l.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())") == "-1 1\n"
