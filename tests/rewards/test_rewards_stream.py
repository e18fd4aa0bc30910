"""Rewards scored while the engine generates (`RewardScorer.stream`, `rounds.collect_rollouts` / `rounds.validate`).

The stream must give exactly what one `score` call after generation gives (same values, order, counts), however the
responses arrive; a hang during generation must not cut responses that finish later; a stream abandoned by an
exception leaves nothing stale for the next batch. One reward pool (real worker processes) serves the module.
"""

from __future__ import annotations

import random
import textwrap
import time

import pytest

from grpo_lib.config import load_config
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.rewards import RewardScorer
from grpo_lib.trainer import rounds

REWARD = textwrap.dedent('''
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise ValueError("bad response")
        if solution_str == "hang":
            time.sleep(60)
        if solution_str == "dict":
            return {"score": 0.5, "acc": 1}
        return float(solution_str == ground_truth) + 0.01 * len(solution_str)
''')


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD)
    with RewardScorer(functions=[{"name": "custom", "weight": 1.0}, {"name": "format", "weight": 0.1}], custom_path=str(path),
                      timeout_s=1.0, num_workers=1) as scorer:
        yield scorer


def batch_lists(responses: list[str]) -> dict:
    return dict(responses=responses, data_sources=["openai/gsm8k"] * len(responses),
                ground_truths=[str(i % 3) for i in range(len(responses))], extra_infos=[{"index": i} for i in range(len(responses))])


def test_stream_equals_score_in_any_arrival_order(scorer):
    responses = [str(i % 4) for i in range(20)] + ["raise", "dict", "#### 7", ""]
    lists = batch_lists(responses)
    expected = scorer.score(**lists)
    assert expected.num_errors == 1 and "acc" in expected.extra, "the batch must exercise errors and extra fields"
    order = list(range(len(responses)))
    random.Random(0).shuffle(order)
    with scorer.stream() as stream:
        for index in order[:15]:  # 15 arrive while "generating", the other 9 only at finish
            stream.add(index, response=responses[index], data_source=lists["data_sources"][index],
                       ground_truth=lists["ground_truths"][index], extra_info=lists["extra_infos"][index])
            stream.poll()
        assert stream.num_added == 15
        got = stream.finish(**lists)
    assert got == expected  # a dataclass: scores, per-function scores, extra fields, counts and error samples


def test_stream_refuses_a_response_added_with_another_text(scorer):
    lists = batch_lists(["1", "2"])
    with pytest.raises(AssertionError, match="another text"):
        with scorer.stream() as stream:
            stream.add(0, response="not what finish gets", data_source="openai/gsm8k", ground_truth="0", extra_info=None)
            stream.finish(**lists)
    assert scorer.score(**lists).scores == scorer.score(**lists).scores  # the pool is usable afterwards


def test_abandoned_stream_leaves_nothing_stale_for_the_next_batch(scorer):
    """An exception mid-generation (engine error, stop) cancels the stream; its calls' results never show up later."""
    with pytest.raises(RuntimeError):
        with scorer.stream() as stream:
            for index in range(6):
                stream.add(index, response="hang" if index == 0 else "0", data_source="openai/gsm8k", ground_truth="1",
                           extra_info=None)
            raise RuntimeError("the engine failed")
    lists = batch_lists(["0", "1", "2"])  # ground truths 0, 1, 2: each response is right
    out = scorer.score(**lists)
    assert out.per_function["custom"] == [1.01, 1.01, 1.01] and out.num_errors == out.num_timeouts == 0


def test_hang_during_generation_does_not_cut_responses_that_finish_later(scorer):
    """timeout_s 1: the hung call starts at t=0 and is killed after its own timeout; responses arriving 2.5 s later
    (generation still running) are scored, not 'not run: the batch's deadline passed'."""
    lists = batch_lists(["hang", "0", "1", "2"])
    lists["ground_truths"] = ["x", "0", "1", "2"]
    start = time.monotonic()
    with scorer.stream() as stream:
        stream.add(0, response="hang", data_source="openai/gsm8k", ground_truth="x", extra_info=lists["extra_infos"][0])
        while time.monotonic() - start < 2.5:  # "generation": the engine polls the stream between its steps
            stream.poll()
            time.sleep(0.01)
        out = stream.finish(**lists)
    assert out.num_timeouts == 1 and out.num_errors == 0, out.error_samples
    assert out.per_function["custom"][1:] == [1.01, 1.01, 1.01]


