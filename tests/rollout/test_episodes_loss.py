"""The loss of a multi-turn batch trains on the model's tokens only (acceptance of issue 18, on CPU).

Episodes come from the scripted engine (tests/scripts/episode_case.py) over the tiny model's tokenizer; the batch is
what the trainer builds from them (`step.build_rollout_batch`). The loss mask is derived a second way, by hand, from
the engine's own records: every request of every turn is (context, sampled ids), and the sampled ids sit right after
the context in their row. The Actor's gradient on the episode batch (micro-batched, packed) must equal the gradient of
the loss written per row with every position outside that hand-built mask simply dropped
(`tests/test_grad_invariance.dropped_positions_loss`), for every aggregation mode (LOSS_AGG_MODES).
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib.algorithms import LOSS_AGG_MODES
from grpo_lib.config import load_config
from grpo_lib.model.actor import Actor
from grpo_lib.tools.builtin import CalculatorTool
from grpo_lib.trainer.step import build_rollout_batch
from tests.scripts import grad_case as case
from tests.scripts.episode_case import EchoTool, ScriptedEngine, call, calls_then_answer, make_prompts, make_runner, schema
from tests.model.test_grad_invariance import dropped_positions_loss

MAX_RESPONSE = 300


def config(model_dir, loss_agg_mode: str, **micro):
    dynamic = "max_tokens" in micro
    return load_config(None, [
        f"model.path={model_dir}", "model.dtype=float32", "model.use_remove_padding=true", "data.train_files=[unused.parquet]",
        "data.max_prompt_length=400", f"data.max_response_length={MAX_RESPONSE}", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2", "rollout.n=2", f"rollout.temperature={case.TEMPERATURE}",
        f"actor.loss_agg_mode={loss_agg_mode}", "actor.use_kl_loss=true", f"actor.kl_loss_coef={case.KL_COEF}",
        "actor.kl_loss_type=low_var_kl", f"actor.entropy_coeff={case.ENTROPY_COEFF}", "actor.grad_clip=0",
        f"actor.use_dynamic_bsz={str(dynamic).lower()}",
        f"actor.ppo_max_token_len_per_gpu={micro['max_tokens']}" if dynamic else f"actor.ppo_micro_batch_size_per_gpu={micro['size']}",
    ])


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """The tiny model's Actor, the episode batch (2 prompts x 2 episodes of 1 to 3 turns) and the hand-built mask."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = make_runner(tokenizer, {"calculator": CalculatorTool({}, schema("calculator", expression="string")),
                                     "echo": EchoTool({}, schema("echo", text="string"))})

    def script(context, seed):
        if "What is 1 + 1?" in context and seed % 2:
            return "#### 2"  # one episode answers at once: a row without holes
        return calls_then_answer(call("calculator", expression=f"6 * {seed % 9}"), "Again: " + call("echo", text="42"),
                                 answer="#### 42")(context, seed)

    engine = ScriptedEngine(tokenizer, script)
    prompts = make_prompts(runner, ["What is 1 + 1?", "What is 6 * 7?"])
    groups = runner.generate(engine, prompts, n=2, max_tokens=MAX_RESPONSE, seeds=[11, 20], temperature=case.TEMPERATURE)
    runner.toolbox.close()
    batch = build_rollout_batch(prompts, groups, pad_id=tokenizer.pad_token_id)
    by_hand = torch.zeros_like(batch.loss_mask)  # [B, T]
    for request in engine.calls:
        for context, sampled in zip(request["prompts"], request["sampled"]):  # n=1 per request
            full = context + sampled
            rows = [i for i in range(len(batch)) if batch.input_ids[i, :len(full)].tolist() == full]
            assert rows, "every sampled turn is in some row, right after its context"
            by_hand[rows, len(context):len(full)] = 1.0
    actor = Actor(config(tiny_model_dir, "token-mean", size=4), device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        current, _ = case.naive_logprobs(actor.model, batch)  # [B, T]
    response = batch.response_mask  # [B, T]
    # advantages, old and reference logprobs nonzero on EVERY response position (holes too), as grad_case does:
    # a term that read response_mask instead of loss_mask would change the gradient
    batch.advantages = torch.randn(len(batch), 1, generator=generator) * response  # [B, T]
    batch.old_logprobs = (current + 0.25 * torch.randn(current.shape, generator=generator)) * response  # [B, T]
    batch.ref_logprobs = (current + 0.3 * torch.randn(current.shape, generator=generator)) * response  # [B, T]
    batch.scores = torch.zeros(len(batch))
    hand_built = batch.select(list(range(len(batch))))
    hand_built.loss_mask = by_hand
    return dict(model_dir=tiny_model_dir, actor=actor, batch=batch, hand_built=hand_built, groups=groups)


def test_the_mask_is_exactly_the_sampled_positions(setup):
    batch, hand_built = setup["batch"], setup["hand_built"]
    assert torch.equal(batch.loss_mask, hand_built.loss_mask)
    holes = (batch.response_mask - batch.loss_mask).sum(-1)  # [B] tool and template tokens per row
    assert sorted(holes.tolist())[0] == 0 and (holes > 0).sum() == 3, "one row without a tool turn, three with two"


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_the_gradient_is_that_of_the_single_turn_batch_with_those_positions_dropped(setup, loss_agg_mode):
    actor, batch, hand_built = setup["actor"], setup["batch"], setup["hand_built"]
    cfg = config(setup["model_dir"], loss_agg_mode, size=4)
    actor.model.zero_grad(set_to_none=True)
    dropped_positions_loss(actor.model, hand_built, cfg).backward()
    expected = case.grads_of(actor.model)
    # every position's hidden state enters the backward: sums over the batch's tokens regroup, N * eps of each
    # tensor's scale (grad_case.GRAD_TOL's derivation, with this batch's token count)
    tol = float(batch.attention_mask.sum()) * torch.finfo(torch.float32).eps
    for micro in (dict(size=1), dict(size=3), dict(max_tokens=int(batch.attention_mask.sum(-1).max()))):
        actor.cfg = config(setup["model_dir"], loss_agg_mode, **micro)
        actor.model.zero_grad(set_to_none=True)
        actor.accumulate_gradients(batch)
        grads = case.grads_of(actor.model)
        assert any(g.abs().max() > 0 for g in expected.values())
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=tol * float(expected[name].abs().max()),
                                       msg=lambda m: f"{loss_agg_mode} {micro}: gradient of {name}: {m}")
