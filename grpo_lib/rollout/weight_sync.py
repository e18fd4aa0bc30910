"""Weight sync: the engine gets the actor's weights with a version, and every step proves it serves them (`WeightSync`).

One unit, called at two places of a step (train_grpo.py), so the probe lives nowhere else:

    expect + push   after the update: the actor's logprobs of the weight probe (`WeightProbe.expect`, from the
                    weights about to be pushed), then engine.prepare_for_generation(weights, version=step): the engine
                    reports `weight_version` = step from then on (set-up: the resumed step's, 0 for a fresh run)
    request         the probe's `types.ScoreRequest`, handed to the step's first generate call (vLLM scores it in the
                    same batch; rollout_round passes it on), which fills it: no queue in the engine, nothing held
                    around validation (its generate calls carry no request)
    check           after the step's rollouts, before anything trains on them: the batch's weight_version is the
                    pushed one, and the request's scores against `expect`'s (rollout/weight_probe_*); either wrong is
                    a WeightMismatch (exit 3)
    check_last_push the push after the last update, which no generation follows: the probe scored by one call
    full_check      trainer.check_weight_sync (a debug pass after every push): a whole trajectory scored by both sides

Versions: the weights after step s's update are version s. A rollout batch carries the version of the engine that
generated it (`RolloutBatch.weight_version`), so a producer in another process, or a push that did not take, shows as
a batch of another version than the trainer pushed. Example: resume at step 4 -> the set-up push is version 4,
step 5's rollouts carry 4, step 5's push is version 5.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from grpo_lib.core.distributed import all_reduce_min, broadcast_object
from grpo_lib.core.types import RolloutBatch, ScoreRequest
from grpo_lib.rollout.weight_probe import WeightMismatch, WeightProbe, mismatch


class WeightSync:
    """The run's weight pushes into `engine` and their proof (`probe`: None with trainer.weight_probe=false)."""

    def __init__(self, engine, probe: WeightProbe | None, *, version: int = 0):
        self.engine, self.probe = engine, probe
        self.version = version  # the version of the weights the engine serves (pushed last, or loaded at set-up)

    def expect(self, actor, *, timings: dict | None = None) -> None:
        """The probe's logprobs from the actor's weights, which the engine is to serve next (at set-up and before a push)."""
        if self.probe is not None:
            with _timed(timings, "weight_probe"):
                self.probe.expect(actor)

    def push(self, actor, *, version: int, timings: dict | None = None) -> None:
        """The actor's weights into the engine (released -> ready, `EngineGlue.prepare_for_generation`: the actor's
        offload before the KV cache wakes) as `version`; the engine serves them to the next generation."""
        with _timed(timings, "push"):
            self.engine.prepare_for_generation(actor.engine_weights(), free_trainer_memory=actor.offload, version=version)
        self.version = version

    def request(self) -> ScoreRequest | None:
        """What the step's first generate call scores along (`engine.generate(..., score=request)`); None: no probe."""
        return ScoreRequest([self.probe.tokens]) if self.probe is not None and self.probe.pending else None

    def check(self, request: ScoreRequest | None, batch: RolloutBatch | None, *, step: int,
              timings: dict | None = None) -> tuple[dict[str, float], WeightMismatch | None]:
        """Did step `step`'s rollouts come from the pushed weights? -> (rollout/weight_probe_* metrics, the error or
        None). The probe's scores are the request's, filled by the generate call that carried it (one score call where
        none did: a process without prompts); `batch` None (the rollouts gave up) checks the probe alone."""
        metrics, error = {}, None
        if request is not None:
            with _timed(timings, "weight_probe"):
                scores = request.scores[0] if request.scores is not None else self.engine.score_logprobs(request.sequences)[0]
                metrics = self.probe.measure(scores)
            error = mismatch(metrics, step=step)
        if error is None and batch is not None and batch.weight_version != self.version:
            error = WeightMismatch(f"step {step}: the rollouts were generated with weight version {batch.weight_version}, "
                                   f"the trainer pushed version {self.version}: they are not trained on; the last completed "
                                   "step is saved. The engine did not take the push (its weight_version), or a batch came "
                                   "from another producer's older weights")
        return metrics, error

    def check_last_push(self, *, timings: dict | None = None) -> dict[str, float]:
        """The probe of the push after the last update (no generation follows): scored now, one engine call."""
        if self.probe is None:
            return {}
        with _timed(timings, "weight_probe"):
            return self.probe.measure(self.engine.score_logprobs([self.probe.tokens])[0])

    def full_check(self, actor, batch: RolloutBatch) -> float:
        """Largest |engine - actor| logprob over process 0's first trajectory of `batch`, at temperature 1 (invariant 3;
        debug/weight_sync_max_abs_diff), after the push; the actor rests on the host again afterwards.

        Every process scores the same sequence (broadcast from process 0), so the ranks of a TP group submit the
        identical request; the actor forward is an FSDP2 collective. The result is the largest error over all engines.
        """
        length = int(batch.attention_mask[0].sum())
        seq = torch.tensor(broadcast_object(batch.input_ids[0, :length].tolist()))  # [L]
        engine_lp = torch.tensor(self.engine.score_logprobs([seq.tolist()])[0])  # [L]
        actor.load_params()  # after the push the shards may rest on the host (param_offload)
        actor.policy.eval()
        with torch.no_grad():
            actor_lp, _ = actor.policy(seq[None].to(actor.device), torch.ones_like(seq)[None].to(actor.device))  # [1, L]
        actor.offload()
        return -all_reduce_min(-float((engine_lp - actor_lp[0].float().cpu()).abs().max()))


@contextmanager
def _timed(timings: dict | None, name: str):
    """Seconds inside, added to timings[f"timing_s/{name}"] (nothing with `timings` None)."""
    start = time.perf_counter()
    yield
    if timings is not None:
        timings[f"timing_s/{name}"] = timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
