"""The policy losses of `actor.policy_loss.loss_mode`, one pure function each, registered by name (verl 0.9's set).

Each function maps the per-token tensors of one call ([batch, seq_len]: actor logprobs `lp`, old logprobs `old`,
advantages `A` broadcast per token, the loss mask `m`, the detached rollout-IS weights `w`) and the parameters
(`PolicyLossParams`, verl's field names and defaults) to the per-token loss, before aggregation, and per-token 0/1
indicators of what clipped (`pg_clipfrac`, `pg_clipfrac_lower`). `grpo_lib.algorithms.losses.policy_loss` is the one entry
point: it checks the arguments, calls the function by name, aggregates (`FORCED_AGG` in `grpo_lib/core/names.py` names the
losses whose aggregation verl fixes) and turns the indicators into masked means. Formulas, papers and the mapping to
verl's `compute_policy_loss_*`: docs/ALGORITHMS.md.

Departures from verl, on purpose (each only binds on inputs verl would overflow on, or concerns bookkeeping):

* Every log-ratio is clamped to [-20, 20] before `exp` (verl leaves it unclamped in clip_cov, kl_cov, geo_mean).
* GSPO keeps PPO's dual clip (verl's GSPO has none); with GSPO's tiny clip ranges and `clip_ratio_c = 3` it binds only
  on wild sequences.
* geo_mean's per-sequence loss is averaged over the sequences with at least one loss token of the whole mini-batch
  (verl: `torch.mean` over the rows of each micro-batch, all-masked rows included), so it is invariant under
  micro-batching like every other loss; for one micro-batch without all-masked rows the two agree.
* Metrics always hold `pg_clipfrac` and `pg_clipfrac_lower` (0 where a loss clips nothing); kl_cov's `pg_clipfrac` is
  the fraction of tokens given the KL penalty, and its `ppo_kl` is the signed mean like every loss (verl: |lp - old|).
* clip_cov and kl_cov pick their tokens among those of the call (one micro-batch), as verl does: their gradient then
  depends on the micro-batching (docs/ALGORITHMS.md). clip_cov's random pick takes `PolicyLossParams.generator`
  (None: torch's global generator, as verl).

Run the tests with ``.venv/bin/python -m pytest tests/algorithms/test_policy_losses.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # |log-ratio| bound before exp, so exp never overflows


@dataclass(frozen=True)
class PolicyLossParams:
    """Parameters of the policy losses under verl's names (`actor.*` and `actor.policy_loss.*`), verl's defaults."""

    clip_ratio_low: float = 0.2  # vanilla/gspo/cispo/geo_mean/clip_cov clip; dppo_*: the divergence threshold
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # vanilla/gspo dual clip; dppo_*: the truncated-IS cap
    tau_pos: float = 1.0  # sapo gate temperature where A > 0
    tau_neg: float = 1.05  # sapo gate temperature where A <= 0
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of the call's loss tokens detached
    clip_cov_lb: float = 1.0  # clip_cov: covariance band (lb, ub) of the candidates
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of the call's loss tokens given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: weight of that penalty |lp - old|
    dro_beta: float | None = None  # dro: quadratic log-ratio penalty, required > 0
    generator: torch.Generator | None = None  # clip_cov's random pick (None: torch's global generator)


LossFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None, PolicyLossParams], tuple[Tensor, dict[str, Tensor]]]


def _ratio(lp: Tensor, old: Tensor) -> Tensor:
    """Token ratio r = exp(clamp(lp - old, -20, 20)). [batch, seq_len]"""
    return (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _weighted(loss: Tensor, w: Tensor | None) -> Tensor:
    """The per-token loss times the (detached) rollout-IS weights, if any."""
    return loss if w is None else loss * w.detach()


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the mask's tokens (0 for an empty mask)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _no_clip(lp: Tensor) -> Tensor:
    return torch.zeros_like(lp, dtype=torch.bool)  # [batch, seq_len]


def _clipped_surrogate(ratio: Tensor, adv: Tensor, p: PolicyLossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO with dual clip: L = max(-A r, -A clip(r, 1-low, 1+high)); where A < 0, L = min(L, -A clip_ratio_c)."""
    unclipped = -adv * ratio  # [batch, seq_len]
    clipped = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)  # [batch, seq_len]
    clip_loss = torch.maximum(unclipped, clipped)  # [batch, seq_len]
    dual_bound = -adv * p.clip_ratio_c  # [batch, seq_len]
    negative_adv = adv < 0  # [batch, seq_len]
    loss = torch.where(negative_adv, torch.minimum(clip_loss, dual_bound), clip_loss)  # [batch, seq_len]
    return loss, {"pg_clipfrac": clipped > unclipped, "pg_clipfrac_lower": negative_adv & (clip_loss > dual_bound)}


def vanilla(lp, old, adv, mask, w, p):
    """PPO's clipped surrogate with dual clip on the token ratio (verl's compute_policy_loss_vanilla)."""
    loss, flags = _clipped_surrogate(_ratio(lp, old), adv, p)
    return _weighted(loss, w), flags


