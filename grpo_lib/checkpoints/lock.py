"""One run at a time in a run folder: the run lock (`trainer.default_local_dir/.run.lock`).

Two runs started at once into one folder both passed every check and wrote into it, so the folder ended up holding one
run's checkpoints and the other's work was gone. Process 0 of a run takes the lock before anything in the folder
changes (train_grpo.py, right after the process group starts) and every process learns the outcome from it (one
broadcast), so the run's processes agree: they all go on, or they all exit 2. Only process 0 holds it: the other
processes of the run, on this machine or on others sharing the folder, are the same run.

    lock = take_run_lock(run_dir)   # RunLockHeld (exit 2, nothing changed) names the holder: pid, host, start time
    ...                              # the run
    lock.release()                   # every way out of main (train_grpo.py's finally); the file is removed

train_grpo.py calls `take_agreed_run_lock`: process 0 takes it, every process gets the refusal (one broadcast).

How, and why these primitives:
- `fcntl.flock` on the lock file, non-blocking. The kernel drops a flock when its process ends in any way (a crash,
  SIGKILL, the OOM killer), so a dead run never holds the folder. On Linux NFS clients flock is carried by the NFS
  byte-range locks (NLM for v3, the protocol's own locks for v4), so a run on another machine sees it too; a lease of
  a crashed client expires on the server (NFSv4: 90 s by default).
- The file holds the holder's JSON (pid, host, start time, a run id) and process 0 touches its mtime every
  `HEARTBEAT_S` (a daemon thread). A folder on an NFS mount without locking (`nolock`, or a server without lockd)
  gives every machine its own flock; then a lock file naming another host with a fresh heartbeat (younger than
  `STALE_AFTER_S`) is still held, and the new run exits 2 the same way.
- A lock file whose flock is free is stale: its holder ended without releasing it (a crash or a kill). The new run
  takes it over and says so, with the holder's pid, host and start time, and whether that pid is still alive on this
  host (a pid alive after its lock was freed is another process that reuses the number).
- Not `O_CREAT | O_EXCL` alone: atomic on local disks and NFSv3+, but a crashed run's file would stay, and telling
  a live holder on another host from a dead one would rest on the heartbeat alone. flock is exact wherever it works;
  the heartbeat covers where it does not.
- The descriptor is close-on-exec (Python's default), so nothing the run execs (the reward forkserver, tool
  processes) inherits the flock; a plain fork would share it, and a refusal whose holder pid is gone says so.
- The file is removed on release. The unlink races with a new run that opened the old file: after taking the flock,
  a run checks that the path still names the file it locked (same inode), and starts again otherwise.

Standard library only (no torch): the check comes before anything heavy.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

LOCK_NAME = ".run.lock"
HEARTBEAT_S = 30.0  # how often the holder touches the lock file (its mtime is the heartbeat)
STALE_AFTER_S = 300.0  # a lock file of another host whose heartbeat is older than this is stale (clock skew allowed)


class RunLockHeld(RuntimeError):
    """Another run holds the run folder (exit code 2: the message names the holder and the way out; nothing changed)."""


def _describe(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {when}"


def _read_info(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        info = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"unreadable": raw[:80].decode("utf-8", "replace")}
    return info if isinstance(info, dict) else {}


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@dataclass
class RunLock:
    """The held lock of one run folder (process 0 of the run). `stale`: what a crashed run left, taken over."""

    path: Path
    fd: int
    info: dict
    stale: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.fd)

    def release(self) -> None:
        """Remove the lock file and drop the flock (idempotent). The unlink comes first, while the flock is held, so no
        other run can lock this file between them (it would find the path gone and start again)."""
        if self.fd < 0:
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


def take_run_lock(run_dir: Path) -> RunLock:
    """Take `run_dir`'s run lock for this process (see the module docstring); RunLockHeld when another run holds it.

    Example message: "trainer.default_local_dir='outputs/run' is in use by another run (pid 4242 on host gpu-3, started
    2026-12-02 05:40:11 UTC): one run at a time per folder. Wait for it to end (or stop it), or choose another
    trainer.default_local_dir. Nothing was changed."
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    for _ in range(10):  # a release unlinked the file we opened: open the new one
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_info(fd)
            os.close(fd)
            raise RunLockHeld(_held_message(run_dir, info)) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise RunLockHeld(f"trainer.default_local_dir={str(run_dir)!r}: its run lock {path} kept changing under this run "
                          "(other runs starting there at once); start one run per folder")
    previous = _read_info(fd)
    stale = None
    if previous:
        mtime = os.fstat(fd).st_mtime
        age = time.time() - mtime
        if previous.get("host") not in (None, socket.gethostname()) and 0 <= age < STALE_AFTER_S:
            os.close(fd)  # its flock is not ours to see (NFS without locking): the heartbeat says it runs
            raise RunLockHeld(_held_message(run_dir, previous, heartbeat_s=age))
        alive = previous.get("host") == socket.gethostname() and _pid_alive(previous.get("pid"))
        stale = (f"{path} was left by a run that ended without releasing it ({_describe(previous)}; "
                 + ("that pid now belongs to another process" if alive else "that process is gone: it crashed or was killed")
                 + f", last heartbeat {age:.0f} s ago): the lock is stale and this run takes it over")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "run_id": uuid.uuid4().hex[:12]}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(info).encode())
    os.fsync(fd)
    lock = RunLock(path=path, fd=fd, info=info, stale=stale)
    threading.Thread(target=lock._beat, name="run-lock-heartbeat", daemon=True).start()
    return lock


def take_agreed_run_lock(run_dir: Path, *, rank: int, agree) -> tuple[RunLock | None, str | None]:
    """The run's lock: taken by process 0, its outcome agreed by every process of the run -> (the lock on process 0,
    None elsewhere; the refusal every process exits 2 with, or None). `agree(value)` returns process 0's value on every
    process (distributed.broadcast_object; passed in: this module stays standard library only). A stale lock taken over
    is a warning on process 0's stderr."""
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = take_run_lock(run_dir)
        except RunLockHeld as exc:
            refusal = str(exc)
        except OSError as exc:
            refusal = f"trainer.default_local_dir={str(run_dir)!r}: its run lock cannot be taken ({exc})"
        if lock is not None and lock.stale:
            print(f"warning: {lock.stale}", file=sys.stderr)
    return lock, agree(refusal)


def _held_message(run_dir: Path, info: dict, *, heartbeat_s: float | None = None) -> str:
    how = (f"; its heartbeat is {heartbeat_s:.0f} s old (this file system gives no lock across machines, so the "
           f"heartbeat decides; stale after {STALE_AFTER_S:.0f} s)" if heartbeat_s is not None else "")
    holder = _describe(info) if info else "the holder has not written its name yet"
    if heartbeat_s is None and info.get("host") == socket.gethostname() and not _pid_alive(info.get("pid")):
        how = (f"; that pid is gone, so a process it forked still holds the lock (a leftover worker: `fuser "
               f"{run_dir / LOCK_NAME}` names it)")
    return (f"trainer.default_local_dir={str(run_dir)!r} is in use by another run ({holder}{how}): one run at a time per "
            "folder. Wait for it to end (or stop it), or choose another trainer.default_local_dir. Nothing was changed.")
