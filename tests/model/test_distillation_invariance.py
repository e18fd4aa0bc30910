"""DESIGN invariant 1 for the distillation term: micro-batch size, token budget and packing never change the gradient.

The Actor's loss path (`Actor.accumulate_gradients`) on `tests/scripts/grad_case.py`'s mini-batch, with fixed teacher
scores on the batch (sampled-token logprobs and a top-k), must give the gradient of the plain full-batch loss: the
GRPO loss of `grad_case.reference_loss` + coef x the distillation term written from full-vocabulary logits (or the
distillation term alone without task rewards), for each loss mode, direct and as a policy gradient, with and without
loss-mask holes. 2 processes = 1: tests/model/test_multiprocess.py runs DISTILL_CASES in tests/scripts/grad_worker.py.
Run: `.venv/bin/python -m pytest tests/model/test_distillation_invariance.py`.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib import algorithms
from grpo_lib.algorithms import distillation as D
from grpo_lib.model.actor import Actor
from tests.scripts import grad_case as case

K = 4
COEF = 0.7


def teacher_scores(batch, seed: int = 5) -> None:
    """Fixed teacher outputs on the batch's loss tokens: logprobs near the old ones, a top-K of a random distribution."""
    generator = torch.Generator().manual_seed(seed)
    mask = batch.loss_mask  # [B, T]
    batch.teacher_logprobs = (batch.old_logprobs + 0.5 * torch.randn(mask.shape, generator=generator)).clamp(max=0) * mask
    logits = torch.randn(*mask.shape, case.VOCAB, generator=generator) * 3  # [B, T, V]
    values, ids = logits.log_softmax(-1).topk(K, dim=-1)  # [B, T, K]
    batch.teacher_topk_logprobs, batch.teacher_topk_ids = values * mask[..., None], ids * mask[..., None].long()


def reference_distill(model, batch, cfg) -> torch.Tensor:
    """The whole loss written plainly: one padded forward, full-vocabulary log_softmax, the batch's own counts."""
    dl, a = cfg.distillation.distillation_loss, cfg.actor
    ids, mask = batch.input_ids, batch.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()
    logp = torch.nn.functional.pad((logits[:, :-1] / case.TEMPERATURE).log_softmax(-1), (0, 0, 1, 0))  # [B, T, V]
    lp = logp.gather(-1, ids[..., None]).squeeze(-1) * batch.loss_mask  # [B, T]
    if D.uses_topk(dl.loss_mode):
        student_topk = logp.gather(-1, batch.teacher_topk_ids)  # [B, T, K]
        div = D.forward_kl_topk(student_topk_logprobs=student_topk, teacher_topk_logprobs=batch.teacher_topk_logprobs)
    else:
        div = algorithms.kl_penalty(lp, batch.teacher_logprobs, dl.loss_mode)  # [B, T]
    if dl.loss_max_clamp is not None:
        div = div.clamp(-dl.loss_max_clamp, dl.loss_max_clamp)
    counts = dict(loss_scale_factor=a.loss_scale_factor)
    if dl.use_policy_gradient:
        term, _ = algorithms.policy_loss(lp, batch.old_logprobs, -div.detach(), batch.loss_mask, clip_ratio_low=0.2,
                                         clip_ratio_high=0.2, loss_agg_mode=a.loss_agg_mode, **counts)
    else:
        term = algorithms.aggregate_loss(div, batch.loss_mask, a.loss_agg_mode, **counts)
    if not dl.use_task_rewards:
        return term
    return case.reference_loss(model, batch, cfg) + COEF * term


@pytest.fixture(scope="module", params=[False, True], ids=["contiguous", "holes"])
def setup(tmp_path_factory, request):
    torch.set_num_threads(1)
    model_dir = case.write_tiny_model(tmp_path_factory.mktemp("distill") / "model")
    actor = Actor(case.make_config(model_dir, remove_padding=True), device=torch.device("cpu"))
    batch = case.make_batch(actor.model)
    if request.param:
        batch = case.with_holes(batch)
    teacher_scores(batch)
    return dict(model_dir=model_dir, actor=actor, batch=batch)


