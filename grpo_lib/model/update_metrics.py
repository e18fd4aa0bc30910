"""The update's metrics of one mini-batch while its micro-batches run: sums kept on the device, read back once.

A micro-batch's metrics (`Actor.micro_batch_loss`) are 0-dim device tensors (its losses, clip fractions, KL, the
engine gap, distillation's terms) and host floats (the `perf/` counts, from the host's own layout decisions).
`MicroBatchSums.add` folds the device ones into float64 sums on the device without reading them, so nothing stops the
host from queueing the backward and the next micro-batch while the device computes; `read` brings every sum back in
ONE device-to-host copy after the last backward (with any other device scalar the caller needs: the gradient norm).

The arithmetic is the one the per-micro-batch `.item()` loop did in python floats, in the same order, on float64
values: a float32 value widened to float64 is exact, and each sum adds the same float64 products in the same order
(python's `weight * v * n` is `(weight * v) * n`, as here), so the metrics are bitwise those of that loop. How each
kind combines (after `read`, `Actor` reduces them over processes):
- `SUMMED_LOSSES` (already normalised by the mini-batch's global counts): sum of weight x value;
- `distillation.EXTREMA`: the min / max over the micro-batches that hold rows (the zero-weighted dummy adds nothing);
- every other metric (a per-micro-batch mean over its loss tokens): sum of weight x value x its loss tokens, a
  token-weighted mean once divided by the mini-batch's loss tokens.
Example: pg_loss 0.25 and 0.5 over 2 micro-batches -> 0.75; ppo_kl 0.1 over 3 tokens and 0.4 over 1 -> 0.7 (/ 4).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from grpo_lib.algorithms.distillation import EXTREMA

# Losses already normalised by the mini-batch's global counts: their micro-batch values add up (the other metrics are
# token-weighted means, perf/ counts, or the ranges of distillation.EXTREMA).
SUMMED_LOSSES = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "distillation/loss")


class MicroBatchSums:
    """One mini-batch's metrics as its micro-batches add them (`add`), read back once (`read`)."""

    def __init__(self):
        self.perf: dict[str, float] = defaultdict(float)  # host: weight x value of the perf/ counts, "micro_batches"
        self.kinds: tuple[list[str], ...] | None = None  # summed, weighted, min, max keys (the first micro-batch's)
        self.order: list[str] = []  # summed and extrema keys in the order the micro-batches report them
        self.sums: Tensor | None = None  # [summed + weighted] float64 on the device
        self.low: Tensor | None = None  # [min keys] float64, +inf until a micro-batch with rows reports
        self.high: Tensor | None = None  # [max keys] float64, -inf likewise

    def add(self, metrics: dict, *, weight: float, loss_tokens: int) -> None:
        """Fold one micro-batch's metrics in: `perf/` keys are host floats, the others 0-dim device tensors (never
        read here). `weight`: 1, or 0 for the dummy of an empty micro-batch; `loss_tokens`: its loss tokens."""
        self.perf["micro_batches"] += weight
        for k, v in metrics.items():
            if k.startswith("perf/"):
                self.perf[k] += weight * v
        keys = [k for k in metrics if not k.startswith("perf/")]
        if self.kinds is None:
            summed = [k for k in keys if k in SUMMED_LOSSES]
            weighted = [k for k in keys if k not in SUMMED_LOSSES and k not in EXTREMA]
            self.kinds = (summed, weighted, [k for k in keys if EXTREMA.get(k) == "min"],
                          [k for k in keys if EXTREMA.get(k) == "max"])
            self.order = [k for k in keys if k in SUMMED_LOSSES or k in EXTREMA]
            device = metrics[keys[0]].device
            self.sums = torch.zeros(len(summed) + len(weighted), dtype=torch.float64, device=device)
            self.low = torch.full((len(self.kinds[2]),), math.inf, dtype=torch.float64, device=device)
            self.high = torch.full((len(self.kinds[3]),), -math.inf, dtype=torch.float64, device=device)
        summed, weighted, low, high = self.kinds
        assert sorted(keys) == sorted(summed + weighted + low + high), f"micro-batch metrics {sorted(keys)} changed"
        values = torch.stack([metrics[k].detach().reshape(()) for k in summed + weighted + low + high]).to(torch.float64)
        s, w = len(summed), len(weighted)
        self.sums[:s].add_(values[:s] * weight)  # python: total += weight * v
        self.sums[s:].add_(values[s : s + w] * weight * loss_tokens)  # python: total += weight * v * tokens
        if weight:  # a range: the dummy adds nothing
            torch.minimum(self.low, values[s + w : s + w + len(low)], out=self.low)
            torch.maximum(self.high, values[s + w + len(low) :], out=self.high)

    def read(self, *extra: Tensor) -> tuple[dict[str, float], dict[str, float], list[float]]:
        """(summed and extrema by key, in the micro-batches' order; token-weighted totals by key; the `extra` device
        scalars as floats), from ONE device-to-host copy of everything."""
        summed, weighted, low, high = self.kinds
        parts = [self.sums, self.low, self.high, *(e.detach().reshape(1).to(self.sums.device, torch.float64) for e in extra)]
        values = torch.cat(parts).tolist()  # the mini-batch's one read
        by_key = dict(zip(summed + weighted + low + high, values))
        return ({k: by_key[k] for k in self.order}, {k: by_key[k] for k in weighted},
                values[len(by_key):])
