"""The weight probe (grpo_lib/rollout/weight_probe.py) on CPU with fakes: its tolerance by hand, what it measures, when it stops.

The end-to-end cases run the trainer: a normal run logs the probe below its tolerance (tests/train/test_train_e2e.py, both
engines), a push that leaves out a parameter stops with exit 3 after saving (tests/train/test_trust.py, both engines).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from grpo_lib.core.types import Generation
from grpo_lib.rollout.engines.base import EngineGlue
from grpo_lib.rollout.weight_probe import calibrated_tolerance, PROBE_TOKENS, WeightMismatch, WeightProbe, mismatch, tolerance
from grpo_lib.rollout.weight_sync import WeightSync


class FakePolicy:
    """The actor's LogprobModel: logprobs [1, L] (entry 0 is 0) of one fixed table, whatever the ids."""

    def __init__(self, logprobs: list[float]):
        self.logprobs = logprobs

    def eval(self):
        return self

    def __call__(self, ids, mask):
        assert ids.shape == mask.shape == (1, len(self.logprobs)), ids.shape
        return torch.tensor([self.logprobs]), None


class FakeActor:
    def __init__(self, logprobs: list[float]):
        self.policy, self.device, self.loads = FakePolicy(logprobs), torch.device("cpu"), 0

    def load_params(self):
        self.loads += 1

    def autocast(self):
        return contextlib.nullcontext()


class FakeEngine(EngineGlue):
    """score_logprobs of one fixed table; generate scores a carried ScoreRequest with it (as HFEngine does)."""

    def __init__(self, logprobs: list[float]):
        self.logprobs, self.requests = logprobs, []

    def score_logprobs(self, sequences):
        self.requests.append(sequences)
        return [self.logprobs]

    def generate(self, prompt_ids, *, n, score=None, **sampling):
        if score is not None:
            score.fill(self.score_logprobs(score.sequences), weight_version=self.weight_version)
        return [[Generation(token_ids=[1], logprobs=[0.0], text="", finish_reason="stop")] * n for _ in prompt_ids]


def probe_step(probe: WeightProbe, engine: FakeEngine, *, step: int = 1) -> dict[str, float]:
    """One step's probe as the trainer runs it: the request rides in the step's generate call, WeightSync.check
    measures the scores that call returned."""
    sync = WeightSync(engine, probe)
    request = sync.request()
    engine.generate([[5, 6]], n=2, temperature=1.0, max_tokens=4, score=request)
    metrics, _ = sync.check(request, None, step=step)
    return metrics


def test_tolerance_by_hand():
    # 8 x eps x (1 + mean |logprob|), eps of the less precise dtype: bfloat16 eps = 2**-7
    assert tolerance([torch.float32, torch.bfloat16], 2.0) == pytest.approx(8 * 2**-7 * 3)
    # float32 only: eps = 2**-23; at a mean |logprob| of 5.7 (the tiny test model): 8 x 1.19e-7 x 6.7 = 6.4e-6
    assert tolerance([torch.float32], 5.7) == pytest.approx(8 * 2**-23 * 6.7)
    assert tolerance([torch.float16, torch.float32], 0.0) == pytest.approx(8 * 2**-10)


def test_calibrated_tolerance_by_hand():
    """Issue 28 item 8: after the first probe, NOISE_FACTOR (3) x the measured noise, at least 3 x the dtype's noise
    floor (issue 41: 0.25 eps x 9 = 0.0176 here) and float32's bound, at most the dtype's ceiling. bfloat16, mean
    |logprob| 8: ceiling 8 x 2**-7 x 9 = 0.5625; float32 8 x 2**-23 x 9."""
    bf16 = [torch.bfloat16, torch.float32]
    assert calibrated_tolerance(bf16, 8.0, None) == pytest.approx(8 * 2**-7 * 9)  # the first probe: the ceiling
    assert calibrated_tolerance(bf16, 8.0, 0.02) == pytest.approx(0.06)  # 3 x the noise
    assert calibrated_tolerance(bf16, 8.0, 0.0) == pytest.approx(3 * 0.25 * 2**-7 * 9)  # identical kernels: the floor
    assert calibrated_tolerance(bf16, 8.0, 1.0) == pytest.approx(8 * 2**-7 * 9)  # never above the ceiling
    # float32 on both sides: the floor is the ceiling, the tolerance the dtype's whatever the noise
    assert calibrated_tolerance([torch.float32], 5.7, 1e-7) == pytest.approx(tolerance([torch.float32], 5.7))


