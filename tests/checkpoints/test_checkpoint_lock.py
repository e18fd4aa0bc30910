"""One run at a time per run folder (grpo_lib/checkpoints/lock.py, through train_grpo.main in this process).

Issue 31 item 1: two runs started at once into one folder both exited 0 and the folder held run A only. The second
run now exits 2 at once naming the holder (pid, host, start time) and changes nothing; the lock goes with any exit of
its run; a lock left by a killed run is stale, taken over and said so. Two machines sharing one folder are one run:
only its process 0 takes the lock (tests/checkpoints/test_checkpoint.py's simulated two machines run through it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_lib.checkpoints.lock import LOCK_NAME, RunLockHeld, take_run_lock
from tests.conftest import REPO
from tests.helpers.checkpoint_runs import checkpoints_of, folder_digest, main_until_setup, resume_args

HOLD = """
import sys, time
from pathlib import Path
from grpo_lib.checkpoints.lock import take_run_lock
lock = take_run_lock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def holder(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s run lock (as a running trainer's process 0 does), once it prints "held"."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_held_folder_exits_2_naming_the_holder_and_changes_nothing(tiny_model_dir, arith_data,
                                                                                        tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = resume_args(tiny_model_dir, arith_data, out)
    checkpoints_of(args, out, [1, 2])
    proc = holder(out)
    try:
        before = folder_digest(out)
        lock_before = (out / LOCK_NAME).read_bytes()
        result, plan = main_until_setup(monkeypatch, args)
        assert result.returncode == 2 and plan is None, result.stderr[-3000:]
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(json.loads(lock_before)["started"]))
        for needle in (f"trainer.default_local_dir={str(out)!r} is in use by another run", f"pid {proc.pid}",
                       f"host {socket.gethostname()}", f"started {started}", "Nothing was changed"):
            assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
        assert folder_digest(out) == before and (out / LOCK_NAME).read_bytes() == lock_before, "the refused run changed the folder"
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_goes_with_any_exit_of_its_run(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """A run that returns (0, or 2 from a later check) or raises leaves no lock: the next run starts."""
    import train_grpo

    out = tmp_path / "run"
    args = resume_args(tiny_model_dir, arith_data, out)
    result, plan = main_until_setup(monkeypatch, args)
    assert result.returncode == 0 and not (out / LOCK_NAME).exists(), result.stderr[-3000:]

    def crash(self):
        assert (out / LOCK_NAME).is_file(), "the run holds the lock while it runs"
        raise RuntimeError("crash in setup")

    monkeypatch.setattr(train_grpo.GRPOTrainer, "setup", crash)
    with pytest.raises(RuntimeError, match="crash in setup"):
        train_grpo.main(args)
    assert not (out / LOCK_NAME).exists()
    take_run_lock(out).release()


def test_a_killed_runs_lock_is_stale_taken_over_and_said_so(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """SIGKILL: no finally runs, the lock file stays; the kernel freed its flock, so the next run takes it over, naming
    the dead holder."""
    out = tmp_path / "run"
    args = resume_args(tiny_model_dir, arith_data, out)
    proc = holder(out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / LOCK_NAME).is_file(), "a kill leaves the file"
    result, plan = main_until_setup(monkeypatch, args)
    assert result.returncode == 0 and plan is not None, result.stderr[-3000:]
    for needle in (f"{out / LOCK_NAME} was left by a run that ended without releasing it", f"pid {proc.pid}",
                   "that process is gone: it crashed or was killed", "the lock is stale and this run takes it over"):
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    assert not (out / LOCK_NAME).exists()


def test_another_hosts_lock_with_a_fresh_heartbeat_is_held_without_flock(tmp_path):
    """NFS without locking gives each machine its own flock: the lock file of another host whose heartbeat (mtime) is
    fresh still holds the folder; one older than STALE_AFTER_S is stale."""
    from grpo_lib.checkpoints.lock import STALE_AFTER_S

    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 77, "host": "gpu-other", "started": time.time() - 60}))
    with pytest.raises(RunLockHeld, match=r"pid 77 on host gpu-other, started .*its heartbeat is \d+ s old"):
        take_run_lock(tmp_path)
    old = time.time() - STALE_AFTER_S - 10
    os.utime(tmp_path / LOCK_NAME, (old, old))
    lock = take_run_lock(tmp_path)
    assert "pid 77 on host gpu-other" in lock.stale and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_second_lock_in_one_process_is_refused_and_a_release_frees_it(tmp_path):
    """flock belongs to the open file: a second take_run_lock, even in the same process, is refused while the first
    holds; after release a new one succeeds (the unlinked file is never locked twice: the inode check)."""
    first = take_run_lock(tmp_path)
    with pytest.raises(RunLockHeld, match=f"pid {os.getpid()} on host"):
        take_run_lock(tmp_path)
    first.release()
    first.release()  # idempotent
    second = take_run_lock(tmp_path)
    assert second.stale is None, "a released lock leaves nothing stale"
    second.release()
