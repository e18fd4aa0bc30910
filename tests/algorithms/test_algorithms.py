"""Tests for grpo_lib.algorithms: hand-computed values (derivation in comments) plus one property test
that micro-batching with global counts never changes the loss or its gradient."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lib.algorithms import (
    ADV_ESTIMATORS,
    KL_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_MODES,
    aggregate_loss,
    compute_advantages,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    rollout_is_weights,
)

F64 = torch.float64
EPS = 1e-6


def t(values, **kwargs):
    """float64 tensor shorthand."""
    return torch.tensor(values, dtype=F64, **kwargs)


# ----------------------------------------------------------------------------- registries


def test_registries_list_expected_names():
    assert {"grpo", "rloo"} <= set(ADV_ESTIMATORS)  # the others: tests/algorithms/test_advantages.py
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv",
                                  "dppo_kl", "gpg", "dro"}  # verl 0.9's registry less bypass_mode (refused in config)
    assert set(LOSS_AGG_MODES) == {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                   "seq-mean-token-sum-norm"}
    assert set(ROLLOUT_IS_MODES) == {"none", "token", "sequence"}
    for base in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"):
        assert base in KL_TYPES and base + "+" in KL_TYPES
    assert "full" not in KL_TYPES


# ----------------------------------------------------------------------------- advantages


def test_grpo_bessel_std_one_group():
    # [1, 0, 0, 1]: mean 0.5; unbiased var = 4 * 0.25 / (4 - 1) = 1/3; std = sqrt(1/3) = 0.57735
    # A = (s - 0.5) / (sqrt(1/3) + eps) = +-0.5 / 0.57735 = +-0.866
    adv = compute_advantages(t([1.0, 0.0, 0.0, 1.0]), [0, 0, 0, 0])
    std = math.sqrt(1 / 3)
    expected = t([0.5, -0.5, -0.5, 0.5]) / (std + EPS)
    torch.testing.assert_close(adv, expected)
    assert adv.dtype == F64


def test_grpo_string_labels_singleton_and_all_equal():
    # group a = [1, 2, 3]: mean 2, std sqrt((1 + 0 + 1) / 2) = 1 -> A = [-1, 0, 1] / (1 + eps)
    # group b = [5, 5]: all equal -> exactly 0; group c = [7]: singleton -> exactly 0
    adv = compute_advantages(t([1.0, 2.0, 3.0, 5.0, 5.0, 7.0]), ["a", "a", "a", "b", "b", "c"])
    expected = t([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / t([1 + EPS] * 3 + [1.0] * 3)
    torch.testing.assert_close(adv, expected)
    assert (adv[3:] == 0).all()


def test_grpo_int_tensor_labels_interleaved():
    # group 3 = [0, 2]: mean 1, std sqrt((1 + 1) / 1) = sqrt(2) -> A = -+1 / (sqrt(2) + eps)
    # group 7 = [1, 5]: mean 3, std sqrt((4 + 4) / 1) = 2 sqrt(2) -> A = -+2 / (2 sqrt(2) + eps)
    adv = compute_advantages(t([0.0, 1.0, 2.0, 5.0]), torch.tensor([3, 7, 3, 7]))
    r2 = math.sqrt(2)
    expected = t([-1 / (r2 + EPS), -2 / (2 * r2 + EPS), 1 / (r2 + EPS), 2 / (2 * r2 + EPS)])
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_no_std_normalisation():
    # norm_by_std=False: A = s - mean_g. [1, 2, 3] -> [-1, 0, 1]; [1, 0, 0, 1] -> +-0.5; [4] -> 0
    adv = compute_advantages([1.0, 2.0, 3.0, 1.0, 0.0, 0.0, 1.0, 4.0], [0, 0, 0, 1, 1, 1, 1, 2],
                             norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.5, -0.5, -0.5, 0.5, 0.0]))


def test_rloo_leave_one_out_baseline():
    # [1, 2, 6]: 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5
    # [3, 3]: all equal -> 0; [9]: singleton -> 0. norm_by_std is ignored by rloo.
    for norm in (True, False):
        adv = compute_advantages(t([1.0, 2.0, 6.0, 3.0, 3.0, 9.0]), ["p", "p", "p", "q", "q", "r"],
                                 estimator="rloo", norm_by_std=norm)
        torch.testing.assert_close(adv, t([-3.0, -1.5, 4.5, 0.0, 0.0, 0.0]))


# the estimators of one value per response from group statistics (whitening and remax's returns: test_advantages.py)
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "grpo_passk", "opo", "gpg", "grpo_vectorized", "rloo_vectorized"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_all_equal_group_is_exactly_zero_despite_rounding(estimator, dtype):
    # 0.1 is not representable: the float mean of [0.1]*3 may differ from 0.1 by one ulp; A must be 0.
    adv = compute_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7], dtype=dtype), [1, 1, 1, 2],
                             estimator=estimator)
    assert (adv == 0).all()


def test_int_scores_are_promoted_to_float():
    # [0, 1] one group: mean 0.5, std sqrt(0.5) -> A = -+0.5 / sqrt(0.5) = -+0.7071
    adv = compute_advantages(torch.tensor([0, 1]), ["g", "g"])
    assert adv.is_floating_point()
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + EPS))


def test_advantages_vectorised_matches_per_group_loop():
    gen = torch.Generator().manual_seed(0)
    num_groups, n = 500, 8
    scores = torch.randint(0, 3, (num_groups * n,), generator=gen).to(F64)  # many all-equal groups
    group_ids = torch.randperm(num_groups * n, generator=gen) % num_groups
    adv = compute_advantages(scores, group_ids)
    for g in range(0, num_groups, 37):
        members = group_ids == g
        s = scores[members]
        expected = torch.zeros_like(s) if s.max() == s.min() else (s - s.mean()) / (s.std() + EPS)
        torch.testing.assert_close(adv[members], expected)


def test_advantages_errors():
    with pytest.raises(ValueError, match="grpo, rloo, grpo_passk"):
        compute_advantages([1.0, 2.0], [0, 0], estimator="gae")
    with pytest.raises(ValueError, match="labels"):
        compute_advantages([1.0, 2.0], [0])


# ----------------------------------------------------------------------------- KL estimators

# lp - ref = d = [0.5, -1.0, 0.0]
LP, REF = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5]
D = [0.5, -1.0, 0.0]
# k3: x = ref - lp = -d = [-0.5, 1, 0]; value exp(x) - x - 1; d/dlp = -(exp(x) - 1) = 1 - exp(ref - lp)
K3_VALUE = [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]
K3_GRAD = [1 - math.exp(-0.5), 1 - math.e, 0.0]
KL_EXPECTED = {  # name: (value, d value / d lp)
    "kl": (D, [1.0, 1.0, 1.0]),
    "k1": (D, [1.0, 1.0, 1.0]),
    "abs": ([0.5, 1.0, 0.0], [1.0, -1.0, 0.0]),  # sign(d); torch's abs gradient at 0 is 0
    "mse": ([0.125, 0.5, 0.0], D),  # 0.5 d^2, gradient d
    "k2": ([0.125, 0.5, 0.0], D),
    "low_var_kl": (K3_VALUE, K3_GRAD),
    "k3": (K3_VALUE, K3_GRAD),
}


def _kl_value_and_grad(kl_type, lp=LP, ref=REF):
    logprobs = t(lp, requires_grad=True)
    value = kl_penalty(logprobs, t(ref), kl_type)
    (grad,) = torch.autograd.grad(value.sum(), logprobs)
    return value.detach(), grad


@pytest.mark.parametrize("kl_type", sorted(KL_EXPECTED))
def test_kl_base_value_and_gradient(kl_type):
    value, grad = _kl_value_and_grad(kl_type)
    torch.testing.assert_close(value, t(KL_EXPECTED[kl_type][0]))
    torch.testing.assert_close(grad, t(KL_EXPECTED[kl_type][1]))


@pytest.mark.parametrize("kl_type", sorted(KL_EXPECTED))
def test_kl_straight_through_plus_forms(kl_type):
    # value of the base estimator, gradient of k2 (= d = lp - ref)
    value, grad = _kl_value_and_grad(kl_type + "+")
    torch.testing.assert_close(value, t(KL_EXPECTED[kl_type][0]))
    torch.testing.assert_close(grad, t(D))


def test_k3_clamps():
    # lp=0, ref=-30: x = clamp(-30) = -20 -> exp(-20) + 20 - 1 = 19.0 -> clamped to 10, zero gradient
    # lp=0, ref=5:   x = 5 -> e^5 - 6 = 142.4 -> clamped to 10
    value, grad = _kl_value_and_grad("k3", lp=[0.0, 0.0], ref=[-30.0, 5.0])
    torch.testing.assert_close(value, t([10.0, 10.0]))
    torch.testing.assert_close(grad, t([0.0, 0.0]))


def test_kl_full_and_unknown_raise():
    with pytest.raises(ValueError, match="not supported.*low_var_kl"):
        kl_penalty(t(LP), t(REF), "full")
    with pytest.raises(ValueError, match="unknown kl_type 'k4'.*k3\\+"):
        kl_penalty(t(LP), t(REF), "k4")


# ----------------------------------------------------------------------------- aggregation

VALUES = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
MASK = [[1, 1, 0, 0], [1, 1, 1, 0]]


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token-mean", {}, 21 / 5),  # (1+2 + 5+6+7) / 5 valid tokens
    ("token-mean", {"num_tokens": 10}, 21 / 10),  # global count from the whole mini-batch
    ("token-sum", {}, 21),  # 1+2 + 5+6+7, no denominator
    ("token-sum", {"num_tokens": 10, "num_seqs": 3}, 21),  # counts never enter it
    ("seq-mean-token-sum", {}, (3 + 18) / 2),  # row sums 3 and 18, 2 sequences
    ("seq-mean-token-sum", {"num_seqs": 3}, 21 / 3),
    ("seq-mean-token-mean", {}, (3 / 2 + 18 / 3) / 2),  # row means 1.5 and 6 -> 3.75
    ("seq-mean-token-sum-norm", {}, 21 / (2 * 4)),  # loss_scale_factor defaults to seq_len = 4
    ("seq-mean-token-sum-norm", {"loss_scale_factor": 7}, 21 / (2 * 7)),
])
def test_aggregate_modes(mode, kwargs, expected):
    loss = aggregate_loss(t(VALUES), torch.tensor(MASK), mode, **kwargs)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_zero_mask_rows(mode):
    # An all-padding row contributes 0 and is not counted in the default num_seqs: same as without it.
    with_pad = aggregate_loss(t(VALUES + [[9.0] * 4]), torch.tensor(MASK + [[0] * 4]), mode)
    without = aggregate_loss(t(VALUES), torch.tensor(MASK), mode)
    assert with_pad.item() == pytest.approx(without.item(), abs=1e-12)
    # A fully masked batch gives 0, not NaN.
    assert aggregate_loss(t(VALUES), torch.zeros(2, 4), mode).item() == 0.0


def test_aggregate_seed_example_token_weights():
    # Two responses of 10 and 90 tokens, padded to 90. d loss / d v_t is the weight of token t.
    # seq-mean-token-mean: 1/2 * 1/10 = 0.05 (short), 1/2 * 1/90 = 1/180 (long); token-mean: 1/100.
    mask = torch.zeros(2, 90)
    mask[0, :10] = 1
    mask[1, :] = 1
    for mode, short_w, long_w in [("seq-mean-token-mean", 0.05, 1 / 180), ("token-mean", 0.01, 0.01)]:
        values = torch.zeros(2, 90, dtype=F64, requires_grad=True)
        (grad,) = torch.autograd.grad(aggregate_loss(values, mask, mode), values)
        torch.testing.assert_close(grad[0, :10], torch.full((10,), short_w, dtype=F64))
        torch.testing.assert_close(grad[0, 10:], torch.zeros(80, dtype=F64))
        torch.testing.assert_close(grad[1], torch.full((90,), long_w, dtype=F64))


# A loss mask with holes (a multi-turn row: tool output inside the response) and a row masked whole (a masked
# truncation). The positions with mask 0 must act as if they were absent: row 0 keeps [1, 3, 4] (sum 8, 3 tokens),
# row 1 keeps [6] (sum 6, 1 token), row 2 keeps nothing and is no sequence. Hand values:
#   token-mean              (8 + 6) / 4 tokens            = 3.5
#   token-sum               8 + 6                         = 14
#   seq-mean-token-sum      (8 + 6) / 2 sequences         = 7
#   seq-mean-token-mean     (8/3 + 6/1) / 2               = 13/3 (row lengths are loss tokens: 3 and 1)
#   seq-mean-token-sum-norm (8 + 6) / (2 * 4)             = 1.75 (the scale is a constant, 4 = seq_len, not a row length)
HOLED_VALUES = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]]
HOLED_MASK = [[1, 0, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]]
DROPPED_VALUES, DROPPED_MASK = [[1.0, 3.0, 4.0], [6.0, 0.0, 0.0]], [[1, 1, 1], [1, 0, 0]]  # the holes simply left out


@pytest.mark.parametrize("mode, expected", [("token-mean", 3.5), ("token-sum", 14.0), ("seq-mean-token-sum", 7.0),
                                            ("seq-mean-token-mean", 13 / 3), ("seq-mean-token-sum-norm", 1.75)])
def test_aggregate_mask_with_holes_is_the_rows_without_them(mode, expected):
    values = t(HOLED_VALUES).requires_grad_()
    loss = aggregate_loss(values, torch.tensor(HOLED_MASK), mode)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    dropped = aggregate_loss(t(DROPPED_VALUES), torch.tensor(DROPPED_MASK), mode, loss_scale_factor=4)
    assert dropped.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, values)
    assert bool((grad[torch.tensor(HOLED_MASK) == 0] == 0).all()), "a hole gets no gradient"


def test_policy_losses_and_is_weights_skip_holes():
    # One row of 4 tokens, position 1 a hole whose log-ratio (5) and IS log-ratio (10) would show if they leaked.
    # GSPO: kept log-ratios [0.1, -0.3, 0.2] -> mean 0, s = 1, loss = -A = -2 (a leak: mean 1.25, s clipped to 1.2).
    # IS sequence: kept old - rollout [log 3, 0, log 0.5] -> exp(log 1.5) = 1.5 (a leak: exp(10.4) capped to 2).
    mask = torch.tensor([[1, 0, 1, 1]])
    old, rollout = t([[-1.0, -1.0, -1.0, -1.0]]), t([[-1.0 - math.log(3.0), -11.0, -1.0, -1.0 - math.log(0.5)]])
    lp = (old + t([[0.1, 5.0, -0.3, 0.2]])).requires_grad_()
    adv = t([[2.0, 2.0, 2.0, 2.0]])
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-2.0, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0, 1].item() == 0.0, "a hole gets no gradient"
    kept = torch.tensor([0, 2, 3])
    for mode in ("token", "sequence"):
        w = rollout_is_weights(old, rollout, mask, mode=mode, cap=2.0)
        w_dropped = rollout_is_weights(old[:, kept], rollout[:, kept], torch.ones(1, 3), mode=mode, cap=2.0)
        torch.testing.assert_close(w[:, kept], w_dropped)
        assert w[0, 1].item() == 1.0, "a hole holds the neutral weight"
    assert rollout_is_weights(old, rollout, mask, mode="sequence", cap=2.0)[0, 0].item() == pytest.approx(1.5, abs=1e-12)


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        aggregate_loss(t(VALUES), torch.tensor(MASK), "mean")


# ----------------------------------------------------------------------------- vanilla policy loss


def _one_token(ratio, advantage, **kwargs):
    """Loss, d loss / d lp and metrics for one token with lp = log(ratio), old = 0."""
    lp = t([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(lp, t([[0.0]]), t([[advantage]]), torch.ones(1, 1), **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad.item(), metrics


# d(-A r)/d lp = -A r (since dr/dlp = r); a clipped or dual-clipped branch is constant: gradient 0.
# Columns: ratio, A, expected loss, expected gradient, pg_clipfrac, pg_clipfrac_lower.
@pytest.mark.parametrize("ratio, adv, loss, grad, clipfrac, clipfrac_lower", [
    (1.1, 1.0, -1.1, -1.1, 0.0, 0.0),  # A>0 inside [0.8, 1.2]: max(-1.1, -1.1)
    (1.5, 1.0, -1.2, 0.0, 1.0, 0.0),  # A>0 above 1.2: max(-1.5, -1.2) = -1.2, clipped
    (0.5, 1.0, -0.5, -0.5, 0.0, 0.0),  # A>0 below 0.8: max(-0.5, -0.8) = -0.5, unclipped
    (0.9, -1.0, 0.9, 0.9, 0.0, 0.0),  # A<0 inside: max(0.9, 0.9)
    (0.5, -1.0, 0.8, 0.0, 1.0, 0.0),  # A<0 below 0.8: max(0.5, 0.8) = 0.8, clipped
    (5.0, -1.0, 3.0, 0.0, 0.0, 1.0),  # A<0 far above: max(5, 1.2) = 5 -> dual min(5, 3) = 3
    (2.0, -1.0, 2.0, 2.0, 0.0, 0.0),  # A<0 above 1.2 but 2 < 3: dual clip inactive
    (5.0, -2.0, 6.0, 0.0, 0.0, 1.0),  # dual bound scales with A: -A * c = 2 * 3 = 6 < 10
])
def test_vanilla_clip_branches(ratio, adv, loss, grad, clipfrac, clipfrac_lower):
    got_loss, got_grad, metrics = _one_token(ratio, adv)
    assert got_loss == pytest.approx(loss, abs=1e-12)
    assert got_grad == pytest.approx(grad, abs=1e-12)
    assert metrics["pg_clipfrac"] == clipfrac
    assert metrics["pg_clipfrac_lower"] == clipfrac_lower
    assert metrics["ppo_kl"] == pytest.approx(-math.log(ratio))  # old - lp = -log r


def test_vanilla_clip_higher():
    # DAPO clip-higher: low 0.2, high 0.28 -> range [0.8, 1.28].
    # A>0, r=1.25: inside the raised upper bound -> -1.25 with gradient -1.25 (symmetric 0.2 clips it).
    assert _one_token(1.25, 1.0, clip_ratio_high=0.28)[:2] == pytest.approx((-1.25, -1.25))
    assert _one_token(1.25, 1.0)[:2] == pytest.approx((-1.2, 0.0))
    # A<0, r=0.79: lower bound still 0.8 -> max(0.79, 0.8) = 0.8, clipped.
    assert _one_token(0.79, -1.0, clip_ratio_high=0.28)[:2] == pytest.approx((0.8, 0.0))


def test_vanilla_metrics_masked():
    # tokens: (A=1, r=1.5) upper clip; (A=-1, r=5) dual clip; (A=1, r=1) nothing; (masked, A=1, r=2).
    # pg_clipfrac = 1/3 (only token 0: for token 1 the clip branch 1.2 < 5 does not bind);
    # pg_clipfrac_lower = 1/3; ppo_kl = mean(old - lp) = -(log 1.5 + log 5 + 0) / 3.
    lp = t([[math.log(1.5), math.log(5.0), 0.0, math.log(2.0)]])
    _, metrics = policy_loss(lp, torch.zeros_like(lp), t([[1.0, -1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert metrics["ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(5.0)) / 3)
    # device scalars without grad, read by nobody here (the trainer adds them up on the device, update_metrics)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_ratio_one_gives_minus_mean_advantage():
    # lp == old -> r = 1 -> L = -A per token; token-mean -> -sum(A m) / sum(m); d/dlp = -A m / sum(m)
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(3, 5, dtype=F64, generator=gen).requires_grad_()
    adv = torch.randn(3, 5, dtype=F64, generator=gen)
    mask = (torch.rand(3, 5, generator=gen) > 0.3).to(F64)
    loss, metrics = policy_loss(lp, lp.detach().clone(), adv, mask)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(loss, -(adv * mask).sum() / mask.sum())
    torch.testing.assert_close(grad, -adv * mask / mask.sum())
    assert metrics == {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}


def test_is_weights_multiply_token_loss():
    # r = 1, A = 1 -> L = -1 per token; weights [0.5, 2] -> token-mean -(0.5 + 2) / 2 = -1.25
    lp = t([[0.0, 0.0]], requires_grad=True)
    loss, _ = policy_loss(lp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), torch.ones(1, 2), is_weights=t([[0.5, 2.0]]))
    assert loss.item() == pytest.approx(-1.25)


def test_policy_loss_errors():
    args = (t([[0.0]]), t([[0.0]]), t([[1.0]]), torch.ones(1, 1))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(*args, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="gspo, vanilla|vanilla, gspo"):
        policy_loss(*args, loss_mode="ppo2")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(*args, loss_agg_mode="sum")


# ----------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_value_and_gradient():
    # row 0: lp - old = [0.1, -0.3, (masked 5.0)] -> mean -0.1 -> s0 = e^-0.1 = 0.905, A = +1
    # row 1: lp - old = [0.2, 0.1, 0.0]           -> mean  0.1 -> s1 = e^0.1 = 1.105,  A = -1
    # both inside [0.8, 1.2]; every token of row i has ratio s_i, so seq-mean-token-mean gives
    # loss = (-A0 s0 - A1 s1) / 2 = (-e^-0.1 + e^0.1) / 2; each token gets the sequence-level gradient
    # d(-A_i s_i / 2)/d lp_t = -A_i s_i / (2 L_i): row 0 -> -e^-0.1 / 4, row 1 -> +e^0.1 / 6.
    old = t([[0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    lp = (old + t([[0.1, -0.3, 5.0], [0.2, 0.1, 0.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = t([[1.0] * 3, [-1.0] * 3])
    loss, metrics = policy_loss(lp, old, adv, mask, loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    s0, s1 = math.exp(-0.1), math.exp(0.1)
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-12)
    torch.testing.assert_close(grad, t([[-s0 / 4, -s0 / 4, 0.0], [s1 / 6, s1 / 6, s1 / 6]]))
    # Same gradient by autograd through the true sequence ratio.
    lp_ref = lp.detach().clone().requires_grad_()
    m = mask.to(F64)
    seq_ratio = (((lp_ref - old) * m).sum(-1) / m.sum(-1)).exp()  # [batch]
    (grad_ref,) = torch.autograd.grad((-adv[:, 0] * seq_ratio).sum() / 2, lp_ref)
    torch.testing.assert_close(grad, grad_ref)
    assert metrics["pg_clipfrac"] == 0.0


@pytest.mark.parametrize("agg, denominator", [("token-mean", 5.0), ("seq-mean-token-sum", 2.0)])
def test_gspo_aggregates_with_the_configured_mode_as_verl_0_9_1(agg, denominator):
    # verl 0.9.1's compute_policy_loss_gspo aggregates with loss_agg_mode (earlier verl forced seq-mean-token-mean).
    # The rows of test_gspo_sequence_ratio_value_and_gradient: every loss token of row i has value -A_i s_i and, the
    # sequence ratio being detached (exp(lp - sg(lp)) * sg(s_i)), gradient -A_i s_i w.r.t. its own lp_t only.
    # token-mean over the 5 loss tokens: loss = (-2 s0 + 3 s1) / 5, grad -A_i s_i / 5;
    # seq-mean-token-sum over the 2 rows:  loss = (-2 s0 + 3 s1) / 2, grad -A_i s_i / 2.
    old = t([[0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    lp = (old + t([[0.1, -0.3, 5.0], [0.2, 0.1, 0.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = t([[1.0] * 3, [-1.0] * 3])
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode="gspo", loss_agg_mode=agg)
    (grad,) = torch.autograd.grad(loss, lp)
    s0, s1 = math.exp(-0.1), math.exp(0.1)
    assert loss.item() == pytest.approx((-2 * s0 + 3 * s1) / denominator, abs=1e-12)
    torch.testing.assert_close(grad, t([[-s0, -s0, 0.0], [s1, s1, s1]]) / denominator)


def test_gspo_clips_whole_sequence():
    # row mean log-ratio 0.5 -> s = e^0.5 = 1.65 > 1.2 with A = +1: every token clipped to -1.2, grad 0
    lp = t([[0.4, 0.6]], requires_grad=True)
    loss, metrics = policy_loss(lp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), torch.ones(1, 2), loss_mode="gspo",
                                loss_agg_mode="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(-1.2)
    torch.testing.assert_close(grad, t([[0.0, 0.0]]))
    assert metrics["pg_clipfrac"] == 1.0


def test_gspo_equals_vanilla_for_one_token_sequences():
    # With one token per row the sequence ratio is the token ratio.
    gen = torch.Generator().manual_seed(2)
    lp, old, adv = (torch.randn(6, 1, dtype=F64, generator=gen) for _ in range(3))
    mask = torch.ones(6, 1)
    vanilla, vanilla_metrics = policy_loss(lp, old, adv, mask, loss_mode="vanilla")
    gspo, gspo_metrics = policy_loss(lp, old, adv, mask, loss_mode="gspo")
    torch.testing.assert_close(gspo, vanilla)
    assert {k: float(v) for k, v in gspo_metrics.items()} == pytest.approx({k: float(v) for k, v in vanilla_metrics.items()})


# ----------------------------------------------------------------------------- entropy


def test_entropy_from_logits():
    # uniform over 2 -> log 2; uniform over 4 -> log 4; shift invariant; huge logits stay finite
    torch.testing.assert_close(entropy_from_logits(t([[0.0, 0.0], [5.0, 5.0]])), t([math.log(2)] * 2))
    torch.testing.assert_close(entropy_from_logits(t([1.0, 1.0, 1.0, 1.0])), t(math.log(4)))
    assert entropy_from_logits(t([1000.0, 0.0])).item() == pytest.approx(0.0, abs=1e-12)
    logits = torch.randn(2, 3, 7, dtype=F64, generator=torch.Generator().manual_seed(3))
    probs = logits.softmax(-1)
    entropy = entropy_from_logits(logits)
    assert entropy.shape == (2, 3)
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum(-1))


# ----------------------------------------------------------------------------- rollout IS weights


def test_rollout_is_weights_token_and_sequence():
    # old - rollout = [0, log 3, log 0.5, (masked) 10]
    # token, cap 2: [e^0, min(3, 2), 0.5, masked -> 1] = [1, 2, 0.5, 1]
    # sequence: exp(0 + log 3 + log 0.5) = 1.5 on valid tokens (cap 2), 1.2 with cap 1.2; masked -> 1
    rollout = t([[-1.0, -2.0, -0.5, -3.0]])
    old = (rollout + t([[0.0, math.log(3.0), math.log(0.5), 10.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]])
    token = rollout_is_weights(old, rollout, mask, mode="token", cap=2.0)
    torch.testing.assert_close(token, t([[1.0, 2.0, 0.5, 1.0]]))
    assert not token.requires_grad
    seq = rollout_is_weights(old, rollout, mask, mode="sequence", cap=2.0)
    torch.testing.assert_close(seq, t([[1.5, 1.5, 1.5, 1.0]]))
    seq_capped = rollout_is_weights(old, rollout, mask, mode="sequence", cap=1.2)
    torch.testing.assert_close(seq_capped, t([[1.2, 1.2, 1.2, 1.0]]))
    torch.testing.assert_close(rollout_is_weights(old, rollout, mask, mode="none", cap=2.0), torch.ones_like(old))


def test_rollout_is_weights_clamp_and_errors():
    # log-ratio -100 is clamped to -20 before exp: weight exp(-20), not 0
    w = rollout_is_weights(t([[-100.0]]), t([[0.0]]), torch.ones(1, 1), mode="token", cap=2.0)
    assert w.item() == pytest.approx(math.exp(-20))
    with pytest.raises(ValueError, match="none, token, sequence"):
        rollout_is_weights(t([[0.0]]), t([[0.0]]), torch.ones(1, 1), mode="seq", cap=2.0)
    with pytest.raises(ValueError, match="cap"):
        rollout_is_weights(t([[0.0]]), t([[0.0]]), torch.ones(1, 1), mode="token", cap=0.0)


# ----------------------------------------------------------------------------- micro-batch additivity


def _losses(kind, lp, old, ref, adv, mask, is_w, mode, counts):
    """The loss of one (micro-)batch for each kind of loss the trainer aggregates."""
    if kind == "kl":
        return aggregate_loss(kl_penalty(lp, ref, "k3+"), mask, mode, **counts)
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode=kind, clip_ratio_high=0.28, loss_agg_mode=mode,
                          is_weights=is_w, **counts)
    return loss


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 6), seq_len=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       num_micro=st.integers(1, 4), holes=st.booleans(), data=st.data())
def test_micro_batches_with_global_counts_sum_to_whole_batch(batch, seq_len, seed, num_micro, holes, data):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(batch, seq_len, dtype=F64, generator=gen) - 1  # [batch, seq_len]
    lp = (old + 0.3 * torch.randn(batch, seq_len, dtype=F64, generator=gen)).requires_grad_()
    ref = old + 0.3 * torch.randn(batch, seq_len, dtype=F64, generator=gen)
    adv = torch.randn(batch, 1, dtype=F64, generator=gen).expand(batch, seq_len)  # per-sequence, broadcast
    is_w = rollout_is_weights(old, old + 0.1 * torch.randn(batch, seq_len, dtype=F64, generator=gen),
                              torch.ones(batch, seq_len), mode="token", cap=2.0)
    lengths = torch.randint(0, seq_len + 1, (batch,), generator=gen)  # 0 -> an all-padding row
    mask = (torch.arange(seq_len) < lengths[:, None]).to(F64)  # [batch, seq_len]
    if holes:  # loss-mask holes inside the responses (about a third of the positions; a row may lose all of them)
        mask = mask * (torch.rand(batch, seq_len, dtype=F64, generator=gen) > 1 / 3)  # [batch, seq_len]
    parts = data.draw(st.lists(st.integers(0, num_micro - 1), min_size=batch, max_size=batch))
    global_counts = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum()}
    for kind in ("vanilla", "gspo", "kl"):
        for mode in LOSS_AGG_MODES:
            whole = _losses(kind, lp, old, ref, adv, mask, is_w, mode, {})  # defaults = whole-batch counts
            (whole_grad,) = torch.autograd.grad(whole, lp)
            total, total_grad = torch.zeros((), dtype=F64), torch.zeros_like(lp)
            for part in set(parts):
                rows = torch.tensor([i for i, p in enumerate(parts) if p == part])
                micro = _losses(kind, lp[rows], old[rows], ref[rows], adv[rows], mask[rows], is_w[rows],
                                mode, global_counts)
                total = total + micro.detach()
                total_grad += torch.autograd.grad(micro, lp)[0]
            torch.testing.assert_close(total, whole.detach(), atol=1e-6, rtol=0, msg=f"{kind} {mode}")
            torch.testing.assert_close(total_grad, whole_grad, atol=1e-6, rtol=0, msg=f"{kind} {mode}")
