"""The suite's fork harness (tests/helpers/forked_runs.py) behaves as `python SCRIPT` and as a launcher would: argv, cwd,
environment, exit statuses (a signal's too), a timeout that kills the run and keeps its output, a 2-process launch
whose first failure stops the other, and which environments need a fresh interpreter instead."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import forked_runs

pytestmark = [pytest.mark.slow,  # starts the warm server (torch, transformers, vLLM imported once per worker)
              pytest.mark.skipif(not forked_runs.enabled(), reason="GRPO_TEST_FORK=0: runs are plain subprocesses")]


def _script(tmp_path, body: str):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(tmp_path, body: str, *args: str, env: dict | None = None, timeout: float = 60):
    return forked_runs.run_forked([sys.executable, str(_script(tmp_path, body)), *args], cwd=tmp_path,
                                  env={**os.environ, **(env or {})}, timeout=timeout)


def test_a_run_sees_its_argv_cwd_environment_and_a_fresh_grpo_lib(tmp_path):
    proc = _run(tmp_path, """
        import json, os, sys
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("FORK_TEST_VAR"),
                          "name": __name__, "grpo_lib": any(m.startswith("grpo_lib") for m in sys.modules),
                          "path0": sys.path[0]}))
        print("to stderr", file=sys.stderr)
    """, "a", "--b", env={"FORK_TEST_VAR": "x y"})
    import json

    seen = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert seen["argv"][1:] == ["a", "--b"] and seen["argv"][0].endswith("script.py")
    assert seen == {**seen, "cwd": str(tmp_path), "var": "x y", "name": "__main__", "grpo_lib": False,
                    "path0": str(tmp_path)}
    assert proc.stderr == "to stderr\n"


@pytest.mark.parametrize(("body", "code"), [
    ("import sys; sys.exit(3)", 3),
    ("import sys; sys.exit(-1)", 255),  # as the interpreter: the status modulo 256, not a signal
    ("import sys; sys.exit('bad input')", 1),
    ("raise ValueError('boom')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
    ("raise KeyboardInterrupt", -2),
])
def test_exit_statuses_are_the_interpreters(tmp_path, body, code):
    proc = _run(tmp_path, body)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    if "ValueError" in body:
        assert "ValueError: boom" in proc.stderr and "Traceback" in proc.stderr
    if "bad input" in body:
        assert proc.stderr.strip() == "bad input"


def test_atexit_and_threads_finish_before_the_exit(tmp_path):
    proc = _run(tmp_path, """
        import atexit, threading, time
        atexit.register(lambda: print("atexit ran"))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
    """)
    assert proc.returncode == 0 and proc.stdout == "thread done\natexit ran\n", proc


def test_a_timeout_kills_the_run_and_keeps_its_output(tmp_path):
    marker = tmp_path / "still-running"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        _run(tmp_path, f"""
            import subprocess, sys, time
            # a grandchild in the run's process group: killed with it
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3); open({str(marker)!r}, 'w')"])
            print("started", flush=True)
            time.sleep(60)
        """, timeout=3)
    assert time.monotonic() - start < 30
    assert caught.value.stdout == "started\n"
    time.sleep(4)
    assert not marker.exists(), "the run's process group outlived its timeout"


def test_launch_gives_ranks_the_launchers_environment_and_stops_the_rest_on_a_failure(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
              f"at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
        if os.environ["RANK"] == "1":
            sys.exit(7)
        time.sleep(60)
    """)
    start = time.monotonic()
    proc = forked_runs.launch([sys.executable, str(script)], procs=2, cwd=tmp_path, env=dict(os.environ), timeout=120,
                              port=29123)
    assert time.monotonic() - start < 30, "rank 0 was not stopped after rank 1 failed"
    assert proc.returncode == 7
    assert proc.stdout == "rank 0 of 2 local 0 at 127.0.0.1:29123\nrank 1 of 2 local 1 at 127.0.0.1:29123\n"


