"""Tests for grpo_lib.model.attention (packed-row attention implementations) and the packing decision of grpo_lib.model.logprobs.

Packing equivalence against padding runs on every implementation available on this machine; the others are skipped
with the reason `available_implementations` gives (flash-attn needs CUDA and the flash_attn package; torch 2.13's
CPU flex attention has no backward). Run: `.venv/bin/python -m pytest tests/model/test_attention.py`.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from grpo_lib.model import attention
from grpo_lib.model.logprobs import packing_pays, real_token_fraction, token_logprobs
from grpo_lib.model.packing import check_packing_isolated, pack_sequences
from tests.model.test_logprobs import make_batch, tiny_qwen3

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


@pytest.mark.parametrize("implementation", [i for i in ("sdpa", attention.VARLEN_NAME) if i in IMPLEMENTATIONS])
def test_the_packed_sequence_probe_runs_only_where_a_dense_mask_needs_it(monkeypatch, implementation):
    """Issue 41 defect 7: transformers probes position ids for packed sequences once per forward (an `.all()` read of
    the device: a host sync per micro-batch on a GPU). Its answer shapes a dense mask only: a varlen attention
    (grpo_varlen) and right-padded rows (one arange per row: the answer is None) skip it; sdpa's packed rows need it (the
    block-diagonal mask; test_packed_equals_padded_with_gradients_on_each_implementation holds its values)."""
    from transformers import masking_utils

    model = model_with(implementation)
    ids, mask = make_batch([3, 40, 17, 9])
    with attention.packing_known():  # installs the switch (idempotent)
        pass
    switch = masking_utils.find_packed_sequence_indices
    calls = []
    monkeypatch.setattr(switch, "original", lambda position_ids, real=switch.original: calls.append(1) or real(position_ids))
    with torch.no_grad():
        token_logprobs(model, ids, mask)  # right-padded rows, no mask
        padded_calls = len(calls)
        token_logprobs(model, ids, mask, remove_padding=True)  # packed rows
    assert padded_calls == 0, "right-padded rows need no probe"
    assert len(calls) == (0 if implementation == attention.VARLEN_NAME else 1), (implementation, len(calls))
    assert not attention._PACKING_KNOWN.get(), "the switch is off outside the logprob function"


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
    """Issue 28 item 1: flash-attn is detected as transformers detects it (a module named flash_attn that transformers
    cannot use is not flash-attn), and with model.use_remove_padding grpo_varlen is chosen even where flash-attn runs
    (shared prompts; torch's flash kernel on CUDA), each choice with the reason the start-up line prints."""
    import transformers.utils

    reasons = attention.available_implementations(DEVICE)
    assert reasons[attention.VARLEN_NAME] is None and reasons["sdpa"] is None
    assert "backward" in reasons["flex_attention"]
    assert attention.select_attn_implementation(DEVICE, torch.float32) == attention.VARLEN_NAME
    cuda = torch.device("cuda")
    # A flash_attn module on the path (a CPU-only build, a namesake) that transformers finds unusable: not chosen
    # (the find_spec detection chose it, and the start-up check then crashed inside it).
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda *a, **k: False)
    assert "no usable flash-attn" in attention.available_implementations(cuda)["flash_attention_2"]
    assert attention.select_attn_implementation(cuda, torch.bfloat16, remove_padding=False) == attention.VARLEN_NAME
    # Usable flash-attn: chosen for padded batches in half precision only; packing prefers grpo_varlen (shared prompts).
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda *a, **k: True)
    monkeypatch.setitem(sys.modules, attention.FLASH_ATTN_EXTENSION, types.ModuleType(attention.FLASH_ATTN_EXTENSION))
    assert attention.available_implementations(cuda)["flash_attention_2"] is None
    assert attention.choose_attn_implementation(cuda, torch.bfloat16, remove_padding=False)[0] == "flash_attention_2"
    assert attention.select_attn_implementation(cuda, torch.float32, remove_padding=False) == attention.VARLEN_NAME
    name, why = attention.choose_attn_implementation(cuda, torch.bfloat16, remove_padding=True)
    assert name == attention.VARLEN_NAME and "shared prompts" in why
    assert "per sequence" in attention.describe(attention.VARLEN_NAME, DEVICE, torch.float32)


@pytest.mark.parametrize("error", ["ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEab')",
                                   "OSError('libcudart.so.12: cannot open shared object file')"])
