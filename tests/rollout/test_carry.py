"""The carry-over pool (grpo_lib/rollout/carry.py) against a scripted engine: what a user of partial rollouts relies on.

The engine here decodes one token per request per step; a request's response length is fixed by its seed (so a
resumed request gets a new length: it is other weights' sampling), its tokens are (seed, position) hashes and its
logprobs -0.1 x position. It honours `stop` as the real engines do (tests/rollout/test_engines.py proves those).
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from grpo_lib.config import Config
from grpo_lib.core.seeds import sample_seed
from grpo_lib.core.types import Generation
from grpo_lib.rollout.carry import CarryPool
from grpo_lib.rollout.data import PromptSampler
from grpo_lib.trainer.step import build_rollout_batch


def h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest(), "little")


class ScriptedEngine:
    """One token per request per step; length of a request's response: 1 + h(seed) % max_len (a long tail)."""

    pad_id = 0

    def __init__(self, max_len: int):
        self.max_len, self.weight_version, self.calls, self.steps = max_len, 0, [], 0

    def generate(self, prompt_ids, *, n, temperature, max_tokens, seeds, on_finished, stop, top_p=1.0, top_k=-1,
                 logprobs=True, score=None):
        assert n == 1
        self.calls.append(len(prompt_ids))
        want = [min(limit, 1 + h(seed) % self.max_len) for seed, limit in zip(seeds, max_tokens)]
        out: list[Generation | None] = [None] * len(prompt_ids)
        t = 0
        while any(o is None for o in out):
            t += 1
            self.steps += 1
            finished = []
            for i, w in enumerate(want):
                if out[i] is None and t >= w:
                    reason = "length" if w == max_tokens[i] else "stop"
                    out[i] = Generation([h(seeds[i], j) for j in range(w)], [-0.1 * j for j in range(w)], f"r{i}", reason)
                    finished.append((i, 0, out[i]))
            on_finished(finished)
            if any(o is None for o in out) and stop():
                for i, w in enumerate(want):
                    if out[i] is None:
                        out[i] = Generation([h(seeds[i], j) for j in range(t)], [-0.1 * j for j in range(t)], "", "abort")
        return [[o] for o in out]


class Data:
    """What the pool reads of a PromptDataset."""

    def __init__(self, rows: int):
        self.prompt_ids = [[1, 2, r] for r in range(rows)]
        self.uids = [f"u{r}" for r in range(rows)]

    def batch(self, idx):
        return SimpleNamespace(prompt_ids=[self.prompt_ids[i] for i in idx], group_ids=[self.uids[i] for i in idx],
                               data_sources=["d"] * len(idx), ground_truths=[None] * len(idx), extra_infos=[{}] * len(idx))


def config(*, batch=4, active=8, k=1, n=2, max_len=16) -> Config:
    cfg = Config()
    cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_response_length = batch, n, max_len
    cfg.rollout.partial_rollout.enable, cfg.rollout.partial_rollout.active_batch_size = True, active
    cfg.rollout.partial_rollout.max_staleness = k
    return cfg


SAMPLING = dict(n=1, temperature=1.0)


def run(cfg, steps: int, *, rows: int = 40, pool=None, sampler=None, engine=None, start: int = 1):
    """`steps` steps of fill -> round -> take -> push (the engine's version = the step): the batches taken."""
    data = Data(rows)
    pool = pool or CarryPool(cfg, world_size=1, rank=0)
    sampler = sampler or PromptSampler(rows, batch_size=cfg.data.train_batch_size, seed=3)
    engine = engine or ScriptedEngine(cfg.data.max_response_length)
    taken = []
    for step in range(start, start + steps):
        engine.weight_version = step - 1  # the push after step s serves version s
        pool.fill(sampler, data, step=step)
        pool.run_round(engine, data, sampling=SAMPLING)
        prompts, generations = pool.take(data)
        batch = build_rollout_batch(prompts, generations)
        batch.weight_version = engine.weight_version
        taken.append((step, prompts, generations, batch, pool.pop_counts()))
    return taken, pool, sampler, engine


