"""verl 0.9's policy losses (grpo_lib/algorithms/policy_losses.py) through the one entry point `algorithms.policy_loss`: each against
values computed by hand (derivation in the comment), its gradient by gradcheck in float64, its metrics, its
aggregation (forced where verl forces it), and micro-batch additivity with global counts. The Actor-level invariance
suites (tests/model/test_grad_invariance.py, tests/model/test_multiprocess.py) run every loss too (grad_case.LOSS_OVERRIDES).
Run: `.venv/bin/python -m pytest tests/algorithms/test_policy_losses.py`.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lib.algorithms import LOSS_AGG_MODES, POLICY_LOSSES, policy_loss
from grpo_lib.core import names

F64 = torch.float64
# float64 arithmetic on O(1) values: a few ulps (2.2e-16 each) per operation; 1e-12 is far above and far below any
# formula error (a wrong term moves the values below by > 1e-3).
ABS = 1e-12


def t(values, **kwargs) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, **kwargs)


def loss_and_grad(lp_values, old, adv, mask=None, **kwargs):
    """(loss, d loss / d lp, metrics) of policy_loss on float64 inputs."""
    lp = t(lp_values).requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.long) if mask is None else torch.tensor(mask)
    loss, metrics = policy_loss(lp, t(old), t(adv), mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad, metrics


def test_registry_matches_names_and_verl():
    # verl 0.9's registry: these 11 plus bypass_mode, which config validation refuses with its reason
    assert tuple(POLICY_LOSSES) == names.POLICY_LOSS_MODES
    assert set(POLICY_LOSSES) | set(names.REFUSED_POLICY_LOSS_MODES) == {
        "vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "gpg", "dro", "bypass_mode"}
    with pytest.raises(ValueError, match="unknown loss_mode 'bypass_mode'; supported: vanilla, gspo, cispo"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), torch.ones(1, 1), loss_mode="bypass_mode")
    with pytest.raises(TypeError, match="unknown parameters \\['tau'\\]"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), torch.ones(1, 1), loss_mode="sapo", tau=1.0)


def test_cispo_clipped_detached_weight():
    # old = 0, lp = [0.5, -0.5, 0.1], A = [1, -1, 2], clip [0.8, 1.2]: r = [e^.5, e^-.5, e^.1] -> clip(r) = [1.2, 0.8, e^.1]
    # (the first two clipped). L_t = -sg(clip r) A lp: [-1.2*0.5, -0.8*(-1)*(-0.5), -e^.1*2*0.1] = [-0.6, -0.4, -0.2e^.1];
    # token-mean / 3. The weight is detached, so d L_t / d lp_t = -clip(r) A / 3 = [-0.4, 0.8/3, -2e^.1/3].
    loss, grad, metrics = loss_and_grad([[0.5, -0.5, 0.1]], [[0.0, 0.0, 0.0]], [[1.0, -1.0, 2.0]], loss_mode="cispo")
    e = math.exp(0.1)
    assert loss == pytest.approx((-0.6 - 0.4 - 0.2 * e) / 3, abs=ABS)
    torch.testing.assert_close(grad, t([[-0.4, 0.8 / 3, -2 * e / 3]]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3) and metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == pytest.approx(-0.1 / 3, abs=ABS)  # mean(old - lp)


def test_sapo_soft_gate_and_forced_seq_mean():
    # Row 0: one token, lp = old (r = 1), A = +1, tau_pos = 1: gate f = sigmoid(0) * 4 / 1 = 2, L = -2;
    #   f'(r) = 4 s (1 - s) with s = sigmoid(tau (r - 1)): f'(1) = 1, d L / d lp = -A f'(r) r = -1.
    # Row 1: two tokens, r = 2 (lp - old = ln 2), A = -1, tau_neg = 1.05: s = sigmoid(1.05), f = 4 s / 1.05, L = +f each;
    #   d L / d lp = -A f'(r) r = 4 s (1 - s) * 2.
    # seq-mean-token-mean (forced, whatever loss_agg_mode): loss = (-2 + f) / 2; row 0's gradient / 2, row 1's / (2 * 2).
    s = 1 / (1 + math.exp(-1.05))
    f = 4 * s / 1.05
    args = ([[0.0, 0.0], [math.log(2.0), math.log(2.0)]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [-1.0, -1.0]], [[1, 0], [1, 1]])
    for mode in ("token-mean", "token-sum", "seq-mean-token-mean"):
        loss, grad, metrics = loss_and_grad(*args, loss_mode="sapo", loss_agg_mode=mode)
        assert loss == pytest.approx((-2 + f) / 2, abs=ABS), mode
        torch.testing.assert_close(grad, t([[-0.5, 0.0], [8 * s * (1 - s) / 4] * 2]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.0
    assert names.FORCED_AGG["sapo"] == "seq-mean-token-mean"


def test_geo_mean_clipped_geometric_mean_per_sequence():
    # clip range (-0.2, 0.2) on x = lp - old (old = 0), kept per token x' = sgn(A) min(sgn(A) x, sgn(A) clip(x)):
    # Row 0, A = +1: x = [0.3, -0.1, 0.05] -> x' = [0.2 (clipped), -0.1, 0.05], mean 0.05, R0 = e^0.05, loss0 = -e^0.05;
    #   d loss0 / d x = -R0 / 3 on the unclipped tokens, 0 on the clipped one.
    # Row 1, A = -1: x = [-0.3, 0.1] -> x' = [-0.2 (clipped), 0.1], mean -0.05, R1 = e^-0.05, loss1 = +e^-0.05;
    #   d loss1 / d x = +R1 / 2 on the unclipped token.
    # Mean over the 2 sequences: loss = (-e^0.05 + e^-0.05) / 2, gradients halved. Clipped: one token with A > 0
    # (pg_clipfrac 1/5), one with A < 0 (pg_clipfrac_lower 1/5).
    lp = [[0.3, -0.1, 0.05], [-0.3, 0.1, 0.0]]
    adv = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    r0, r1 = math.exp(0.05), math.exp(-0.05)
    for mode in ("token-mean", "seq-mean-token-sum"):  # forced: the mean over sequences either way
        loss, grad, metrics = loss_and_grad(lp, [[0.0] * 3] * 2, adv, mask, loss_mode="geo_mean", loss_agg_mode=mode)
        assert loss == pytest.approx((-r0 + r1) / 2, abs=ABS)
        torch.testing.assert_close(grad, t([[0.0, -r0 / 6, -r0 / 6], [0.0, r1 / 4, 0.0]]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 5) and metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)


def test_geo_mean_is_weights_enter_as_their_geometric_mean():
    # One row, lp = old, A = 1: R = 1; token IS weights [4, 1/4, 1] -> geometric mean (4 * 1/4 * 1)^(1/3) = 1 -> loss -1;
    # weights [2, 2, 2] -> 2 -> loss -2.
    for w, expected in (([[4.0, 0.25, 1.0]], -1.0), ([[2.0, 2.0, 2.0]], -2.0)):
        loss, _ = policy_loss(t([[0.0] * 3]), t([[0.0] * 3]), t([[1.0] * 3]), torch.ones(1, 3), loss_mode="geo_mean",
                              is_weights=t(w))
        assert loss.item() == pytest.approx(expected, abs=1e-9)  # the 1e-10 inside verl's log: 1e-10 relative


# clip_cov / kl_cov case: one row of 4 tokens, A = [2, -2, 0, 0] (mean 0), lp = [-1, -2.5, -2.25, -2.25] (mean -2):
# covariance (A - mean A)(lp - mean lp) = [2*1, -2*(-0.5), 0, 0] = [2, 1, 0, 0]; lp - old = d = [0.1, -0.2, 0, 0].
COV_LP, COV_ADV, COV_D = [[-1.0, -2.5, -2.25, -2.25]], [[2.0, -2.0, 0.0, 0.0]], [0.1, -0.2, 0.0, 0.0]
COV_OLD = [[lp - d for lp, d in zip(COV_LP[0], COV_D)]]


def test_clip_cov_detaches_the_picked_token():
    # Candidates: not PPO-clipped (r = e^0.1, e^-0.2 inside [0.8, 1.2]) and covariance in (1, 5): token 0 only (token
    # 1's covariance 1 is not > 1). Count max(int(0.0002 * 4), 1) = 1: token 0 loses its loss and gradient.
    # Loss (token-mean): (0 + 2 e^-0.2 + 0 + 0) / 4; gradient of token 1: -A r / 4 = 2 e^-0.2 / 4; pg_clipfrac 1/4.
    loss, grad, metrics = loss_and_grad(COV_LP, COV_OLD, COV_ADV, loss_mode="clip_cov")
    e = math.exp(-0.2)
    assert loss == pytest.approx(2 * e / 4, abs=ABS)
    torch.testing.assert_close(grad, t([[0.0, 2 * e / 4, 0.0, 0.0]]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 4)
    # Band (0.5, 5) holds tokens 0 and 1; clip_cov_ratio 0.5 -> int(0.5 * 4) = 2: both detached, loss 0.
    loss, grad, metrics = loss_and_grad(COV_LP, COV_OLD, COV_ADV, loss_mode="clip_cov", clip_cov_lb=0.5, clip_cov_ratio=0.5)
    assert loss == 0.0 and metrics["pg_clipfrac"] == pytest.approx(2 / 4)
    # Band (0.5, 5), one pick among two, by the generator: the same seed picks the same token.
    picks = [loss_and_grad(COV_LP, COV_OLD, COV_ADV, loss_mode="clip_cov", clip_cov_lb=0.5,
                           generator=torch.Generator().manual_seed(seed))[1].eq(0)[0, :2].tolist() for seed in (3, 3)]
    assert picks[0] == picks[1] and sum(picks[0]) == 1


def test_clip_cov_never_picks_a_ppo_clipped_token():
    # Same row with lp - old = 0.5 on token 0 (r = e^0.5 > 1.2, A > 0: PPO-clipped): no candidate is left in (1, 5), so
    # the loss is PPO's clip alone: (-2 * 1.2 + 2 e^-0.2) / 4, no gradient on token 0.
    old = [[COV_LP[0][0] - 0.5, *COV_OLD[0][1:]]]
    loss, grad, metrics = loss_and_grad(COV_LP, old, COV_ADV, loss_mode="clip_cov")
    assert loss == pytest.approx((-2.4 + 2 * math.exp(-0.2)) / 4, abs=ABS)
    assert grad[0, 0].item() == 0.0 and metrics["pg_clipfrac"] == 0.0


def test_kl_cov_penalises_the_largest_covariance():
    # k = max(1, int(4 * 0.0002)) = 1 token with the largest covariance (token 0, cov 2) gets + ppo_kl_coef |lp - old|.
    # L = [-2 e^0.1 + 0.1 * 0.1, +2 e^-0.2, 0, 0] (no clip in kl_cov), token-mean / 4;
    # d L / d lp = [(-2 e^0.1 + 0.1) / 4, 2 e^-0.2 / 4, 0, 0] (d|x|/dx = sign(x) = +1 on token 0).
    loss, grad, metrics = loss_and_grad(COV_LP, COV_OLD, COV_ADV, loss_mode="kl_cov")
    a, b = math.exp(0.1), math.exp(-0.2)
    assert loss == pytest.approx((-2 * a + 0.01 + 2 * b) / 4, abs=ABS)
    torch.testing.assert_close(grad, t([[(-2 * a + 0.1) / 4, 2 * b / 4, 0.0, 0.0]]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 4)


def test_kl_cov_and_clip_cov_pick_within_each_call():
    # The documented departure from invariance (as verl): the pick counts the call's tokens. Two rows of the case above
    # in one call penalise max(1, int(8 * 0.0002)) = 1 token; split into two calls, one each: 2 in all.
    lp, old, adv = t(COV_LP * 2), t(COV_OLD * 2), t(COV_ADV * 2)
    mask = torch.ones(2, 4)
    _, whole = policy_loss(lp, old, adv, mask, loss_mode="kl_cov")
    halves = [policy_loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[:1], loss_mode="kl_cov")[1] for i in (0, 1)]
    assert whole["pg_clipfrac"] * 8 == pytest.approx(1) and sum(h["pg_clipfrac"] * 4 for h in halves) == pytest.approx(2)


def test_dppo_tv_trust_region_and_truncated_is():
    # old prob 0.5 except token 4 (0.1); A = [+1, +1, -1, -1, -1]; thresholds low = high = 0.2; TIS cap clip_ratio_c = 3.
    # token 0: p 0.8, p - p_old = +0.3 > 0.2 with A > 0 -> outside (no loss, no gradient)
    # token 1: p 0.6, +0.1 <= 0.2 -> inside, r = 1.2: L = -1 * 1.2 * ln 0.6, dL/dlp = -1.2
    # token 2: p 0.2, -0.3 < -0.2 with A < 0 -> outside
    # token 3: p 0.4, -0.1 >= -0.2 -> inside, r = 0.8: L = +0.8 ln 0.4, dL/dlp = +0.8
    # token 4: p 0.35, old 0.1: +0.25 >= -0.2 with A < 0 -> inside, r = 3.5 truncated to 3: L = +3 ln 0.35, dL/dlp = +3
    # token-mean / 5; pg_clipfrac = outside = 2/5; pg_clipfrac_lower = inside and r > 3 = 1/5.
    probs, old_probs = [0.8, 0.6, 0.2, 0.4, 0.35], [0.5, 0.5, 0.5, 0.5, 0.1]
    lp, old = [[math.log(p) for p in probs]], [[math.log(p) for p in old_probs]]
    loss, grad, metrics = loss_and_grad(lp, old, [[1.0, 1.0, -1.0, -1.0, -1.0]], loss_mode="dppo_tv")
    assert loss == pytest.approx((-1.2 * math.log(0.6) + 0.8 * math.log(0.4) + 3 * math.log(0.35)) / 5, abs=ABS)
    torch.testing.assert_close(grad, t([[0.0, -1.2 / 5, 0.0, 0.8 / 5, 3 / 5]]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5) and metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)


def test_dppo_kl_binary_kl_trust_region():
    # old prob 0.5; binary KL kl(p) = 0.5 ln(0.5 / p) + 0.5 ln(0.5 / (1 - p)) (the 1e-8 terms move it by ~1e-8):
    # p 0.8: 0.5 ln(1.5625) = 0.223 > 0.2, A > 0 and p > p_old -> outside;   p 0.6: 0.5 ln(1.0417) = 0.020 -> inside, r 1.2
    # p 0.2: 0.223 > 0.2, A < 0 and p < p_old -> outside;                    p 0.9: kl 0.51 but A < 0 and p >= p_old
    #   (moved against the advantage's push) -> inside, r 1.8.
    # L = [0, -1.2 ln 0.6, 0, +1.8 ln 0.9] / 4; dL/dlp = [0, -1.2, 0, 1.8] / 4; pg_clipfrac 2/4.
    lp, old = [[math.log(p) for p in (0.8, 0.6, 0.2, 0.9)]], [[math.log(0.5)] * 4]
    loss, grad, metrics = loss_and_grad(lp, old, [[1.0, 1.0, -1.0, -1.0]], loss_mode="dppo_kl")
    assert loss == pytest.approx((-1.2 * math.log(0.6) + 1.8 * math.log(0.9)) / 4, abs=ABS)
    torch.testing.assert_close(grad, t([[0.0, -1.2 / 4, 0.0, 1.8 / 4]]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4) and metrics["pg_clipfrac_lower"] == 0.0


def test_gpg_plain_policy_gradient_with_token_sum():
    # L = -lp A: lp = [-1, -2], A = [3, -1] -> [3, -2]; token-sum 1 (no denominator), gradient -A = [-3, 1].
    loss, grad, metrics = loss_and_grad([[-1.0, -2.0]], [[0.0, 0.0]], [[3.0, -1.0]], loss_mode="gpg", loss_agg_mode="token-sum")
    assert loss == pytest.approx(1.0, abs=ABS)
    torch.testing.assert_close(grad, t([[-3.0, 1.0]]), rtol=0, atol=ABS)
    assert metrics["pg_clipfrac"] == 0.0


def test_dro_quadratic_penalty():
    # beta 0.5, lp = -1, old = -1.2 (lp - old = 0.2), A = 1: L = -(lp A - beta/2 (lp - old)^2) = 1 + 0.25 * 0.04 = 1.01;
    # dL/dlp = -(A - beta (lp - old)) = -(1 - 0.1) = -0.9.
    loss, grad, _ = loss_and_grad([[-1.0]], [[-1.2]], [[1.0]], loss_mode="dro", dro_beta=0.5)
    assert loss == pytest.approx(1.01, abs=ABS)
    torch.testing.assert_close(grad, t([[-0.9]]), rtol=0, atol=ABS)
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), torch.ones(1, 1), loss_mode="dro")


PARAMS = {"dro": dict(dro_beta=0.3), "clip_cov": dict(clip_cov_lb=0.0, clip_cov_ratio=0.3), "kl_cov": dict(kl_cov_ratio=0.3),
          "sapo": dict(tau_pos=1.3, tau_neg=2.0)}


def _random_case(seed: int = 5, noise: float = 0.15):
    """lp, old (probabilities in (0, 1), so dppo's trust regions bind on some tokens), per-sequence advantages of
    both signs, a mask with holes, rollout-IS weights. [3, 4] each."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.rand(3, 4, dtype=F64, generator=gen).log()
    lp = (old + noise * torch.randn(3, 4, dtype=F64, generator=gen)).clamp(max=-1e-3).requires_grad_()
    adv = torch.randn(3, 1, dtype=F64, generator=gen).expand(3, 4)  # per sequence, broadcast (geo_mean needs that)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]])
    w = 0.5 + torch.rand(3, 4, dtype=F64, generator=gen)
    return lp, old, adv, mask, w


# Losses whose gradient is, by design, not the derivative of their value (a stop-gradient factor): gradcheck cannot
# apply, their gradient is checked against its closed form instead (test_detached_weight_gradients). GSPO's value-side
# trick exp(lp - sg(lp)) * sg(s_i) gives each token d s_i / d lp_t once aggregated per sequence, so it is gradchecked,
# without IS weights (which weight its tokens, not its sequence value).
DETACHED = ("cispo", "dppo_tv", "dppo_kl")


@pytest.mark.parametrize("loss_mode", [m for m in POLICY_LOSSES if m not in DETACHED])
def test_gradcheck_float64(loss_mode):
    """Autograd's gradient of each loss against finite differences (float64), on random inputs of both advantage signs
    with masked positions and rollout-IS weights. clip_cov's pick gets a fresh, equally seeded generator per call."""
    lp, old, adv, mask, w = _random_case()
    w = None if loss_mode == "gspo" else w
    params = PARAMS.get(loss_mode, {})

    def loss_of(x):
        extra = {"generator": torch.Generator().manual_seed(0)} if loss_mode == "clip_cov" else {}
        return policy_loss(x, old, adv, mask, loss_mode=loss_mode, is_weights=w, **params, **extra)[0]

    assert torch.autograd.gradcheck(loss_of, (lp,), eps=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(loss_of(lp), lp)
    assert grad[0, 3] == 0 and grad[2, 1] == 0, "a masked position gets no gradient"


@pytest.mark.parametrize("loss_mode", DETACHED)
def test_detached_weight_gradients(loss_mode):
    """cispo: dL/dlp_t = -sg(clip(r_t, 0.8, 1.2)) A_t w_t / N; dppo_*: -A_t sg(min(r_t, 3)) valid_t w_t / N, with
    valid_t the trust region of its docstring (TV: p - p_old <= 0.2 if A > 0, >= -0.2 otherwise; KL: binary KL <= 0.2 or
    moved against A); N the loss tokens (token-mean). Written here from the formulas, not from the module."""
    lp, old, adv, mask, w = _random_case(noise=1.0)  # wide moves, so the clip and the trust regions bind on some tokens
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode=loss_mode, is_weights=w)
    (grad,) = torch.autograd.grad(loss, lp)
    x = lp.detach()
    r = (x - old).exp()
    if loss_mode == "cispo":
        per_token = -r.clamp(0.8, 1.2) * adv
    else:
        p, p_old = x.exp(), old.exp()
        if loss_mode == "dppo_tv":
            valid = torch.where(adv > 0, p - p_old <= 0.2, p - p_old >= -0.2)
        else:
            kl = p_old * (old - x) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            valid = torch.where(adv > 0, (kl <= 0.2) | (p <= p_old), (kl <= 0.2) | (p >= p_old))
        assert 0 < int((valid & (mask > 0)).sum()) < int(mask.sum()), "the trust region binds on some tokens, not all"
        per_token = -adv * r.clamp(max=3.0) * valid
    torch.testing.assert_close(grad, per_token * w * mask / mask.sum(), rtol=0, atol=ABS)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", [m for m in POLICY_LOSSES if m not in ("clip_cov", "kl_cov")])
def test_micro_batches_with_global_counts_sum_to_the_whole_batch(loss_mode, loss_agg_mode):
    """Every loss (clip_cov / kl_cov pick per call: test_kl_cov_and_clip_cov_pick_within_each_call) under every
    aggregation: micro-batch losses with the whole batch's counts add up to the whole batch's loss and gradient."""
    gen = torch.Generator().manual_seed(11)
    old = torch.rand(6, 5, dtype=F64, generator=gen).log()  # [6, 5]
    lp = (old + 0.3 * torch.randn(6, 5, dtype=F64, generator=gen)).clamp(max=-1e-3).requires_grad_()
    adv = torch.randn(6, 1, dtype=F64, generator=gen).expand(6, 5)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).long()
    mask[4] = 0  # a row without loss tokens: no sequence of the loss
    counts = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum(), loss_scale_factor=5)
    params = dict(PARAMS.get(loss_mode, {}), loss_mode=loss_mode, loss_agg_mode=loss_agg_mode)
    whole, _ = policy_loss(lp, old, adv, mask, **params, loss_scale_factor=5)
    (whole_grad,) = torch.autograd.grad(whole, lp)
    total, total_grad = 0.0, torch.zeros_like(lp)
    for rows in ([0, 3], [1], [2, 4, 5]):
        micro, _ = policy_loss(lp[rows], old[rows], adv[rows], mask[rows], **params, **counts)
        total += micro.item()
        total_grad += torch.autograd.grad(micro, lp)[0]
    assert total == pytest.approx(whole.item(), abs=1e-12)  # sums of 30 float64 terms of O(1): ~30 ulps
    torch.testing.assert_close(total_grad, whole_grad, rtol=0, atol=1e-12)
