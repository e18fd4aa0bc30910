"""A child process that dies with its parent, however the parent ends (SIGKILL included): the reward pool's workers,
the tool workers and the GPU check's collective workers ask for it first thing. Standard library only, so a script
can call it before it imports torch.

    die_with_parent()   # Linux: True once the kernel will SIGKILL this process when its parent exits
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> bool:
    """Linux: ask the kernel to SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG); exits at once when
    the parent is already gone (it went between the two reads, before the request took hold). Returns whether the
    request was made (False elsewhere, or where prctl is unavailable: the caller's other signals then stand alone)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
        os._exit(1)
    return True
