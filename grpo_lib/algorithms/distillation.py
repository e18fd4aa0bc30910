"""On-policy distillation's math as pure tensor functions: the per-token divergences and the distillation term.

A teacher scores the student's own rollouts (grpo_lib/model/teacher.py, through the one logprob function); the student is
trained towards it (docs/ALGORITHMS.md, "On-policy distillation": GKD, Agarwal et al. 2024; Thinking Machines'
on-policy distillation, Lu 2025). verl 0.9's `verl/trainer/distillation/losses.py` is the reference for names and
formulas; the registry below holds its loss modes:

* sampled-token estimators of KL(student || teacher) at the token the student sampled (`kl` / `k1`, `abs`, `k2` /
  `mse`, `k3` / `low_var_kl`): `grpo_lib.algorithms.losses.kl_penalty(student, teacher)`, the estimators of the KL loss
  (verl's `kl_penalty(logprob, ref_logprob=teacher)`);
* `forward_kl_topk`: over the teacher's k most likely tokens, sum_j p_T(j) (log p_T(j) - log p_S(j)), clamped at 0 (the
  truncated sums need not be >= 0), both log-probabilities first clamped from below at `log_prob_min_clamp`.

The term (`distillation_term`): each token's divergence clamped to [-loss_max_clamp, loss_max_clamp], then either
backpropagated directly and aggregated like every loss (`use_policy_gradient=false`, GKD), or, detached and negated, the
advantage of a vanilla PPO clipped loss (`use_policy_gradient=true`: on-policy distillation's reward -KL per token).
The trainer adds it to the GRPO loss x `distillation_loss_coef` (`use_task_rewards`) or uses it alone (`total_loss`).
Every count is the mini-batch's global one (`num_tokens`, `num_seqs`), so micro-batching never changes the gradient.
The training loop never branches on a loss name: the actor calls `micro_batch_loss` once per micro-batch.
Run the tests with `.venv/bin/python -m pytest tests/algorithms/test_distillation.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from grpo_lib import algorithms
from grpo_lib.core import names
from grpo_lib.core.devices import to_device
from grpo_lib.core.types import RolloutBatch


def _estimator(kl_type: str) -> Callable[..., Tensor]:
    def divergence(*, logprobs: Tensor, teacher_logprobs: Tensor, **_unused) -> Tensor:
        return algorithms.kl_penalty(logprobs, teacher_logprobs, kl_type)  # [b, T]
    divergence.__doc__ = f"{kl_type}: the sampled-token estimator of KL(student || teacher), algorithms.kl_penalty."
    return divergence


def forward_kl_topk(*, student_topk_logprobs: Tensor, teacher_topk_logprobs: Tensor,
                    log_prob_min_clamp: float | None = None, **_unused) -> Tensor:
    """sum_j p_T(j) (log p_T(j) - log p_S(j)) over the teacher's top-k ids j, >= 0 (verl's forward_kl_topk).

    Inputs [b, T, k] (the student's log-probabilities at the teacher's ids, the teacher's own); with
    `log_prob_min_clamp` both are clamped from below first. Output [b, T]. The top-k sums miss the rest of the
    vocabulary, so they can be < 0; they are clamped at 0 (verl does the same).
    Example: teacher log p [log .5, log .25], student [log .25, log .25] -> .5 log 2 + .25 log 1 = 0.3466.
    """
    dtype = torch.promote_types(student_topk_logprobs.dtype, torch.float32)  # at least float32 (float64 stays)
    student, teacher = student_topk_logprobs.to(dtype), teacher_topk_logprobs.to(dtype)  # [b, T, k]
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp(min=log_prob_min_clamp), teacher.clamp(min=log_prob_min_clamp)
    return (teacher.exp() * (teacher - student)).sum(dim=-1).clamp(min=0.0)  # [b, T]


DIVERGENCES: dict[str, Callable[..., Tensor]] = {
    **{name: _estimator(name) for name in names.KL_BASE_TYPES}, "forward_kl_topk": forward_kl_topk,
}
TOPK_MODES = ("forward_kl_topk",)  # the modes that read the teacher's top-k (the others its sampled-token logprob)
assert tuple(DIVERGENCES) == names.DISTILLATION_LOSS_MODES, "grpo_lib/core/names.py and this registry disagree"


def uses_topk(loss_mode: str) -> bool:
    """Whether `loss_mode` needs the teacher's top-k ids and log-probabilities (else its sampled-token logprobs)."""
    return loss_mode in TOPK_MODES


def token_divergence(loss_mode: str, **inputs: Tensor | float | None) -> Tensor:
    """The per-token divergence [b, T] of `loss_mode` (DIVERGENCES); an unknown name raises with the supported ones.

    Inputs by name: `logprobs` and `teacher_logprobs` [b, T] (the estimators), `student_topk_logprobs` and
    `teacher_topk_logprobs` [b, T, k] and `log_prob_min_clamp` (forward_kl_topk).
    """
    if loss_mode not in DIVERGENCES:
        raise ValueError(f"unknown distillation loss_mode {loss_mode!r}; supported: {', '.join(DIVERGENCES)}")
    return DIVERGENCES[loss_mode](**inputs)


def distillation_term(divergence: Tensor, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, *,
                      use_policy_gradient: bool, loss_max_clamp: float | None = None, clip_ratio_low: float = 0.2,
                      clip_ratio_high: float = 0.2, loss_agg_mode: str = "token-mean",
                      num_tokens: Tensor | float | None = None, num_seqs: Tensor | float | None = None,
                      loss_scale_factor: float | None = None,
                      is_weights: Tensor | None = None,
                      loss_positions: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation loss of one micro-batch (a scalar with the mini-batch's global counts) and its metrics.

    `divergence` [b, T]: `token_divergence` of the current student (with grad); clamped to [-loss_max_clamp,
    loss_max_clamp] when given. use_policy_gradient: `algorithms.policy_loss` (vanilla, dual clip 3 as verl's default)
    with advantages -divergence.detach(), old_logprobs as its ratio's denominator and `is_weights`; else
    `algorithms.aggregate_loss(divergence)`. Metrics, local to this call (0-dim tensors on the device; the actor weights
    them by loss tokens): `distillation/kl_mean` and `distillation/abs_loss` (mean of the divergence / its absolute value
    over the loss tokens, before the clamp), `distillation/loss_min` / `loss_max` (+inf / -inf without a loss token).
    `loss_positions` [n] long: the loss tokens' indices in the flattened [b * T] (`loss_positions` of the host's mask):
    the values are picked by index, so nothing is read back from the device; without it the mask picks them,
    which reads their count. Either way the same values in the same order: the same means, bit for bit.
    Example: divergence [[0.5, 1.5]], mask [[1, 1]], token-mean, direct -> loss 1.0, kl_mean 1.0, range [0.5, 1.5].
    """
    with torch.no_grad():
        picked = _pick(divergence.detach(), mask, loss_positions)  # [n]
        empty = picked.numel() == 0  # a shape: known without reading the device
        metrics = {
            "distillation/kl_mean": picked.new_zeros(()) if empty else picked.mean(),
            "distillation/abs_loss": picked.new_zeros(()) if empty else picked.abs().mean(),
            "distillation/loss_min": picked.new_full((), math.inf) if empty else picked.min(),
            "distillation/loss_max": picked.new_full((), -math.inf) if empty else picked.max(),
        }
    if loss_max_clamp is not None:
        divergence = divergence.clamp(-loss_max_clamp, loss_max_clamp)  # [b, T]
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    if use_policy_gradient:
        loss, pg_metrics = algorithms.policy_loss(
            logprobs, old_logprobs, -divergence.detach(), mask, loss_mode="vanilla", clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode, is_weights=is_weights, **counts)
        metrics.update({f"distillation/{k}": v for k, v in pg_metrics.items()})  # pg_clipfrac, ppo_kl of this term
    else:
        loss = algorithms.aggregate_loss(divergence, mask, loss_agg_mode, **counts)
    return loss, metrics


def total_loss(task_loss: Tensor, distill_loss: Tensor, *, use_task_rewards: bool, distillation_loss_coef: float) -> Tensor:
    """use_task_rewards: task_loss + distillation_loss_coef x distill_loss; else distill_loss alone (coefficient 1, as
    verl: the GRPO loss, its KL and entropy terms included, trains nothing).
    Example: task 2.0, distillation 0.5, coef 0.1 -> 2.05; without task rewards -> 0.5."""
    if not use_task_rewards:
        return distill_loss
    return task_loss + distillation_loss_coef * distill_loss


# Metrics reduced by their extreme over micro-batches, processes and updates (the others: sums or token-weighted means).
EXTREMA: dict[str, str] = {"distillation/loss_min": "min", "distillation/loss_max": "max"}


def loss_positions(mask: Tensor) -> Tensor:
    """Indices [n] of the loss tokens (nonzero `mask` entries) in the flattened [b * T], row-major: the order a boolean
    mask selects in. Called on the HOST mask, then sent to the device: picking by them reads nothing back there.
    Example: [[0, 1], [1, 1]] -> [1, 2, 3]."""
    return mask.reshape(-1).nonzero().squeeze(1)


def _pick(values: Tensor, mask: Tensor, positions: Tensor | None) -> Tensor:
    """values[mask.bool()] ([b, T, ...] -> [n, ...]) as an index gather by `positions` (`loss_positions(mask)` when None:
    the caller's mask then decides, read where it is)."""
    positions = loss_positions(mask) if positions is None else positions  # [n]
    return values.reshape(-1, *values.shape[mask.dim():]).index_select(0, positions.to(values.device))


def topk_mass_metrics(student_topk_logprobs: Tensor, teacher_topk_logprobs: Tensor, mask: Tensor,
                      positions: Tensor | None = None) -> dict[str, Tensor]:
    """forward_kl_topk: mean over loss tokens of the probability mass the student / the teacher puts on the teacher's
    top-k ids (verl's distillation/student_mass, teacher_mass), 0-dim tensors (0 without a loss token); `positions`:
    `loss_positions` of the mask (picked by index: nothing read back), as in `distillation_term`. A teacher mass far
    below 1 says k is too small.
    Example: teacher top-2 probabilities [.5, .25], student [.25, .25] -> teacher_mass .75, student_mass .5."""
    with torch.no_grad():
        student = _pick(student_topk_logprobs.detach().float().exp().sum(-1), mask, positions)  # [n]
        teacher = _pick(teacher_topk_logprobs.detach().float().exp().sum(-1), mask, positions)  # [n]
        if not student.numel():
            return {"distillation/student_mass": student.new_zeros(()), "distillation/teacher_mass": teacher.new_zeros(())}
        return {"distillation/student_mass": student.mean(), "distillation/teacher_mass": teacher.mean()}


# ------------------------------------------------------------------ the actor's one call (grpo_lib/model/actor.py)


def student_topk_ids(ds, mb: RolloutBatch) -> Tensor | None:
    """The teacher's top-k ids [b, T, k] that the student's forward scores too (forward_kl_topk), else None.
    `ds`: the config's distillation section."""
    return mb.teacher_topk_ids if ds.enabled and uses_topk(ds.distillation_loss.loss_mode) else None


def micro_batch_loss(dl, mb: RolloutBatch, task_loss: Tensor, lp: Tensor, student_topk: Tensor | None, old: Tensor,
                     mask: Tensor, is_weights: Tensor, counts: dict, metrics: dict, *, loss_agg_mode: str,
                     device: torch.device) -> Tensor:
    """A micro-batch's loss with the teacher's term (`total_loss`), its metrics added to `metrics`.

    `dl`: the config's distillation_loss section; lp [b, T]: the student's logprobs (with grad); student_topk [b, T, k]:
    its log-probabilities at the teacher's top-k ids (forward_kl_topk), from the same forward; `mb` holds the teacher's
    scores (host tensors; `mask` is its loss mask on the device); counts: the mini-batch's global ones (micro-batching never
    changes the gradient). Reads nothing back from the device: the metrics stay device scalars."""
    topk = uses_topk(dl.loss_mode)
    teacher_topk = to_device(mb.teacher_topk_logprobs, device) if topk else None  # [b, T, k]
    divergence = token_divergence(dl.loss_mode, logprobs=lp, teacher_logprobs=None if topk else to_device(mb.teacher_logprobs, device),
                                  student_topk_logprobs=student_topk, teacher_topk_logprobs=teacher_topk,
                                  log_prob_min_clamp=dl.log_prob_min_clamp)  # [b, T]
    positions = to_device(loss_positions(mb.loss_mask), device)  # [n] from the host's mask: no read on the device
    term, term_metrics = distillation_term(
        divergence, lp, old, mask, use_policy_gradient=dl.use_policy_gradient, loss_max_clamp=dl.loss_max_clamp,
        clip_ratio_low=dl.clip_ratio_low, clip_ratio_high=dl.clip_ratio_high, loss_agg_mode=loss_agg_mode,
        is_weights=is_weights, loss_positions=positions, **counts)
    metrics.update(term_metrics)
    if topk:
        metrics.update(topk_mass_metrics(student_topk, teacher_topk, mask, positions))
    metrics["distillation/loss"] = term.detach()  # a device scalar: read once per mini-batch (grpo_lib/model/update_metrics.py)
    return total_loss(task_loss, term, use_task_rewards=dl.use_task_rewards, distillation_loss_coef=dl.distillation_loss_coef)
