"""GRPO math as pure tensor functions: KL estimators, loss aggregation, the policy-loss entry point (advantages:
grpo_lib/algorithms/advantages.py, losses: grpo_lib/algorithms/policy_losses.py).

Everything here is torch-only and stateless; the training loop picks behaviour by *name* through the
small registries below (``ADV_ESTIMATORS``, re-exported from ``grpo_lib.algorithms.advantages``, ``KL_TYPES``, ``LOSS_AGG_MODES``, ``POLICY_LOSSES``,
``ROLLOUT_IS_MODES``) and never branches on a loss name itself. An unknown name raises ``ValueError``
listing the supported names. Their names are also in ``grpo_lib/core/names.py`` (torch-free, for config validation); an
assert at the end of this module keeps the two equal. Formulas follow docs/ALGORITHMS.md (DeepSeekMath GRPO, Dr. GRPO,
DAPO, GSPO, verl's ``core_algos.py``).

Departures from the papers / verl, on purpose:

* A group of one response gets advantage exactly 0 (verl passes its raw score through). A group whose
  scores are all equal also gets exactly 0 (forced, so float rounding of the mean cannot leak through).
* The policy losses themselves live in ``grpo_lib/algorithms/policy_losses.py`` (their departures are listed there);
  ``policy_loss`` here is their one entry point.
* The sequence log-ratio in rollout IS weights is clamped to [-20, 20] before ``exp``.
* Counts used as denominators are clamped to at least 1, so an all-masked batch gives loss 0, not NaN.
* ``num_seqs`` defaults to the number of rows with at least one valid token (all-padding rows, e.g.
  dummy rows used to even out data-parallel shards, do not count).
* Rollout IS weights hold 1.0 (the neutral multiplier) at masked positions, like ``mode="none"``.
* ``policy_loss`` metrics are local to the tensors passed in (one micro-batch), not global, and stay 0-dim tensors on
  their device (nothing here reads a value back: the trainer adds them up on the device, ``grpo_lib/model/update_metrics.py``).

Run the tests with ``.venv/bin/python -m pytest tests/algorithms/test_algorithms.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from grpo_lib.core import names
from grpo_lib.algorithms.advantages import ADV_ESTIMATORS, compute_advantages, token_advantages  # noqa: F401 (re-exported)
from grpo_lib.algorithms.policy_losses import LOG_RATIO_CLAMP, POLICY_LOSSES, PolicyLossParams


def _check_name(kind: str, name: str, supported: Sequence[str]) -> None:
    """Raise ValueError naming the supported names if ``name`` is not one of them."""
    if name not in supported:
        raise ValueError(f"unknown {kind} {name!r}; supported: {', '.join(supported)}")


# --------------------------------------------------------------------------- KL estimators


def overlong_penalty(response_lengths: Tensor, *, max_resp_len: int, buffer_len: int, penalty_factor: float) -> Tensor:
    """DAPO's soft overlong punishment (verl's DAPO reward manager), added to each response's score.

    expected = max_resp_len - buffer_len; penalty = min(-(length - expected) / buffer_len * penalty_factor, 0): 0 up to
    `expected` tokens, then linear down to -penalty_factor at max_resp_len.
    Example: max_resp_len 20, buffer_len 4, factor 1, lengths [15, 17, 20] -> [0, -0.25, -1.0].
    """
    assert buffer_len > 0, f"the overlong buffer must be > 0 tokens, got {buffer_len}"
    exceed = response_lengths.float() - (max_resp_len - buffer_len)  # [B]
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)  # [B]


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1: lp - ref (unbiased KL estimate, high variance, can be negative)."""
    return logprobs - ref_logprobs


def _abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """abs: |lp - ref|."""
    return (logprobs - ref_logprobs).abs()


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 / mse: 0.5 * (lp - ref)^2; its gradient is the unbiased gradient of KL."""
    return 0.5 * (logprobs - ref_logprobs).square()


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 / low_var_kl: x = clamp(ref - lp, -20, 20); clamp(exp(x) - x - 1, -10, 10)."""
    x = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (x.exp() - x - 1).clamp(-10.0, 10.0)


_KL_BASE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3,
}
# Every accepted name: base estimators plus their straight-through "+" forms.
KL_TYPES: tuple[str, ...] = tuple(_KL_BASE) + tuple(f"{name}+" for name in _KL_BASE)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str) -> Tensor:
    """Elementwise KL estimate between actor and reference logprobs of the sampled tokens.

    ``name+`` forms: value of ``name``, gradient of k2 (``k2 - k2.detach() + value.detach()``).
    ``full`` (needs full-vocabulary distributions) is not supported.
    """
    if kl_type == "full":
        raise ValueError(f"kl_type 'full' is not supported; supported: {', '.join(KL_TYPES)}")
    _check_name("kl_type", kl_type, KL_TYPES)
    value = _KL_BASE[kl_type.rstrip("+")](logprobs, ref_logprobs)  # same shape as logprobs
    if not kl_type.endswith("+"):
        return value
    k2 = _k2(logprobs, ref_logprobs)  # same shape as logprobs
    return k2 - k2.detach() + value.detach()


