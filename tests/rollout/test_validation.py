"""Validation (grpo_lib/rollout/validation.py, rounds.validate): DAPO's overlong shaping applies to validation rewards as in verl
(its validation reward manager is built with the training one's reward kwargs: the penalty is in the reward, not in
the accuracy), and a multi-turn run's validation logs the episode and tool metrics. In process: hand-built batches,
and rounds.validate over the episode loop with a scripted engine (tests/scripts/episode_case.py)."""

from __future__ import annotations

import pytest
import torch

from grpo_lib.config import Config
from tests.scripts.episode_case import ScriptedEngine, call, calls_then_answer, make_prompts, make_runner


class ContainsScorer:
    """accuracy 1.0 when the ground truth follows '#### ' in the response; the score is the accuracy."""

    def score(self, *, responses, data_sources, ground_truths, extra_infos):
        from grpo_lib.rewards import RewardOutput

        acc = [float(f"#### {g}" in r) for r, g in zip(responses, ground_truths)]
        return RewardOutput(scores=list(acc), per_function={"accuracy": acc}, extra={}, num_errors=0, num_timeouts=0)


def batch_of(rows: list[tuple[str, str, int]]):
    """[(response, ground truth, response length in tokens)], one prompt each, source "a" -> a RolloutBatch."""
    from grpo_lib.core.types import RolloutBatch

    B, T = len(rows), 2 + max(length for _, _, length in rows)
    response_mask = torch.zeros((B, T))  # [B, T] a 2-token prompt, then the response
    for i, (_, _, length) in enumerate(rows):
        response_mask[i, 2:2 + length] = 1.0
    zeros = torch.zeros((B, T))
    return RolloutBatch(input_ids=zeros.long(), attention_mask=(response_mask > 0).long(), response_mask=response_mask,
                        loss_mask=response_mask.clone(), rollout_logprobs=zeros, group_ids=[f"p{i}" for i in range(B)],
                        response_texts=[r for r, _, _ in rows], data_sources=["a"] * B, ground_truths=[g for _, g, _ in rows],
                        extra_infos=[{}] * B, truncated=torch.zeros(B, dtype=torch.bool))


def overlong(enable=True, len=4, penalty_factor=1.0, max_resp_len=None):
    from grpo_lib.config.schema import OverlongBufferConfig

    return OverlongBufferConfig(enable=enable, len=len, penalty_factor=penalty_factor, max_resp_len=max_resp_len)


def test_validation_reward_carries_the_overlong_penalty_and_accuracy_does_not():
    from grpo_lib.rollout.validation import val_metrics

    rows = [("#### 1", "1", 17), ("#### 0", "2", 15), ("#### 3", "3", 20)]
    # max_resp_len 20 (data.max_response_length), buffer 4: expected 16 tokens; penalty min(-(L - 16) / 4, 0):
    # L 17 -> -0.25, L 15 -> 0, L 20 -> -1.0. Scores 1, 0, 1 -> rewards 0.75, 0, 0; acc 2/3 either way.
    m = val_metrics(ContainsScorer(), batch_of(rows), sources=["a"], n=1, overlong_buffer=overlong(), max_response_length=20)
    assert m["val/a/reward_mean"] == pytest.approx((0.75 + 0.0 + 0.0) / 3) and m["val/reward_mean"] == m["val/a/reward_mean"]
    assert m["val/a/acc"] == pytest.approx(2 / 3), "accuracy is the score before the penalty (verl's acc)"
    assert m["val/a/overlong_penalty_mean"] == pytest.approx((-0.25 + 0.0 - 1.0) / 3)
    # overlong_buffer.max_resp_len replaces data.max_response_length: 18 -> expected 14: penalties -0.75, -0.25, -1.5
    m = val_metrics(ContainsScorer(), batch_of(rows), sources=["a"], n=1, overlong_buffer=overlong(max_resp_len=18, penalty_factor=1.0),
                    max_response_length=20)
    assert m["val/a/overlong_penalty_mean"] == pytest.approx((-0.75 - 0.25 - 1.5) / 3)
    assert m["val/a/reward_mean"] == pytest.approx((1 - 0.75 + 0 - 0.25 + 1 - 1.5) / 3)
    off = val_metrics(ContainsScorer(), batch_of(rows), sources=["a"], n=1, overlong_buffer=overlong(enable=False), max_response_length=20)
    assert off["val/a/reward_mean"] == pytest.approx(2 / 3) and "val/a/overlong_penalty_mean" not in off, "off: unchanged"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_validation_with_episodes_logs_episode_metrics_and_shapes_rewards(tokenizer):
    """rounds.validate over 3 prompts whose episodes call the calculator once, then answer: val/episode/* and val/tools/*
    are the training step's metrics over these episodes, and the overlong penalty is computed on the whole episode
    (tool tokens count, as verl's DAPO manager counts the response's attention mask)."""
    from grpo_lib.rollout.data import PromptDataset
    from grpo_lib.trainer import rounds

    runner = make_runner(tokenizer)
    try:
        questions = ["What is 6 * 7?", "What is 7 * 6?", "What is 42?"]
        prompts = make_prompts(runner, questions)
        script = calls_then_answer(call("calculator", expression="6 * 7"), answer="#### 42")
        # the episodes' lengths, from the same deterministic script (the model's turns do not depend on the seed here)
        [lengths] = [[len(g.token_ids) for group in runner.generate(ScriptedEngine(tokenizer, script), prompts, n=1, max_tokens=400,
                                                                    temperature=0.0, seeds=[0, 0, 0], logprobs=False)
                      for g in group]]
        dataset = PromptDataset(prompt_ids=prompts.prompt_ids, uids=["u0", "u1", "u2"], data_sources=["a"] * 3,
                                ground_truths=["42", "42", "7"], extra_infos=[{}] * 3, num_filtered=0, num_truncated=0,
                                messages=prompts.messages)
        cfg = Config()
        cfg.data.max_response_length = 400
        cfg.rollout.multi_turn.enable = True
        ob = cfg.reward.overlong_buffer
        ob.enable, ob.len, ob.max_resp_len = True, 10, max(lengths) + 5  # expected = max - 5: the longest is penalised -0.5
        metrics, _ = rounds.validate(cfg, ScriptedEngine(tokenizer, script), ContainsScorer(), dataset, world_size=1, rank=0,
                                episodes=runner)
    finally:
        runner.toolbox.close()
    assert metrics["val/episode/turns_mean"] == 2.0 and metrics["val/episode/turns_max"] == 2.0, metrics
    assert metrics["val/episode/tool_calls_mean"] == 1.0 and metrics["val/tools/calculator/calls"] == 3.0
    assert metrics["val/tools/errors"] == 0.0 and metrics["val/episode/stopped_length"] == 0.0
    expected = [min(-(L - (max(lengths) + 5 - 10)) / 10, 0.0) for L in lengths]
    assert metrics["val/a/overlong_penalty_mean"] == pytest.approx(sum(expected) / 3) and min(expected) <= -0.5
    assert metrics["val/a/acc"] == pytest.approx(2 / 3), "two of three ground truths are 42"
    assert metrics["val/a/reward_mean"] == pytest.approx((2 + sum(expected)) / 3)
