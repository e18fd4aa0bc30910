"""Tests for grpo_lib.model.logprobs.token_logprobs against the naive full-logits path on a tiny random Qwen3."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from grpo_lib.model.logprobs import _TargetLogprobs, token_logprobs

LENGTHS = [3, 40, 17, 64]  # very different lengths, right-padded to 64


def tiny_qwen3(**overrides) -> torch.nn.Module:
    """Tiny random Qwen3 (float32, sdpa, seeded); a fresh config each call (from_config mutates it)."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        **overrides,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def model(request):
    model = tiny_qwen3(tie_word_embeddings=request.param)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == request.param, "tying as configured"
    return model


def make_batch(lengths: list[int] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    seq_len = max(lengths)
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()  # [b, T]
    ids = torch.randint(1, 128, (len(lengths), seq_len), generator=generator) * mask  # [b, T], pad id 0
    return ids, mask


def naive(model, ids, mask, temperature=1.0):
    """The reference: full logits from model(...), float32 log_softmax, shifted to token positions."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float() / temperature  # [b, T, V]
    logp_all = logits[:, :-1].log_softmax(-1)  # [b, T-1, V]
    logprobs = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [b, T-1]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [b, T-1]
    scored = mask[:, 1:] * mask[:, :-1]  # [b, T-1]: a token with a real predecessor
    pad = torch.nn.functional.pad
    return pad(logprobs * scored, (1, 0)), pad(entropy * scored, (1, 0))  # [b, T] each


@pytest.mark.parametrize("remove_padding", [False, True])
def test_matches_naive_logprobs_and_entropy(model, remove_padding):
    ids, mask = make_batch()
    with torch.no_grad():
        expected, expected_entropy = naive(model, ids, mask)
        logprobs, entropy = token_logprobs(model, ids, mask, remove_padding=remove_padding, compute_entropy=True)
    assert logprobs.shape == ids.shape and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    assert (logprobs[:, 0] == 0).all() and (logprobs[mask == 0] == 0).all(), "position 0 and pads are 0"
    assert (entropy[:, 0] == 0).all() and (entropy[mask == 0] == 0).all(), "position 0 and pads are 0"
    assert (logprobs[:, 1:][mask[:, 1:] == 1] < 0).all(), "every scored token has a real log-prob"


def test_packed_equals_padded(model):
    ids, mask = make_batch()
    with torch.no_grad():
        padded, padded_entropy = token_logprobs(model, ids, mask, compute_entropy=True)
        packed, packed_entropy = token_logprobs(model, ids, mask, remove_padding=True, compute_entropy=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_entropy, padded_entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_temperature_applied(model, remove_padding):
    ids, mask = make_batch()
    with torch.no_grad():
        expected, expected_entropy = naive(model, ids, mask, temperature=0.7)
        untempered, _ = naive(model, ids, mask)
        logprobs, entropy = token_logprobs(
            model, ids, mask, temperature=0.7, remove_padding=remove_padding, compute_entropy=True
        )
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    assert (logprobs - untempered).abs().max() > 1e-3, "temperature changes the result"


@pytest.mark.parametrize("remove_padding", [False, True])
def test_small_chunks_identical(model, remove_padding):
    ids, mask = make_batch()
    with torch.no_grad():
        whole, whole_entropy = token_logprobs(model, ids, mask, remove_padding=remove_padding, compute_entropy=True)
        chunked, chunked_entropy = token_logprobs(
            model, ids, mask, remove_padding=remove_padding, compute_entropy=True, chunk_size=7
        )
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked_entropy, whole_entropy, atol=1e-6, rtol=0)


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("remove_padding", [False, True])
def test_gradients_match_naive(model, remove_padding):
    ids, mask = make_batch()
    expected, expected_entropy = naive(model, ids, mask)
    (expected * mask).sum().add(0.1 * (expected_entropy * mask).sum()).backward()
    expected_grads = _grads(model)
    logprobs, entropy = token_logprobs(
        model, ids, mask, remove_padding=remove_padding, compute_entropy=True, chunk_size=50
    )
    (logprobs * mask).sum().add(0.1 * (entropy * mask).sum()).backward()
    grads = _grads(model)
    assert grads.keys() == expected_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")


def test_head_function_values_and_gradient_are_log_softmax():
    """The head's fused function: log-probabilities and entropy equal log_softmax's, its closed-form backward passes
    gradcheck (float64: the tolerances are float64 rounding, far below any real difference)."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 11, generator=generator, dtype=torch.float64) * 5).requires_grad_()  # [c, V]
    targets = torch.randint(0, 11, (6,), generator=generator)  # [c]
    logprobs, entropy = _TargetLogprobs.apply(logits, targets, True)
    reference = torch.log_softmax(logits, dim=-1)  # [c, V]
    torch.testing.assert_close(logprobs, reference.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1), rtol=0, atol=1e-12)
    assert not entropy.requires_grad, "the fused function's entropy is a metric: no graph"
    assert torch.autograd.gradcheck(lambda z: _TargetLogprobs.apply(z, targets, False)[0], (logits,))
    weights = torch.ones(6, dtype=torch.float64, requires_grad=True)  # [c]
    (grad,) = torch.autograd.grad(_TargetLogprobs.apply(logits, targets, False)[0], logits, grad_outputs=weights,
                                  create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):  # an error, not a second derivative missing a term
        grad.sum().backward()


