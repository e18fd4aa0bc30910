"""Process-group helpers: start-up under `accelerate launch` / torchrun, small reductions, and `Reduction` (a phase's
metrics reduced in one packed all-reduce per kind).

One rule for collectives: the group is created with one backend per device type, "cpu:gloo,cuda:nccl" on a
GPU machine and "cpu:gloo" on CPU. A collective on a CPU tensor then runs over gloo and one on a CUDA tensor
over NCCL, so every helper here reduces plain CPU tensors on either machine (an NCCL-only group rejects CPU
tensors: `all_reduce_sum` would die at step 1 on GPU). The FSDP2 all-gathers / reduce-scatters move CUDA
tensors over NCCL. Hence every process must pass the same device type to a collective (a CUDA tensor here and a CPU
one there hang: docs/DESIGN.md, invariant 10). `tests/core/test_distributed.py` runs every helper on 2 processes with
`backend_string(False)`.

Which runs get a group: a launcher run (WORLD_SIZE set, even to 1), and a single-GPU `python train_grpo.py`
(a 1-process group so the actor takes the same FSDP2 mixed-precision path as on 4 GPUs). A plain
`python train_grpo.py` on CPU has no group: the actor is then not sharded (float32 compute either way) and
every helper is the identity.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist


def backend_string(cuda: bool) -> str:
    """Backend of the process group: gloo for CPU tensors always, NCCL for CUDA tensors on a GPU machine."""
    return "cpu:gloo,cuda:nccl" if cuda else "cpu:gloo"


def is_on() -> bool:
    """True when several processes train together (reductions are needed)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def has_group() -> bool:
    """True when a process group exists (also with one process): the actor is then sharded with FSDP2."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if has_group() else 1


def rank() -> int:
    return dist.get_rank() if has_group() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"  # one entry per GPU the NVIDIA kernel driver knows


def gpu_visibility_problem() -> str | None:
    """What would stop this process from getting its own GPU, as a message (None when all is as expected):
    more processes on this machine than visible GPUs, or a CUDA build of torch that sees no GPU on a machine whose
    driver lists some (usually a driver older than torch's CUDA: the run would silently train on the CPU). A CPU
    build, no NVIDIA driver, or CUDA_VISIBLE_DEVICES set to an empty list on purpose is a CPU run, not a problem."""
    if torch.cuda.is_available():
        local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= visible:  # torch.cuda.set_device would fail with "invalid device ordinal"
            return (f"process LOCAL_RANK={local_rank} but only {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch at most {visible} process(es) per machine "
                    "(accelerate launch --num_processes, or the config's num_processes), one per GPU")
        return None
    if torch.version.cuda is None or os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return None
    try:
        gpus = len(os.listdir(NVIDIA_GPUS_DIR))
    except OSError:
        return None
    if not gpus:
        return None
    return (f"this machine's NVIDIA driver lists {gpus} GPU(s) but torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}) cannot use them, so the run would train on the CPU: the driver is probably older than "
            "that CUDA version needs (`nvidia-smi` shows the highest CUDA version the driver supports); update the driver "
            "or install a torch / vllm build for the driver's CUDA. To run on the CPU on purpose: CUDA_VISIBLE_DEVICES=")


def init_distributed() -> None:
    """Join the process group the launcher set up; on one GPU without a launcher, start a 1-process group."""
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    launched = "WORLD_SIZE" in os.environ
    if not launched and not cuda:
        return  # plain CPU run: no group, no sharding
    if not launched:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_string(cuda))


def close_distributed() -> None:
    """Leave the process group at the end of a run (every process). Exiting without this lets each process tear its
    gloo/NCCL threads down at interpreter exit, in any order: a process can then abort ("terminate called without an
    active exception") while the other one is still closing its connections, and the launcher reports a failure.

    A vLLM engine in the process does this itself: its shutdown at interpreter exit destroys its own groups and then
    the default one (and raises "Invalid process group specified" if the default one is already gone), so with
    vLLM's groups in place this leaves the teardown to it."""
    if not dist.is_initialized():
        return
    vllm_state = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_state is not None and vllm_state.model_parallel_is_initialized():
        return
    dist.destroy_process_group()


T = TypeVar("T")


def _reduce(value: float, op) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)  # CPU tensor: gloo on every machine
    dist.all_reduce(t, op=op)
    return float(t.item())


def all_reduce_sum(value: float) -> float:
    """Sum of a python number over processes (identity with one process)."""
    return _reduce(value, dist.ReduceOp.SUM) if is_on() else float(value)


def all_reduce_min(value: float) -> float:
    """Minimum of a python number over processes (identity with one process)."""
    return _reduce(value, dist.ReduceOp.MIN) if is_on() else float(value)


def all_reduce_max(value: float) -> float:
    """Maximum of a python number over processes (identity with one process)."""
    return _reduce(value, dist.ReduceOp.MAX) if is_on() else float(value)


def all_gather_object(obj) -> list:
    """Every process's `obj` in rank order (pickled, sent over the CPU backend); [obj] with one process."""
    if not is_on():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Process `src`'s `obj` on every process; `obj` itself with one process."""
    if not is_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class _LeaderError:
    """A leader's exception, carried to its group so every member raises it too (no member left waiting): the same
    exception where it pickles (a ToolStallError stays one: exit 3 on every process), else a RuntimeError naming it."""

    def __init__(self, exc: BaseException):
        import pickle

        self.text = f"{type(exc).__name__}: {exc}"
        try:
            self.exc = pickle.loads(pickle.dumps(exc)) if isinstance(exc, Exception) else None
        except Exception:  # noqa: BLE001 - an exception that does not pickle is named instead
            self.exc = None


def group_leader_call(group_size: int) -> Callable[[Callable[[], T]], T]:
    """`call(fn)`: within each group of `group_size` consecutive processes (a tensor-parallel group: process r is in
    the group of r // group_size), the group's first process runs `fn()` and every member gets its result (pickled,
    over a gloo group of the members). The identity call without a group or with groups of one. Every process must
    call this (the groups are created collectively) and then call `call` as often as the others of its group.
    A leader whose `fn` raises hands the error to its members, which raise it too.

    Why: work whose outcome depends on the clock (a tool with a wall-clock timeout) would otherwise differ between
    the members, whose engines must then be sent identical requests (a tensor-parallel collective mismatch)."""
    if group_size <= 1 or not is_on():
        return lambda fn: fn()
    world, me = dist.get_world_size(), dist.get_rank()
    assert world % group_size == 0, f"{world} processes do not split into groups of {group_size}"
    groups = [dist.new_group(list(range(first, first + group_size)), backend="gloo")
              for first in range(0, world, group_size)]  # every process creates every group, in the same order
    leader = me // group_size * group_size
    group = groups[me // group_size]

    def call(fn):
        box = [None]
        if me == leader:
            try:
                box[0] = fn()
            except BaseException as exc:  # noqa: BLE001 - the members must not wait for a result that never comes
                box[0] = _LeaderError(exc)
                dist.broadcast_object_list(box, src=leader, group=group)
                raise
        dist.broadcast_object_list(box, src=leader, group=group)
        if isinstance(box[0], _LeaderError):
            raise box[0].exc or RuntimeError(f"process {leader}, which runs this group's work, failed: {box[0].text}")
        return box[0]

    return call


def barrier() -> None:
    if is_on():
        dist.barrier()


def raise_agreed(error: Exception | None) -> None:
    """Every process calls this at the same point with the error it caught there (None: it had none); when any
    process had one, every process raises, so none is left waiting in the next collective for one that stopped: a
    process its own error, the others the first failing process's (the same class where it pickles and builds from
    its message, a ToolStallError stays one: exit 3 on every process; else RuntimeError), naming that process.
    One all-gather of small objects; without a group, `error` is raised as is.

    Example (2 processes): process 1 raise_agreed(ToolStallError("stuck")), process 0 raise_agreed(None) -> process 1
    raises its error, process 0 ToolStallError("process 1: stuck")."""
    if not is_on():
        if error is not None:
            raise error
        return
    reports = all_gather_object(None if error is None else _LeaderError(error))
    if error is not None:
        raise error
    for who, report in enumerate(reports):
        if report is None:
            continue
        try:
            agreed = type(report.exc)(f"process {who}: {report.exc}") if report.exc is not None else None
        except Exception:  # noqa: BLE001 - an exception class that does not take one message
            agreed = None
        raise agreed or RuntimeError(f"process {who} failed: {report.text}")


class Reduction:
    """Metrics reduced over processes in one packed all-reduce per kind of reduction, whatever their number.

    Each metric declares its kind once, where it is added:
      `sum(key, v)`: a sum or a count over processes (errors, calls, kept groups);
      `max(key, v)` / `min(key, v)`: the largest / smallest process's value (a slowest phase, a longest response);
      `mean(key, total, over=name)`: a mean over tokens or over samples: `total` and the count `count(name, n)` (the
      tokens or samples it is over) are both summed over processes, then divided (by at least 1).
    `reduce()` packs every value of a kind into one float64 CPU tensor (gloo on every machine, as `all_reduce_sum`) and
    makes at most three all-reduces (SUM, MAX, MIN); element by element that is the same reduction as one all-reduce
    per number, so the values are those of `all_reduce_sum` / `max` / `min`. Every process adds the same keys in the same
    order (the packing follows it). Without a process group: the same arithmetic, no collective.

    Example: r.count("samples", 4); r.mean("reward/mean", 3.0, over="samples"); r.sum("reward/errors", 1)
    -> r.reduce() on 2 processes holding the same: {"reward/mean": 0.75, "reward/errors": 2.0} (one all-reduce).
    """

    def __init__(self):
        self._sums: dict[str, float] = {}  # sums, counts, means' totals and their denominators (under "count:<name>")
        self._max: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._means: dict[str, str] = {}  # mean key -> the count it is over
        self._order: dict[str, None] = {}  # the metrics in the order they were added (the result's order)

    def sum(self, key: str, value: float) -> None:
        self._sums[key] = float(value)
        self._order[key] = None

    def max(self, key: str, value: float) -> None:
        self._max[key] = float(value)
        self._order[key] = None

    def min(self, key: str, value: float) -> None:
        self._min[key] = float(value)
        self._order[key] = None

    def count(self, name: str, value: float) -> None:
        """The tokens or samples `name` that means are over (summed over processes; not itself a metric)."""
        self._sums[f"count:{name}"] = float(value)

    def mean(self, key: str, total: float, *, over: str) -> None:
        self._sums[f"total:{key}"] = float(total)
        self._means[key] = over
        self._order[key] = None

    def reduce(self) -> dict[str, float]:
        sums, maxes, mins = (_reduce_many(d, op) for d, op in ((self._sums, "SUM"), (self._max, "MAX"), (self._min, "MIN")))
        out = {**{k: v for k, v in sums.items() if not k.startswith(("count:", "total:"))}, **maxes, **mins}
        for key, over in self._means.items():
            out[key] = sums[f"total:{key}"] / max(sums[f"count:{over}"], 1.0)
        return {key: out[key] for key in self._order}


def _reduce_many(values: dict[str, float], op: str) -> dict[str, float]:
    """`values` reduced over processes by `op` ("SUM", "MAX", "MIN") in one all-reduce (none when empty or alone)."""
    if not values or not is_on():
        return dict(values)
    t = torch.tensor(list(values.values()), dtype=torch.float64)  # [n] CPU tensor: gloo on every machine
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return dict(zip(values, t.tolist()))