def test_the_round_stops_when_the_batch_is_complete_and_carries_the_rest():
    taken, pool, _, _ = run(config(), 3)
    for _, prompts, generations, _, counts in taken:
        assert len(prompts.prompt_ids) == 4 and all(g.finish_reason in ("stop", "length") for gs in generations for g in gs)
        assert counts["rollout/pool_groups"] == 8  # 4 fresh + 4 in flight before the take
    assert sum(c["rollout/carried_responses"] for *_, c in taken) > 0, "the long tail was never carried"
    assert sum(c["rollout/resumed_responses"] for *_, c in taken) > 0, "a carried response was never resumed"
    assert len(pool.groups) == 4


def test_no_prompt_is_lost_or_trained_twice_and_the_order_is_reproducible():
    rows = 40
    taken, pool, sampler, _ = run(config(k=1), 9, rows=rows)
    trained = [g for _, prompts, *_ in taken for g in prompts.group_ids]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    drawn = PromptSampler(rows, batch_size=4, seed=3)
    draws = [drawn.next_batch() for _ in range(10)]  # step 1 drew 2 batches, each later step 1
    in_flight = {g.group_id for g in pool.groups}
    expected = {f"u{r}" for b in draws[:1] for r in b} | {f"u{r}#round2" for r in draws[1]} | {f"u{r}" for b in draws[2:] for r in b}
    assert set(trained) | in_flight == expected and not set(trained) & in_flight, "a drawn prompt went missing"
    again, *_ = run(config(k=1), 9, rows=rows)
    assert [p.group_ids for _, p, *_ in again] == [p.group_ids for _, p, *_ in taken]
    assert all(b1.input_ids.equal(b2.input_ids) for (*_, b1, _), (*_, b2, _) in zip(again, taken))


@pytest.mark.parametrize("k, active", [(1, 8), (1, 16), (2, 12), (3, 16)])
def test_no_trained_token_is_older_than_max_staleness(k, active):
    taken, *_ = run(config(k=k, active=active), 10)
    ages = [int(a) for *_, batch, _ in taken
            for a in (batch.weight_version - batch.token_versions)[batch.loss_mask > 0].tolist()]
    assert 1 <= max(ages) <= k, "no stale token trained (the test would prove little), or one older than K"
    dropped = sum(c["rollout/dropped_stale_responses"] for *_, c in taken)
    if active <= 2 * 4:  # due groups finish in their round: with at most twice the batch in flight nothing is thrown away
        assert dropped == 0


def test_a_response_older_than_k_is_dropped_and_started_again():
    """More complete groups than a step trains (4x the batch in flight, K=1): the surplus goes stale and is dropped."""
    taken, *_ = run(config(k=1, active=16, max_len=4), 6)
    assert sum(c["rollout/dropped_stale_responses"] for *_, c in taken) > 0
    ages = [int(a) for *_, batch, _ in taken for a in (batch.weight_version - batch.token_versions)[batch.loss_mask > 0].tolist()]
    assert max(ages) <= 1


def test_a_carried_response_keeps_its_tokens_logprobs_and_versions():
    taken, *_ = run(config(k=2, active=12), 6)
    carried = [(batch, i) for *_, batch, _ in taken for i in range(len(batch))
               if batch.token_versions[i][batch.loss_mask[i] > 0].unique().numel() > 1]
    assert carried, "no trained response spans two weight versions"
    batch, i = carried[0]
    versions = batch.token_versions[i][batch.loss_mask[i] > 0].tolist()
    assert versions == sorted(versions), "a response's tokens are in the order their versions wrote them"
    logprobs = batch.rollout_logprobs[i][batch.loss_mask[i] > 0].tolist()
    first = versions.count(versions[0])
    assert logprobs[:first] == pytest.approx([-0.1 * j for j in range(first)]), "the first request's logprobs were not kept"


def test_active_equal_to_the_batch_is_the_synchronous_step():
    cfg = config(active=4)
    taken, pool, _, engine = run(cfg, 3)
    sampler = PromptSampler(40, batch_size=4, seed=3)
    for step, prompts, generations, batch, counts in taken:
        assert prompts.group_ids == [f"u{r}" for r in sampler.next_batch()], "the sampler's batch in its order"
        seeds = [sample_seed(cfg.trainer.seed, purpose="train", step=step, round=1, prompt_index=i, n=2) for i in range(4)]
        want = [[min(16, 1 + h(s + k) % 16) for k in range(2)] for s in seeds]
        assert [[len(g.token_ids) for g in gs] for gs in generations] == want, "the synchronous step's seeds"
        assert counts["rollout/carried_responses"] == 0 and (batch.token_versions[batch.response_mask > 0] == step - 1).all()
    assert not pool.groups


