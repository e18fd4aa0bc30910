"""Process-group helpers: start-up under `accelerate launch` / torchrun, and small reductions.

With one process (plain `python train_grpo.py`) every helper is the identity. Under a launcher the
environment carries RANK / WORLD_SIZE / MASTER_ADDR; the group uses NCCL on GPU and gloo on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_distributed() -> None:
    """Join the process group the launcher set up (no-op for a single process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def all_reduce_sum(value: float) -> float:
    """Sum of a python number over processes (identity with one process)."""
    if not is_on():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_min(value: float) -> float:
    if not is_on():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def barrier() -> None:
    if is_on():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Process `src`'s picklable `obj` on every process (identity with one process)."""
    if not is_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
