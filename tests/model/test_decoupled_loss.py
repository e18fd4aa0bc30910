"""The loss that knows the data is off-policy (actor.use_decoupled_loss, docs/ALGORITHMS.md "Decoupled PPO").

On the Actor's own loss path over `tests/scripts/grad_case.py`'s mini-batch (old logprobs = the proximal policy,
rollout logprobs = the behaviour policy that sampled the tokens):
- no token of older weights (every token's version is the batch's): the gradient and the metrics are today's, bit for
  bit (the synchronous step's path);
- every token of older weights: the decoupled weight min(exp(proximal - behaviour), cap) is exactly the rollout
  correction's token-mode weight with that cap, so the two runs give the same gradient bit for bit;
- use_decoupled_loss=false: stale tokens train as if on-policy (today's loss).
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_lib import algorithms
from grpo_lib.model.actor import Actor
from tests.scripts import grad_case as case


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = case.write_tiny_model(tmp_path_factory.mktemp("decoupled") / "model")
    cfg = case.make_config(model_dir, micro_batch_size=2)
    actor = Actor(cfg, device=torch.device("cpu"))
    batch = case.make_batch(actor.model)
    batch.weight_version = 5
    return actor, cfg, batch


def grads(actor: Actor, cfg, batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    actor.cfg = cfg
    actor.model.zero_grad(set_to_none=True)
    metrics = actor.accumulate_gradients(batch)
    return case.grads_of(actor.model), metrics


def versioned(batch, version: int):
    out = copy.copy(batch)
    out.token_versions = torch.full_like(batch.input_ids, version)  # [B, T]
    return out


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: not bit-identical"


def test_without_stale_tokens_the_step_is_todays_bit_for_bit(setup):
    actor, cfg, batch = setup
    today, today_metrics = grads(actor, cfg, batch)
    fresh, fresh_metrics = grads(actor, cfg, versioned(batch, 5))
    assert any(g.abs().max() > 0 for g in today.values())
    assert_equal(today, fresh)
    for k, v in today_metrics.items():
        assert fresh_metrics[k] == v, f"{k}: {v} vs {fresh_metrics[k]}"
    assert fresh_metrics["actor/stale_token_fraction"] == 0.0


def test_on_stale_tokens_the_weight_is_the_truncated_behaviour_ratio(setup):
    actor, cfg, batch = setup
    cfg = copy.deepcopy(cfg)
    cfg.actor.behav_imp_weight_cap = 1.5
    stale, stale_metrics = grads(actor, cfg, versioned(batch, 4))
    by_hand = copy.deepcopy(cfg)  # the same weight, written as the rollout correction's token mode
    by_hand.algorithm.rollout_correction.mode, by_hand.algorithm.rollout_correction.cap = "token", 1.5
    expected, _ = grads(actor, by_hand, batch)
    assert_equal(stale, expected)
    today, _ = grads(actor, case.make_config(cfg.model.path, micro_batch_size=2), batch)
    assert any(not torch.equal(stale[k], today[k]) for k in stale), "the behaviour weight changed nothing"
    assert stale_metrics["actor/stale_token_fraction"] == 1.0
    assert 0 < stale_metrics["actor/behav_imp_weight_mean"] <= 1.5


def test_decoupled_loss_off_trains_stale_tokens_as_on_policy(setup):
    actor, cfg, batch = setup
    off = copy.deepcopy(cfg)
    off.actor.use_decoupled_loss = False
    today, _ = grads(actor, cfg, batch)
    stale, _ = grads(actor, off, versioned(batch, 4))
    assert_equal(today, stale)


def test_decoupled_weights_formula():
    is_weights = torch.tensor([[1.0, 0.5, 1.0]])
    prox, behav = torch.tensor([[0.0, 0.0, 0.0]]), torch.log(torch.tensor([[1 / 3, 1 / 3, 4.0]]))
    stale = torch.tensor([[False, True, True]])
    out = algorithms.decoupled_weights(is_weights, prox, behav, stale, cap=2.0)
    assert out[0].tolist() == pytest.approx([1.0, 2.0, 0.25])
    assert algorithms.decoupled_weights(is_weights, prox, behav, torch.zeros_like(stale), cap=2.0).equal(is_weights)
    with pytest.raises(ValueError, match="cap must be > 0"):
        algorithms.decoupled_weights(is_weights, prox, behav, stale, cap=0.0)