# --------------------------------------------------------------------------- aggregation

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
)


def _at_least_one(count: Tensor | float) -> Tensor | float:
    """Clamp a denominator count to >= 1 (an empty batch then gives 0, not NaN)."""
    return count.clamp(min=1) if isinstance(count, Tensor) else max(float(count), 1.0)


def aggregate_loss(values: Tensor, mask: Tensor, mode: str, *, num_tokens: Tensor | float | None = None,
                   num_seqs: Tensor | float | None = None,
                   loss_scale_factor: float | None = None) -> Tensor:
    """Reduce per-token ``values`` [batch, seq_len] to a scalar with ``mode`` (see LOSS_AGG_MODES).

    ``mask`` is the loss mask (the trainer passes ``RolloutBatch.loss_mask``); it may have holes: a position
    with mask 0 adds nothing and is counted nowhere, exactly as if it were absent from its row.
    ``num_tokens`` / ``num_seqs`` are the counts of the whole mini-batch (all micro-batches, all
    processes); pass them when aggregating a micro-batch so micro-batch losses sum to the mini-batch
    loss. Defaults: this tensor's ``mask.sum()`` and its number of rows with any valid token.
    ``loss_scale_factor`` defaults to ``mask.shape[-1]``; pass ``data.max_response_length`` explicitly
    when micro-batches are padded to different lengths, or they will not add up.
    ``token-sum`` is the plain masked sum (no count: it adds up over micro-batches and, times the world size, over
    processes, as verl's ``masked_sum * dp_size``).
    Example (token weights): rows of 10 and 90 valid tokens -> token-mean 0.01 each; token-sum 1 each;
    seq-mean-token-mean 0.05 for the short row's tokens and 1/180 for the long row's.
    """
    _check_name("loss_agg_mode", mode, LOSS_AGG_MODES)
    mask = mask.to(values.dtype)  # [batch, seq_len]
    masked_values = values * mask  # [batch, seq_len]
    if mode == "token-mean":
        total_tokens = mask.sum() if num_tokens is None else num_tokens
        return masked_values.sum() / _at_least_one(total_tokens)
    if mode == "token-sum":  # no denominator: micro-batch sums add up to the mini-batch's (verl 0.9)
        return masked_values.sum()
    row_sums = masked_values.sum(dim=-1)  # [batch]
    total_seqs = (mask.sum(dim=-1) > 0).sum() if num_seqs is None else num_seqs
    if mode == "seq-mean-token-sum":
        return row_sums.sum() / _at_least_one(total_seqs)
    if mode == "seq-mean-token-mean":
        row_means = row_sums / mask.sum(dim=-1).clamp(min=1)  # [batch]; all-padding row -> 0
        return row_means.sum() / _at_least_one(total_seqs)
    # a constant (data.max_response_length in the trainer), not a per-row length: holes do not change it
    scale = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    if scale <= 0:
        raise ValueError(f"loss_scale_factor must be > 0, got {scale}")
    return row_sums.sum() / (_at_least_one(total_seqs) * scale)  # seq-mean-token-sum-norm


# --------------------------------------------------------------------------- policy losses


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                loss_mode: str = "vanilla", clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                num_tokens: Tensor | float | None = None, num_seqs: Tensor | float | None = None,
                loss_scale_factor: float | None = None, is_weights: Tensor | None = None,
                **params) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss ``loss_mode`` (grpo_lib/algorithms/policy_losses.py, docs/ALGORITHMS.md), aggregated, and its metrics.

    All tensors are [batch, seq_len]; ``advantages`` is already broadcast per token. ``params`` are the other
    parameters under verl's names and defaults (``tau_pos``, ``tau_neg``, ``clip_cov_ratio``, ``clip_cov_lb``,
    ``clip_cov_ub``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``dro_beta``; ``generator`` for clip_cov's random pick: see
    ``policy_losses.PolicyLossParams``). ``vanilla`` per token: L = max(-A*r, -A*clip(r, 1-low, 1+high)); where A < 0,
    L = min(L, -A*clip_ratio_c). ``is_weights`` (detached) multiply L before ``aggregate_loss``, which uses
    ``loss_agg_mode`` except for the losses of ``names.FORCED_AGG`` (sapo, geo_mean: seq-mean-token-mean, as
    verl). Metrics (0-dim tensors without grad on the inputs' device, never read here: masked means over this call's
    valid tokens): ``pg_clipfrac`` (the loss's clip binding), ``pg_clipfrac_lower`` (dual clip / the lower side
    binding), ``ppo_kl`` (mean of old - lp).
    Example: lp == old, vanilla, token-mean -> r = 1 everywhere and loss = -mean(A over valid tokens).
    """
    _check_name("loss_mode", loss_mode, tuple(POLICY_LOSSES))
    _check_name("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip lower bound), got {clip_ratio_c}")
    if not (0.0 <= clip_ratio_low < 1.0 and clip_ratio_high >= 0.0):
        raise ValueError(f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
                         f"got low={clip_ratio_low}, high={clip_ratio_high}")
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
                         f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}")
    unknown = sorted(set(params) - set(PolicyLossParams.__dataclass_fields__))
    if unknown:
        raise TypeError(f"policy_loss got unknown parameters {unknown}; known: {sorted(PolicyLossParams.__dataclass_fields__)}")
    p = PolicyLossParams(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, **params)
    token_loss, flags = POLICY_LOSSES[loss_mode](logprobs, old_logprobs, advantages, mask, is_weights, p)  # [batch, seq_len]
    loss = aggregate_loss(token_loss, mask, names.FORCED_AGG.get(loss_mode, loss_agg_mode), num_tokens=num_tokens,
                          num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        valid = mask.to(logprobs.dtype)  # [batch, seq_len]
        denom = valid.sum().clamp(min=1)

        def masked_mean(x: Tensor) -> Tensor:
            return (x.to(valid.dtype) * valid).sum() / denom  # [] on the device: no read back

        metrics = {name: masked_mean(flag) for name, flag in flags.items()}
        metrics["ppo_kl"] = masked_mean(old_logprobs - logprobs)
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy per position over the last dim: logsumexp(z) - sum(softmax(z) * z). Logits must be
    finite. Example: logits [0, 0] -> log(2)."""
    probs = torch.softmax(logits, dim=-1)  # [..., vocab]
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)  # [...]