def distill_extra(model_dir, *extra) -> tuple[str, ...]:
    """The overrides of a distillation case on top of grad_case's config."""
    return ("distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={model_dir}",
            f"distillation.distillation_loss.distillation_loss_coef={COEF}", f"distillation.distillation_loss.topk={K}", *extra)


def distill_config(model_dir, *extra, **kwargs):
    return case.make_config(model_dir, extra=distill_extra(model_dir, *extra), **kwargs)


# The cases tests/model/test_multiprocess.py runs on 2 processes (tests/scripts/grad_worker.py)
DISTILL_CASES = {
    "k3": ("distillation.distillation_loss.loss_mode=k3",),
    "forward_kl_topk": ("distillation.distillation_loss.loss_mode=forward_kl_topk",),
    "k1-pg-alone": ("distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true",
                    "distillation.distillation_loss.use_task_rewards=false"),
}


@pytest.mark.parametrize("extra", [
    ("distillation.distillation_loss.loss_mode=k3",),
    ("distillation.distillation_loss.loss_mode=k3", "distillation.distillation_loss.loss_max_clamp=0.05"),
    ("distillation.distillation_loss.loss_mode=forward_kl_topk",),
    ("distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true"),
    ("distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true",
     "distillation.distillation_loss.use_task_rewards=false"),
], ids=["k3", "k3-clamped", "forward_kl_topk", "k1-pg", "k1-pg-alone"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_distillation_term_never_changes_with_micro_batching(setup, extra, agg):
    actor, batch = setup["actor"], setup["batch"]
    cfg = distill_config(setup["model_dir"], *extra, loss_agg_mode=agg)
    actor.model.zero_grad(set_to_none=True)
    reference_distill(actor.model, batch, cfg).backward()
    expected = case.grads_of(actor.model)
    assert any(g.abs().max() > 0 for g in expected.values())
    for micro in (dict(micro_batch_size=1), dict(micro_batch_size=3), dict(max_tokens=case.LONGEST), dict(max_tokens=150)):
        for remove_padding in (False, True):
            cfg = distill_config(setup["model_dir"], *extra, loss_agg_mode=agg, remove_padding=remove_padding, **micro)
            actor.cfg = cfg
            actor.model.zero_grad(set_to_none=True)
            metrics = actor.accumulate_gradients(batch)
            case.assert_close_grads(case.grads_of(actor.model), expected, f"{extra} {agg} {micro} packing={remove_padding}")
            assert metrics["distillation/loss_min"] <= metrics["distillation/kl_mean"] <= metrics["distillation/loss_max"]


def test_distillation_metrics_are_the_whole_mini_batchs(setup):
    """kl_mean is the mean over every loss token and the range its min / max, whatever the micro-batching."""
    actor, batch = setup["actor"], setup["batch"]
    with torch.no_grad():
        lp, _ = case.naive_logprobs(actor.model, batch)
    div = algorithms.kl_penalty(lp, batch.teacher_logprobs, "k3")[batch.loss_mask.bool()]  # [n]
    for micro in (dict(micro_batch_size=1), dict(micro_batch_size=8)):
        actor.cfg = distill_config(setup["model_dir"], **micro)
        actor.model.zero_grad(set_to_none=True)
        metrics = actor.accumulate_gradients(batch)
        # float32 forwards two ways: ~1e-6 per logprob, k3's slope e^x - 1 < 3 here
        assert metrics["distillation/kl_mean"] == pytest.approx(float(div.mean()), abs=1e-5)
        assert metrics["distillation/loss_min"] == pytest.approx(float(div.min()), abs=1e-5)
        assert metrics["distillation/loss_max"] == pytest.approx(float(div.max()), abs=1e-5)
