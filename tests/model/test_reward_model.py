"""The reward model (grpo_lib/model/reward_model.py): each row's score is the classification head at its last real token,
whatever the padding and the micro-batching; a re-rendered row is the reward model's own chat template of the prompt's
messages and the response text; the memory plan counts it."""

from __future__ import annotations

import pytest
import torch

from grpo_lib.config import load_config
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.trainer.step import build_rollout_batch


@pytest.fixture(scope="module")
def tiny_rm_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a one-label head (random: the tests compare computations, not preferences)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    out = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def rm_config(model_dir, rm_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "model.dtype=float32", "rollout.n=2",
                              "actor.ppo_micro_batch_size_per_gpu=2",
                              "reward_model.enable=true", f"reward_model.model.path={rm_dir}", *extra])


def batch_of(tokenizer, texts: list[tuple[str, str]]):
    """A RolloutBatch of (question, response) rows, one prompt each, with their chat messages."""
    messages = [[{"role": "user", "content": q}] for q, _ in texts]
    prompt_ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompt_ids]
    gens = [[Generation(token_ids=tokenizer(r + tokenizer.eos_token, add_special_tokens=False)["input_ids"], logprobs=[0.0] * len(
        tokenizer(r + tokenizer.eos_token, add_special_tokens=False)["input_ids"]), text=r, finish_reason="stop")] for _, r in texts]
    prompts = PromptBatch(prompt_ids=prompt_ids, group_ids=[str(i) for i in range(len(texts))], data_sources=["x"] * len(texts),
                          ground_truths=["1"] * len(texts), extra_infos=[{}] * len(texts), messages=messages)
    return build_rollout_batch(prompts, gens, pad_id=tokenizer.pad_token_id)


TEXTS = [("What is 3 + 4?", "3 + 4 = 7\n#### 7"), ("What is 1 + 1?", "#### 3"), ("What is 9 + 9?", "9 + 9 = 18, so\n#### 18")]


def test_each_score_is_the_head_at_the_rows_last_token_whatever_the_micro_batching(tiny_model_dir, tiny_rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo_lib.model.reward_model import RewardModel

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = batch_of(tokenizer, TEXTS)
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # one row at a time, no padding: transformers' own pooling reads the last token
        expected = [reference(input_ids=batch.input_ids[i][batch.attention_mask[i] > 0][None]).logits[0, 0].item()
                    for i in range(len(batch))]
    assert max(expected) - min(expected) > 1e-3, "rows must score differently for the comparison to mean anything"
    for micro in (1, 2, 8):
        rm = RewardModel(rm_config(tiny_model_dir, tiny_rm_dir, f"reward_model.micro_batch_size_per_gpu={micro}"),
                         device=torch.device("cpu"), policy_tokenizer=tokenizer)
        got = rm.score(batch)
        # float32, the same weights; padding changes only the attention's masked softmax terms (exp(-inf) = 0) and
        # the reduction order of a padded matmul: relative round-off of a few float32 ulps per layer
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-5), (micro, got, expected)
        assert rm.metrics == {"reward_model/truncated": 0.0}
    assert rm.score(batch.select([])) == [], "no rows: a dummy forward, nothing returned"


def test_a_rerendered_row_is_the_reward_models_chat_template_of_the_messages_and_the_response(tiny_model_dir, tiny_rm_dir):
    from transformers import AutoTokenizer

    from grpo_lib.model.reward_model import RewardModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = batch_of(tokenizer, TEXTS)
    rm = RewardModel(rm_config(tiny_model_dir, tiny_rm_dir, f"reward_model.model.input_tokenizer={tiny_model_dir}",
                               "reward_model.max_length=30", "data.max_prompt_length=20", "data.max_response_length=8"), device=torch.device("cpu"), policy_tokenizer=tokenizer)
    rows, cut = rm.inputs(batch)
    lengths = []
    for i, (question, response) in enumerate(TEXTS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}, {"role": "assistant", "content": response}],
                                             tokenize=False)
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert rows[i] == full[-30:], "the whole chat, the response as text, cut from the left to max_length"
        lengths.append(len(full))
    assert cut == sum(n > 30 for n in lengths) > 0, lengths
    rm.score(batch)
    assert rm.metrics["reward_model/truncated"] == cut


def test_the_plan_counts_the_reward_model(tmp_path):
    """A 7B-shaped reward model beside Qwen3-4B on 4 GPUs: resident shards unless offloaded, its pass in the scoring phase."""
    import json

    from grpo_lib.planning.memory import memory_plan, model_sizes

    policy, rm_sizes = (model_sizes(json.loads(open(f"tests/data/{name}_config.json").read())) for name in ("qwen3_4b", "qwen3_8b"))
    cfg = load_config("recipes/qwen3_4b_gsm8k.yaml", ["reward_model.enable=true", f"reward_model.model.path={tmp_path}"],
                      world_size=4)
    plan = memory_plan(cfg, policy, world_size=4, gpu_bytes=80 * 2**30, reward_model=rm_sizes)
    assert plan["reward model"] == pytest.approx(2 * rm_sizes.params / 4)
    assert plan["scoring phase"] > plan["generation phase"] and plan["peak"] >= plan["scoring phase"]
    cfg.reward_model.model.fsdp_config.param_offload = True
    offloaded = memory_plan(cfg, policy, world_size=4, gpu_bytes=80 * 2**30, reward_model=rm_sizes)
    assert offloaded["reward model"] == 0.0 and offloaded["generation phase"] < plan["generation phase"]
