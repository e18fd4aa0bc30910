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
               probe (`WeightSync.request`, grpo_lib/rollout/weight_sync.py: a `types.ScoreRequest`) and scores it (vLLM: one
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
the kernels, and on a GPU it varies from step to step (vLLM's fused kernels and TP all-reduce against the FSDP forward;
GEMM kernels chosen by the batch's token count). So the probe measures it over the first CALIBRATION_PROBES (3) probes
of a run (the set-up's weights, loaded by both sides from model.path or pushed from the resumed checkpoint: known good,
and the next two), and later probes allow NOISE_FACTOR (3) times the largest of them, never less than NOISE_FACTOR
times the dtype's noise floor (the mean difference of two independent roundings to it):

    scale     = 1 + mean |actor logprob| over the probe
    ceiling   = TOLERANCE_EPS (8) x eps(dtype) x scale               (the dtype's bound)
    floor     = NOISE_FLOOR_EPS (1/4) x eps(dtype) x scale          (one rounding's mean difference, below)
    noise     = the largest difference of the first CALIBRATION_PROBES probes (running: probe k is judged by the
                probes before it)
    tolerance = ceiling at the first probe; then min(ceiling, max(NOISE_FACTOR x max(noise, floor),
                                                                 TOLERANCE_EPS x eps(float32) x scale))

with eps = torch.finfo(dtype).eps of the less precise side (float32 1.2e-7, bfloat16 7.8e-3, float16 9.8e-4). The
first probe itself must be under the ceiling (garbage weights at set-up differ by whole nats). In float32 the last term
is the ceiling: the tolerance is the dtype's, as before. The floor: both sides round their logits to the compute dtype
(vLLM's head and the actor's output bf16 logits); with different kernels the two roundings to nearest are independent,
each off by up to half an ulp, on average 0.75 x u x |x| over a binade (u = eps / 2), and two independent errors
uniform on +-a differ by 2a / 3 on average: 2/3 x 0.75 x eps / 2 = eps / 4 of the value, with the ceiling's scale
standing for |x| (an estimate of the logits' size, not a bound). A first reading below it (the same kernels on a quiet
batch) does not make the tolerance tighter than independent roundings on a GPU can be. Issue 41: a GPU run read 0.004
at set-up and 0.013 a step later, and the tolerance of 3 x the first reading (0.012) stopped a healthy run; with the
probe's mean |logprob| 2, the floor is eps x 3 / 4 = 0.0059 and the tolerance 0.018, and the second reading raises the
noise to 0.013 for the run (tests/rollout/test_weight_probe_calibration.py).
Measured on CPU (the tiny model, the hf engine and the actor both in bf16, an AVX-512 AMD EPYC): the set-up probe
8.3e-4 (scale 6.7: floor 0.013, tolerance 0.039); a healthy run at actor.lr 1e-2 at most 1.5e-3 over 5 steps; a push
leaving out layers.1.self_attn.o_proj at lr 1e-2 read 0.031 at step 2 (taken as noise: under 0.039) and 0.12 at step 3,
above 3 x 0.031: stopped there (tests/train/test_trust.py); against the ceiling (0.42) alone it would have run on.
`rollout/weight_probe_ratio` = difference / tolerance is logged every step (above 1 the run stops);
`rollout/weight_probe_noise` the calibration so far. scripts/gpu_check.sh's runs print the ratios on a GPU.

What it cannot see: a mismatch whose effect on these few tokens stays under the tolerance: in bf16 anything under
NOISE_FACTOR x the floor (3/4 of one bf16 rounding at the probe's scale), e.g. a stale parameter the updates have not
moved far yet (on CPU in bf16 a push leaving out layers.0.mlp.down_proj at actor.lr 1e-3 reads 2.7e-3 to 5.1e-3 over
steps 2-5: under that, so not caught; the same in float32 is caught at step 2, the first rollouts after the first push,
tests/train/test_trust.py); and a mismatch from the first push that stays under the tolerance of the calibrating probes is
taken as noise (at most NOISE_FACTOR-fold per calibrating probe).
The push after the last update, which no generation follows, is scored at once (one engine call per run); the step's
row keeps the worse of its two probes. Cost: one actor forward of PROBE_TOKENS tokens per step, plus one more short request in the engine's generation
batch (timing_s/weight_probe, inside timing_s/step; bench/bench_weight_probe.py, bench/results_weight_probe_cpu.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from grpo_lib.core.distributed import all_reduce_max, all_reduce_min

PROBE_TOKENS = 32  # tokens of the probe: enough to average out one token's rounding, one tiny forward
TOLERANCE_EPS = 8  # roundings of the least precise dtype, relative to the logprobs' size: the ceiling (module docstring)
NOISE_FACTOR = 3  # the tolerance after the first probe: this many times the noise (the calibrating probes' largest)
CALIBRATION_PROBES = 3  # probes whose difference sets the noise: the set-up's (known good) and the next two
NOISE_FLOOR_EPS = 0.25  # the noise is at least this many eps of the dtype at the probe's scale: the mean difference of
#                         two independent roundings to nearest (module docstring: 2/3 x 0.75 x eps / 2)


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


def noise_floor(dtypes: Iterable[torch.dtype], mean_abs_logprob: float) -> float:
    """The smallest noise the tolerance assumes: NOISE_FLOOR_EPS roundings of the least precise dtype at the probe's
    scale (two independent roundings' mean difference, module docstring).

    Example: noise_floor([torch.bfloat16, torch.float32], 2.0) = 0.25 x 2**-7 x 3 = 0.00586.
    """
    return NOISE_FLOOR_EPS * max(torch.finfo(d).eps for d in dtypes) * (1.0 + mean_abs_logprob)


def calibrated_tolerance(dtypes: Iterable[torch.dtype], mean_abs_logprob: float, noise: float | None) -> float:
    """The probe's tolerance: the dtype's ceiling before the run's noise is known (`noise` None: the first probe), then
    NOISE_FACTOR x max(noise, the dtype's noise floor), at least float32's bound, at most the dtype's ceiling.

    Example: bfloat16, mean |logprob| 8, noise 0.02: min(8 x 2**-7 x 9, max(3 x max(0.02, 0.25 x 2**-7 x 9),
    8 x 2**-23 x 9)) = 0.06; noise 0 (identical kernels): 3 x 0.0176 = 0.053.
    """
    ceiling = tolerance(dtypes, mean_abs_logprob)
    if noise is None:
        return ceiling
    floor = noise_floor(dtypes, mean_abs_logprob)
    return min(ceiling, max(NOISE_FACTOR * max(noise, floor), tolerance([torch.float32], mean_abs_logprob)))


class WeightProbe:
    """The probe of one run: its tokens, the dtypes of both sides, and the actor's logprobs since the last `expect`."""

    def __init__(self, prompt_ids: list[int], *, dtypes: Iterable[torch.dtype]):
        self.tokens = list(prompt_ids[:PROBE_TOKENS])  # [L]
        assert len(self.tokens) >= 2, f"the weight probe needs a prompt of 2 or more tokens, got {self.tokens}"
        self.dtypes = tuple(dtypes)
        self.expected: torch.Tensor | None = None  # [L-1] the actor's logprobs of tokens 1.. (token 0 has none)
        self.noise: float | None = None  # the largest difference of the calibrating probes measured so far
        self.measured = 0  # probes measured so far: the first CALIBRATION_PROBES calibrate

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
        processes, the tolerance the smallest). Each of the first CALIBRATION_PROBES probes of the run that passes its
        tolerance raises the noise the later tolerances come from to its difference (`calibrated_tolerance`)."""
        assert self.expected is not None, "WeightProbe.measure before expect: score the actor's weights before the push"
        got = torch.tensor(engine_logprobs[1:], dtype=torch.float32)  # [L-1]
        diff = float((got - self.expected).abs().mean())
        if diff != diff:  # NaN (garbage weights can give it): the largest possible mismatch, not one that compares False
            diff = float("inf")
        diff = all_reduce_max(diff)
        tol = all_reduce_min(calibrated_tolerance(self.dtypes, float(self.expected.abs().mean()), self.noise))
        self.expected = None
        if self.measured < CALIBRATION_PROBES and diff <= tol:  # a calibrating probe within its tolerance: noise
            self.noise = diff if self.noise is None else max(self.noise, diff)
        self.measured += 1
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
        f"probe is {diff:.3g}, above its tolerance {tol:.3g} ({NOISE_FACTOR} x the larger of the run's noise, the largest "
        f"difference of its first {CALIBRATION_PROBES} probes, and the compute dtype's noise floor, within that dtype's bound; rollout/weight_probe_abs_diff and _ratio in metrics.jsonl). {what}: a parameter missing from the push, LoRA adapters not merged, weights lost in the "
        "engine's sleep (rollout.sleep_level=2), or a model.path the engine and the actor read differently. "
        "trainer.check_weight_sync=true compares a whole trajectory after every push, to debug it")
