"""Tally of escape attempts against the Python tool's sandbox of a checkout: which of issue 40's attempts the model's
code gets through (ESCAPED) and which are contained. Not a test (tests/tools/test_tools_python_escapes.py asserts each);
this runs against any checkout, so an older one can be compared:

    .venv/bin/python bench/sandbox_escapes.py              # this checkout
    .venv/bin/python bench/sandbox_escapes.py --repo /path/to/an/older/checkout

Run it as the trainer would be run (root here). This process stands for the trainer.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
from pathlib import Path

ME = os.getpid()
LIBC = "import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\n"


def attempts(shm_key: int, probe_file: str) -> list[tuple[str, str, object]]:
    """(name, code, escaped(output) -> bool)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    mode = os.stat(probe_file).st_mode
    return [
        ("prlimit64 on the trainer", LIBC + f"class R(ctypes.Structure):\n    _fields_ = [('c', ctypes.c_ulong), ('m', ctypes.c_ulong)]\n"
         f"print(l.prlimit({ME}, 7, ctypes.byref(R(64, 64)), None))",
         lambda out: _changed_and_restored(nofile)),
        ("setpriority on the trainer", LIBC + f"print(l.setpriority(0, {ME}, 1))", lambda out: out.strip() == "0"),
        ("sched_setaffinity on the trainer", LIBC + f"print(l.syscall(203, {ME}, 8, ctypes.byref(ctypes.c_ulong(3))))",
         lambda out: out.strip() == "0"),
        ("sched_setscheduler on the trainer", LIBC + f"print(l.syscall(144, {ME}, 0, ctypes.byref(ctypes.c_int(0))))",
         lambda out: out.strip() == "0"),
        ("ioprio_set on the trainer", LIBC + f"print(l.syscall(251, 1, {ME}, 4))", lambda out: out.strip() == "0"),
        ("the trainer's pid is visible", f"import os\ntry:\n    os.kill({ME}, 0)\n    print('seen')\nexcept ProcessLookupError:\n"
         "    print('none')\nexcept PermissionError:\n    print('refused')\nprint(os.getpid())",
         lambda out: "seen" in out or str(ME) in out.split()[-1:]),
        ("read the host's shared memory", LIBC + f"print(l.shmget({shm_key}, 0, 0))", lambda out: out.strip() != "-1"),
        ("pin a shared-memory segment", LIBC + "print(l.shmget(0, 1 << 20, 0o1000 | 0o600))",
         lambda out: out.strip().lstrip("-").isdigit() and int(out) >= 0 and _segments_of_others() > 0),
        ("chmod 04777 a host file", f"import os\nos.chmod({probe_file!r}, 0o4777)\nprint('done')",
         lambda out: os.stat(probe_file).st_mode != mode),
        ("setxattr security.capability", f"import os\nos.setxattr({probe_file!r}, 'security.capability', b'\\x01' * 20)\n"
         "print('done')", lambda out: "done" in out),
        ("300 threads (clone CLONE_THREAD)", "import threading\nthreading.stack_size(1 << 16)\ne = threading.Event()\nn = 0\n"
         "try:\n    while n < 300:\n        threading.Thread(target=e.wait, daemon=True).start()\n        n += 1\nexcept RuntimeError:\n"
         "    pass\ne.set()\nprint(n)", lambda out: out.strip() == "300"),
        ("30,000 files", "n = 0\ntry:\n    while n < 30000:\n        open(f'f{n}', 'w').close()\n        n += 1\nexcept OSError:\n"
         "    pass\nprint(n)", lambda out: out.strip() == "30000"),
        ("socketpair", "import socket\nsocket.socketpair()\nprint('done')", lambda out: "done" in out),
        ("forge 'sandbox could not start' (exit 97)", "import os\nos._exit(97)", lambda out: "could not" in out),
        ("self SIGKILL reported as the CPU limit", "import os\nos.kill(os.getpid(), 9)", lambda out: "CPU time" in out),
        ("signal 40 breaks the tool", "import os\nos.kill(os.getpid(), 40)", lambda out: out.startswith("TOOL RAISED")),
        ("host path / uid 0 / hostname in the output", "import os, sys\nprint(os.getuid(), sys.prefix, os.uname().nodename)",
         lambda out: out.split()[:1] == ["0"] or "/root" in out or os.uname().nodename in out),
        ("fsopen", LIBC + "print(l.syscall(430, b'tmpfs', 0))", lambda out: out.strip() != "-1"),
    ]


def _changed_and_restored(nofile: tuple) -> bool:
    """Whether the trainer's RLIMIT_NOFILE was lowered (then put back where this process may raise it again: root with
    CAP_SYS_RESOURCE; without it the trainer keeps the lowered limit, which is the escape)."""
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    if now != nofile:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        except ValueError:
            print(f"  (the trainer's RLIMIT_NOFILE stays lowered to {now}: this process may not raise it back)")
    return now != nofile


def _segments_of_others() -> int:
    """SysV segments on the host not made by this process (a pinned one of the sandbox shows here)."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return sum(1 for line in lines if int(line.split()[4]) != ME)  # cpid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    sys.path.insert(0, args.repo)
    from grpo_lib.tools.base import ToolSchema
    from grpo_lib.tools.builtin import PythonTool

    tool = PythonTool({"cpu_time_s": 2, "wall_time_s": 10, "memory_mb": 256},
                      ToolSchema({"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}))
    libc = ctypes.CDLL(None, use_errno=True)
    shm_key = 0x47530000 + ME % 0x10000
    shmid = libc.shmget(shm_key, 4096, 0o1000 | 0o666)
    probe = Path(args.repo) / ".sandbox_probe_file"
    probe.write_text("x")
    probe.chmod(0o644)
    before = _segments_of_others()
    escaped = 0
    try:
        for name, code, check in attempts(shm_key, str(probe)):
            try:
                out, _, _ = tool.execute("tally", {"code": code})
            except Exception as error:  # noqa: BLE001 - a tool that raises is one of the outcomes tallied
                out = f"TOOL RAISED {type(error).__name__}: {error}"
            hit = bool(check(out)) if name != "pin a shared-memory segment" else _segments_of_others() > before
            escaped += hit
            print(f"{'ESCAPED  ' if hit else 'contained'}  {name:45s} {out.strip()[:70]!r}")
    finally:
        libc.shmctl(shmid, 0, None)
        probe.unlink()
    print(f"{escaped} of {len(attempts(shm_key, __file__))} attempts escaped ({args.repo}, uid {os.getuid()})")


if __name__ == "__main__":
    main()