def gspo(lp, old, adv, mask, w, p):
    """GSPO: the sequence ratio s_i = exp(masked mean_t(lp - old)), applied per token as exp(lp - lp.detach()) *
    s_i.detach() (value s_i, gradient d s_i / d lp_t summed over the row), clipped like vanilla."""
    mask = mask.to(lp.dtype)  # [batch, seq_len]
    row_tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [batch, 1]
    seq_log_ratio = ((lp - old) * mask).sum(dim=-1, keepdim=True) / row_tokens  # [batch, 1]
    seq_log_ratio = seq_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [batch, 1]
    loss, flags = _clipped_surrogate((lp - lp.detach() + seq_log_ratio).exp(), adv, p)  # [batch, seq_len]
    return _weighted(loss, w), flags


def cispo(lp, old, adv, mask, w, p):
    """CISPO: L = -sg(clip(r, 1-low, 1+high)) * A * lp. Every token keeps its gradient A * clip(r) (REINFORCE with a
    clipped, detached IS weight). pg_clipfrac: tokens whose ratio the clip moved."""
    ratio = _ratio(lp, old)  # [batch, seq_len]
    clipped = ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)  # [batch, seq_len]
    loss = -clipped.detach() * adv * lp  # [batch, seq_len]
    return _weighted(loss, w), {"pg_clipfrac": ratio != clipped, "pg_clipfrac_lower": _no_clip(lp)}


def sapo(lp, old, adv, mask, w, p):
    """SAPO: a soft gate instead of the clip, L = -f(r) * A with f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos
    where A > 0 else tau_neg (f(1) = 2 / tau, f'(1) = 1: the PPO gradient on-policy). Aggregated seq-mean-token-mean."""
    ratio = _ratio(lp, old)  # [batch, seq_len]
    tau = torch.where(adv > 0, torch.as_tensor(p.tau_pos, dtype=adv.dtype, device=adv.device),
                      torch.as_tensor(p.tau_neg, dtype=adv.dtype, device=adv.device))  # [batch, seq_len]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [batch, seq_len]
    return _weighted(-gate * adv, w), {"pg_clipfrac": _no_clip(lp), "pg_clipfrac_lower": _no_clip(lp)}


def gpg(lp, old, adv, mask, w, p):
    """GPG: plain policy gradient L = -lp * A (no ratio, no clip)."""
    return _weighted(-lp * adv, w), {"pg_clipfrac": _no_clip(lp), "pg_clipfrac_lower": _no_clip(lp)}


def dro(lp, old, adv, mask, w, p):
    """DRO: L = -(lp * A - beta / 2 * (lp - old)^2), the policy gradient with a quadratic log-ratio penalty."""
    if p.dro_beta is None or p.dro_beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 for loss_mode dro, got {p.dro_beta}")
    loss = -(lp * adv - 0.5 * p.dro_beta * (lp - old).square())  # [batch, seq_len]
    return _weighted(loss, w), {"pg_clipfrac": _no_clip(lp), "pg_clipfrac_lower": _no_clip(lp)}


def _dppo(lp, old, adv, w, p, valid_pos: Tensor, valid_neg: Tensor):
    """DPPO's shared form: L = -A * sg(min(r, clip_ratio_c)) * lp on the tokens whose divergence from the old policy is
    inside the trust region for their advantage's sign, 0 (no gradient) on the others."""
    ratio = _ratio(lp, old)  # [batch, seq_len]
    truncated = ratio.clamp(max=p.clip_ratio_c).detach()  # [batch, seq_len]
    valid = torch.where(adv > 0, valid_pos, valid_neg).detach()  # [batch, seq_len] bool
    loss = -adv * truncated * lp * valid.to(lp.dtype)  # [batch, seq_len]
    return _weighted(loss, w), {"pg_clipfrac": ~valid, "pg_clipfrac_lower": (ratio > p.clip_ratio_c) & valid}


def dppo_tv(lp, old, adv, mask, w, p):
    """DPPO-Binary-TV: a token counts if its probability moved by at most clip_ratio_high up (A > 0) or
    clip_ratio_low down (A <= 0): pi - pi_old <= high, resp. pi - pi_old >= -low."""
    diff = lp.exp() - old.exp()  # [batch, seq_len]
    return _dppo(lp, old, adv, w, p, diff <= p.clip_ratio_high, diff >= -p.clip_ratio_low)


