"""The weight sync unit (grpo_lib/rollout/weight_sync.py) and the rollout rounds it vouches for, on CPU with fakes.

Versions: a push carries one, the engine reports it, every rollout batch carries the version it was generated with,
and a batch of other weights is caught. The probe: its scores come back from the generate call that carried them
(the step's first; no later call, no validation call carries one). The rounds: `rounds.GroupFilter` (DAPO's keep/drop)
accumulates rounds handed to it as batches, no engine involved. The real engines fill a ScoreRequest and report their
version in tests/rollout/test_engines.py; the probe's tolerance and its stop are tests/rollout/test_weight_probe.py's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_lib.config import load_config
from grpo_lib.core.types import Generation, PromptBatch, RolloutBatch, ScoreRequest
from grpo_lib.rollout.engines.base import EngineGlue, Lifecycle
from grpo_lib.rollout.weight_probe import WeightMismatch, WeightProbe
from grpo_lib.rollout.weight_sync import WeightSync
from grpo_lib.trainer import rounds
from grpo_lib.trainer import step
from tests.train.test_algorithm_recipes import CyclingSampler, FakeData, FakeEngine, FakeScorer
from tests.rollout.test_weight_probe import FakeActor


class PushedEngine(EngineGlue):
    """EngineGlue's prepare_for_generation over a lifecycle that moves nothing; records the pushed names."""

    def __init__(self):
        self.lifecycle, self.pushed = Lifecycle(frees_memory=False, discards_weights=False), []

    def release(self):
        with self.lifecycle.transition("release"):
            pass

    def restore_weights(self):
        with self.lifecycle.transition("restore_weights"):
            pass

    def restore_cache(self):
        with self.lifecycle.transition("restore_cache"):
            pass

    def push_weights(self, named_tensors):
        with self.lifecycle.transition("push"):
            self.pushed += [name for name, _ in named_tensors]

    def reset_prefix_cache(self):
        pass


class PushedActor(FakeActor):
    def __init__(self):
        super().__init__([0.0, -1.0])
        self.offloads = 0

    def named_weights(self):
        yield "w", torch.zeros(2)

    def engine_weights(self):  # the Actor's: what a push hands the engine (the full weights here)
        return self.named_weights()

    def offload(self):
        self.offloads += 1


def dapo_config(**overrides) -> object:
    keys = {"data.train_batch_size": 4, "rollout.n": 3, "algorithm.filter_groups.enable": "true",
            "algorithm.filter_groups.max_num_gen_batches": 4, **overrides}
    return load_config(None, ["model.path=unused", "data.train_files=[unused.parquet]", "actor.ppo_mini_batch_size=4",
                              "actor.ppo_micro_batch_size_per_gpu=4", "reward.num_workers=0",
                              *(f"{k}={v}" for k, v in keys.items())])


# ------------------------------------------------------------------------------------------------ versions


def test_a_push_carries_its_version_and_the_engine_reports_it():
    engine, actor = PushedEngine(), PushedActor()
    sync = WeightSync(engine, None)
    assert (engine.weight_version, sync.version) == (0, 0), "as built, the engine serves model.path's weights: version 0"
    engine.release()
    timings = {}
    sync.push(actor, version=3, timings=timings)
    assert (engine.weight_version, sync.version) == (3, 3) and engine.pushed == ["w"]
    assert engine.lifecycle.state == "ready" and actor.offloads == 1, "the actor rests on the host before the cache wakes"
    assert "timing_s/push" in timings
    engine.release()
    engine.prepare_for_generation(None)  # no weights: nothing pushed, the version stays
    assert engine.weight_version == 3


def test_every_rollout_batch_carries_the_version_it_was_generated_with():
    """One round or several (DAPO: the rounds' batches concatenated), the batch says which weights produced it."""
    engine = FakeEngine()
    engine.weight_version = 5
    batch, metrics = rounds.collect_rollouts(dapo_config(), engine, FakeScorer(), FakeData(), CyclingSampler(), step=6,
                                           world_size=1, rank=0, timings={})
    assert metrics["batch/gen_rounds"] == 3.0 and batch.weight_version == 5
    batch, _ = rounds.collect_rollouts(dapo_config(**{"algorithm.filter_groups.enable": "false"}), engine, FakeScorer(),
                                     FakeData(), CyclingSampler(), step=6, world_size=1, rank=0, timings={})
    assert batch.weight_version == 5 and batch.select([0, 1]).weight_version == 5


