"""Issue 41 item 6: the memory the plan did not count. The flat 1.5 GiB of "CUDA context + NCCL" is now the context
and one term per NCCL communicator a process is in (the trainer's world, the engine's TP group), from NCCL's and
vLLM's defaults; the host plan counts vLLM's pinned backup of its CUDA-graph pool at sleep; the plan prints its margin.
Every constant is checked by hand from the sources named in grpo_lib/planning/memory.py."""

from __future__ import annotations

import json
import re

import pytest

from grpo_lib.config import load_config
from grpo_lib.planning.memory import (GIB, context_terms, host_memory, memory_plan, model_sizes, nccl_bytes,
                                  vllm_graph_pool_bytes)
from tests.planning.test_plan import QWEN3_4B, REPO, plan

RECIPE = REPO / "recipes" / "qwen3_4b_gsm8k.yaml"  # 4 processes, TP 2, sleep level 1
MIB = 2**20
CONNECTION = 4 * MIB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16  # NCCL's Simple + LL128 + LL buffers of one connection
RING_AND_TREE = 32 * 2 * CONNECTION  # 32 channels x (ring, tree): 588 MiB


def sizes():
    return model_sizes(json.loads(QWEN3_4B.read_text()))


def test_nccl_buffers_per_communicator_by_hand():
    """Nothing for one rank; 32 channels x 2 connections x 9.19 MiB from 2 ranks; NVLS above 2 ranks adds 32 MiB per
    rank (16 channels x 2 x 128 KiB x 8 steps): the term grows with the communicator, as NCCL's NVLS buffers do."""
    assert CONNECTION == 9_633_792 and RING_AND_TREE / MIB == pytest.approx(588.0)
    assert nccl_bytes(1) == 0
    assert nccl_bytes(2) == RING_AND_TREE  # NCCL turns NVLS on only above 2 GPUs
    assert nccl_bytes(4) == RING_AND_TREE + 4 * 32 * MIB
    assert nccl_bytes(8) - nccl_bytes(4) == 4 * 32 * MIB


@pytest.mark.parametrize("processes, tp, world, tp_group", [
    (1, 1, 0, 0),
    (4, 2, RING_AND_TREE + 4 * 32 * MIB, RING_AND_TREE + 64 * MIB),  # + vLLM's sm90 symmetric memory at TP 2: 64 MiB
    (8, 4, RING_AND_TREE + 8 * 32 * MIB, RING_AND_TREE + 4 * 32 * MIB + 32 * MIB),  # TP 4: NVLS, 32 MiB symmetric
])
def test_context_terms_per_communicator_and_their_sum_in_the_plan(processes, tp, world, tp_group):
    cfg = load_config(RECIPE, [f"rollout.tensor_model_parallel_size={tp}", f"trainer.n_gpus_per_node={processes}"],
                      world_size=processes)
    terms = context_terms(cfg, world_size=processes)
    assert terms == {"CUDA context": 1.0 * GIB, f"NCCL trainer world ({processes})": world,
                     f"NCCL vLLM TP group ({tp})": tp_group}
    parts = memory_plan(cfg, sizes(), world_size=processes, gpu_bytes=80 * GIB)
    assert parts["CUDA context + NCCL"] == sum(terms.values())
    assert parts["generation phase"] - parts["vLLM share"] - parts["actor master weights"] - parts["AdamW state"] == \
        pytest.approx(sum(terms.values()))  # every phase holds it (reference offloaded in this recipe)


def test_the_printed_plan_shows_each_communicator_and_the_margin(capsys):
    code, out = plan(capsys, str(RECIPE), "--model-config", str(QWEN3_4B))
    assert code == 0
    rows = dict(re.findall(r"^ {6}(CUDA context|NCCL trainer world \(4\)|NCCL vLLM TP group \(2\))\s+([\d.]+) GiB$", out, re.M))
    assert rows == {"CUDA context": "1.00", "NCCL trainer world (4)": f"{(RING_AND_TREE + 128 * MIB) / GIB:.2f}",
                    "NCCL vLLM TP group (2)": f"{(RING_AND_TREE + 64 * MIB) / GIB:.2f}"}, out
    total = float(re.search(r"CUDA context \+ NCCL\s+([\d.]+) GiB", out).group(1))
    assert total == pytest.approx(sum(map(float, rows.values())), abs=0.011)


@pytest.mark.parametrize("gpu_gb", ["139", "80"])
def test_the_one_gpu_plan_states_its_margin(capsys, gpu_gb):
    """The 1-GPU plan (scripts/gpu_check.sh's big run: 1 process, TP 1) on an H200 peaks near 130 of 139 GiB: the printout
    says how much is left (GPU - peak, computed, and its share of the GPU); one that does not fit says by how much."""
    code, out = plan(capsys, str(RECIPE), "--num-processes", "1", "trainer.n_gpus_per_node=1",
                     "rollout.tensor_model_parallel_size=1", "--model-config", str(QWEN3_4B), "--gpu-memory-gb", gpu_gb)
    peak = float(re.search(r"peak per GPU\s+([\d.]+) GiB of", out).group(1))
    if gpu_gb == "139":
        assert code == 0 and 120 < peak < 139, out
        margin = re.search(r"peak per GPU\s+[\d.]+ GiB of 139 GiB: fits; margin ([\d.]+) GiB \(([\d.]+)% of the GPU\)", out)
        assert margin, out
        assert float(margin.group(1)) == pytest.approx(139 - peak, abs=0.011)
        assert float(margin.group(2)) == pytest.approx(100 * (139 - peak) / 139, abs=0.06)
    else:
        assert code == 4 and f"GiB of 80 GiB: DOES NOT FIT, short by {peak - 80:.2f} GiB" in out, out


def test_host_plan_counts_vllms_pinned_graph_pool_backup():
    """vLLM 0.32's sleep copies its CUDA-graph pool to pinned host memory at every level (its weights at level 1 too):
    per process min(2 x max_num_seqs, 512) tokens x one layer's bf16 transients (Qwen3-4B: 2 x (3 x 2560 + 2 x 4096 +
    2 x 1024 + 4 x 9728) = 113,664 B per token); none with enforce_eager or the hf engine (no graphs)."""
    s, P = sizes(), sizes().params
    cfg = load_config(RECIPE, world_size=4)
    per_token = 2 * (3 * 2560 + 2 * 4096 + 2 * 1024 + 4 * 9728)
    assert vllm_graph_pool_bytes(cfg, s) == 512 * per_token  # max_num_seqs 256: capture sizes up to 512
    assert vllm_graph_pool_bytes(load_config(RECIPE, ["rollout.max_num_seqs=64"], world_size=4), s) == 128 * per_token
    assert vllm_graph_pool_bytes(load_config(RECIPE, ["rollout.enforce_eager=true"], world_size=4), s) == 0
    assert vllm_graph_pool_bytes(load_config(RECIPE, ["rollout.name=hf", "rollout.tensor_model_parallel_size=1"],
                                             world_size=4), s) == 0
    host = host_memory(cfg, s, world_size=4)
    assert host["engine graph pool backup"] == 4 * 512 * per_token  # one pool per engine process
    assert host["engine weights backup"] == 2 * P * 4 / 2  # level 1: bf16, one TP shard per process
    assert host["resident"] == 2 * P + host["engine weights backup"] + host["engine graph pool backup"]
    level2 = host_memory(load_config(RECIPE, ["rollout.sleep_level=2"], world_size=4), s, world_size=4)
    assert level2["engine weights backup"] == 0 and level2["engine graph pool backup"] == 4 * 512 * per_token
