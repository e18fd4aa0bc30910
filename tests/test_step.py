"""grpo_lib.step on hand-built rows: `build_rollout_batch` fills response_mask and loss_mask (a Generation's own
per-token loss mask, None meaning all 1), and `compute_advantages` reads the loss mask (advantages, KL in the
reward) while the score stays on the response's last token. Run: `.venv/bin/python -m pytest tests/test_step.py`.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib import step
from grpo_lib.config import load_config
from grpo_lib.types import Generation, PromptBatch


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