def test_the_set_up_probe_calibrates_and_a_stale_bf16_weight_is_caught():
    """The bf16 case of issue 28 item 8, replayed with its numbers: the set-up's probe (known-good weights) reads a
    noise of 0.02; a healthy 0.03 passes (3 x 0.02) and, a calibrating probe, raises the noise to 0.03; a parameter the
    push skipped then reads 0.34, under the dtype's ceiling (0.56: never caught before) and above 3 x 0.03: a mismatch.
    Every probe logs its ratio."""
    n = PROBE_TOKENS
    actor_lp = [0.0] + [-8.0] * (n - 1)
    probe = WeightProbe(list(range(n)), dtypes=[torch.bfloat16, torch.float32])
    metrics = []
    for diff in (0.02, 0.03, 0.34):  # set-up (noise), a healthy step, the stale one
        probe.expect(FakeActor(actor_lp))
        engine = FakeEngine([0.0] + [-8.0 + diff] * (n - 1))
        metrics.append(probe_step(probe, engine))
    ceiling = 8 * 2**-7 * 9
    assert metrics[0]["rollout/weight_probe_tolerance"] == pytest.approx(ceiling)
    assert probe.noise == pytest.approx(0.03, rel=1e-5)
    assert [m["rollout/weight_probe_tolerance"] for m in metrics[1:]] == [pytest.approx(0.06, rel=1e-5),
                                                                          pytest.approx(0.09, rel=1e-5)]
    assert mismatch(metrics[1], step=1) is None and metrics[1]["rollout/weight_probe_ratio"] == pytest.approx(0.5, rel=1e-4)
    assert 0.34 < ceiling and isinstance(mismatch(metrics[2], step=2), WeightMismatch)
    assert metrics[2]["rollout/weight_probe_ratio"] == pytest.approx(0.34 / 0.09, rel=1e-4)
    assert [m["rollout/weight_probe_noise"] for m in metrics] == [pytest.approx(x, rel=1e-5) for x in (0.02, 0.03, 0.03)]


def test_a_set_up_probe_above_the_ceiling_stops_and_calibrates_nothing():
    probe = WeightProbe(list(range(8)), dtypes=[torch.float32])
    probe.expect(FakeActor([0.0] + [-2.0] * 7))
    engine = FakeEngine([0.0] + [-3.0] * 7)  # garbage at set-up: a whole nat
    assert isinstance(mismatch(probe_step(probe, engine), step=1), WeightMismatch) and probe.noise is None


def test_the_probe_is_the_first_tokens_of_the_prompt_and_compares_their_mean_difference():
    prompt = list(range(100, 100 + PROBE_TOKENS + 10))
    probe = WeightProbe(prompt, dtypes=[torch.float32])
    assert probe.tokens == prompt[:PROBE_TOKENS]
    actor_lp = [0.0] + [-2.0] * (PROBE_TOKENS - 1)
    engine_lp = [0.0] + [-2.0 + 2**-18] * (PROBE_TOKENS // 2) + [-2.0] * (PROBE_TOKENS // 2 - 1)  # exact in float32
    actor, engine = FakeActor(actor_lp), FakeEngine(engine_lp)
    probe.expect(actor)
    request = WeightSync(engine, probe).request()
    assert probe.pending and engine.requests == [], "requested: the engine scores it in the generate call that carries it"
    assert request.sequences == [probe.tokens]
    metrics = probe_step(probe, engine)
    assert engine.requests == [[probe.tokens]], "one request: the probe's tokens, the same on every process"
    assert not probe.pending
    # 16 of the 31 scored tokens differ by 2**-18: mean 16 x 2**-18 / 31; tolerance 8 x 2**-23 x (1 + 2)
    assert metrics["rollout/weight_probe_abs_diff"] == pytest.approx(16 * 2**-18 / 31, rel=1e-6)
    assert metrics["rollout/weight_probe_tolerance"] == pytest.approx(8 * 2**-23 * 3)
    assert mismatch(metrics, step=4) is None


@pytest.mark.parametrize("engine_value", [-2.01, float("nan")], ids=["stale", "garbage"])
def test_a_mismatch_stops_the_run_with_exit_3_and_says_why(engine_value):
    """A stale engine (logprobs 0.01 off: far above float32's tolerance) or garbage weights (NaN logprobs, which must
    not compare as 'not above the tolerance') give a WeightMismatch with exit code 3."""
    probe = WeightProbe(list(range(8)), dtypes=[torch.float32])
    probe.expect(FakeActor([0.0] + [-2.0] * 7))
    engine = FakeEngine([0.0] + [engine_value] * 7)
    metrics = probe_step(probe, engine)
    assert metrics["rollout/weight_probe_abs_diff"] == (pytest.approx(0.01) if engine_value == -2.01 else math.inf)
    error = mismatch(metrics, step=3)
    assert isinstance(error, WeightMismatch) and error.exit_code == 3
    assert str(error).startswith("step 3: the engine does not serve the actor's weights"), error
    assert "rollout/weight_probe_abs_diff" in str(error) and "trainer.check_weight_sync" in str(error)
    assert "This step's rollouts came from other weights" in str(error)
    assert "The last update's push left the engine" in str(mismatch(metrics, step=3, final_push=True))


def test_measure_before_expect_is_refused_and_runs_without_the_probe_stop_nothing():
    probe = WeightProbe([1, 2, 3], dtypes=[torch.float32])
    with pytest.raises(AssertionError, match="before expect"):
        probe.measure([0.0, -1.0, -1.0])
    assert mismatch({"actor/pg_loss": 0.1}, step=1) is None, "trainer.weight_probe=false: no probe metrics, no stop"


