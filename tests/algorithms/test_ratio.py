"""DESIGN invariant 2 on the tiny model, in-process: the first update of a step is on-policy, so its
importance ratio is exactly 1.

Two ways the trainer gets the "old" logprobs of that first update:
(a) one mini-batch, one epoch: no old-logprob pass; old = the update's own logprobs, detached. Then every
    ratio is exp(0) = 1: ppo_kl and both clip fractions are 0 and the token-mean loss is -mean(A).
(b) several updates: `Actor.compute_logprobs` (no grad, eval mode) runs before the update. The update's
    first micro-batch must recompute the very same numbers (torch.equal, not allclose), with and without
    padding-free packing, also when the step holds several mini-batches, also when the loss masks have holes
    (the grad group is the loss tokens; the holes are scored with the prompt, `passes.response_scores`).

Why (b) can fail: a row's logprobs are only bit-identical between two forwards when the row sits in the
same micro-batch, with the same neighbours and padded width (a different packed layout or matrix shape
changes the floating-point summation order; with `use_remove_padding` the difference is ~5e-7). So the
old-logprob pass cuts the batch into the same mini-batches and micro-batches as the update's first epoch.

Run: .venv/bin/python -m pytest tests/algorithms/test_ratio.py
"""

from __future__ import annotations

import random

import pytest
import torch

import grpo_lib.model.fsdp as fsdp_module  # LogprobModel.forward calls token_logprobs from there
from grpo_lib.config import load_config
from grpo_lib.config.checks import needs_old_logprobs
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.model.actor import Actor
from grpo_lib.trainer import step
from tests.conftest import merge_overrides

NUM_PROMPTS, N = 3, 4  # 12 trajectories


def make_cfg(model_dir, *overrides: str):
    """The case's config; `overrides` replace its settings of the same key (merge_overrides)."""
    return load_config(None, merge_overrides(
        f"model.path={model_dir}", "data.train_files=[unused.parquet]", "data.max_response_length=9",
        f"data.train_batch_size={NUM_PROMPTS}", f"actor.ppo_mini_batch_size={NUM_PROMPTS}", f"rollout.n={N}",
        "actor.ppo_micro_batch_size_per_gpu=5", "actor.lr=1e-3", *overrides))


def hole_mask(length: int, index: int) -> list[int]:
    """A multi-turn-like loss mask of one response: the middle third is a hole (a tool's output); response 7 is
    masked whole (a masked truncation). Example: length 6 -> [1, 1, 0, 0, 1, 1]."""
    if index == 7:
        return [0] * length
    return [0 if length // 3 <= j < 2 * length // 3 else 1 for j in range(length)]


def fake_rollout(*, seed: int = 0, holes: bool = False):
    """3 prompts x 4 responses of random tokens (prompts 5-12 tokens, responses 1-9), fixed 0/1 scores; all rows distinct.
    With `holes`, each generation carries `hole_mask` as its loss mask."""
    rng = random.Random(seed)
    prompts = PromptBatch(prompt_ids=[[rng.randrange(3, 300) for _ in range(rng.randint(5, 12))] for _ in range(NUM_PROMPTS)],
                          group_ids=[f"g{p}" for p in range(NUM_PROMPTS)], data_sources=["fake"] * NUM_PROMPTS,
                          ground_truths=["0"] * NUM_PROMPTS, extra_infos=[{}] * NUM_PROMPTS)
    generations = []
    for _ in range(NUM_PROMPTS):
        group = []
        for _ in range(N):
            ids = [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))]
            loss_mask = hole_mask(len(ids), len(generations) * N + len(group)) if holes else None
            group.append(Generation(token_ids=ids, logprobs=[-1.0] * len(ids), text="", finish_reason="stop", loss_mask=loss_mask))
        generations.append(group)
    batch = step.build_rollout_batch(prompts, generations, pad_id=0)
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # [12], every group mixed
    return batch


def fake_batch(cfg, *, seed: int = 0, holes: bool = False):
    """`fake_rollout` with the advantages of `cfg` (the step's own `compute_advantages`)."""
    batch = fake_rollout(seed=seed, holes=holes)
    step.compute_advantages(cfg, batch)
    assert batch.advantages.abs().sum() > 0, "the fake batch must carry advantage signal"
    return batch


@pytest.mark.parametrize("holes", [False, True], ids=["contiguous", "holes"])
def test_single_update_has_ratio_one(tiny_model_dir, holes):
    cfg = make_cfg(tiny_model_dir)  # one mini-batch, ppo_epochs 1, 3 micro-batches of <= 5 rows
    assert not needs_old_logprobs(cfg), "one update per step must not run an old-logprob pass"
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    batch = fake_batch(cfg, holes=holes)
    metrics = actor.update(batch)
    assert metrics["actor/ppo_kl"] == 0.0, metrics
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0, metrics
    # ratio 1: L_t = max(-A, -A * clip(1)) = -A (the dual clip -3A never binds), token-mean over the loss tokens of all 12 rows.
    mask = batch.loss_mask  # [12, T]
    expected = float(-(batch.advantages * mask).sum() / mask.sum())
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7), (metrics["actor/pg_loss"], expected)
    assert metrics["actor/grad_norm"] > 0, "a non-zero advantage must give a gradient"


