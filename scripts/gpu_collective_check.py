"""A run's collectives on 2 processes even where there is ONE GPU: scripts/gpu_check.sh's `collectives` stage.

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_collective_check.py RECIPE [key=value ...]

Runs `train_grpo.main(RECIPE, key=value ...)` on each of the 2 processes (the stage passes a 2-step tiny run with the
KL reference's shards in host memory, `ref.fsdp_config.param_offload=true`, as the 4-GPU recipe builds it), with:
- The process group. With 2+ GPUs: the run's own ("cpu:gloo,cuda:nccl", one GPU per process). With ONE GPU both
  processes use it and the group is "cpu:gloo,cuda:gloo": NCCL refuses two ranks on one device ("Duplicate GPU
  detected"), and gloo moves CUDA tensors through pinned host copies. One backend per device type, as in a run: a
  collective whose tensor stands on the GPU on one process and on the host on the other picks another backend on
  each and hangs, as with NCCL on 4 GPUs (issue 41 item 1: process 0's reference buffers on CUDA, the others' on the
  host). Without CUDA: "cpu:gloo" (a CPU run, what tests/repo/test_gpu_check_script.py runs).
- An audit of every tensor collective of torch.distributed that grpo_lib, torch.distributed.checkpoint and FSDP2 call
  by name (AUDITED): before it runs, the processes exchange its name and its tensors' device types and dtypes over a
  side gloo group; when they differ it raises on every process, naming the collective, each process's devices and the
  caller, instead of hanging until the stage's timeout. Collectives of a subgroup are counted, not audited.
- Each process dies with its parent (die_with_parent, first thing): torch elastic starts the workers in sessions of
  their own, so the stage's timeout, which signals its process group, reaches only torchrun; when torchrun goes (its
  SIGKILL 10 s after the TERM at the latest) the kernel SIGKILLs the workers, which would otherwise outlive the stage
  (the trainer takes a first SIGTERM as "finish the step and save").
Prints `gpu_collective_check: rank R: N collectives audited (...by name and device...)` per process and exits with the
run's exit code (1 when the audit raised).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_lib.core.processes import die_with_parent  # noqa: E402 (standard library only)

if __name__ == "__main__":
    die_with_parent()  # before the imports below: torch takes seconds to import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# torch.distributed's tensor collectives as callers name them (dist.<name>); those this torch lacks are left out
AUDITED = ("broadcast", "_broadcast_coalesced", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
           "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "gather", "scatter",
           "all_to_all", "all_to_all_single")


class CollectiveMismatch(RuntimeError):
    """The processes entered one collective with tensors on different device types or dtypes (a hang on GPUs)."""


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
    return found


def _group(name: str, args, kwargs):
    """The process group a collective call names (None: the default group)."""
    if name == "_broadcast_coalesced":  # (process_group, tensors, buffer_size, src)
        return args[0] if args else kwargs.get("process_group")
    group = kwargs.get("group")
    if group is None:  # positional: the argument after the tensors and src / op / dst (torch's signatures)
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group


def _caller() -> str:
    """The first frame outside torch and this file: who called the collective."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("gpu_collective_check.py"):
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


class Audit:
    """Wraps the AUDITED collectives of torch.distributed; counts every call by (name, device type)."""

    def __init__(self, side_group):
        self.side = side_group
        self.counts: collections.Counter = collections.Counter()
        self.unaudited = 0
        self._inside = threading.local()

    def install(self) -> None:
        for name in AUDITED:
            real = getattr(dist, name, None)
            if real is not None:
                setattr(dist, name, self._wrap(name, real))

    def _wrap(self, name: str, real):
        def audited(*args, **kwargs):
            if getattr(self._inside, "busy", False):
                return real(*args, **kwargs)
            tensors = _tensors(args, kwargs)
            mine = (name, sorted({t.device.type for t in tensors}), sorted({str(t.dtype) for t in tensors}))
            self.counts[(name, ",".join(mine[1]))] += 1
            group = _group(name, args, kwargs)
            if group is not None and dist.get_world_size(group) != dist.get_world_size():
                self.unaudited += 1  # a subgroup: not every process enters it
                return real(*args, **kwargs)
            every = [None] * dist.get_world_size()
            self._inside.busy = True
            try:
                dist.all_gather_object(every, (*mine, _caller()), group=self.side)
            finally:
                self._inside.busy = False
            if any(e[:3] != every[0][:3] or len(e[1]) > 1 for e in every):
                raise CollectiveMismatch(f"dist.{name}: the processes pass different tensors, which hangs on GPUs: " +
                                         "; ".join(f"rank {r}: {e[1]} {e[2]} from {e[3]}" for r, e in enumerate(every)))
            return real(*args, **kwargs)

        return audited

    def summary(self) -> str:
        by = ", ".join(f"{name} on {devices or 'no tensor'} x{n}" for (name, devices), n in sorted(self.counts.items()))
        return f"{sum(self.counts.values()) - self.unaudited} collectives audited, {self.unaudited} of subgroups ({by})"


def init_group() -> str:
    """The process group of this check (module docstring); returns a line naming it."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "cpu:gloo,cuda:nccl"
    elif gpus == 1:
        os.environ["LOCAL_RANK"] = "0"  # both processes on GPU 0 (the run's check of LOCAL_RANK < visible GPUs)
        torch.cuda.set_device(0)
        backend = "cpu:gloo,cuda:gloo"
    else:
        backend = "cpu:gloo"
    dist.init_process_group(backend)
    where = f"{gpus} GPU(s)" if gpus else "CPU"
    return f"{dist.get_world_size()} processes on {where}, group {backend}"


def main(argv: list[str]) -> int:
    import train_grpo

    group = init_group()
    rank = dist.get_rank()
    audit = Audit(dist.new_group(backend="gloo"))
    audit.install()
    try:
        code = train_grpo.main(argv)
    except CollectiveMismatch as exc:
        print(f"gpu_collective_check: rank {rank}: FAILED: {exc}", flush=True)
        code = 1
    print(f"gpu_collective_check: rank {rank}: {group}; {audit.summary()}; the run exited {code}", flush=True)
    return code


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    from grpo_lib.core.distributed import close_distributed

    close_distributed()
    sys.exit(exit_code)
