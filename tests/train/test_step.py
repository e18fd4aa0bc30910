"""grpo_lib.trainer.step on hand-built rows: `build_rollout_batch` fills response_mask and loss_mask (a Generation's own
per-token loss mask, None meaning all 1), and `compute_advantages` reads the loss mask (advantages, KL in the
reward) while the score stays on the response's last token. Run: `.venv/bin/python -m pytest tests/train/test_step.py`.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib import algorithms
from grpo_lib.config import load_config
from grpo_lib.config.schema import OverlongBufferConfig
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.rewards import RewardOutput
from grpo_lib.trainer import rounds
from grpo_lib.trainer import step


def prompts(*prompt_ids: list[int]) -> PromptBatch:
    k = len(prompt_ids)
    return PromptBatch(prompt_ids=list(prompt_ids), group_ids=[f"g{i}" for i in range(k)], data_sources=["fake"] * k,
                       ground_truths=["0"] * k, extra_infos=[{}] * k)


def gen(ids: list[int], loss_mask: list[int] | None = None) -> Generation:
    return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), text="", finish_reason="stop", loss_mask=loss_mask)


def test_single_turn_loss_mask_is_the_response_mask():
    # prompt [5, 6], responses [7, 2] and [8], pad 0 (the docstring's example)
    batch = step.build_rollout_batch(prompts([5, 6]), [[gen([7, 2]), gen([8])]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 2], [5, 6, 8, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert torch.equal(batch.loss_mask, batch.response_mask) and batch.loss_mask.dtype == torch.float32


def test_generation_loss_mask_leaves_a_hole_inside_the_response():
    # prompt [5, 6]; response [7, 9, 9, 2]: the two 9s are a tool's output (loss_mask 0); a second response masked
    # whole (a masked truncation). response_mask stays prompt end to sequence end, loss_mask has the holes.
    batch = step.build_rollout_batch(prompts([5, 6]), [[gen([7, 9, 9, 2], [1, 0, 0, 1]), gen([8, 3], [0, 0])]], pad_id=0)
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0]]
    assert batch.response_lengths.tolist() == [4, 2], "response lengths count the tokens after the prompt, holes included"
    selected = batch.select([1, 0])
    assert selected.loss_mask.tolist() == [[0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 1]]


def test_generation_loss_mask_must_match_its_tokens():
    with pytest.raises(AssertionError, match="one 0 or 1 per response token"):
        step.build_rollout_batch(prompts([5]), [[gen([7, 2], [1])]])
    with pytest.raises(AssertionError, match="one 0 or 1 per response token"):
        step.build_rollout_batch(prompts([5]), [[gen([7, 2], [1, 2])]])


def test_advantages_and_kl_in_reward_read_the_loss_mask(tmp_path):
    # One group of 2 rows, prompt [5]; row 0 = [7, 9, 2] with the 9 a hole, row 1 = [8, 4] masked whole, its last
    # response token (position 2) out of the loss. Scores 1 and 0; old - ref = 0.5 everywhere but at row 0's hole (0).
    cfg = load_config(None, [f"model.path={tmp_path}", "data.train_files=[unused.parquet]", "data.train_batch_size=1",
                             "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=2", "rollout.n=2",
                             "algorithm.use_kl_in_reward=true",
                             "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.kl_coef=0.1"])
    batch = step.build_rollout_batch(prompts([5]), [[gen([7, 9, 2], [1, 0, 1]), gen([8, 4], [0, 0])]], pad_id=0)
    batch.scores = torch.tensor([1.0, 0.0])
    batch.old_logprobs = torch.full((2, 4), -1.0)  # [2, 4]
    batch.ref_logprobs = torch.full((2, 4), -1.5)  # [2, 4]
    batch.ref_logprobs[0, 2] = -1.0
    metrics = step.compute_advantages(cfg, batch)
    # k1 = old - ref = 0.5 on the loss tokens only: row 0 positions 1 and 3; row 1 none. Token rewards: the score on
    # the response's last token (row 0 position 3, row 1 position 2, out of the loss but still the response's end)
    # minus 0.1 * 0.5 on each loss token. Sequence scores 1 - 2 * 0.05 = 0.9 and 0.
    eps = torch.finfo(torch.float32).eps  # float32 round-off: each expected value is a few float32 operations away
    torch.testing.assert_close(batch.token_rewards, torch.tensor([[0, -0.05, 0, 0.95], [0, 0, 0, 0]]), rtol=2 * eps, atol=0)
    assert metrics["critic/kl_in_reward"] == 0.5, "mean over the 2 loss tokens (over the 5 response tokens: 0.4); exact in float32"
    # GRPO, 2 rows: mean 0.45, std (Bessel) = 0.9 / sqrt(2) -> A = +-0.45 / (0.6364 + 1e-6) = +-0.7071, on loss tokens
    # (row 1 has none, so its -0.7071 appears nowhere). About 8 float32 operations (sums, mean, sqrt, divisions): 8 eps.
    a = 0.45 / (0.9 / 2 ** 0.5 + 1e-6)
    torch.testing.assert_close(batch.advantages, torch.tensor([[0, a, 0, a], [0, 0, 0, 0]]), rtol=8 * eps, atol=0)


# ------------------------------------------------------------------------------- DAPO: overlong penalty, filter metrics,
# truncation masking


def test_overlong_penalty_hand_values():
    # max_resp_len 20, buffer 4: expected = 20 - 4 = 16 tokens are free; beyond that min(-(L - 16) / 4 * factor, 0):
    # L=15 -> -(-1)/4 = +0.25 -> min(., 0) = 0; L=16 -> 0; L=17 -> -1/4 = -0.25; L=20 -> -4/4 = -1.0
    lengths = torch.tensor([15.0, 16.0, 17.0, 20.0])
    penalty = algorithms.overlong_penalty(lengths, max_resp_len=20, buffer_len=4, penalty_factor=1.0)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -1.0]
    # factor 0.5 halves it: L=18 -> -2/4 * 0.5 = -0.25, L=20 -> -0.5
    half = algorithms.overlong_penalty(torch.tensor([18.0, 20.0]), max_resp_len=20, buffer_len=4, penalty_factor=0.5)
    assert half.tolist() == [-0.25, -0.5]


class ListScorer:
    """Scores, accuracy and format values given per response, in batch order."""

    def __init__(self, accuracy, fmt=None):
        self.accuracy, self.fmt = accuracy, fmt

    def score(self, *, responses, data_sources, ground_truths, extra_infos):
        per_function = {"accuracy": list(self.accuracy)}
        if self.fmt is not None:
            per_function["format"] = list(self.fmt)
        scores = [a + (f if self.fmt else 0.0) for a, f in zip(self.accuracy, self.fmt or [0.0] * len(self.accuracy))]
        return RewardOutput(scores=scores, per_function=per_function, extra={}, num_errors=0, num_timeouts=0)


def overlong(enable=True, length=4, factor=1.0, max_resp_len=None):
    return OverlongBufferConfig(enable=enable, len=length, penalty_factor=factor, max_resp_len=max_resp_len)


def test_score_adds_the_overlong_penalty_after_the_reward_functions():
    # One group, prompt [5]; responses of 15, 17 and 20 tokens, the 17-token one a multi-turn episode with a 5-token
    # tool output (loss_mask 0): the length is the whole response, holes included (verl's DAPO manager counts the
    # response's attention mask), so it is 17 -> -0.25. Accuracy 1, 1, 0 -> scores 1 + 0, 1 - 0.25, 0 - 1.0.
    batch = step.build_rollout_batch(prompts([5]), [[gen([7] * 15), gen([7] * 17, [1] * 6 + [0] * 5 + [1] * 6), gen([7] * 20)]])
    sums = step.score(ListScorer([1.0, 1.0, 0.0]), batch, overlong_buffer=overlong(), max_response_length=20)
    assert batch.scores.tolist() == [1.0, 0.75, -1.0]
    assert batch.overlong_penalties.tolist() == [0.0, -0.25, -1.0] and batch.accuracies.tolist() == [1.0, 1.0, 0.0]
    assert sums["reward/overlong_penalty_mean"] == -1.25, "a sum here; collect_rollouts divides by the response count"
    assert sums["reward/accuracy/mean"] == 2.0, "the reward functions' own metrics are before the penalty"
    # overlong_buffer.max_resp_len (verl's reward_kwargs.max_resp_len) replaces data.max_response_length: 24 - 4 = 20 free
    step.score(ListScorer([1.0, 1.0, 0.0]), batch, overlong_buffer=overlong(max_resp_len=24), max_response_length=20)
    assert batch.scores.tolist() == [1.0, 1.0, 0.0]
    # off (the default): the scores are the reward functions', bit for bit, and no overlong metric
    sums = step.score(ListScorer([1.0, 1.0, 0.0]), batch, overlong_buffer=overlong(enable=False), max_response_length=20)
    assert batch.scores.tolist() == [1.0, 1.0, 0.0] and "reward/overlong_penalty_mean" not in sums


def test_filter_groups_metrics_pick_their_values():
    # Three groups of 2 (prompt [5], [6], [7]); per row (accuracy, format, overlong penalty):
    #   g0: (1, 0, 0) and (1, 0.2, 0)       acc equal, score 1 | 1.2 differs -> kept by score and seq_reward
    #   g1: (1, 0, 0) and (0, 0, 0)         all differ -> kept by every metric
    #   g2: (1, 0, 0) and (1, 0, -0.5)      acc, score equal; seq_reward 1 | 0.5 differs -> kept by seq_reward only
    batch = step.build_rollout_batch(prompts([5], [6], [7]), [[gen([7] * 3), gen([7] * 3)], [gen([7] * 3), gen([7] * 3)],
                                                             [gen([7] * 3), gen([7] * 18)]])
    step.score(ListScorer([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], fmt=[0.0, 0.2, 0.0, 0.0, 0.0, 0.0]), batch,
               overlong_buffer=overlong(), max_response_length=20)  # the 18-token row: -(18 - 16) / 4 = -0.5
    assert batch.overlong_penalties.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -0.5]
    assert step.informative_groups(batch, "acc") == ["g1"]
    assert step.informative_groups(batch, "score") == ["g0", "g1"]
    assert step.informative_groups(batch, "seq_reward") == ["g0", "g1", "g2"]
    assert step.informative_groups(batch, "seq_final_reward") == ["g0", "g1", "g2"]
    assert step.informative_groups(batch) == ["g0", "g1", "g2"], "the default, seq_reward: the scores as before"
    # acc from a custom reward's `acc` field when there is no accuracy function (verl's math_dapo returns one)
    custom = RewardOutput(scores=[1.0, 0.0, 1.0, 1.0, 0.5, 0.5], per_function={"custom": [1.0, 0.0, 1.0, 1.0, 0.5, 0.5]},
                          extra={"acc": [True, False, True, True, False, None]}, num_errors=0, num_timeouts=0)
    step.score(type("Custom", (), {"score": lambda self, **kw: custom})(), batch)
    # the last row's call returned no `acc` (None): its score 0.5 stands in (verl: acc = the score of a float return)
    assert batch.accuracies.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 0.5] and step.informative_groups(batch, "acc") == ["g0", "g2"]
    custom.extra = {}  # a custom reward returning floats: acc is its score
    step.score(type("Custom", (), {"score": lambda self, **kw: custom})(), batch)
    assert batch.accuracies.tolist() == custom.scores
    batch.accuracies = None
    with pytest.raises(AssertionError, match="metric=acc needs the accuracy reward"):
        step.informative_groups(batch, "acc")


class TruncatingEngine:
    """Two responses per prompt: [10, 1] stopped, [11, 12, 13, 14] cut at max_tokens=4 (finish reason length)."""

    pad_id = 0
    weight_version = 0  # the engine's weights as built (engines.base.EngineGlue)

    def pop_metrics(self, prefix=""):
        return {"rollout/preemptions": 0.0}

    def generate(self, prompt_ids, *, n, **kwargs):
        return [[Generation(token_ids=[10, 1], logprobs=[-1.0, -0.5], text="a", finish_reason="stop"),
                 Generation(token_ids=[11, 12, 13, 14], logprobs=[-1.0] * 4, text="b", finish_reason="length")]
                for _ in prompt_ids]


class OnePrompt:
    def batch(self, idx):
        return prompts(*[[5, 6] for _ in idx])


class FirstPrompt:
    def next_batch(self):
        return [0]


@pytest.mark.parametrize("mask", [False, True])
def test_collect_rollouts_masks_truncated_responses_and_keeps_their_score(tmp_path, mask):
    # max_response_length 4, overlong buffer 2 (factor 1): the stopped response (2 tokens) gets 0, the truncated one
    # (4 tokens) -(4 - 2) / 2 = -1. Accuracy 1 and 1 -> scores 1 and 0. With actor.mask_truncated_responses the
    # truncated row's loss_mask is all 0, its score (0) stays and still enters the group baseline.
    cfg = load_config(None, [f"model.path={tmp_path}", "data.train_files=[unused.parquet]", "data.train_batch_size=1",
                             "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=2", "rollout.n=2",
                             "data.max_response_length=4", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
                             f"actor.mask_truncated_responses={str(mask).lower()}"])
    batch, metrics = rounds.collect_rollouts(cfg, TruncatingEngine(), ListScorer([1.0, 1.0]), OnePrompt(), FirstPrompt(), step=1,
                                           world_size=1, rank=0, timings={})
    assert batch.scores.tolist() == [1.0, 0.0] and metrics["reward/overlong_penalty_mean"] == -0.5
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0] if mask else [0, 0, 1, 1, 1, 1]]
    step.compute_advantages(cfg, batch)
    # GRPO over 2 rows, scores 1 and 0: A = +-0.5 / (std 0.7071 + 1e-6); the masked row's -0.7071 lands on no token
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    torch.testing.assert_close(batch.advantages[0], torch.tensor([0, 0, a, a, 0, 0]))
    assert batch.advantages[1].abs().sum() == 0 if mask else torch.allclose(batch.advantages[1, 2:], torch.tensor(-a))
