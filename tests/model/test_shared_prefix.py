"""Tests for shared-prompt packing: GRPO's n responses to one prompt run that prompt through the decoder once
(`packing.pack_shared_prefixes`, grpo_varlen's continuation segments, `logprobs.choose_layout`).

Run: `.venv/bin/python -m pytest tests/model/test_shared_prefix.py`.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib.model import attention
from grpo_lib.model.logprobs import choose_layout, prefix_lengths, token_logprobs
from grpo_lib.model.packing import check_packing_isolated, pack_shared_prefixes, shared_prefix_rows, shared_prefix_tokens
from tests.model.test_logprobs import tiny_qwen3


def group_batch(prompt_lens: list[int], responses: list[list[int]], *, seed: int = 0):
    """Right-padded rows: group g is prompt g (prompt_lens[g] random tokens) followed by each of its responses' lengths;
    returns ids, mask and the score (loss) mask [b, T] that is 1 on the responses."""
    generator = torch.Generator().manual_seed(seed)
    rows = [(g, r) for g, lens in enumerate(responses) for r in lens]
    width = max(prompt_lens[g] + r for g, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # [b, T]
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [b, T]
    score = torch.zeros(len(rows), width)  # [b, T]
    prompts = [torch.randint(1, 128, (p,), generator=generator) for p in prompt_lens]
    for i, (g, r) in enumerate(rows):
        p = prompt_lens[g]
        ids[i, :p] = prompts[g]
        ids[i, p : p + r] = torch.randint(1, 128, (r,), generator=generator)
        mask[i, : p + r] = 1
        score[i, p : p + r] = 1.0
    return ids, mask, score


def test_layout_of_the_docstring_example():
    ids = torch.tensor([[5, 6, 8], [5, 6, 9]])
    packed = pack_shared_prefixes(ids, torch.ones_like(ids), [2, 2])
    assert packed.input_ids.tolist() == [[5, 6, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2]]
    assert packed.cu_seqlens.tolist() == [0, 2, 3, 4] and packed.continues == (-1, 0, 0) and packed.max_seqlen == 2
    assert packed.padded_to_packed.tolist() == [[0, 1, 2], [0, 1, 3]]


def test_rows_share_only_an_identical_prefix():
    """Equal prompts share; a prompt of the same length but other tokens, a row scoring nothing (prefix length 0) and a
    lone row do not (a lone row goes whole: one segment)."""
    ids = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 2], [5, 9, 7, 3], [5, 6, 4, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    assert shared_prefix_rows(ids, mask, [2, 2, 2, 2, 0]) == [(2, [0, 1, 3]), (0, [2]), (0, [4])]
    assert shared_prefix_tokens(ids, mask, [2, 2, 2, 2, 0]) == 19 - 2 * 2
    packed = pack_shared_prefixes(ids, mask, [2, 2, 2, 2, 0])
    assert packed.continues == (-1, 0, 0, 0, -1, -1)  # prompt, 3 continuations, 2 whole rows
    assert packed.cu_seqlens.diff().tolist() == [2, 2, 2, 1, 4, 4]
    flat = packed.input_ids[0]
    real = mask.bool()
    assert torch.equal(flat[packed.padded_to_packed[real]], ids[real]), "every real position maps to its own token"
    assert bool((packed.padded_to_packed[~real] == -1).all())


def test_prefix_lengths_are_the_tokens_before_the_first_scored_one():
    assert prefix_lengths(torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]])) == [2, 1, 0]


def test_layout_choice():
    """Shared where prompts repeat and it computes < 90% of the padded block, packed where lengths spread alone,
    padded otherwise or with packing off; the token counts are what the decoder runs over."""
    ids, mask, score = group_batch([30], [[128] * 8])  # no length spread, one prompt for 8 rows
    assert choose_layout(ids, mask, score, remove_padding=True, share_prefixes=True) == ("shared_prefix", 30 + 8 * 128)
    assert choose_layout(ids, mask, score, remove_padding=True, share_prefixes=False) == ("padded", 8 * 158)
    assert choose_layout(ids, mask, score, remove_padding=False, share_prefixes=True) == ("padded", 8 * 158)
    assert choose_layout(ids, mask, None, remove_padding=True, share_prefixes=True) == ("padded", 8 * 158)
    ids, mask, score = group_batch([3, 4], [[100], [5]])  # spread, nothing shared
    assert choose_layout(ids, mask, score, remove_padding=True, share_prefixes=True) == ("packed", 103 + 9)
    ids, mask, score = group_batch([2], [[100, 100]])  # a 2-token prompt: shared saves 2 of 204 tokens, not enough
    assert choose_layout(ids, mask, score, remove_padding=True, share_prefixes=True) == ("padded", 204)


@pytest.mark.parametrize("holes", [False, True], ids=["contiguous", "holes"])
def test_shared_prompts_give_the_padded_logprobs_entropies_and_gradients(holes):
    """3 groups (prompts of 7, 1 and 12 tokens, 1-3 responses of 1-40 tokens): the shared-prompt row's logprobs,
    entropies and gradients equal the padded forward's (sdpa, same weights). A prompt's hidden states serve all its rows,
    so its gradient is the sum over them; the tolerances are the packed-vs-padded ones of test_attention (float32
    sums in another order: ~1e-7 relative per op; logprobs O(5), gradients up to ~10; a leak between rows moves
    logprobs by O(1e-1))."""
    attention.register()
    model = tiny_qwen3(tie_word_embeddings=True)
    model.set_attn_implementation(attention.VARLEN_NAME)
    reference = tiny_qwen3(tie_word_embeddings=True)
    ids, mask, score = group_batch([7, 1, 12], [[20, 40, 1], [9], [33, 5]])
    if holes:  # tool output in the middle of row 0, the whole first response token of row 1 masked (shares nothing)
        score[0, 12:18] = 0.0
        score[1, 7] = 0.0
    assert choose_layout(ids, mask, score, remove_padding=True, share_prefixes=True)[0] == "shared_prefix"

    def run(m, **kwargs):
        lp, ent = token_logprobs(m, ids, mask, score_mask=score, compute_entropy=True, **kwargs)
        ((lp * score).sum() + 0.1 * (ent * score).sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return lp.detach(), ent.detach(), grads

    lp, ent, grads = run(reference)
    shared_lp, shared_ent, shared_grads = run(model, remove_padding=True, share_prefixes=True)
    torch.testing.assert_close(shared_lp * score, lp * score, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_ent * score, ent * score, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def test_unscored_positions_get_their_values_too():
    """score_unmasked=True (the old-logprob pass) scores the prompt's tokens from the shared copy: equal to padded."""
    attention.register()
    model = tiny_qwen3()
    model.set_attn_implementation(attention.VARLEN_NAME)
    ids, mask, score = group_batch([9, 5], [[30, 30], [12, 40, 2]])
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, mask, score_mask=score, score_unmasked=True)
        shared, _ = token_logprobs(model, ids, mask, score_mask=score, score_unmasked=True, remove_padding=True,
                                   share_prefixes=True)
    assert bool((padded[:2, 1:9] != 0).all()) and bool((padded[2:, 1:5] != 0).all()), "prompt tokens are scored"
    torch.testing.assert_close(shared, padded, atol=1e-5, rtol=0)


