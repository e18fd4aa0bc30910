"""Tests for grpo_lib.attention (packed-row attention implementations) and the packing decision of grpo_lib.logprobs.

Packing equivalence against padding runs on every implementation available on this machine; the others are skipped
with the reason `available_implementations` gives (flash-attn needs CUDA and the flash_attn package; torch 2.13's
CPU flex attention has no backward). Run: `.venv/bin/python -m pytest tests/test_attention.py`.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lib import attention
from grpo_lib.packing import check_packing_isolated, pack_sequences
from grpo_lib.logprobs import packing_pays, real_token_fraction, token_logprobs
from tests.test_logprobs import make_batch, tiny_qwen3

DEVICE = torch.device("cpu")
IMPLEMENTATIONS = list(attention.available_implementations(DEVICE))


def model_with(implementation: str) -> torch.nn.Module:
    reason = attention.available_implementations(DEVICE)[implementation]
    if reason is not None:
        pytest.skip(f"{implementation} does not train on this machine: {reason}")
    attention.register()
    model = tiny_qwen3(tie_word_embeddings=True)
    model.set_attn_implementation(implementation)
    return model


def grads_of(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_equals_padded_with_gradients_on_each_implementation(implementation):
    """8 sequences of 1-64 tokens: packed logprobs, entropies and gradients equal the padded ones.

    Padded reference: sdpa with the padding mask. Tolerances: the packed path computes the same float32 sums in
    another order / other kernels (~1e-7 relative per op); logprobs here are O(5) and gradients reach ~10, so 1e-5
    absolute on logprobs and 1e-4 relative on gradients leave a margin of ~10 over the round-off, and a leak between
    sequences changes logprobs by O(1e-1) or more (test_batching pins that).
    """
    model = model_with(implementation)
    reference = tiny_qwen3(tie_word_embeddings=True)  # same seed: same weights, sdpa
    ids, mask = make_batch([3, 40, 17, 64, 25, 9, 50, 1])
    padded, padded_entropy = token_logprobs(reference, ids, mask, compute_entropy=True)
    (padded * mask).sum().add(0.1 * (padded_entropy * mask).sum()).backward()
    expected = grads_of(reference)
    packed, packed_entropy = token_logprobs(model, ids, mask, remove_padding=True, compute_entropy=True)
    (packed * mask).sum().add(0.1 * (packed_entropy * mask).sum()).backward()
    torch.testing.assert_close(packed.detach(), padded.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_entropy.detach(), padded_entropy.detach(), atol=1e-5, rtol=0)
    grads = grads_of(model)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_start_up_isolation_check_passes_on_each_implementation(implementation):
    check_packing_isolated(model_with(implementation))


def test_varlen_packs_one_row_with_the_boundaries_as_kwargs(monkeypatch):
    """With a varlen implementation the decoder sees ONE packed row (no pad segment) and cu_seq_lens; with sdpa, rows
    of >= packed_row_tokens and no boundaries."""
    seen = []
    model = model_with(attention.VARLEN_NAME)
    inner = model.model.forward

    def spy(**kwargs):
        seen.append(kwargs)
        return inner(**kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    ids, mask = make_batch([3, 40, 17, 64])
    with torch.no_grad():
        token_logprobs(model, ids, mask, remove_padding=True, packed_row_tokens=64)
    assert tuple(seen[-1]["input_ids"].shape) == (1, 124), "one row of the 124 real tokens"
    assert seen[-1]["cu_seq_lens_q"].tolist() == [0, 3, 43, 60, 124] and seen[-1]["max_length_q"] == 64
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        token_logprobs(model, ids, mask, remove_padding=True, packed_row_tokens=64)
    assert seen[-1]["input_ids"].shape[0] == 2 and "cu_seq_lens_q" not in seen[-1], "dense: rows of >= 64 tokens"


def test_varlen_unpacked_is_sdpa():
    """Not packed (a 2D padding mask; here left padding), grpo_varlen is transformers' sdpa: the same logits."""
    model = model_with(attention.VARLEN_NAME)
    reference = tiny_qwen3(tie_word_embeddings=True)
    ids = torch.randint(1, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: needs the mask
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got[mask.bool()], expected[mask.bool()])


def test_segments_from_position_ids_and_cu_seq_lens():
    assert attention._segments(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [[(0, 3), (3, 5), (5, 6)]]
    packed = pack_sequences(torch.ones(3, 4, dtype=torch.long), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]),
                            num_rows=2)  # rows [4] and [2 + 1 + a 1-token pad segment]
    by_cu = attention._segments_from_cu(packed.cu_seqlens, *packed.input_ids.shape)
    assert by_cu == attention._segments(packed.position_ids)
    assert sorted(e - s for row in by_cu for s, e in row) == [1, 1, 2, 4]


def test_selection_and_reasons(monkeypatch):
    reasons = attention.available_implementations(DEVICE)
    assert reasons[attention.VARLEN_NAME] is None and reasons["sdpa"] is None
    assert "backward" in reasons["flex_attention"]
    assert attention.select_attn_implementation(DEVICE, torch.float32) == attention.VARLEN_NAME
    # Where flash-attn is installed on CUDA it wins for half-precision compute, never for float32 (it has no fp32 kernel).
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    cuda = torch.device("cuda")
    assert attention.available_implementations(cuda)["flash_attention_2"] is None
    assert attention.select_attn_implementation(cuda, torch.bfloat16) == "flash_attention_2"
    assert attention.select_attn_implementation(cuda, torch.float32) == attention.VARLEN_NAME
    assert "per sequence" in attention.describe(attention.VARLEN_NAME, DEVICE, torch.float32)


def test_packing_pays_only_with_length_spread():
    # real / (rows x longest): [128, 128, 127] -> 383 / 384 = 0.997 (no pack); [480, 40, 60] -> 580 / 1440 = 0.40 (pack).
    def mask_of(lengths):
        return (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()

    assert real_token_fraction(mask_of([4, 2])) == 0.75
    assert not packing_pays(mask_of([128, 128, 127]))
    assert packing_pays(mask_of([480, 40, 60]))
    assert not packing_pays(mask_of([7]))  # one row never pays
