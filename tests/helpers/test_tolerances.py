"""The comparison rule of tests/helpers/tolerances.py: round-off relative to the tensor's scale, rare AdamW sign flips."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tolerances import adam_step_bound, adamw_flip_bound, assert_close_after_adamw


def test_adam_step_bound_holds_for_adversarial_gradients():
    # t=1: m_hat / sqrt(v_hat) = g / |g| = 1 exactly; two runs stepping apart: 2 x lr per step (+ weight decay)
    assert adam_step_bound(1) == pytest.approx(1.0)
    assert adamw_flip_bound(lr=1e-2, optimizer_steps=1, weight_decay=0.1, weight_scale=0.5) == pytest.approx(2e-2 * 1.05)
    assert 1.0 < adam_step_bound(6) < 1.02 < adam_step_bound(100)
    # torch's AdamW (eps 0 would divide by zero: eps tiny) on gradient histories that make the step as large as it
    # gets (a long run of tiny gradients, then a large one): never above the bound, and close to it
    for t in (2, 6, 20):
        for grads in ([1e-6] * (t - 1) + [1.0], [1.0] * t, [(-1.0) ** k for k in range(t)]):
            w = torch.zeros(1, requires_grad=True)
            opt = torch.optim.AdamW([w], lr=1.0, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.0)
            steps = []
            for g in grads:
                before = w.detach().clone()
                w.grad = torch.tensor([g])
                opt.step()
                steps.append(float((w.detach() - before).abs()))
            assert max(steps) <= max(adam_step_bound(k) for k in range(1, t + 1)) * (1 + 1e-6), (t, grads[:3], steps)


def test_round_off_is_relative_to_the_tensor_scale():
    want = torch.tensor([1.0, 1e-7, -0.5, 0.25] * 100)
    got = want + 5e-5  # 5e-5 < rtol 1e-4 x scale 1.0 everywhere, even on the near-zero elements
    assert assert_close_after_adamw(got, want, flip_bound=0.0) == 0


def test_rare_flips_pass_within_the_bound_and_fail_beyond_it():
    want = torch.linspace(-1, 1, 1000)
    got = want.clone()
    got[3] += 5e-3  # one element: 0.1% of the tensor
    assert assert_close_after_adamw(got, want, flip_bound=1e-2) == 1
    with pytest.raises(AssertionError, match="sign-flip bound"):
        assert_close_after_adamw(got, want, flip_bound=1e-3)


def test_many_outliers_fail_whatever_the_bound():
    want = torch.linspace(-1, 1, 1000)
    got = want.clone()
    got[:5] += 1e-3  # 5 elements of 1000: more than the 2 (+0.05%) a near-zero gradient explains
    with pytest.raises(AssertionError, match="more than round-off"):
        assert_close_after_adamw(got, want, flip_bound=1.0)
