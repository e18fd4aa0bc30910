"""Speed knobs of grpo_lib/core/perf.py and the head work of grpo_lib/model/logprobs.py: KV sizing, allocator, compute dtype,
engine logprobs only when read, no-grad entropy, response-first scoring, size-gated head checkpointing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from grpo_lib.config import load_config
from grpo_lib.config.checks import engine_logprobs_needed
from grpo_lib.core import perf
from grpo_lib.core.dtypes import torch_dtype
from grpo_lib.model.logprobs import token_logprobs


def qwen3(**kw) -> Qwen3Config:
    return Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, **kw)


def test_kv_bytes_per_token_from_the_model_config():
    # 2 (K, V) x 2 layers x 1 kv head x 32 dims x 4 bytes = 512; bf16 halves it.
    assert perf.kv_bytes_per_token(qwen3(), "float32") == 512
    assert perf.kv_bytes_per_token(qwen3(), "bfloat16") == 256


def test_cpu_kv_cache_fits_the_batch_and_is_capped():
    big = 1 << 40
    # 128 sequences x (ceil(160 / 128) + 1 = 3 blocks of 128 tokens) x 4096 bytes: the docstring's example, 192 MiB.
    cfg = Qwen3Config(vocab_size=2000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    assert perf.cpu_kv_cache_bytes(cfg, num_seqs=128, max_model_len=160, dtype="float32", available_bytes=big) == 192 * 2**20
    # Capped at a quarter of available memory split over the local processes, floored at KV_MIN_BYTES.
    assert perf.cpu_kv_cache_bytes(cfg, num_seqs=128, max_model_len=160, dtype="float32", available_bytes=400 * 2**20,
                                   local_processes=2) == 50 * 2**20
    assert perf.cpu_kv_cache_bytes(qwen3(), num_seqs=1, max_model_len=8, dtype="float32", available_bytes=big) == perf.KV_MIN_BYTES


def test_resolve_kv_cache_bytes(tiny_model_dir):
    base = [f"model.path={tiny_model_dir}", "data.train_files=[x.parquet]", "data.train_batch_size=64", "actor.ppo_mini_batch_size=64",
            "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=16", "data.max_prompt_length=200", "data.max_response_length=312"]
    explicit = load_config(None, base + ["rollout.kv_cache_memory_bytes=12345"])
    assert perf.resolve_kv_cache_bytes(explicit, world_size=1, engine_dtype="float32") == 12345  # an explicit value wins
    cfg = load_config(None, base)
    per_token = perf.kv_bytes_per_token(__import__("transformers").AutoConfig.from_pretrained(tiny_model_dir), "float32")
    # 64 prompts x 16 = 1024 sequences, capped by rollout.max_num_seqs=256; 512 tokens -> 4 + 1 blocks of 128.
    expected = max(perf.KV_MIN_BYTES, 256 * 5 * 128 * per_token)
    assert perf.resolve_kv_cache_bytes(cfg, world_size=1, engine_dtype="float32") == expected
    # Two processes: half the prompts each.
    cfg2 = load_config(None, base + ["rollout.max_num_seqs=2048"], world_size=2)
    assert perf.resolve_kv_cache_bytes(cfg2, world_size=2, engine_dtype="float32") == max(perf.KV_MIN_BYTES, 512 * 5 * 128 * per_token)


ALLOC_SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    sys.path.insert(0, {repo!r})
    from grpo_lib.core.perf import tune_allocator
    if sys.argv[1] == "tuned":
        assert tune_allocator(), "mallopt failed"
    for _ in range(3):  # warm up: the heap grows once
        x = torch.ones(64 * 2**20 // 4); del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, like the activations of one micro-batch
        del x
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_tuned_allocator_reuses_freed_memory_instead_of_faulting_it_back(tmp_path):
    """glibc returns a freed 64 MiB block to the OS (above its largest mmap threshold, 32 MiB) and faults it in again
    on the next allocation: 16384 page faults of 4 KiB per round. Tuned, the block stays in the heap and is reused
    (some faults remain: measured 3-5x fewer here, not zero)."""
    script = tmp_path / "alloc.py"
    script.write_text(ALLOC_SCRIPT.format(repo=str(Path(__file__).resolve().parents[2])))
    faults = {mode: int(subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, check=True).stdout)
              for mode in ("default", "tuned")}
    assert faults["default"] > 20 * 8000, faults  # ~16384 faults per 64 MiB round
    assert faults["tuned"] < faults["default"] / 2, faults  # measured: 327700 -> 65536-98304 (glibc 2.36)


def test_engine_logprobs_only_when_read(tiny_model_dir):
    base = [f"model.path={tiny_model_dir}", "data.train_files=[x.parquet]", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4"]
    assert not engine_logprobs_needed(load_config(None, base))
    assert engine_logprobs_needed(load_config(None, base + ["algorithm.rollout_correction.mode=token"]))
    assert engine_logprobs_needed(load_config(None, base + ["actor.fsdp_config.param_dtype=bfloat16"]))  # the gap metric
    assert engine_logprobs_needed(load_config(None, base + ["rollout.dtype=bfloat16"]))
    assert engine_logprobs_needed(load_config(None, base), gpu=True), "auto is bf16 on a GPU: the gap is logged"
    fp32 = load_config(None, base + ["rollout.dtype=float32", "actor.fsdp_config.param_dtype=float32"])
    assert not engine_logprobs_needed(fp32, gpu=True)


def test_compute_dtype_and_cpu_autocast():
    cpu = torch.device("cpu")
    assert torch_dtype("auto", cpu, cpu_auto=torch.float32) == torch.float32  # the demo stays fp32 and exact
    assert torch_dtype("bfloat16", cpu, cpu_auto=torch.float32) == torch.bfloat16
    layer = torch.nn.Linear(4, 4)
    with perf.compute_autocast(cpu, torch.bfloat16, torch.float32):
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    with perf.compute_autocast(cpu, torch.float32, torch.float32):
        assert layer(torch.ones(1, 4)).dtype == torch.float32
    assert layer.weight.dtype == torch.float32  # master weights untouched


# ----------------------------------------------------------------------------------------- head work (logprobs.py)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(qwen3(tie_word_embeddings=True)).float()


def batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (3, 20), generator=generator)  # [3, 20]
    mask = torch.ones(3, 20, dtype=torch.long)  # [3, 20]
    mask[1, 15:] = 0
    mask[2, 9:] = 0
    response = torch.zeros(3, 20)  # [3, 20]: prompts of 6 tokens, then the response
    response[:, 6:] = 1.0
    response *= mask
    return ids, mask, response


def head_rows(model, fn):
    rows: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    try:
        out = fn()
    finally:
        handle.remove()
    return out, rows


@pytest.mark.parametrize("remove_padding", [False, True])
def test_entropy_without_grad_has_the_same_values_and_no_graph(model, remove_padding):
    ids, mask, _ = batch()
    lp_a, ent_a = token_logprobs(model, ids, mask, remove_padding=remove_padding, compute_entropy=True)
    lp_b, ent_b = token_logprobs(model, ids, mask, remove_padding=remove_padding, compute_entropy=True, entropy_grad=False)
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert ent_a.requires_grad and not ent_b.requires_grad
    lp_b.sum().backward()  # the logprob graph is intact
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_response_positions_scored_first_and_alone(model, remove_padding):
    ids, mask, response = batch()
    full, _ = token_logprobs(model, ids, mask, remove_padding=remove_padding)
    (only, _), rows = head_rows(model, lambda: token_logprobs(model, ids, mask, remove_padding=remove_padding, score_mask=response))
    want = response.bool() & torch.ones_like(mask).bool()
    assert rows[1:] == [int(response[:, 1:].sum())], f"the head saw only response tokens: {rows}"
    assert torch.equal(only[~want], torch.zeros(int((~want).sum()))), "prompt positions are 0"
    torch.testing.assert_close(only[want], full[want], rtol=0, atol=1e-5)
    # score_unmasked: every position, the response part bit-identical to the score_mask-only call.
    (both, _), rows = head_rows(model, lambda: token_logprobs(model, ids, mask, remove_padding=remove_padding, score_mask=response,
                                                              score_unmasked=True))
    assert torch.equal(both[want], only[want])
    torch.testing.assert_close(both, full, rtol=0, atol=1e-5)
    # With grad on, the prompt part carries no graph: the gradient is that of the response part alone.
    model.zero_grad(set_to_none=True)
    lp, _ = token_logprobs(model, ids, mask, remove_padding=remove_padding, score_mask=response, score_unmasked=True)
    lp.sum().backward()
    g_both = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    lp, _ = token_logprobs(model, ids, mask, remove_padding=remove_padding, score_mask=response)
    lp.sum().backward()
    for a, b in zip(g_both, [p.grad for p in model.parameters()]):
        assert torch.equal(a, b)
    model.zero_grad(set_to_none=True)


def test_head_checkpointed_only_above_the_size_threshold(model):
    ids, mask, _ = batch()
    lp_small, rows_small = head_rows(model, lambda: token_logprobs(model, ids, mask, chunk_size=10, checkpoint_min_bytes=1 << 30)[0].sum().backward())
    grads_small = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _, rows_ckpt = head_rows(model, lambda: token_logprobs(model, ids, mask, chunk_size=10)[0].sum().backward())
    model.zero_grad(set_to_none=True)
    # The same single chunk, recomputed in the backward: the same ops, so the same gradients up to float32 round-off.
    _, rows_one = head_rows(model, lambda: token_logprobs(model, ids, mask, chunk_size=64)[0].sum().backward())
    assert rows_one == [1, 41, 41]
    grads_one_recomputed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    forward = [1, 10, 10, 10, 10, 1]  # logits_to_keep=1, then 41 scored tokens in chunks of 10
    assert rows_small == [1, 41], f"below the threshold one chunk, not recomputed: {rows_small}"
    assert sorted(rows_ckpt) == sorted(forward * 2)[1:], f"each chunk recomputed in the backward: {rows_ckpt}"
    for a, b in zip(grads_small, grads_one_recomputed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------- actor compute (actor.py)


def _actor_and_batch(tiny_model_dir, *overrides):
    from grpo_lib.model.actor import Actor
    from tests.algorithms.test_ratio import fake_batch, make_cfg

    cfg = make_cfg(tiny_model_dir, *overrides)
    torch.manual_seed(0)
    return Actor(cfg, device=torch.device("cpu")), fake_batch(cfg)


def _update_grads(actor, batch):
    actor.accumulate_gradients(batch)
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters()}
    actor.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.slow
def test_torch_compiled_decoder_layers_match_eager(tiny_model_dir):
    """actor.use_torch_compile: logprobs within 1e-5 and gradients within 1e-4 (relative) of the eager actor (fp32;
    inductor fuses and reorders float ops, so not bitwise); the update runs through the compiled layers."""
    eager, batch = _actor_and_batch(tiny_model_dir)
    compiled, _ = _actor_and_batch(tiny_model_dir, "actor.use_torch_compile=true")
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.get_decoder().layers), "each layer compiled"
    torch.testing.assert_close(compiled.compute_logprobs(batch), eager.compute_logprobs(batch), rtol=0, atol=1e-5)
    g_compiled, g_eager = _update_grads(compiled, batch), _update_grads(eager, batch)
    for name, grad in g_eager.items():
        torch.testing.assert_close(g_compiled[name], grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
    metrics = compiled.update(batch)
    assert all(map(torch.isfinite, map(torch.tensor, metrics.values()))), metrics


def test_bf16_autocast_keeps_fp32_master_and_changes_the_weights(tiny_model_dir):
    actor, batch = _actor_and_batch(tiny_model_dir, "actor.fsdp_config.param_dtype=bfloat16", "actor.lr=1e-5")
    fp32, _ = _actor_and_batch(tiny_model_dir)
    bf16_lp, fp32_lp = actor.compute_logprobs(batch), fp32.compute_logprobs(batch)
    gap = float((bf16_lp - fp32_lp).abs().max())
    assert 1e-6 < gap < 0.5, f"bf16 compute differs from fp32 by a small, nonzero amount: {gap}"
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    batch.rollout_logprobs = fp32_lp * batch.response_mask  # as if an fp32 engine had sampled
    metrics = actor.update(batch)
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in actor.model.named_parameters())
    total = sum(p.numel() for p in actor.model.parameters())
    assert changed > 0.5 * total, f"lr 1e-5 with fp32 master weights: {changed}/{total} entries moved"
    assert 0 < metrics["rollout/logprob_abs_diff_mean"] < 0.5, metrics