# ------------------------------------------------------------------------------------------ the step's call site


class FinishingEngine:
    """Responses of different lengths, reported through on_finished shortest first (as an engine finishes them)."""

    pad_id = 0
    weight_version = 0  # the engine's weights as built (engines.base.EngineGlue)

    def __init__(self, *, report: bool = True):
        self.report, self.reported = report, []

    def pop_metrics(self, prefix=""):
        return {"rollout/preemptions": 0.0}

    def generate(self, prompt_ids, *, n, seeds, on_finished=None, **kwargs):
        out = []
        for i, seed in enumerate(seeds):
            group = []
            for k in range(n):
                rng = random.Random(seed + k)
                length = rng.randrange(1, 6)
                group.append(Generation(token_ids=[10 + rng.randrange(5) for _ in range(length)], logprobs=[-1.0] * length,
                                        text=str(rng.randrange(3)), finish_reason="stop"))
            out.append(group)
        if on_finished is not None and self.report:
            order = sorted(((i, k) for i in range(len(out)) for k in range(n)), key=lambda ik: len(out[ik[0]][ik[1]].token_ids))
            for i, k in order:
                on_finished([(i, k, out[i][k])])
                on_finished([])
                self.reported.append((i, k))
        return out


class Prompts:
    def __len__(self):
        return 6

    def batch(self, idx):
        return PromptBatch(prompt_ids=[[100 + i, 7] for i in idx], group_ids=[f"p{i}" for i in idx],
                           data_sources=["openai/gsm8k"] * len(idx), ground_truths=[str(i % 3) for i in idx],
                           extra_infos=[{"index": i} for i in idx])

    @property
    def data_sources(self):
        return ["openai/gsm8k"] * 6


class Sampler:
    def next_batch(self):
        return [0, 1, 2, 3]


def small_cfg(tmp_path):
    return load_config(None, ["model.path=unused", f"data.train_files=[{tmp_path}/x.parquet]", "data.train_batch_size=4",
                              "actor.ppo_mini_batch_size=4", "rollout.n=3", "rollout.val_kwargs.n=2",
                              "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0",
                              "actor.use_dynamic_bsz=true", f"trainer.default_local_dir={tmp_path}/out"])


@pytest.mark.parametrize("world_size, rank", [(1, 0), (2, 1)], ids=["one process", "rank 1 of 2 (keeps half)"])
def test_collect_rollouts_streamed_equals_scored_after(scorer, tmp_path, world_size, rank, monkeypatch):
    """Same scores and reward metrics with the stream as with one score call after generation; the engine's reports
    reached the stream (so the rewards really were handed out during generation); timing_s/reward_exposed is logged."""
    cfg = small_cfg(tmp_path)
    runs = {}
    for streamed in (True, False):
        engine, timings = FinishingEngine(), {}
        added = []

        def stream():
            s = RewardScorer.stream(scorer)
            real_add = s.add
            s.add = lambda index, **kw: (added.append(index), real_add(index, **kw))
            return s

        monkeypatch.setattr(scorer, "stream", stream)
        batch, metrics = rounds.collect_rollouts(cfg, engine, scorer, Prompts(), Sampler(), step=1, world_size=world_size,
                                               rank=rank, timings=timings, stream_rewards=streamed)
        runs[streamed] = (batch, metrics, timings, added)
    (b1, m1, t1, added), (b0, m0, t0, added_after) = runs[True], runs[False]
    assert b1.scores.tolist() == b0.scores.tolist() and b1.response_texts == b0.response_texts
    assert {k: v for k, v in m1.items()} == m0
    assert sorted(added) == list(range(len(b1))), "every kept response was added as the engine reported it"
    assert added != sorted(added), "the responses arrived in finish order, not row order"
    assert added_after == list(range(len(b0))), "without streaming every response is added at finish, in row order"
    assert t1["timing_s/reward_exposed"] >= 0 and "timing_s/reward_exposed" in t0


def test_validate_streams_and_equals_scored_after(scorer, tmp_path):
    cfg = small_cfg(tmp_path)
    streamed, _ = rounds.validate(cfg, FinishingEngine(), scorer, Prompts(), world_size=1, rank=0)
    after, _ = rounds.validate(cfg, FinishingEngine(report=False), scorer, Prompts(), world_size=1, rank=0)
    assert streamed == after and "val/openai/gsm8k/acc" in streamed