def test_a_saved_pool_resumes_exactly():
    cfg = config(k=1)
    whole, *_ = run(cfg, 6)
    first, pool, sampler, _ = run(cfg, 3)
    state, sampler_state = pool.state_dict(), sampler.state_dict()
    import json

    state = json.loads(json.dumps(state))  # as the checkpoint writes and reads it
    resumed_pool = CarryPool(cfg, world_size=1, rank=0)
    resumed_pool.load_state_dict(state, where="ckpt")
    resumed_sampler = PromptSampler(40, batch_size=4, seed=3)
    resumed_sampler.load_state_dict(sampler_state)
    rest, *_ = run(cfg, 3, pool=resumed_pool, sampler=resumed_sampler, start=4)
    for (_, p1, _, b1, _), (_, p2, _, b2, _) in zip(whole[3:], rest):
        assert p1.group_ids == p2.group_ids
        assert b1.input_ids.equal(b2.input_ids) and b1.token_versions.equal(b2.token_versions)


def test_a_pool_saved_on_another_layout_is_refused_naming_the_fix():
    _, pool, _, _ = run(config(), 2)
    other = CarryPool(config(batch=4), world_size=2, rank=0)
    with pytest.raises(ValueError, match="saved by 1 processes.*this run has 2.*carry/ folder"):
        other.load_state_dict(pool.state_dict(), where="ckpt/carry")


def test_tp_members_hold_the_same_pool_and_each_trains_its_own_share():
    cfg = config(batch=4, active=8)
    cfg.rollout.tensor_model_parallel_size = 2
    data, engines = Data(40), [ScriptedEngine(16), ScriptedEngine(16)]
    pools = [CarryPool(cfg, world_size=2, rank=r) for r in (0, 1)]
    samplers = [PromptSampler(40, batch_size=4, seed=3) for _ in (0, 1)]
    for step in (1, 2, 3):
        batches = []
        for r in (0, 1):
            engines[r].weight_version = step - 1
            pools[r].fill(samplers[r], data, step=step)
            pools[r].run_round(engines[r], data, sampling=SAMPLING)
            batches.append(pools[r].take(data)[0].group_ids)
        assert pools[0].state_dict() == pools[1].state_dict(), "the TP members' pools diverged"
        assert len(batches[0]) == len(batches[1]) == 2 and not set(batches[0]) & set(batches[1])
        assert engines[0].calls == engines[1].calls, "the members submitted different requests"


def test_an_aborted_step_is_undone_and_replays_the_same():
    """A step aborted before its update (failing rewards, a failed weight probe: its tokens may come from unproven
    weights): the pool goes back to the step's start (its draw, its tokens, its take undone), so the checkpoint of the
    step before holds what it held and the resume replays the step with the same seeds."""
    import json

    cfg = config(k=1)
    whole, *_ = run(cfg, 4)
    _, pool, sampler, engine = run(cfg, 2)
    before, sampler_before = json.dumps(pool.state_dict()), sampler.state_dict()
    data = Data(40)
    engine.weight_version = 2
    pool.fill(sampler, data, step=3)
    pool.run_round(engine, data, sampling=SAMPLING)
    pool.take(data)
    pool.undo_step()
    assert json.dumps(pool.state_dict()) == before, "the undone step left the pool changed"
    sampler.load_state_dict(sampler_before)
    rest, *_ = run(cfg, 2, pool=pool, sampler=sampler, start=3)
    for (_, p1, _, b1, _), (_, p2, _, b2, _) in zip(whole[2:], rest):
        assert p1.group_ids == p2.group_ids and b1.input_ids.equal(b2.input_ids)


def test_the_pool_stays_at_its_size():
    """Each step trains one batch's worth and draws one batch: the pool keeps active_batch_size groups."""
    taken, pool, *_ = run(config(batch=4, active=12, k=2), 6)
    assert all(c["rollout/pool_groups"] == 12 for *_, c in taken)
    assert len(pool.groups) == 8
