"""The hf engine's batched decoding (`grpo_lib/rollout/engines/hf.py`): one sampling call per step, rows leaving the batch.

`sample` is checked on hand-computed distributions (fast tier); the engine itself, in this process on the tiny model
(marked slow: it builds an engine), must give every sample what it gives when generated alone (seeded sampling does
not depend on the batch), shrink its batch as rows finish, and report each row once.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib.rollout.engines.hf import process_logits, sample


def test_sample_takes_each_token_with_its_probability_and_never_a_removed_one():
    """Probabilities [0.5, 0, 0.5]: cumulative [0.5, 0.5, 1.0]; a draw u takes the first token whose cumulative
    probability exceeds u: 0.25 -> 0, 0.5 -> 2 (token 1 adds nothing), 0.75 -> 2."""
    logits = torch.tensor([[0.5, 0.0, 0.5]]).log().expand(3, 3)  # [3, V]
    ids, lp = sample(logits, torch.tensor([0.25, 0.5, 0.75]))
    assert ids.tolist() == [0, 2, 2]
    assert torch.allclose(lp, torch.full((3,), 0.5).log())
    # top-k 2 of 4 logits: tokens 1 and 3 removed (-inf). Stratified draws (j + 0.5) / 1000 and the largest float32
    # below 1 take tokens in proportion to their probabilities (softmax of [3, 1] = 0.8808, 0.1192), never a removed one
    processed = process_logits(torch.tensor([[3.0, 0.0, 1.0, -1.0]]), temperature=1.0, top_k=2, top_p=1.0)  # [1, V]
    draws = torch.cat([(torch.arange(1000) + 0.5) / 1000, torch.tensor([1 - 2**-24])])  # [1001]
    ids, _ = sample(processed.expand(len(draws), 4), draws)
    counts = torch.bincount(ids, minlength=4).tolist()
    assert counts[1] == counts[3] == 0
    assert abs(counts[0] - 880.8) <= 1.5 and counts[0] + counts[2] == 1001, counts  # stratified: off by < 1 draw + the extra one


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from grpo_lib.config import RolloutConfig
    from grpo_lib.rollout.engines.hf import HFEngine

    return HFEngine(model_path=str(tiny_model_dir), cfg=RolloutConfig(max_num_seqs=16), on_cpu=True)


PROMPTS = [[11, 40, 7], [23, 5, 90, 91, 17], [60, 61], [101, 3, 44, 45]]
LIMITS = [3, 9, 5, 12]
SEEDS = [5, 50, 500, 5000]


@pytest.mark.slow
def test_rows_leave_the_batch_and_a_sample_does_not_depend_on_its_batch(engine):
    sizes, reports = [], []
    hook = engine.model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        batched = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=LIMITS, seeds=SEEDS, on_finished=reports.append)
    finally:
        hook.remove()
    lengths = [len(g.token_ids) for group in batched for g in group]
    assert all(length <= LIMITS[i // 2] for i, length in enumerate(lengths))
    # one forward per step; after each step the rows that finished are gone from the batch (and from its KV cache)
    assert sizes[0] == 8 and len(sizes) == max(lengths)
    assert sizes == [sum(length > t for length in lengths) for t in range(len(sizes))], (sizes, lengths)
    assert len(reports) == len(sizes), "on_finished after every decode step"
    flat = [(i, k, g) for finished in reports for i, k, g in finished]
    assert sorted((i, k) for i, k, _ in flat) == [(i, k) for i in range(4) for k in range(2)]
    assert all(g == batched[i][k] for i, k, g in flat)
    for i, prompt in enumerate(PROMPTS):  # each sample alone: its own seed, no other row in the batch
        for k in range(2):
            [[alone]] = engine.generate([prompt], n=1, temperature=1.0, max_tokens=LIMITS[i], seeds=[SEEDS[i] + k])
            assert alone.token_ids == batched[i][k].token_ids, f"prompt {i} sample {k} depends on its batch"
            # the same fp32 math on other batch shapes: logprobs of a ~1e-1..1e1 logit scale agree to ~1e-6
            assert max(abs(a - b) for a, b in zip(alone.logprobs, batched[i][k].logprobs)) < 1e-4


@pytest.mark.slow
def test_greedy_batched_equals_each_row_alone(engine):
    batched = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=LIMITS)
    for i, prompt in enumerate(PROMPTS):
        [[alone]] = engine.generate([prompt], n=1, temperature=0.0, max_tokens=LIMITS[i])
        assert alone.token_ids == batched[i][0].token_ids and alone.finish_reason == batched[i][0].finish_reason


@pytest.mark.slow
def test_compiled_engine_gives_the_eager_tokens(engine, tiny_model_dir):
    """rollout.hf_use_torch_compile: the compiled decode forward samples the same tokens and logprobs as eager, greedy
    and seeded, through rows leaving the batch (dynamic shapes), and reads pushed weights without a rebuild."""
    from grpo_lib.config import RolloutConfig
    from grpo_lib.rollout.engines.hf import HFEngine

    compiled = HFEngine(model_path=str(tiny_model_dir), cfg=RolloutConfig(max_num_seqs=16, hf_use_torch_compile=True),
                        on_cpu=True)
    assert compiled.forward is not compiled.model, "the decode forward is the compiled module"
    for temperature in (0.0, 1.0):
        want = engine.generate(PROMPTS, n=2, temperature=temperature, max_tokens=LIMITS, seeds=SEEDS)
        got = compiled.generate(PROMPTS, n=2, temperature=temperature, max_tokens=LIMITS, seeds=SEEDS)
        assert [[g.token_ids for g in group] for group in got] == [[g.token_ids for g in group] for group in want]
        for group_got, group_want in zip(got, want):
            for g, w in zip(group_got, group_want):
                torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
    with torch.no_grad():  # a push: new weights (the embedding scaled), read by the compiled forward at the next call
        scaled = [(name, p * 0.5 if "embed" in name else p) for name, p in engine.model.named_parameters()]
        compiled.push_weights(scaled)
        engine.push_weights(scaled)
    try:
        want = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=LIMITS)
        got = compiled.generate(PROMPTS, n=1, temperature=0.0, max_tokens=LIMITS)
        assert [g[0].token_ids for g in got] == [g[0].token_ids for g in want]
    finally:  # the module-scoped engine back to its weights
        with torch.no_grad():
            engine.push_weights([(name, p * 2.0 if "embed" in name else p) for name, p in engine.model.named_parameters()])