def test_flash_attn_whose_binary_does_not_load_is_not_chosen(monkeypatch, tmp_path, error):
    """Issue 41 item 8: a flash-attn wheel built for another torch ABI (or CUDA) passes transformers' metadata check
    (distribution and version) and fails only when its compiled extension loads, at the model's first attention. A
    fake package whose metadata passes and whose extension raises on import: flash_attention_2 is not chosen, and the
    reason names the failed load."""
    import transformers.utils

    (tmp_path / f"{attention.FLASH_ATTN_EXTENSION}.py").write_text(f"raise {error}\n")
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("__version__ = '2.8.3'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, attention.FLASH_ATTN_EXTENSION, raising=False)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda *a, **k: True)  # the metadata passes
    cuda = torch.device("cuda")
    reason = attention.available_implementations(cuda)["flash_attention_2"]
    assert reason is not None and f"CUDA extension {attention.FLASH_ATTN_EXTENSION} does not load" in reason, reason
    assert error.split("'")[1] in reason  # the loader's own message
    name, why = attention.choose_attn_implementation(cuda, torch.bfloat16, remove_padding=False)
    assert name == attention.VARLEN_NAME and "does not load" in why, why


def test_packing_pays_only_with_length_spread():
    # real / (rows x longest): [128, 128, 127] -> 383 / 384 = 0.997 (no pack); [480, 40, 60] -> 580 / 1440 = 0.40 (pack).
    def mask_of(lengths):
        return (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()

    assert real_token_fraction(mask_of([4, 2])) == 0.75
    assert not packing_pays(mask_of([128, 128, 127]))
    assert packing_pays(mask_of([480, 40, 60]))
    assert not packing_pays(mask_of([7]))  # one row never pays


def _module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2  # what transformers' sdpa reads of a Qwen3 attention (GQA 4 / 2)
    return module.eval()


def test_no_host_read_of_a_device_tensor_in_a_layer():
    """Issue 28 item 4: grpo_varlen decides packed / padded from the kwargs the caller passes once per micro-batch, never
    by reading position_ids in every layer (36 device syncs per Qwen3-4B forward). Meta tensors raise on any host read
    (bool(), .item(), .tolist()), so these calls prove it: the padded right-padding call token_logprobs makes (no mask,
    arange position_ids) and a packed row whose device boundaries are meta and whose host copy is a CPU tensor."""
    meta = torch.device("meta")
    q = torch.empty(2, 4, 16, 32, device=meta)  # [b, Hq, T, D]
    k, v = (torch.empty(2, 2, 16, 32, device=meta) for _ in range(2))  # [b, Hkv, T, D] (GQA)
    with pytest.raises(Exception):  # the premise: a host read of a meta tensor raises
        bool(torch.arange(3, device=meta).any())
    positions = torch.arange(16, device=meta).expand(2, -1)  # [b, T]
    out, _ = attention.varlen_attention_forward(_module(), q, k, v, None, position_ids=positions)
    assert out.shape == (2, 16, 4, 32) and out.is_meta
    cu = torch.tensor([0, 5, 16, 32], dtype=torch.int32)  # row 0: 5 + 11 tokens, row 1: 16
    out, _ = attention.varlen_attention_forward(
        _module(), q, k, v, None, position_ids=positions, cu_seq_lens_q=cu.to(meta), cu_seq_lens_k=cu.to(meta),
        max_length_q=16, max_length_k=16, **{attention.HOST_CU_KWARG: cu})
    assert out.shape == (2, 16, 4, 32) and out.is_meta
    # A shared-prefix row: its boundaries and continuation table are host tensors by construction.
    q1, k1, v1 = q[:1], k[:1], v[:1]
    out, _ = attention.varlen_attention_forward(
        _module(), q1, k1, v1, None, position_ids=positions[:1], cu_seq_lens_q=torch.tensor([0, 6, 11, 16]),
        max_length_q=6, **{attention.CONTINUES_KWARG: torch.tensor([-1, 0, 0])})
    assert out.shape == (1, 16, 4, 32) and out.is_meta


def _cpu_varlen_twin(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """torch's varlen_attn as documented, on CPU (it runs on CUDA only): per sequence, queries cu_q[i]..cu_q[i+1]
    attend keys cu_k[i]..cu_k[i+1] under causal masking aligned to the bottom right (window_size (-1, 0); flash's
    convention when a sequence has fewer queries than keys: query j of Lq sees keys 0 .. Lk - Lq + j)."""
    assert window_size == (-1, 0)
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert qe - qs <= max_q and ke - ks <= max_k
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
        o = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q[qs:qe], k[ks:ke], v[ks:ke])),
                                           attn_mask=mask, scale=scale, enable_gqa=enable_gqa)  # [1, Hq, Lq, D]
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)  # [N, Hq, D]


