"""The split roles' bridge (grpo_lib/core/bridge.py) between two gloo members, here two threads over one store:
objects and bucketed weights arrive as sent; a peer that is gone raises BridgeError instead of waiting."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from grpo_lib.core import bridge as bridge_module
from grpo_lib.core.bridge import Bridge, BridgeError


def pair():
    store = dist.HashStore()
    sides: dict[int, Bridge] = {}

    def make(rank):
        sides[rank] = Bridge(store, rank=rank, cuda=False)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return sides[0], sides[1]


def test_objects_and_weights_arrive_as_sent():
    trainer, engine = pair()
    generator = torch.Generator().manual_seed(0)
    weights = [(f"w{i}", torch.randn(3 + i, 5, generator=generator)) for i in range(7)] + [("scalar", torch.tensor(2.5))]
    got: dict = {}

    def engine_side():
        got["message"] = engine.recv()
        got["weights"] = [(n, t.clone()) for n, t in engine.recv_weights(dtype=torch.float32)]
        engine.send({"ok": True})

    thread = threading.Thread(target=engine_side)
    thread.start()
    trainer.send(("weights", 3, [1, 2, 3]))
    sent = trainer.send_weights(iter(weights), bucket_bytes=200, dtype=torch.float32)  # several buckets
    assert trainer.recv() == {"ok": True}
    thread.join(60)
    assert got["message"] == ("weights", 3, [1, 2, 3])
    assert [n for n, _ in got["weights"]] == [n for n, _ in weights]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got["weights"], weights))
    assert sent == sum(t.numel() * 4 for _, t in weights)


def test_a_peer_that_is_gone_raises_instead_of_waiting(monkeypatch):
    monkeypatch.setattr(bridge_module, "BRIDGE_TIMEOUT", timedelta(seconds=2))
    trainer, _engine = pair()  # the engine side never answers: a dead peer's socket errors, a silent one times out
    with pytest.raises(BridgeError, match="the engine processes stopped answering"):
        trainer.recv()
