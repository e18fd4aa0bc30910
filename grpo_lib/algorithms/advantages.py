"""Advantage estimators (``algorithm.adv_estimator``) as pure tensor functions behind one registry.

Every estimator takes the step's token rewards and loss mask (``EstimatorInputs``) and returns one advantage per
token, [batch, seq_len], zero wherever the loss mask is 0. Estimators of one value per response (grpo, rloo, opo, gpg,
grpo_passk) compute it from the response's score (the sum of its token rewards) and broadcast it over the loss
tokens; the others (reinforce_plus_plus, reinforce_plus_plus_baseline, remax) work on tokens: returns summed backwards
along the row, whitening over every loss token of the batch. The trainer calls ``token_advantages`` and never branches
on the name. Formulas, papers and the mapping to verl's ``core_algos.py`` functions: docs/ALGORITHMS.md.

Statistics over the *whole batch* (the whitening of reinforce++, GPG's alpha) go through ``batch_sum``, a function
that sums a small tensor over the data-parallel processes (the trainer passes an all-reduce; the default is the
identity), so 2 processes give the advantages of 1. Group statistics need no communication: a group never straddles
processes.

Departures from verl, on purpose (each in docs/ALGORITHMS.md):

* A group of one response has no baseline: its advantage is exactly 0 (verl passes its raw score through; pass@k
  raises). A group whose scores are all equal gets exactly 0 before any whitening.
* Returns (reinforce_plus_plus, remax) run across the holes of a multi-turn row (a tool's output: loss mask 0): the
  reward at the end of the episode reaches the assistant tokens of every turn, the discount counts the loss tokens
  only (one step per sampled token), and a reward sitting on a hole is added undiscounted to the loss token before
  it. verl resets its running return at every position of mask 0, which cuts earlier turns off the final reward.
  Single-turn rows are unchanged.
* OPO's length weights count loss tokens (verl counts its response mask, which is the same in verl's multi-turn).

Run the tests with ``.venv/bin/python -m pytest tests/algorithms/test_advantages.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_lib.core import names

WHITEN_EPS = 1e-8  # verl's masked_whiten: added to the token count and to the variance


def _local_sum(x: Tensor) -> Tensor:
    """One process: the batch is this tensor's batch."""
    return x


@dataclass(frozen=True)
class Groups:
    """Group statistics of the per-response scores, one entry per row (the row's group's value)."""

    index: Tensor  # [B] long, dense group of each row, 0..G-1
    num_groups: int
    count: Tensor  # [B] responses in the row's group
    mean: Tensor  # [B] group mean of the scores
    std: Tensor  # [B] group std, unbiased (Bessel)
    no_signal: Tensor  # [B] bool, the group has one response or all its scores are equal


@dataclass(frozen=True)
class EstimatorInputs:
    """What every estimator receives; each reads the fields it needs."""

    token_rewards: Tensor  # [B, T] float, the score on each response's last token (minus KL on loss tokens if in reward)
    mask: Tensor  # [B, T] float, the loss mask (holes allowed)
    scores: Tensor  # [B] token_rewards summed over the row
    groups: Groups
    norm_by_std: bool  # algorithm.norm_adv_by_std_in_grpo
    eps: float  # added to group stds
    gamma: float  # algorithm.gamma, discount per loss token (reinforce_plus_plus)
    reward_baselines: Tensor | None  # [B] float, the greedy response's score of each row's prompt (remax)
    batch_sum: Callable[[Tensor], Tensor]  # sums a tensor over the processes


def _group_index(group_ids: Sequence[Hashable] | Tensor, device: torch.device) -> tuple[Tensor, int]:
    """Map arbitrary group labels to dense ints 0..G-1. ['b', 'a', 'b'] -> ([0, 1, 0], 2)."""
    if isinstance(group_ids, Tensor):
        _, index = torch.unique(group_ids, return_inverse=True)  # [N]
        return index.to(device), int(index.max().item()) + 1 if index.numel() else 0
    label_to_int: dict[Hashable, int] = {}
    ints = [label_to_int.setdefault(label, len(label_to_int)) for label in group_ids]
    return torch.tensor(ints, dtype=torch.long, device=device), len(label_to_int)  # [N]