def dppo_kl(lp, old, adv, mask, w, p):
    """DPPO-Binary-KL: the KL between Bernoulli(pi_old) and Bernoulli(pi) of the sampled token,
    kl = pi_old (old - lp) + (1 - pi_old) log((1 - pi_old + 1e-8) / (1 - pi + 1e-8)); a token counts if kl <= high or
    its probability moved against the advantage (A > 0: pi <= pi_old), resp. kl <= low or pi >= pi_old."""
    prob, old_prob = lp.exp(), old.exp()  # [batch, seq_len]
    kl = old_prob * (old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return _dppo(lp, old, adv, w, p, (kl <= p.clip_ratio_high) | (prob <= old_prob), (kl <= p.clip_ratio_low) | (prob >= old_prob))


def _token_covariance(lp: Tensor, adv: Tensor, valid: Tensor) -> Tensor:
    """(A - mean A) * (lp - mean lp) per token, the means over the call's loss tokens (detached). [batch, seq_len]"""
    mask = valid.to(lp.dtype)
    return (adv - _masked_mean(adv, mask)) * (lp.detach() - _masked_mean(lp.detach(), mask))


def clip_cov(lp, old, adv, mask, w, p):
    """Clip-Cov: PPO's clip (no dual clip), and a random clip_cov_ratio of the call's loss tokens (at least 1) among
    those not clipped whose covariance lies in (clip_cov_lb, clip_cov_ub) lose their loss and gradient.
    pg_clipfrac: the fraction so detached."""
    valid = mask > 0  # [batch, seq_len]
    ratio = _ratio(lp, old)  # [batch, seq_len]
    unclipped = -adv * ratio  # [batch, seq_len]
    clipped = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)  # [batch, seq_len]
    cov = _token_covariance(lp, adv, valid)  # [batch, seq_len]
    candidates = valid & ~(clipped > unclipped) & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)  # [batch, seq_len]
    index = torch.nonzero(candidates)  # [K, 2]
    count = max(int(p.clip_cov_ratio * int(valid.sum())), 1)
    pick = index[torch.randperm(len(index), generator=p.generator)[:count].to(index.device)]  # [<= count, 2]
    keep = torch.ones_like(lp)  # [batch, seq_len]
    keep[pick[:, 0], pick[:, 1]] = 0.0
    loss = torch.maximum(unclipped, clipped) * keep  # [batch, seq_len]
    return _weighted(loss, w), {"pg_clipfrac": keep == 0, "pg_clipfrac_lower": _no_clip(lp)}


def kl_cov(lp, old, adv, mask, w, p):
    """KL-Cov: the unclipped surrogate -A r, plus ppo_kl_coef * |lp - old| on the kl_cov_ratio of the call's loss
    tokens (at least 1) with the largest covariance. pg_clipfrac: the fraction so penalised."""
    valid = mask > 0  # [batch, seq_len]
    loss = -adv * _ratio(lp, old)  # [batch, seq_len]
    num_valid = int(valid.sum())
    penalised = torch.zeros_like(valid)  # [batch, seq_len]
    if num_valid > 0:
        cov = _token_covariance(lp, adv, valid)[valid]  # [num_valid]
        top = torch.topk(cov, max(1, int(num_valid * p.kl_cov_ratio)), largest=True).indices  # [k]
        flat = penalised.view(-1)
        flat[torch.nonzero(valid.view(-1), as_tuple=True)[0][top]] = True
    loss = torch.where(penalised, loss + p.ppo_kl_coef * (lp - old).abs(), loss)  # [batch, seq_len]
    return _weighted(loss, w), {"pg_clipfrac": penalised, "pg_clipfrac_lower": _no_clip(lp)}


def geo_mean(lp, old, adv, mask, w, p):
    """GMPO: one ratio per sequence, the geometric mean of its token ratios each clipped on its advantage's side,
    R_i = exp(mean_t sgn(A) min(sgn(A) x_t, sgn(A) clip(x_t, -low, high))) with x_t = lp - old, and the loss
    -mean_t(A) * R_i per sequence (sequence-level advantages), set on every loss token of the row so that the forced
    seq-mean-token-mean gives the mean over sequences. IS weights enter as their geometric mean per sequence."""
    m = mask.to(lp.dtype)  # [batch, seq_len]
    row_tokens = m.sum(dim=-1).clamp(min=1)  # [batch]
    x = lp - old  # [batch, seq_len]
    sign = torch.sign(adv)  # [batch, seq_len]
    x_clip = x.clamp(-p.clip_ratio_low, p.clip_ratio_high)  # [batch, seq_len]
    x_kept = sign * torch.minimum(sign * x, sign * x_clip)  # [batch, seq_len]
    seq_log_ratio = ((x_kept * m).sum(dim=-1) / row_tokens).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [batch]
    seq_adv = (adv * m).sum(dim=-1) / row_tokens  # [batch]
    seq_loss = -seq_adv * seq_log_ratio.exp()  # [batch]
    if w is not None:
        seq_loss = seq_loss * ((torch.log(w.detach() + 1e-10) * m).sum(dim=-1) / row_tokens).exp()  # [batch]
    clipped = x != x_clip  # [batch, seq_len]
    flags = {"pg_clipfrac": clipped & (adv > 0), "pg_clipfrac_lower": clipped & (adv < 0)}
    return seq_loss[:, None].expand_as(lp), flags  # [batch, seq_len]


POLICY_LOSSES: dict[str, LossFn] = {
    "vanilla": vanilla, "gspo": gspo, "cispo": cispo, "sapo": sapo, "geo_mean": geo_mean, "clip_cov": clip_cov,
    "kl_cov": kl_cov, "dppo_tv": dppo_tv, "dppo_kl": dppo_kl, "gpg": gpg, "dro": dro,
}
