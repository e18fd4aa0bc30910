"""Tolerances derived from the math they check, not fitted to one machine.

Two runs that compute the same thing in a different order (1 vs 2 processes, AVX2 vs AVX-512 kernels) agree on
float32 sums only up to round-off: a sum of N terms of size up to S has an absolute error of about N * eps * S,
so an element that is the cancellation of large terms has an error relative to the TENSOR's scale, not its own
(near-zero) value. Weights compared after AdamW steps add one more effect: Adam divides the gradient by its own
running RMS, so an element whose gradient is within round-off of zero can take a step of full size in either
direction. How large: with m_t = (1-b1) sum_i b1^(t-i) g_i and v_t = (1-b2) sum_i b2^(t-i) g_i^2, Cauchy-Schwarz
gives |m_t| / sqrt(v_t) <= sqrt(sum_k (1-b1)^2 b1^(2k) / ((1-b2) b2^k)), and the bias corrections multiply that by
sqrt(1-b2^t) / (1-b1^t): 1.000 at t=1, 1.016 at t=6, 2.24 at t=100 for betas (0.9, 0.999) (`adam_step_bound`). Add
the decoupled weight decay lr * wd * |w| per step; two runs can step in opposite directions, so such an element may
differ by twice the sum of those steps (`adamw_flip_bound`).

How many such elements: a gradient within round-off of zero is the exception, not a law we can derive; seen here,
one element of 20480 (tied embedding) and one of 512 (LoRA adapters). The rule allows FLIPS_PER_TENSOR elements per
tensor plus FLIP_FRACTION of a large one, and fails on more: a real difference moves many elements at once.
"""

from __future__ import annotations

import torch

FLIPS_PER_TENSOR = 2  # elements of any tensor that may take the sign-flip bound ...
FLIP_FRACTION = 5e-4  # ... plus this fraction of a large tensor's elements (10 of a 20480-element embedding)


def adam_step_bound(t: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Largest |bias-corrected m_t / sqrt(v_t)| over all gradient histories (module docstring): one Adam step is at
    most this times lr. adam_step_bound(1) == 1.0; adam_step_bound(6) ~ 1.016."""
    b1, b2 = betas
    ratio_sq = sum((1 - b1) ** 2 * b1 ** (2 * k) / ((1 - b2) * b2 ** k) for k in range(t))
    return (1 - b2 ** t) ** 0.5 / (1 - b1 ** t) * ratio_sq ** 0.5


def adamw_flip_bound(*, lr: float, optimizer_steps: int, weight_decay: float = 0.0, weight_scale: float = 0.0) -> float:
    """Largest difference of one element between two AdamW runs (constant lr) whose gradients for it differ in sign
    at every step: both runs step the full bound, in opposite directions, each step."""
    return 2.0 * sum(lr * (adam_step_bound(t) + weight_decay * weight_scale) for t in range(1, optimizer_steps + 1))


def assert_close_after_adamw(got: torch.Tensor, want: torch.Tensor, *, flip_bound: float, rtol: float = 1e-4,
                             name: str = "tensor") -> int:
    """`got` equals `want` within round-off relative to the tensor's scale (rtol * max|want| + rtol * |want|), except
    for a few elements (FLIPS_PER_TENSOR + FLIP_FRACTION of the tensor) that may differ by up to `flip_bound`
    (`adamw_flip_bound`). Returns how many elements needed the flip bound."""
    got, want = got.detach().float(), want.detach().float()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = (got - want).abs()
    outside = diff > rtol * scale + rtol * want.abs()
    count = int(outside.sum())
    allowed = FLIPS_PER_TENSOR + int(FLIP_FRACTION * want.numel())
    assert count <= allowed, (f"{name}: {count} of {want.numel()} elements differ by more than round-off (max "
                              f"{float(diff.max()):.3g}, tensor scale {scale:.3g}); at most {allowed} may (gradients near zero)")
    if count:
        worst = float(diff[outside].max())
        assert worst <= flip_bound, f"{name}: an element differs by {worst:.3g}, more than the AdamW sign-flip bound {flip_bound:.3g}"
    return count