def test_sharing_needs_grpo_varlen():
    model = tiny_qwen3()  # sdpa
    ids, mask, score = group_batch([9], [[30, 30]])
    assert not attention.shares_prefixes(model)
    with pytest.raises(AssertionError, match="grpo_varlen"):
        token_logprobs(model, ids, mask, score_mask=score, remove_padding=True, share_prefixes=True)


def test_start_up_check_catches_a_continuation_that_ignores_its_prompt(monkeypatch):
    """If continuation segments did not see their prompt, the start-up isolation check would stop the run."""
    attention.register()
    model = tiny_qwen3()
    model.set_attn_implementation(attention.VARLEN_NAME)
    check_packing_isolated(model)  # the real attention passes
    real = attention._shared_prefix_attention

    def forgetful(module, query, key, value, cu_seq_lens, continues, **kwargs):
        return real(module, query, key, value, cu_seq_lens, tuple(-1 for _ in continues), **kwargs)

    monkeypatch.setattr(attention, "_shared_prefix_attention", forgetful)
    with pytest.raises(RuntimeError, match="shared-prompt"):
        check_packing_isolated(model)


def test_token_budget_keeps_a_groups_rows_together():
    """With group ids, a token-budgeted partition keeps each group's rows in one micro-batch where they fit (rows that
    share a prompt then share its forward), cuts a group over the budget into consecutive runs that fit, keeps every
    micro-batch within the budget, and still gives the count asked for."""
    from grpo_lib.model.batching import micro_batch_indices

    lens = [40, 50, 30, 60, 20, 25, 70, 80, 90]
    groups = ["a", "a", "a", "b", "b", "c", "d", "d", "d"]
    parts = micro_batch_indices(lens, max_tokens=160, groups=groups)
    assert sorted(i for p in parts for i in p) == list(range(len(lens)))
    assert all(sum(lens[i] for i in p) <= 160 for p in parts)
    where = {i: k for k, p in enumerate(parts) for i in p}
    assert where[0] == where[1] == where[2] and where[3] == where[4], parts  # groups a, b whole
    assert where[6] == where[7] != where[8], parts  # d (240 tokens) cut into [6, 7] and [8]
    five = micro_batch_indices(lens, max_tokens=160, groups=groups, min_num_micro_batches=5)
    assert len(five) == 5 and all(sum(lens[i] for i in p) <= 160 for p in five)
    many = micro_batch_indices(lens, max_tokens=160, groups=groups, min_num_micro_batches=8)  # more parts than units
    assert len(many) == 8 and sorted(i for p in many for i in p) == list(range(len(lens)))


def test_lower_right_mask_of_each_device_gives_the_same_attention():
    """A continuation's mask: the CPU's cached boolean mask and the bias the CUDA branch returns (torch's
    causal_lower_right, evaluated here on CPU tensors) give the attention of the last queries of a causal sequence."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 16, generator=generator)  # [1, Hq, T, D]: a 4-token prompt + a 5-token response
    k, v = (torch.randn(1, 2, 9, 16, generator=generator) for _ in range(2))  # [1, Hkv, T, D]
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, 4:]
    for device in ("cpu", "cuda"):  # the CUDA branch builds no CUDA tensor: its bias is evaluated on the CPU here
        mask = attention._lower_right_causal(5, 9, torch.device(device))
        got = torch.nn.functional.scaled_dot_product_attention(q[:, :, 4:], k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, full, rtol=0, atol=1e-6, msg=f"the {device} branch's mask")
    cpu = torch.device("cpu")
    assert attention._lower_right_causal(5, 9, cpu) is attention._lower_right_causal(5, 9, cpu), "cached per shape"
