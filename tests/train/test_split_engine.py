"""The engine processes' message loop (grpo_lib/trainer/split.py `engine_main`) against a scripted bridge and engine, in
this process: it answers in the order the trainer asks, tags each batch with the weights it came from, and a push cut
midway (the trainer gone) never leaves it serving: the loop raises before it generates again."""

from __future__ import annotations

import pytest
import torch

from grpo_lib.config import Config
from grpo_lib.core.bridge import BridgeError
from grpo_lib.core.types import Generation
from grpo_lib.rollout import engines
from grpo_lib.trainer import split


class ScriptedBridge:
    def __init__(self, messages, weights=None, cut_after: int | None = None):
        self.messages, self.weights, self.cut_after, self.sent = list(messages), weights or [], cut_after, []

    def recv(self):
        return self.messages.pop(0)

    def send(self, obj):
        self.sent.append(obj)

    def recv_weights(self, *, dtype):
        for i, pair in enumerate(self.weights):
            if self.cut_after is not None and i == self.cut_after:
                raise BridgeError("the trainer processes stopped answering (test)")
            yield pair


class RecordingEngine:
    pad_id, weight_version = 0, 0

    def __init__(self):
        self.calls, self.pushed = [], []

    def generate(self, prompt_ids, **kwargs):
        self.calls.append(("generate", len(prompt_ids), self.weight_version))
        return [[Generation([1, 2], [-0.1, -0.2], "x", "stop")] * kwargs.get("n", 1) for _ in prompt_ids]

    def push_weights(self, named):
        self.pushed.append([name for name, _ in named])  # consumes the stream as vLLM's reload_weights does

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def score_logprobs(self, sequences):
        return [[0.0] * len(s) for s in sequences]

    def pop_metrics(self, prefix=""):
        return {"rollout/preemptions": 0.0}


@pytest.fixture
def engine(monkeypatch):
    built = RecordingEngine()
    monkeypatch.setattr(engines, "build_engine", lambda cfg, **kw: built)
    return built


def config() -> Config:
    cfg = Config()
    cfg.rollout.n = 2
    return cfg


def test_the_engine_answers_in_order_with_the_version_of_its_weights(engine):
    weights = [("a", torch.ones(2)), ("b", torch.zeros(3))]
    bridge = ScriptedBridge([("go", 1, [[5, 6]]), ("weights", 1), ("score", [[1, 2, 3]]), ("go", 2, [[7], [8]]), ("stop",)],
                            weights=weights)
    assert split.engine_main(config(), bridge, world_size=1, rank=0) == 0
    first, scores, second = bridge.sent
    assert (first["step"], first["version"], len(first["generations"])) == (1, 0, 1)
    assert scores == [[0.0, 0.0, 0.0]]
    assert (second["step"], second["version"], len(second["generations"])) == (2, 1, 2)
    assert engine.pushed == [["a", "b"]] and ("reset_prefix_cache",) in engine.calls


def test_a_push_cut_midway_never_serves_mixed_weights(engine):
    weights = [("a", torch.ones(2)), ("b", torch.zeros(3)), ("c", torch.zeros(1))]
    bridge = ScriptedBridge([("weights", 1), ("go", 2, [[7]]), ("stop",)], weights=weights, cut_after=2)
    with pytest.raises(BridgeError):
        split.engine_main(config(), bridge, world_size=1, rank=0)
    assert not [c for c in engine.calls if c[0] == "generate"], "the engine generated after a push cut midway"
    assert engine.weight_version == 0, "the version of a push that did not finish was taken"


def test_a_saved_batch_of_the_wrong_version_is_asked_for_again_with_the_same_prompts():
    """A checkpoint holding a batch whose version cannot train its step (saved before the check found it, or marked):
    the resume sends its go again with its own prompt rows, drawing nothing new; a good one is kept."""
    from types import SimpleNamespace

    sent = []
    bridge = SimpleNamespace(send=sent.append, stopped=False)
    engine = split.RemoteEngine(config(), bridge, pad_id=0, world_size=1, rank=0)
    draws = []
    sampler = SimpleNamespace(next_batch=lambda: draws.append(1) or [9, 9], state_dict=lambda: {"position": len(draws)})
    dataset = SimpleNamespace(prompt_ids={3: [1], 4: [2], 5: [3], 6: [4], 9: [5]})
    pipeline = split.OneStepOff(config(), engine, dataset, sampler, world_size=1, rank=0, total_steps=10)

    def entry(step, rows, version):
        payload = None if version is None else {"step": step, "generations": [], "version": version, "preemptions": 0.0,
                                                "gen_s": 0.0, "idle_s": 0.0}
        return {"step": step, "rows": rows, "sampler_before": {}, "sampler": {}, "payload": payload}

    pipeline.start(4, {"entries": [entry(5, [3, 4], 0)]})  # step 5 trains version 3 or 4: version 0 is stale
    assert sent == [("go", 5, [[1], [2]])] and not draws and not pipeline.received
    sent.clear()
    pipeline = split.OneStepOff(config(), engine, dataset, sampler, world_size=1, rank=0, total_steps=10)
    pipeline.start(4, {"entries": [entry(5, [5, 6], 3)]})
    assert sent == [] and 5 in pipeline.received and not draws
