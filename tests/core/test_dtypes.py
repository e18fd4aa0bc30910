"""grpo_lib/core/dtypes.py: one rule for "auto" and each caller's reading of it (the rules actor.resolve_dtype,
perf.compute_dtype, the engines and the plan each had before, written out by hand)."""

from __future__ import annotations

import pytest
import torch

from grpo_lib.core.dtypes import DTYPE_BYTES, resolve, torch_dtype

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no CUDA


@pytest.mark.parametrize("name, on_gpu, expected", [
    ("auto", False, "float32"), ("auto", True, "bfloat16"),
    ("float32", True, "float32"), ("bfloat16", False, "bfloat16"), ("float16", False, "float16"), ("float16", True, "float16"),
])
def test_names(name, on_gpu, expected):
    # rollout.dtype for vLLM and the CPU KV-cache size: auto is float32 on CPU (exact match with the trainer), bf16 on GPU
    assert resolve(name, on_gpu=on_gpu) == expected


def test_storage_and_gather_dtype():
    # model.dtype (the reference's storage), actor.fsdp_config.param_dtype (FSDP2's gather dtype), the hf engine's dtype
    assert (torch_dtype("auto", CPU), torch_dtype("auto", GPU)) == (torch.float32, torch.bfloat16)
    assert torch_dtype("bfloat16", CPU) == torch.bfloat16 and torch_dtype("float32", GPU) == torch.float32


def test_compute_dtype_follows_the_master_weights_on_cpu():
    # actor.fsdp_config.param_dtype as autocast dtype: auto never autocasts on CPU, whatever the master dtype (a reference
    # stored in model.dtype=bfloat16 computes in bfloat16); bf16 on GPU; a named dtype is that dtype everywhere
    assert torch_dtype("auto", CPU, cpu_auto=torch.float32) == torch.float32
    assert torch_dtype("auto", CPU, cpu_auto=torch.bfloat16) == torch.bfloat16
    assert torch_dtype("auto", GPU, cpu_auto=torch.float32) == torch.bfloat16
    assert torch_dtype("float32", CPU, cpu_auto=torch.bfloat16) == torch.float32


def test_plan_bytes_on_gpu():
    # --print-plan plans for a GPU: auto is bfloat16 there, 2 bytes
    assert [DTYPE_BYTES[resolve(n, on_gpu=True)] for n in ("auto", "float32", "bfloat16", "float16")] == [2, 4, 2, 2]