@pytest.mark.parametrize("remove_padding", [False, True])
def test_gradients_match_naive_without_entropy_grad(model, remove_padding):
    """The update's usual case (entropy logged, no bonus): log-probability gradients through the fused head function
    equal autograd's through log_softmax."""
    ids, mask = make_batch()
    expected, _ = naive(model, ids, mask)
    (expected * mask).sum().backward()
    expected_grads = _grads(model)
    logprobs, entropy = token_logprobs(model, ids, mask, remove_padding=remove_padding, compute_entropy=True,
                                       entropy_grad=False, chunk_size=50)
    assert not entropy.requires_grad
    (logprobs * mask).sum().backward()
    # atol relative to the tensor's scale (tests/helpers/tolerances.py): an embedding row's gradient sums ~100 tokens' terms of
    # up to ~10, so float32 order alone moves it by ~1e-6 * 10 (2.9e-6 seen on an AMX Xeon); a wrong gradient, O(0.1).
    for name, grad in _grads(model).items():
        scale = float(expected_grads[name].abs().max())
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6 * max(scale, 1.0), msg=f"gradient of {name}")


@pytest.mark.parametrize("packed_row_tokens, num_rows", [(None, 1), (150, 2), (100, 3), (1, 4)])
def test_multi_row_packed_equals_padded_with_gradients(model, packed_row_tokens, num_rows):
    """8 sequences (209 tokens, longest 64) packed into ceil(209 / max(packed_row_tokens, 64)) rows."""
    ids, mask = make_batch(LENGTHS + [25, 9, 50, 1])
    padded, padded_entropy = token_logprobs(model, ids, mask, compute_entropy=True)
    (padded * mask).sum().add(0.1 * (padded_entropy * mask).sum()).backward()
    padded_grads = _grads(model)
    shapes: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    packed, packed_entropy = token_logprobs(
        model, ids, mask, remove_padding=True, compute_entropy=True, packed_row_tokens=packed_row_tokens, chunk_size=50
    )
    handle.remove()
    assert shapes[0][0] == num_rows, f"packed into {shapes[0][0]} rows, expected {num_rows}"
    torch.testing.assert_close(packed.detach(), padded.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_entropy.detach(), padded_entropy.detach(), atol=1e-5, rtol=0)
    (packed * mask).sum().add(0.1 * (packed_entropy * mask).sum()).backward()
    grads = _grads(model)
    assert grads.keys() == padded_grads.keys() and len(grads) == len(list(model.parameters()))
    # atol 1e-5: gradients reach ~10 here and float32 summation order differs between layouts (one-row packing
    # already differs from padded by ~1e-6 on near-zero entries); a leak between sequences changes them by O(0.1).
    for name, grad in grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def test_left_padding_in_padded_mode(model):
    """Padded mode takes position_ids from the mask, so a left-padded row scores like the unpadded one."""
    ids, mask = make_batch([5, 9])
    left_ids = torch.stack([ids[0].roll(4), ids[1]])  # [2, 9], row 0 left-padded
    left_mask = torch.stack([mask[0].roll(4), mask[1]])  # [2, 9]
    with torch.no_grad():
        right, _ = token_logprobs(model, ids, mask)
        left, _ = token_logprobs(model, left_ids, left_mask)
    torch.testing.assert_close(left[0, 4:], right[0, :5], atol=1e-5, rtol=0)
    assert (left[0, :5] == 0).all(), "left pads and the first real token are 0"


def test_one_token_rows_and_entropy_off(model):
    ids, mask = make_batch([1, 1])
    logprobs, entropy = token_logprobs(model, ids, mask, remove_padding=True)
    assert entropy is None and torch.equal(logprobs, torch.zeros(2, 1))


def test_head_runs_in_chunks_and_is_recomputed_in_backward(model):
    ids, mask = make_batch()
    num_scored = int((mask[:, 1:] * mask[:, :-1]).sum())  # 2 + 39 + 16 + 63 = 120
    rows: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    logprobs, _ = token_logprobs(model, ids, mask, remove_padding=True, chunk_size=50)
    forward_rows = list(rows)
    logprobs.sum().backward()
    handle.remove()
    # The root forward asks for one position's logits (logits_to_keep=1), then 3 chunks of <= 50 tokens.
    assert forward_rows == [1, 50, 50, num_scored - 100]
    assert sorted(rows[len(forward_rows) :]) == sorted(forward_rows[1:]), f"backward recomputes each chunk: {rows}"


def test_peft_lora_wrapped_model():
    peft = pytest.importorskip("peft")
    base = tiny_qwen3()
    ids, mask = make_batch()
    with torch.no_grad():
        expected, _ = token_logprobs(base, ids, mask)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    logprobs, _ = token_logprobs(lora, ids, mask, remove_padding=True)
    with torch.no_grad(), lora.disable_adapter():
        disabled, _ = token_logprobs(lora, ids, mask, remove_padding=True)
    with torch.no_grad():
        naive_lora, _ = naive(lora, ids, mask)
    torch.testing.assert_close(disabled, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs.detach(), naive_lora, atol=1e-5, rtol=0)
    assert (logprobs.detach() - expected).abs().max() > 1e-4, "adapters change the result"
    (logprobs * mask).sum().backward()
    lora_grads = [p.grad for name, p in lora.named_parameters() if "lora_" in name]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads), "grads reach LoRA weights"
