"""Moving host tensors to the device without making the host wait (issue 41 item 7: the update loop queues work on the
GPU instead of alternating with it).

    x_gpu = to_device(x_cpu, torch.device("cuda", 0))   # pinned, non_blocking; on CPU / meta: x.to(device)
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device` without the host waiting for the device: a host tensor bound for a CUDA device is copied
    into a contiguous pinned buffer and sent with non_blocking=True (a plain `.to` from pageable memory synchronises
    the stream: the host would wait for every kernel queued before it); the caching host allocator keeps the pinned
    block until the copy is done. Contiguous, because a micro-batch's fields are column-trimmed views of the
    mini-batch (`RolloutBatch.select(width=)`), `pin_memory()` keeps a view's strides, and a strided host-to-device
    copy goes through a pageable temporary, which is the wait again. Elsewhere (CPU, meta, already there) `.to(device)`."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        pinned = _pinned_like(tensor)  # contiguous
        pinned.copy_(tensor)
        return pinned.to(device, non_blocking=True)
    return tensor.to(device)


def _pinned_like(tensor: Tensor) -> Tensor:
    """An uninitialised contiguous pinned host tensor of `tensor`'s shape and dtype."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