def group_stats(scores: Tensor, group_ids: Sequence[Hashable] | Tensor) -> Groups:
    """Per-row count, mean, unbiased std and no-signal flag of the row's group. Example: scores [1, 0, 3], groups
    ['a', 'a', 'b'] -> count [2, 2, 1], mean [0.5, 0.5, 3], std [0.7071, 0.7071, 0], no_signal [F, F, T]."""
    index, num_groups = _group_index(group_ids, scores.device)  # [B]
    if index.shape != scores.shape:
        raise ValueError(f"group_ids has {index.numel()} labels but scores has {scores.numel()} entries")
    zeros = scores.new_zeros(num_groups)  # [G]
    count_g = zeros.index_add(0, index, torch.ones_like(scores))  # [G]
    mean_g = zeros.index_add(0, index, scores) / count_g.clamp(min=1)  # [G]
    sq_dev_g = zeros.index_add(0, index, (scores - mean_g[index]) ** 2)  # [G]
    std_g = (sq_dev_g / (count_g - 1).clamp(min=1)).sqrt()  # [G]
    max_g = zeros.scatter_reduce(0, index, scores, reduce="amax", include_self=False)  # [G]
    min_g = zeros.scatter_reduce(0, index, scores, reduce="amin", include_self=False)  # [G]
    no_signal_g = (count_g < 2) | (max_g == min_g)  # [G]
    return Groups(index=index, num_groups=num_groups, count=count_g[index], mean=mean_g[index], std=std_g[index],
                  no_signal=no_signal_g[index])


def _silenced(adv: Tensor, groups: Groups) -> Tensor:
    """Exactly 0 for rows of singleton or all-equal groups (so float rounding of a mean cannot leak through)."""
    return torch.where(groups.no_signal, torch.zeros_like(adv), adv)  # [B]