def test_shared_prompts_in_one_varlen_call_equal_the_per_continuation_path():
    """Issue 28 item 5: on CUDA a shared-prefix row's segments run in ONE varlen call (each continuation's keys are its
    prompt's, gathered once, then its own; bottom-right causal), not 2 sdpa calls and 2 cats per continuation. Its
    layout (`shared_prefix_kv_plan`, the gather, cu_seq_k) against the per-continuation path, values and gradients in
    float64 (the same sums in another order: equal to ~1e-15), with varlen_attn's CPU twin as the kernel (the kernel
    itself is checked on the GPU by scripts/gpu_check.sh). Two prompts (5 and 3 tokens) with 3 and 2 responses, and a
    row sharing nothing; GQA 4 query heads over 2 kv heads."""
    seg_lens, continues = [5, 4, 2, 6, 3, 3, 1, 7], [-1, 0, 0, 0, -1, 4, 4, -1]
    n = sum(seg_lens)
    cu = torch.tensor([0, *torch.tensor(seg_lens).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, 16, generator=g, dtype=torch.float64, requires_grad=True)  # [1, Hq, N, D]
    k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kv_index, cu_k, max_k = attention.shared_prefix_kv_plan(seg_lens, continues)
    assert cu_k.tolist()[-1] == n + 3 * 5 + 2 * 3 and max_k == 5 + 6  # each response copies its prompt's keys
    one = attention._shared_prefix_one_call(q, k, v, kv_index=kv_index, cu_q=cu, cu_k=cu_k, max_q=max(seg_lens),
                                            max_k=max_k, scaling=0.25, kernel=_cpu_varlen_twin)  # [1, N, Hq, D]
    loop, _ = attention._shared_prefix_attention(_module(), q, k, v, cu, torch.tensor(continues), dropout=0.0,
                                                 scaling=0.25, sliding_window=None)  # [1, N, Hq, D]
    assert torch.allclose(one, loop, rtol=0, atol=1e-12), (one - loop).abs().max()
    w = torch.randn(one.shape, generator=g, dtype=torch.float64)
    grads_one = torch.autograd.grad((one * w).sum(), (q, k, v))
    grads_loop = torch.autograd.grad((loop * w).sum(), (q, k, v))
    for a, b in zip(grads_one, grads_loop):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (a - b).abs().max()


def test_shared_prefix_kwargs_carry_the_one_call_plan_once_per_micro_batch():
    """The one-call plan travels as forward kwargs built once per micro-batch (on CUDA by default; here asked for)."""
    from grpo_lib.model.packing import pack_shared_prefixes, shared_prefix_forward_kwargs

    ids = torch.tensor([[5, 6, 8, 0], [5, 6, 9, 4]])
    shared = pack_shared_prefixes(ids, (ids > 0).long(), [2, 2])
    assert attention.SHARED_KV_INDEX_KWARG not in shared_prefix_forward_kwargs(shared)  # CPU: the loop, no plan
    kwargs = shared_prefix_forward_kwargs(shared, one_call=True)
    assert kwargs[attention.SHARED_KV_INDEX_KWARG].tolist() == [0, 1, 0, 1, 2, 0, 1, 3, 4]
    assert kwargs[attention.SHARED_CU_K_KWARG].tolist() == [0, 2, 5, 9] and kwargs[attention.SHARED_MAX_K_KWARG] == 4


def test_varlen_attn_used_only_when_its_signature_binds(monkeypatch):
    """Issue 28 item 6: torch drift. A varlen_attn without grpo_varlen's keywords (e.g. no enable_gqa) is not called:
    the reason names the torch and the mismatch, and the start-up description says the per-sequence path runs."""
    import torch.nn.attention.varlen as varlen_module

    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        raise AssertionError("never called")

    assert attention.torch_varlen_attn()[0] is not None  # this torch's (2.13) binds
    attention.torch_varlen_attn.cache_clear()
    monkeypatch.setattr(varlen_module, "varlen_attn", old_varlen_attn)
    try:
        kernel, why = attention.torch_varlen_attn()
        assert kernel is None and "enable_gqa" in why and torch.__version__ in why
        described = attention.describe(attention.VARLEN_NAME, torch.device("cuda"), torch.bfloat16)
        assert "per sequence" in described and "enable_gqa" in described
    finally:
        attention.torch_varlen_attn.cache_clear()


@pytest.mark.multiprocess
def test_start_up_check_runs_on_the_sharded_policy_in_the_compute_dtype(tmp_path):
    """Issue 28 item 2: the packing isolation check runs where the run runs: after FSDP2 sharding (the parameters are
    shards, every process takes part), in the compute dtype (bf16 logits here, as on a GPU), with the dtype's
    tolerance; before, it ran on process 0's unsharded float32 host copy (so on CUDA the kernels checked were not the
    run's, and flash-attn got CPU float32 tensors). A backend that lets packed rows attend to each other stops every
    process with the check's message."""
    import json

    from tests.conftest import REPO, launch
    from tests.scripts import grad_case as case

    model_dir = case.write_tiny_model(tmp_path / "model")
    proc = launch([REPO / "tests" / "scripts" / "isolation_worker.py", model_dir, tmp_path], procs=2)
    assert proc.returncode == 0, f"--- stderr ---\n{proc.stderr[-6000:]}\n--- stdout ---\n{proc.stdout[-2000:]}"
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["sharded"], f"process {r}: the check ran on an unsharded model"
        assert seen["dtype"] == seen["compute_dtype"] == "torch.bfloat16", seen
        assert seen["logits_dtypes"] == ["torch.bfloat16"], f"process {r}: the check's forwards ran in {seen['logits_dtypes']}"
        assert seen["atol"] == 16 * 2 ** -7, seen  # bf16's tolerance, not float32's
        assert "Packed sequences are not isolated" in seen["leak"], f"process {r}: {seen['leak']}"