class FirstGradForward:
    """Wraps `grpo_lib.model.actor.token_logprobs` and keeps the first call made with grad on (the update's first micro-batch)."""

    def __init__(self, fn):
        self.fn, self.first = fn, None

    def __call__(self, model, input_ids, attention_mask, **kwargs):
        lp, entropy = self.fn(model, input_ids, attention_mask, **kwargs)
        if torch.is_grad_enabled() and self.first is None:
            self.first = (input_ids.detach().cpu(), attention_mask.detach().cpu(), lp.detach().float().cpu())
        return lp, entropy


def rows_of(batch, input_ids, attention_mask) -> list[int]:
    """Batch row of each row of a micro-batch, found by content (the fake rows are all distinct)."""
    width = input_ids.shape[1]
    rows = []
    for ids, mask in zip(input_ids, attention_mask):
        hits = [i for i in range(len(batch)) if torch.equal(batch.attention_mask[i, :width], mask)
                and torch.equal(batch.input_ids[i, :width] * batch.attention_mask[i, :width], ids * mask)]
        assert len(hits) == 1, f"micro-batch row matches {len(hits)} batch rows"
        rows.append(hits[0])
    return rows


@pytest.mark.parametrize("holes", [False, True], ids=["contiguous", "holes"])
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mini_batch_prompts,shuffle", [(NUM_PROMPTS, False), (1, False), (1, True)],
                         ids=["one-mini-batch", "three-mini-batches", "three-shuffled-mini-batches"])
def test_old_logprobs_equal_first_update_logprobs(tiny_model_dir, monkeypatch, remove_padding, mini_batch_prompts, shuffle, holes):
    # Micro-batches of 3 rows: a whole-batch split ([0-2], [3-5], ...) and a split of each 4-row mini-batch
    # ([0, 1], [2, 3]) differ, unless the old-logprob pass follows the update's mini-batches.
    cfg = make_cfg(tiny_model_dir, "actor.ppo_epochs=2", "actor.ppo_micro_batch_size_per_gpu=3", f"actor.ppo_mini_batch_size={mini_batch_prompts}",
                   f"actor.shuffle={str(shuffle).lower()}", f"model.use_remove_padding={str(remove_padding).lower()}")
    assert needs_old_logprobs(cfg)
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    batch = fake_batch(cfg, holes=holes)
    if holes:
        assert ((batch.loss_mask == 0) & (batch.response_mask == 1)).any(), "the holes must be inside the responses"
    batch.old_logprobs = actor.compute_logprobs(batch)  # [12, T]
    spy = FirstGradForward(fsdp_module.token_logprobs)
    monkeypatch.setattr(fsdp_module, "token_logprobs", spy)
    metrics = actor.update(batch)
    assert spy.first is not None, "the update never ran a forward with grad on"
    input_ids, attention_mask, lp = spy.first
    rows = rows_of(batch, input_ids, attention_mask)
    old = batch.old_logprobs[torch.as_tensor(rows), :lp.shape[1]]  # [b, w]
    # The ratio reads the loss tokens: there the update's logprobs are the old pass's, bit for bit. The update scores
    # nothing else (prompt, holes: 0), the old pass scores every position.
    loss = batch.loss_mask[torch.as_tensor(rows), :lp.shape[1]].bool()  # [b, w]
    assert torch.equal(lp[loss], old[loss]), (f"first micro-batch (rows {rows}) recomputes different logprobs than the "
                                              f"old-logprob pass: max |diff| {float((lp - old)[loss].abs().max()):.3g}")
    assert bool((lp[~loss] == 0).all()), "the update scores only the loss tokens"
    assert all(map(torch.isfinite, map(torch.tensor, metrics.values()))), metrics


def test_the_step_plan_is_made_once_and_followed(tiny_model_dir, monkeypatch):
    """Issue 29 item 1: the step's mini-batches are split once (`Actor.plan_step`: one permutation per epoch from one
    generator), and the old-logprob pass and the update follow the plan they are handed: no pass re-derives it. A plan
    holding only the first mini-batch makes the update take one optimizer step, on exactly its rows."""
    from grpo_lib.model import batching
    from grpo_lib.model.batching import StepPlan

    cfg = make_cfg(tiny_model_dir, "actor.ppo_epochs=2", "actor.ppo_mini_batch_size=1", "actor.shuffle=true")
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    batch = fake_batch(cfg)
    calls = {"split": 0, "generator": 0}
    split, generator = batching.split_mini_batches, Actor._shuffle_generator

    def counted_split(*args, **kwargs):
        calls["split"] += 1
        return split(*args, **kwargs)

    def counted_generator(self):
        calls["generator"] += 1
        return generator(self)

    monkeypatch.setattr(batching, "split_mini_batches", counted_split)
    monkeypatch.setattr(Actor, "_shuffle_generator", counted_generator)
    plan = actor.plan_step(batch)
    assert [len(e) for e in plan.epochs] == [3, 3] and plan.old_logprob is plan.epochs[0]  # 3 one-prompt mini-batches
    batch.old_logprobs = actor.compute_logprobs(batch, plan)
    stepped, step = [], Actor._optimizer_step
    monkeypatch.setattr(Actor, "_optimizer_step", lambda self, mini, micro=None: stepped.append((mini, micro)) or step(self, mini, micro))
    first = plan.epochs[0][0]
    actor.update(batch, StepPlan(epochs=[[first]], old_logprob=[first]))
    assert calls == {"split": 2, "generator": 1}, "the plan is made once: one generator, one split per epoch"
    ((mini, micro),) = stepped
    assert micro is first.micro_batches and torch.equal(mini.input_ids, batch.select(first.rows).input_ids)
