"""Per-phase peak memory (grpo_lib/core/perf.py `PhaseMemory`): the high-water mark is reset at each phase's start, on CPU
through /proc/self/clear_refs (VmHWM), on a GPU through torch.cuda.reset_peak_memory_stats less the engine's memory
that vLLM's sleep unmapped (faked here: no GPU)."""

from __future__ import annotations

import mmap
import sys
from types import SimpleNamespace

import pytest
import torch

from grpo_lib.core import perf

MB = 2**20


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def touch_and_unmap(size: int) -> None:
    """`size` bytes of a fresh anonymous mapping made resident (one write per 4 KiB page), then unmapped."""
    block = mmap.mmap(-1, size)
    for offset in range(0, size, 4096):
        block[offset] = 1
    block.close()


@pytest.mark.skipif(not perf.reset_peak_memory(torch.device("cpu")), reason="/proc/self/clear_refs is not writable here")
def test_cpu_phase_peaks_reset_between_phases():
    """Phase a touches 300 MiB and frees it, phase b touches 10 MiB: without the reset phase b would report phase a's
    peak. The blocks are anonymous mappings of their own (mmap), touched page by page and unmapped: resident while
    touched, returned to the OS when closed, whatever the allocator's state in this process (an earlier test in the same
    worker may leave glibc's heap holding freed memory that a 300 MiB malloc would reuse without growing the RSS)."""
    memory = perf.PhaseMemory(torch.device("cpu"))
    memory.begin("a")
    start_a = rss_mb()
    touch_and_unmap(300 * MB)
    memory.begin("b")
    start_b = rss_mb()
    touch_and_unmap(10 * MB)
    metrics = memory.metrics()
    assert set(metrics) == {"memory/a_peak_mb", "memory/b_peak_mb", "memory/peak_mb"}
    assert metrics["memory/a_peak_mb"] >= start_a + 300 * 0.95, metrics  # the freed block counted in its own phase
    assert start_b <= metrics["memory/b_peak_mb"] + 1 and metrics["memory/b_peak_mb"] < start_b + 100, (metrics, start_b)
    assert metrics["memory/peak_mb"] == metrics["memory/a_peak_mb"]


def test_gpu_peak_is_reset_per_phase_and_leaves_out_the_sleeping_engine(monkeypatch):
    """On CUDA: reset_peak_memory_stats at every phase start; the peak is max_memory_allocated less the bytes of vLLM's
    sleep-mode pool that are asleep (torch still counts them allocated)."""
    state = {"peak": 0, "resets": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(resets=state["resets"] + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    # issue 28 item 9: the caching allocator's reserve (allocated + 300 MiB of fragmentation) and the device's free bytes
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["peak"] + 300 * MB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * 1024 * MB))
    state["free"] = 20000 * MB
    engine = {1: SimpleNamespace(handle=(0, 4000 * MB), is_asleep=False), 2: SimpleNamespace(handle=(0, 1000 * MB), is_asleep=False)}
    cumem = SimpleNamespace(CuMemAllocator=SimpleNamespace(instance=SimpleNamespace(pointer_to_data=engine)))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    memory = perf.PhaseMemory(torch.device("cuda", 0))
    memory.begin("gen")
    state["peak"] = 5000 * MB + 700 * MB  # the engine's 5000 mapped + the trainer's 700
    memory.begin("update")
    assert state["resets"] == 2
    for data in engine.values():  # sleep: unmapped, still allocated in torch's eyes
        data.is_asleep = True
    state["peak"] = 5000 * MB + 9000 * MB
    state["free"] = 60000 * MB
    memory.end()
    metrics = memory.metrics()
    assert metrics == {"memory/gen_peak_mb": 5700.0, "memory/update_peak_mb": 9000.0, "memory/peak_mb": 9000.0,
                       "memory/gen_reserved_mb": 6000.0, "memory/update_reserved_mb": 9300.0,
                       "memory/gen_device_free_mb": 20000.0, "memory/update_device_free_mb": 60000.0}


def test_the_engines_residual_while_it_sleeps_is_a_metric(monkeypatch):
    """Issue 28 item 9: after a release on CUDA, the device MiB in use that torch's allocator does not hold as live
    memory (total - free - (reserved - the unmapped sleep pool)): the engine's graph pool / buffers, the context, NCCL."""
    from grpo_lib.rollout.engines import base

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50000 * MB, 80000 * MB))  # 30000 in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 33000 * MB)  # of which 5000 unmapped
    engine = {1: SimpleNamespace(handle=(0, 5000 * MB), is_asleep=True)}
    cumem = SimpleNamespace(CuMemAllocator=SimpleNamespace(instance=SimpleNamespace(pointer_to_data=engine)))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    life = base.Lifecycle(frees_memory=True, discards_weights=False)
    with life.transition("release"):
        pass
    assert life.metrics["memory/sleep_residual_mb"] == 30000 - (33000 - 5000)


def test_engine_unmapped_bytes_without_vllm(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.cumem", raising=False)
    assert perf.engine_unmapped_bytes() == 0