def test_rollouts_of_other_weights_are_caught_and_never_mixed():
    """A batch generated with version 2 while the trainer pushed 3 (a push the engine did not take, or a producer
    behind): WeightSync.check's error stops the step (exit 3); concat refuses to mix two versions in one batch."""
    engine = FakeEngine()
    engine.weight_version = 2
    batch, _ = rounds.collect_rollouts(dapo_config(**{"algorithm.filter_groups.enable": "false"}), engine, FakeScorer(),
                                     FakeData(), CyclingSampler(), step=4, world_size=1, rank=0, timings={})
    sync = WeightSync(engine, None, version=3)
    metrics, error = sync.check(None, batch, step=4)
    assert metrics == {} and isinstance(error, WeightMismatch) and error.exit_code == 3
    assert str(error).startswith("step 4: the rollouts were generated with weight version 2, the trainer pushed version 3")
    assert WeightSync(engine, None, version=2).check(None, batch, step=4) == ({}, None)
    other = batch.select([0, 1])
    other.weight_version = 3
    with pytest.raises(ValueError, match=r"weight versions \[2, 3\]"):
        RolloutBatch.concat([batch, other])


# ------------------------------------------------------------------------------------------------ the probe's scores


class ProbeCarryingEngine(FakeEngine):
    """FakeEngine whose generate fills a carried ScoreRequest from a fixed table and records which calls carried one;
    score_logprobs (a call of its own) is counted."""

    def __init__(self, table: list[float]):
        super().__init__()
        self.table, self.carried, self.score_calls = table, [], 0

    def generate(self, prompt_ids, *, n, score=None, **kwargs):
        self.carried.append(score is not None)
        if score is not None:
            score.fill([list(self.table)], weight_version=self.weight_version)
        return super().generate(prompt_ids, n=n, **kwargs)

    def score_logprobs(self, sequences):
        self.score_calls += 1
        return [list(self.table)]


def test_the_probe_scores_come_back_from_the_generate_call_that_carried_them():
    """DAPO's three rounds: only round 1's generate call carries the probe; WeightSync.check measures the scores that
    call filled in, with no engine call of its own (the table differs from the actor's by 0.5 per token: measured)."""
    probe = WeightProbe([3, 4, 5], dtypes=[torch.float32])
    probe.expect(FakeActor([0.0, -1.0, -1.0]))
    engine = ProbeCarryingEngine([0.0, -1.5, -1.5])
    sync = WeightSync(engine, probe)
    request = sync.request()
    assert isinstance(request, ScoreRequest) and request.sequences == [[3, 4, 5]] and request.scores is None
    batch, _ = rounds.collect_rollouts(dapo_config(), engine, FakeScorer(), FakeData(), CyclingSampler(), step=1,
                                     world_size=1, rank=0, timings={}, score_request=request)
    assert engine.carried == [True, False, False], "the probe rides in the step's first generate call only"
    assert request.scores == [[0.0, -1.5, -1.5]] and request.weight_version == 0
    metrics, error = sync.check(request, batch, step=1)
    assert engine.score_calls == 0 and metrics["rollout/weight_probe_abs_diff"] == pytest.approx(0.5)
    assert isinstance(error, WeightMismatch), "0.5 per token is far above float32's tolerance"
    assert not probe.pending and sync.request() is None, "measured: nothing rides in a later call until the next expect"


def test_a_request_no_call_carried_and_the_last_push_are_scored_by_one_call():
    """A process without prompts makes no generate call (its request stays unfilled), and no generation follows the
    last push: both score the probe with one score_logprobs call."""
    engine = ProbeCarryingEngine([0.0, -1.0, -1.0])
    probe = WeightProbe([3, 4, 5], dtypes=[torch.float32])
    sync = WeightSync(engine, probe)
    probe.expect(FakeActor([0.0, -1.0, -1.0]))
    metrics, error = sync.check(sync.request(), None, step=1)
    assert engine.score_calls == 1 and error is None and metrics["rollout/weight_probe_abs_diff"] == 0.0
    probe.expect(FakeActor([0.0, -1.0, -1.0]))
    assert sync.check_last_push()["rollout/weight_probe_abs_diff"] == 0.0 and engine.score_calls == 2
    assert WeightSync(engine, None).request() is None and WeightSync(engine, None).check_last_push() == {}


def test_validation_generates_without_the_probe():
    """GRPOTrainer.validate passes no request: validation's generate calls carry none, so the probe always rides in
    the next training step's first call, whether a validation ran after the push or not (as after a resume)."""
    cfg = dapo_config(**{"algorithm.filter_groups.enable": "false", "data.val_files": "[unused.parquet]"})
    engine = ProbeCarryingEngine([0.0, -1.0])

    class Val(FakeData):
        data_sources = ["fake"] * 4

        def __len__(self):
            return 4

    rounds.validate(cfg, engine, FakeScorer(), Val(), world_size=1, rank=0, step=10)
    assert engine.carried == [False]


# ------------------------------------------------------------------------------------------------ rounds and the filter