def masked_whiten(values: Tensor, mask: Tensor, batch_sum: Callable[[Tensor], Tensor] = _local_sum) -> Tensor:
    """verl's masked_whiten over every mask-1 token of the batch (all processes): (v - mean) / sqrt(var + 1e-8), with
    mean = sum(m v) / (N + 1e-8), var = sum(m (v - mean)^2) / (N + 1e-8) x N / (N - 1) (Bessel; 1 when N <= 1, where
    verl raises). Example: v [[1, 3, 9]], m [[1, 1, 0]] -> mean 2, var 2, [[-0.7071, 0.7071, 4.9497]]."""
    n_and_sum = batch_sum(torch.stack([mask.sum(), (values * mask).sum()]))  # [2]
    n = n_and_sum[0]
    mean = n_and_sum[1] / (n + WHITEN_EPS)
    var = batch_sum((((values - mean) ** 2) * mask).sum()[None])[0] / (n + WHITEN_EPS)
    bessel = n / (n - 1) if n > 1 else torch.ones_like(n)
    return (values - mean) * torch.rsqrt(var * bessel + WHITEN_EPS)  # same shape as values


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + (rewards on the holes up to the next loss token) + gamma * G_next-loss-token, for every loss token.

    The discount counts loss tokens only: a hole (mask 0: a tool's output, padding) neither discounts nor resets the
    running return, and a reward on a hole joins the loss token before it undiscounted; holes themselves get 0.
    Single-turn rows get verl's REINFORCE++ returns.
    Example: gamma 0.5, rewards [[0, 0, 0, 0, 1]], mask [[1, 1, 0, 0, 1]] -> loss tokens 0, 1, 4 get [0.25, 0.5, _, _, 1].
    """
    returns = torch.zeros_like(token_rewards)  # [B, T]
    future = token_rewards.new_zeros(token_rewards.shape[0])  # [B] return of the next loss token
    pending = token_rewards.new_zeros(token_rewards.shape[0])  # [B] rewards on the holes after this position
    for t in reversed(range(token_rewards.shape[1])):
        is_loss = mask[:, t] > 0  # [B]
        at_loss = token_rewards[:, t] + pending + gamma * future  # [B]
        pending = torch.where(is_loss, torch.zeros_like(pending), pending + token_rewards[:, t])  # [B]
        future = torch.where(is_loss, at_loss, future)  # [B]
        returns[:, t] = torch.where(is_loss, at_loss, torch.zeros_like(at_loss))  # [B]
    return returns


# --------------------------------------------------------------------------- the estimators


def _grpo(x: EstimatorInputs) -> Tensor:
    """GRPO: (s - mean_g) / (std_g + eps); Dr. GRPO (norm_by_std=False): s - mean_g."""
    g = x.groups
    centered = x.scores - g.mean  # [B]
    adv = centered / (g.std + x.eps) if x.norm_by_std else centered  # [B]
    return _silenced(adv, g)[:, None] * x.mask  # [B, T]


def _rloo(x: EstimatorInputs) -> Tensor:
    """RLOO: s_i - mean of the other n-1 scores = n/(n-1) * (s_i - mean_g). Ignores norm_by_std."""
    g = x.groups
    adv = g.count / (g.count - 1).clamp(min=1) * (x.scores - g.mean)  # [B]
    return _silenced(adv, g)[:, None] * x.mask  # [B, T]


def _grpo_passk(x: EstimatorInputs) -> Tensor:
    """Pass@k: only the best response of each group (the first if tied) gets (max_g - second max_g), divided by
    (std_g + eps) with norm_by_std; every other response gets 0."""
    g = x.groups
    rows = torch.arange(x.scores.shape[0], device=x.scores.device)  # [B]
    zeros = x.scores.new_zeros(g.num_groups)  # [G]
    max_g = zeros.scatter_reduce(0, g.index, x.scores, reduce="amax", include_self=False)  # [G]
    is_max = x.scores == max_g[g.index]  # [B]
    first_g = torch.full((g.num_groups,), x.scores.shape[0], dtype=torch.long, device=x.scores.device)  # [G]
    first_g = first_g.scatter_reduce(0, g.index, torch.where(is_max, rows, x.scores.shape[0]), reduce="amin")  # [G]
    best = rows == first_g[g.index]  # [B] one row per group
    others = torch.where(best, torch.full_like(x.scores, float("-inf")), x.scores)  # [B]
    second_g = torch.full_like(zeros, float("-inf")).scatter_reduce(0, g.index, others, reduce="amax")  # [G]
    gap = x.scores - second_g[g.index]  # [B] meaningful on the best rows (-inf second max only in singletons)
    gap = gap / (g.std + x.eps) if x.norm_by_std else gap  # [B]
    adv = torch.where(best & ~g.no_signal, gap, torch.zeros_like(gap))  # [B]
    return adv[:, None] * x.mask  # [B, T]


def _opo(x: EstimatorInputs) -> Tensor:
    """OPO: s_i - b_g with the length-weighted baseline b_g = sum_j L_j s_j / sum_j L_j (L: loss tokens)."""
    g = x.groups
    lengths = x.mask.sum(dim=-1)  # [B]
    zeros = x.scores.new_zeros(g.num_groups)  # [G]
    weighted_g = zeros.index_add(0, g.index, lengths * x.scores)  # [G]
    length_g = zeros.index_add(0, g.index, lengths)  # [G]
    baseline = (weighted_g / length_g.clamp(min=1))[g.index]  # [B]; a group without loss tokens trains nothing
    return _silenced(x.scores - baseline, g)[:, None] * x.mask  # [B, T]


def _gpg(x: EstimatorInputs) -> Tensor:
    """GPG: alpha * (s - mean_g), alpha = (responses in the batch) / (responses with a non-zero score), f_norm = 1."""
    g = x.groups
    counts = x.batch_sum(torch.stack([x.scores.new_tensor(float(x.scores.shape[0])),
                                      (x.scores != 0).sum().to(x.scores.dtype)]))  # [2] over all processes
    alpha = counts[0] / counts[1].clamp(min=1)
    return _silenced(alpha * (x.scores - g.mean), g)[:, None] * x.mask  # [B, T]


def _reinforce_plus_plus(x: EstimatorInputs) -> Tensor:
    """REINFORCE++: discounted returns per token (gamma per loss token), whitened over the batch's loss tokens."""
    returns = discounted_returns(x.token_rewards, x.mask, x.gamma)  # [B, T]
    return masked_whiten(returns, x.mask, x.batch_sum) * x.mask  # [B, T]


def _reinforce_plus_plus_baseline(x: EstimatorInputs) -> Tensor:
    """REINFORCE++-baseline: s - mean_g on every loss token, whitened over the batch's loss tokens."""
    centered = _silenced(x.scores - x.groups.mean, x.groups)[:, None] * x.mask  # [B, T]
    return masked_whiten(centered, x.mask, x.batch_sum) * x.mask  # [B, T]


def _remax(x: EstimatorInputs) -> Tensor:
    """ReMax: undiscounted return-to-go per token minus the greedy response's score of the row's prompt."""
    if x.reward_baselines is None:
        raise ValueError("adv_estimator 'remax' needs reward_baselines: the score of one greedy response per prompt, "
                         "one value per row (the trainer generates it; see docs/ALGORITHMS.md)")
    if x.reward_baselines.shape != x.scores.shape:
        raise ValueError(f"reward_baselines has shape {tuple(x.reward_baselines.shape)}, need one per row "
                         f"{tuple(x.scores.shape)}")
    returns = discounted_returns(x.token_rewards, x.mask, 1.0)  # [B, T]
    return (returns - x.reward_baselines.to(returns.dtype)[:, None]) * x.mask  # [B, T]


ADV_ESTIMATORS: dict[str, Callable[[EstimatorInputs], Tensor]] = {
    "grpo": _grpo, "rloo": _rloo, "grpo_passk": _grpo_passk, "opo": _opo, "gpg": _gpg,
    "reinforce_plus_plus": _reinforce_plus_plus, "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
    "remax": _remax,
}
ADV_ESTIMATORS.update({alias: ADV_ESTIMATORS[target] for alias, target in names.ADV_ESTIMATOR_ALIASES.items()})


def token_advantages(token_rewards: Tensor, mask: Tensor, group_ids: Sequence[Hashable] | Tensor, *,
                     estimator: str = "grpo", norm_by_std: bool = True, eps: float = 1e-6, gamma: float = 1.0,
                     reward_baselines: Tensor | None = None,
                     batch_sum: Callable[[Tensor], Tensor] = _local_sum) -> Tensor:
    """Advantages [B, T] of ``estimator`` (see ADV_ESTIMATORS), 0 where ``mask`` is 0.

    ``token_rewards`` [B, T] (the response's score on its last token; the in-reward KL on loss tokens), ``mask`` the
    loss mask [B, T], ``group_ids`` B labels (any hashables or an integer tensor; rows of one prompt share one).
    ``reward_baselines`` [B]: remax's greedy score of each row's prompt. ``batch_sum``: sums over processes.
    Example (grpo): one group, scores [1, 0], masks [[1, 1], [1, 0]] -> [[0.7071, 0.7071], [-0.7071, 0]] (+-0.5 /
    (std 0.7071 + 1e-6)).
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {estimator!r}; supported: {', '.join(ADV_ESTIMATORS)}")
    token_rewards = torch.as_tensor(token_rewards)
    if not token_rewards.is_floating_point():
        token_rewards = token_rewards.to(torch.get_default_dtype())
    if token_rewards.dim() != 2 or token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards and mask must be the same [batch, seq_len] shape, got "
                         f"{tuple(token_rewards.shape)} and {tuple(mask.shape)}")
    mask = mask.to(token_rewards.dtype)  # [B, T]
    scores = token_rewards.sum(dim=-1)  # [B]
    inputs = EstimatorInputs(token_rewards=token_rewards, mask=mask, scores=scores, groups=group_stats(scores, group_ids),
                             norm_by_std=norm_by_std, eps=eps, gamma=gamma, reward_baselines=reward_baselines,
                             batch_sum=batch_sum)
    return ADV_ESTIMATORS[estimator](inputs)  # [B, T]


def compute_advantages(scores: Tensor | Sequence[float], group_ids: Sequence[Hashable] | Tensor, *,
                       estimator: str = "grpo", norm_by_std: bool = True, eps: float = 1e-6, **kwargs) -> Tensor:
    """One advantage per response: ``token_advantages`` with each response one loss token holding its score.

    Exact for the per-response estimators (grpo, rloo, grpo_passk, gpg); for the length-aware ones (opo, the
    whitening of reinforce++) every response then weighs one token: the trainer uses ``token_advantages``.
    ``scores`` is 1-D (list or tensor). Singleton groups and groups of equal scores get exactly 0. Std is unbiased.
    Example: scores [1, 0, 0, 1], one group -> mean 0.5, std sqrt(1/3), A = +-0.5 / (0.57735 + eps).
    """
    scores = torch.as_tensor(scores)
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D, got shape {tuple(scores.shape)}")
    rewards = scores[:, None]  # [B, 1]
    return token_advantages(rewards, torch.ones(rewards.shape, dtype=rewards.dtype if rewards.is_floating_point()
                                                else torch.get_default_dtype()),
                            group_ids, estimator=estimator, norm_by_std=norm_by_std, eps=eps, **kwargs)[:, 0]  # [B]


# The config checks names against grpo_lib/core/names.py without importing torch: the registry must hold exactly those.
assert tuple(ADV_ESTIMATORS) == names.ADV_ESTIMATORS, f"ADV_ESTIMATORS {tuple(ADV_ESTIMATORS)} != names.ADV_ESTIMATORS"