# --------------------------------------------------------------------------- rollout correction

ROLLOUT_IS_MODES: tuple[str, ...] = ("none", "token", "sequence")


def rollout_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, mode: str,
                       cap: float) -> Tensor:
    """Truncated importance weights correcting trainer/vLLM logprob mismatch, detached, [batch, seq_len].

    ``token``: min(exp(old - rollout), cap) per token; ``sequence``: min(exp(sum_t m*(old - rollout)),
    cap) broadcast over the row; ``none``: ones. Log-ratios are clamped to [-20, 20] before exp.
    Masked positions hold 1.0. Example (token, cap 2): old - rollout = [0, log 3] -> [1, 2].
    """
    _check_name("rollout_correction mode", mode, ROLLOUT_IS_MODES)
    if cap <= 0:
        raise ValueError(f"rollout IS cap must be > 0, got {cap}")
    with torch.no_grad():
        ones = torch.ones_like(old_logprobs)  # [batch, seq_len]
        if mode == "none":
            return ones
        valid = mask.bool()  # [batch, seq_len]
        log_ratio = torch.where(valid, old_logprobs - rollout_logprobs, 0.0)  # [batch, seq_len]
        if mode == "sequence":
            log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)  # [batch, seq_len]
        weights = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap)  # [batch, seq_len]
        return torch.where(valid, weights, ones)  # [batch, seq_len]


def decoupled_weights(is_weights: Tensor, proximal_logprobs: Tensor, behaviour_logprobs: Tensor, stale: Tensor, *,
                      cap: float) -> Tensor:
    """Decoupled PPO's behaviour weight (AReaL) on the tokens of older weights, detached, [batch, seq_len]: where `stale`,
    min(exp(proximal - behaviour), cap) (the log-ratio clamped to [-20, 20]); elsewhere `is_weights` unchanged (the
    token's sampling and proximal policies are the same weights: only the rollout correction's engine/trainer mismatch
    is left, handled by `rollout_is_weights`). No stale token: `is_weights` itself, bit for bit.
    Example (cap 2): is_weights [1, 1], proximal - behaviour [log 3, log 3], stale [False, True] -> [1, 2]."""
    if cap <= 0:
        raise ValueError(f"behaviour weight cap must be > 0, got {cap}")
    with torch.no_grad():
        log_ratio = (proximal_logprobs - behaviour_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [batch, seq_len]
        return torch.where(stale, log_ratio.exp().clamp(max=cap), is_weights)  # [batch, seq_len]


# The config checks names against grpo_lib/core/names.py without importing torch: the registries must hold exactly those.
assert KL_TYPES == names.KL_TYPES, f"KL_TYPES {KL_TYPES} != names.KL_TYPES {names.KL_TYPES}"
assert LOSS_AGG_MODES == names.LOSS_AGG_MODES, f"LOSS_AGG_MODES {LOSS_AGG_MODES} != names.LOSS_AGG_MODES"
assert tuple(POLICY_LOSSES) == names.POLICY_LOSS_MODES, f"POLICY_LOSSES {tuple(POLICY_LOSSES)} != names.POLICY_LOSS_MODES"
assert ROLLOUT_IS_MODES == names.ROLLOUT_IS_MODES, f"ROLLOUT_IS_MODES {ROLLOUT_IS_MODES} != names.ROLLOUT_IS_MODES"
