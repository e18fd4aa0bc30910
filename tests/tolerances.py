"""Tolerances derived from the math they check, not fitted to one machine.

Two runs that compute the same thing in a different order (1 vs 2 processes, AVX2 vs AVX-512 kernels) agree on
float32 sums only up to round-off: a sum of N terms of size up to S has an absolute error of about N * eps * S,
so an element that is the cancellation of large terms has an error relative to the TENSOR's scale, not its own
(near-zero) value. Weights compared after AdamW steps add one more effect: Adam divides the gradient by its own
running RMS, so an element whose gradient is within round-off of zero can take a step of full size in either
direction. Per step the bias-corrected Adam update is bounded by lr * (1 - beta1) / sqrt(1 - beta2) when
(1 - beta1) > sqrt(1 - beta2) (Kingma & Ba 2015, section 2.1), 3.16 * lr for beta1 0.9, beta2 0.999, plus the
decoupled weight decay lr * wd * |w|; the two runs can step in opposite directions, so such an element may differ
by twice that per step. Those elements must be rare: a gradient near zero against round-off is the exception.
"""

from __future__ import annotations

import torch

ADAM_STEP_BOUND = 0.1 / 0.001 ** 0.5  # (1 - beta1) / sqrt(1 - beta2) for betas (0.9, 0.999): 3.16
RARE_FRACTION = 0.01  # at most 1% of a tensor's elements (and at least one allowed) may take the sign-flip bound


def adamw_flip_bound(*, lr: float, optimizer_steps: int, weight_decay: float = 0.0, weight_scale: float = 0.0) -> float:
    """Largest difference of one element between two AdamW runs whose gradients for it differ in sign every step."""
    return 2.0 * optimizer_steps * lr * (ADAM_STEP_BOUND + weight_decay * weight_scale)


def assert_close_after_adamw(got: torch.Tensor, want: torch.Tensor, *, flip_bound: float, rtol: float = 1e-4,
                             name: str = "tensor") -> int:
    """`got` equals `want` within round-off relative to the tensor's scale (rtol * max|want| + rtol * |want|), except
    for rare elements (RARE_FRACTION) that may differ by up to `flip_bound` (`adamw_flip_bound`). Returns how many
    elements needed the flip bound (for the caller's message)."""
    got, want = got.detach().float(), want.detach().float()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = (got - want).abs()
    outside = diff > rtol * scale + rtol * want.abs()
    count = int(outside.sum())
    allowed = max(1, int(RARE_FRACTION * want.numel()))
    assert count <= allowed, (f"{name}: {count} of {want.numel()} elements differ by more than round-off (max "
                              f"{float(diff.max()):.3g}, tensor scale {scale:.3g}); at most {allowed} may (gradients near zero)")
    if count:
        worst = float(diff[outside].max())
        assert worst <= flip_bound, f"{name}: an element differs by {worst:.3g}, more than the AdamW sign-flip bound {flip_bound:.3g}"
    return count
