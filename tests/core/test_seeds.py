"""grpo_lib.core.seeds: sample seeds and tensor-parallel prompt shares, without an engine.

Each test would fail if the behaviour broke: seeds must be unique per sample and independent of the topology, the
ranks of a TP group must submit identical requests and keep disjoint slices that equal the TP-1 shares.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_lib.core.seeds import sample_seed, tp_group_share
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.trainer.rounds import generate_share


# ------------------------------------------------------------------------------------------------ seeds
def test_sample_seeds_unique_across_steps_rounds_prompts_samples_and_purposes():
    n, seen = 4, {}
    for purpose in ("train", "val"):
        for step in range(4):
            for rnd in range(1, 4):
                for prompt in range(16):
                    base = sample_seed(7, purpose=purpose, step=step, round=rnd, prompt_index=prompt, n=n)
                    for k in range(n):  # vLLM seeds the n children of a request base, base + 1, ...
                        key = (purpose, step, rnd, prompt, k)
                        assert base + k not in seen, f"{key} shares seed {base + k} with {seen[base + k]}"
                        seen[base + k] = key
    assert sample_seed(8, purpose="train", step=1, round=1, prompt_index=0, n=4) != sample_seed(7, purpose="train", step=1, round=1,
                                                                                               prompt_index=0, n=4)


# ------------------------------------------------------------------------------------------------ TP shares
class RecordingEngine:
    """Answers each sample with [seed of that sample] and records what it was asked."""

    pad_id = 0
    weight_version = 0  # the engine's weights as built (engines.base.EngineGlue)

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, *, n, seeds, **sampling):
        self.calls.append((prompt_ids, seeds, n, sampling))
        return [[Generation(token_ids=[s + k], logprobs=[0.0], text="", finish_reason="length") for k in range(n)] for s in seeds]


class Rows:
    """A dataset whose prompt i is [i]."""

    def batch(self, idx):
        return PromptBatch(prompt_ids=[[i] for i in idx], group_ids=[str(i) for i in idx], data_sources=["s"] * len(idx),
                           ground_truths=[None] * len(idx), extra_infos=[{}] * len(idx))


def share(world_size: int, rank: int, tp: int, global_idx: list[int]):
    cfg = SimpleNamespace(rollout=SimpleNamespace(tensor_model_parallel_size=tp), trainer=SimpleNamespace(seed=3))
    engine = RecordingEngine()
    prompts, gens = generate_share(cfg, engine, Rows(), global_idx, world_size=world_size, rank=rank, purpose="train", step=2,
                                   round=1, sampling=dict(n=2, temperature=1.0))
    kept = {p[0]: [g.token_ids[0] for g in group] for p, group in zip(prompts.prompt_ids, gens)}  # prompt -> its sample seeds
    return engine.calls[0], kept


@pytest.mark.parametrize("world_size,tp", [(2, 2), (4, 2), (4, 4), (4, 1)])
def test_tp_group_submits_identical_requests_and_keeps_disjoint_slices(world_size, tp):
    global_idx = [50 + 3 * i for i in range(8)]
    single = {r: share(world_size, r, 1, global_idx)[1] for r in range(world_size)}  # the TP-1 shares
    for first in range(0, world_size, tp):
        calls = [share(world_size, r, tp, global_idx) for r in range(first, first + tp)]
        assert all(c == calls[0][0] for c, _ in calls), "ranks of one TP group submitted different requests"
        kept = [k for _, k in calls]
        for r, k in zip(range(first, first + tp), kept):
            assert k == single[r], f"rank {r} with TP={tp} keeps {k}, with TP=1 {single[r]}"
        assert sum(len(k) for k in kept) == len(set().union(*kept)), "slices of one group overlap"
    assert sorted(p for k in single.values() for p in k) == sorted(global_idx)


def test_tp_group_share_example():
    assert tp_group_share(8, world_size=4, rank=1, tp_size=2) == ([0, 1, 4, 5], [1, 3])
    assert tp_group_share(8, world_size=4, rank=2, tp_size=2) == ([2, 3, 6, 7], [0, 2])