def fake_round(prompt_scores: dict[str, list[float]]) -> RolloutBatch:
    """A round's scored batch as rollout_round returns it: one group per prompt, its responses' scores as given."""
    names = list(prompt_scores)
    prompts = PromptBatch(prompt_ids=[[100 + i, 7] for i in range(len(names))], group_ids=names,
                          data_sources=["fake"] * len(names), ground_truths=["0"] * len(names),
                          extra_infos=[{} for _ in names])
    generations = [[Generation(token_ids=[10, 1], logprobs=[-1.0, -0.5], text="r", finish_reason="stop")
                    for _ in prompt_scores[g]] for g in names]
    batch = step.build_rollout_batch(prompts, generations)
    batch.scores = torch.tensor([s for g in names for s in prompt_scores[g]])  # [B]
    return batch


def filter_config(*, enable: bool = True, max_rounds: int = 3, per_process: int = 2):
    return SimpleNamespace(algorithm=SimpleNamespace(filter_groups=SimpleNamespace(
        enable=enable, metric="seq_reward", max_num_gen_batches=max_rounds)), data=SimpleNamespace(train_batch_size=per_process),
        reward=SimpleNamespace(max_error_fraction=1.0, timeout_s=1.0))


def test_the_group_filter_accumulates_rounds_until_enough_groups_differ():
    """2 groups wanted. Round 1: a differs, b is all 1 (dropped). Round 2: c and d differ -> enough; the step's batch is
    the first 2 kept groups (a, c; d is the last round's surplus). No engine: the rounds are handed in as batches."""
    groups = rounds.GroupFilter(filter_config(), world_size=1)
    assert groups.add(fake_round({"a": [0.0, 1.0], "b": [1.0, 1.0]})) is False
    assert groups.add(fake_round({"c": [1.0, 0.0], "d": [0.5, 0.0]})) is True
    stats = rounds.RoundStats(sums={"count": 8.0})
    batch = groups.finish(filter_config(), step=1, stats=stats, scorer=None)
    assert batch.group_ids == ["a", "a", "c", "c"] and batch.scores.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert (groups.rounds, groups.dropped, groups.groups) == (2, 1, ["a", "c"])


def test_the_group_filter_stops_at_max_rounds_and_aborts_when_nothing_differs():
    groups = rounds.GroupFilter(filter_config(max_rounds=2), world_size=1)
    assert groups.add(fake_round({"a": [0.0, 1.0], "b": [1.0, 1.0]})) is False
    assert groups.add(fake_round({"c": [0.0, 0.0]})) is True, "max_num_gen_batches rounds: the step goes on with fewer"
    assert groups.finish(filter_config(), step=1, stats=rounds.RoundStats(), scorer=None).group_ids == ["a", "a"]
    groups = rounds.GroupFilter(filter_config(max_rounds=1), world_size=1)
    assert groups.add(fake_round({"a": [1.0, 1.0]})) is True
    stats = rounds.RoundStats(sums={"count": 2.0, "reward/error_fraction": 0.0, "reward/errors": 0.0, "reward/timeouts": 0.0})
    with pytest.raises(step.RunAborted, match="dynamic sampling found no group with different scores in 1 rounds"):
        groups.finish(filter_config(), step=1, stats=stats, scorer=SimpleNamespace(last_error_samples=[]))


def test_without_filter_groups_one_round_is_the_batch_and_round_stats_add_up():
    groups = rounds.GroupFilter(filter_config(enable=False), world_size=1)
    batch = fake_round({"a": [1.0, 1.0]})
    assert groups.add(batch) is True and groups.finish(None, step=1, stats=rounds.RoundStats(), scorer=None) is batch
    total = rounds.RoundStats(sums={"rollout/preemptions": 0.0})
    total.add(rounds.RoundStats(sums={"count": 4.0, "response/length_max": 6.0}, tool_sums={"episode/turns_max": 2.0}))
    total.add(rounds.RoundStats(sums={"count": 4.0, "response/length_max": 3.0}, tool_sums={"episode/turns_max": 5.0}))
    assert total.sums == {"rollout/preemptions": 0.0, "count": 8.0, "response/length_max": 6.0}
    assert total.tool_sums == {"episode/turns_max": 5.0}, "a *_max key keeps the larger"


def test_the_last_step_without_a_probe_logs_no_probe_metrics():
    """trainer.weight_probe=false: check_last_push gives {} and the step's row keeps what it had (worse_probe)."""
    from grpo_lib.rollout.weight_probe import worse_probe

    assert worse_probe({"actor/pg_loss": 0.1}, {}) == {}
    rollouts = {"rollout/weight_probe_abs_diff": 1e-6, "rollout/weight_probe_tolerance": 8e-6, "actor/pg_loss": 0.1}
    assert worse_probe(rollouts, {}) == {"rollout/weight_probe_abs_diff": 1e-6, "rollout/weight_probe_tolerance": 8e-6}