def test_only_environments_the_server_was_imported_under_are_forked():
    env = dict(os.environ)
    assert forked_runs.can_fork(env)
    assert forked_runs.can_fork({**env, "GRPO_SOMETHING": "1", "OMP_NUM_THREADS": "1"})
    assert not forked_runs.can_fork({**env, "PYTHONPATH": "/elsewhere"})  # a sitecustomize acts at start
    assert not forked_runs.can_fork({**env, "HF_HUB_CACHE": "/elsewhere"})  # hub constants fixed at import
    assert not forked_runs.can_fork({**env, "TMPDIR": "/elsewhere"})
    without = {k: v for k, v in env.items() if not k.startswith("HF_")}
    if without != env:
        assert not forked_runs.can_fork(without)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed: nothing sets its variables")
def test_environments_copied_after_importing_vllm_in_the_test_process_are_still_forked():
    saved = dict(os.environ)
    import vllm  # noqa: F401 - as an in-process engine test does: it sets TORCHINDUCTOR_* and LD_LIBRARY_PATH here

    env = dict(os.environ)
    try:
        changed = {k for k in env if k.startswith(forked_runs.IMPORT_TIME) and env[k] != forked_runs._START_ENV.get(k)}
        assert changed <= set(forked_runs.server_import_env()), "the server's imports set what vllm's import set here"
        assert forked_runs.can_fork(env)
        assert not forked_runs.can_fork({**env, "TORCHINDUCTOR_COMPILE_THREADS": "7"})  # neither the start's nor vllm's
    finally:  # this worker's later tests see the environment they would have without this one
        os.environ.clear()
        os.environ.update(saved)


def test_a_run_whose_test_process_is_killed_does_not_outlive_it(tmp_path):
    """SIGKILL of the process that asked for a run (a pytest worker killed, or Ctrl-C twice): its server dies with it
    (PR_SET_PDEATHSIG) and the run's waiter, seeing its client's socket close, kills the run."""
    pid_file = tmp_path / "run.pid"
    script = _script(tmp_path, f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    client = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(forked_runs.__file__).parent)!r})
        import forked_runs
        forked_runs.run_forked([sys.executable, {str(script)!r}], cwd={str(tmp_path)!r}, env=dict(os.environ), timeout=300)
    """)], env={**os.environ, "GRPO_TEST_FORK": "1", "TMPDIR": str(tmp_path)})  # its server's folder: never removed
    try:
        deadline = time.monotonic() + 240  # the client's own server imports torch, transformers, vLLM first
        while not pid_file.exists() or not pid_file.read_text():
            assert client.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        run_pid = int(pid_file.read_text())
        os.kill(run_pid, 0)  # running
        client.kill()
        client.wait()
        gone_by = time.monotonic() + 30
        while _alive(run_pid):
            assert time.monotonic() < gone_by, f"the run {run_pid} outlived its killed client by 30 s"
            time.sleep(0.1)
    finally:
        client.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polled"])
def test_the_waiter_reports_an_exit_and_kills_a_run_whose_client_left(monkeypatch, pidfd):
    """forked_runs._wait_or_client_gone, with a pidfd and without (os.pidfd_open refused, as under some sandboxes):
    a run that exits is reported with its status; a run whose client's socket closes is killed, its group with it."""
    import socket

    if not pidfd:
        monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError("refused")))

    ours, theirs = socket.socketpair()

    def start(seconds: float, code: int) -> int:  # a run as the waiter forks it: in its own group, no client socket
        pid = os.fork()
        if pid == 0:
            ours.close()
            theirs.close()
            os.setpgrp()
            time.sleep(seconds)
            os._exit(code)
        try:
            os.setpgid(pid, pid)
        except OSError:  # it did so first
            pass
        return pid

    try:
        pid = start(0.3, 5)
        started = time.monotonic()
        got_pid, status = forked_runs._wait_or_client_gone(pid, ours)
        assert got_pid == pid and os.waitstatus_to_exitcode(status) == 5
        assert time.monotonic() - started < 5
        pid = start(120, 0)
        theirs.close()  # the client went away
        started = time.monotonic()
        _, status = forked_runs._wait_or_client_gone(pid, ours)
        assert os.waitstatus_to_exitcode(status) == -9 and time.monotonic() - started < 5
    finally:
        ours.close()

