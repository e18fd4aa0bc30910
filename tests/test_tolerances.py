"""The comparison rule of tests/tolerances.py: round-off relative to the tensor's scale, rare AdamW sign flips."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import ADAM_STEP_BOUND, adamw_flip_bound, assert_close_after_adamw


def test_flip_bound_is_adams_step_bound_twice_per_step():
    # (1 - 0.9) / sqrt(1 - 0.999) = 0.1 / 0.0316 = 3.162; two runs stepping apart: 2 x 3.162 x lr per step
    assert ADAM_STEP_BOUND == pytest.approx(3.1623, rel=1e-4)
    assert adamw_flip_bound(lr=1e-3, optimizer_steps=6) == pytest.approx(2 * 6 * 1e-3 * 3.1623, rel=1e-4)
    assert adamw_flip_bound(lr=1e-2, optimizer_steps=1, weight_decay=0.1, weight_scale=0.5) == pytest.approx(2e-2 * (3.1623 + 0.05), rel=1e-4)


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
    got[:20] += 1e-3  # 2% of the elements: not "rare", a real difference
    with pytest.raises(AssertionError, match="more than round-off"):
        assert_close_after_adamw(got, want, flip_bound=1.0)
