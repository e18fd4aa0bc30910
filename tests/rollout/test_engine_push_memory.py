"""Issue 41 item 6a: the push's cached blocks go back to the device before the engine's KV cache wakes.

The push gathers every full tensor (FSDP2, one at a time: the fp32 embedding is 1.5 GiB for Qwen3-4B), casts it to
the engine's dtype and fills a bucket; freed, those blocks stay reserved by torch's caching allocator until
`torch.cuda.empty_cache()`, and vLLM's wake_up(kv_cache) maps memory with its own allocator, which cannot use that
reserve. With no offload key on (both 4B recipes), `Actor.offload` empties nothing, so before the fix the reserve
stayed through generation.

A fake CUDA device stands in (no GPU here): torch.cuda.empty_cache / mem_get_info / memory_reserved are patched onto a
model of torch's reserve; the actor's gathers add to it. `VLLMEngine` and `WeightSync` run as they are over a recording
stand-in for vllm.LLM, whose calls land in the same event list, so the test sees the order a GPU would.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_lib.config import load_config
from grpo_lib.rollout.engines.vllm import VLLMEngine
from grpo_lib.rollout.weight_sync import WeightSync
from tests.conftest import REPO

GIB = 2**30
GATHERED = int(1.5 * GIB)  # what the fake push leaves cached: Qwen3-4B's fp32 embedding gather


class FakeDevice:
    """torch's caching allocator in one number: `reserved` bytes held, all free blocks (the push is over)."""

    def __init__(self, events: list):
        self.events, self.total, self.reserved, self.engine = events, 80 * GIB, 0, 0

    def mem_get_info(self, device=None):
        return self.total - self.reserved - self.engine, self.total

    def empty_cache(self):
        self.events.append("empty_cache")
        self.reserved = 0


class FakeLLM:
    """vllm.LLM's sleep / wake / reload calls, recorded in the device's event list; wake_up(kv_cache) notes how much of
    torch's reserve was still held when the KV cache was mapped."""

    def __init__(self, device: FakeDevice):
        self.device, self.reserved_at_kv_wake = device, None
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))

    def get_tokenizer(self):
        return SimpleNamespace(pad_token_id=0, eos_token_id=1)

    def sleep(self, level):
        self.device.events.append(f"sleep:{level}")

    def wake_up(self, tags=None):
        self.device.events.append("wake_up:" + ",".join(tags or ["ALL"]))
        if tags == ["kv_cache"]:
            self.reserved_at_kv_wake = self.device.reserved

    def collective_rpc(self, method, kwargs=None):
        list(kwargs["weights_iterator"])  # the push consumes the actor's gathered tensors
        self.device.events.append(method)

    def reset_prefix_cache(self):
        self.device.events.append("reset_prefix_cache")


class FakeActor:
    """What WeightSync.push reads: named_weights (each gather leaves its blocks in torch's reserve; no tensor is
    yielded, since a CPU torch cannot make the CUDA copies) and offload (with no offload key: moves nothing, empties
    nothing, as `Actor.offload` on both 4B recipes)."""

    def __init__(self, device: FakeDevice):
        self.device = device

    def named_weights(self):
        self.device.events.append("gather")
        self.device.reserved += GATHERED
        yield from ()

    def engine_weights(self):  # the Actor's: what a push hands the engine (the full weights here)
        return self.named_weights()

    def offload(self):
        self.device.events.append("offload")


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_the_push_cache_is_emptied_between_the_push_and_the_kv_wake(monkeypatch, sleep_level):
    events: list = []
    device = FakeDevice(events)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", device.empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", device.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device_=None: device.reserved)
    cfg = load_config(REPO / "recipes" / "tiny_cpu.yaml", ["rollout.free_cache_engine=true", f"rollout.sleep_level={sleep_level}"])
    llm = FakeLLM(device)
    engine = VLLMEngine(model_path="m", cfg=cfg.rollout, max_model_len=64, seed=0, on_cpu=False, world_size=1,
                        llm_factory=lambda **kwargs: llm)
    assert engine.lifecycle.frees_memory, "sleep is real here, as on a GPU with rollout.free_cache_engine"
    engine.release()
    WeightSync(engine, None).push(FakeActor(device), version=1)
    assert events == [f"sleep:{sleep_level}", "empty_cache", "wake_up:weights", "gather", "reload_weights",
                      "reset_prefix_cache", "offload", "empty_cache", "wake_up:kv_cache"], events
    assert llm.reserved_at_kv_wake == 0, "the push's blocks were still reserved by torch when the KV cache was mapped"
    metrics = engine.pop_metrics("memory/")
    assert metrics["memory/push_cache_freed_mb"] == GATHERED / 2**20, metrics  # what the second empty_cache gave back
    assert engine.lifecycle.state == "ready" and engine.weight_version == 1
