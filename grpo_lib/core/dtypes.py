"""The config's dtype names ("auto", "float32", "bfloat16", "float16") resolved to a concrete dtype: one rule for all.

"auto" is bfloat16 on a GPU and float32 on CPU, for every key that takes a dtype name:

    model.dtype                    the frozen reference's storage: float32 on CPU, bfloat16 on GPU
    actor.fsdp_config.param_dtype  FSDP2's gather dtype of the actor and the reference: float32 on CPU, bfloat16 on GPU;
                                   as the compute (autocast) dtype, on CPU the module's own master dtype (pass
                                   cpu_auto=): float32 for the actor, model.dtype for the reference, so "auto" never
                                   autocasts on CPU
    rollout.dtype                  the engine's dtype (vLLM and hf): float32 on CPU (exact match with the trainer),
                                   bfloat16 on GPU

`resolve` works on names and imports nothing (config checks, the plan, vLLM's dtype argument); `torch_dtype` gives
the torch dtype for a device (torch imported when called).

    resolve("auto", on_gpu=True) -> "bfloat16";  resolve("auto", on_gpu=False) -> "float32"
    resolve("float16", on_gpu=False) -> "float16"
    torch_dtype("auto", cpu) -> torch.float32;  torch_dtype("auto", cpu, cpu_auto=torch.bfloat16) -> torch.bfloat16
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each concrete dtype name."""


def resolve(name: str, *, on_gpu: bool, cpu_auto: str = "float32") -> str:
    """`name` with "auto" resolved: bfloat16 on a GPU, `cpu_auto` (float32 unless the caller's master dtype) on CPU."""
    if name != "auto":
        return name
    return "bfloat16" if on_gpu else cpu_auto


def torch_dtype(name: str, device, *, cpu_auto=None):
    """The torch dtype of `name` on `device` (a torch.device; anything but CPU counts as a GPU). With `cpu_auto` (a
    torch dtype: the module's master dtype), "auto" on CPU is that dtype instead of float32 (the compute dtype)."""
    import torch

    if name == "auto" and device.type == "cpu" and cpu_auto is not None:
        return cpu_auto
    return getattr(torch, resolve(name, on_gpu=device.type != "cpu"))
