"""grpo_lib.model.fsdp in one process: mixed precision, the sharded reference, offload keys, the bucketed push.

The FSDP2 path runs here on a 1-process gloo group ("cpu:gloo", as `init_distributed` builds it on CPU), so
`fully_shard` and `MixedPrecisionPolicy` are really applied; 2-process sharding is covered by
tests/model/test_multiprocess.py (gradients) and tests/train/test_multiprocess_train.py (training, push, export).
GPU-only tests (real offload to host memory) are marked and skip on CPU.

Run: .venv/bin/python -m pytest tests/model/test_fsdp.py
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpo_lib.model import fsdp
from grpo_lib.model.actor import Actor
from grpo_lib.model.reference import Reference
from grpo_lib.rollout.engines.base import Lifecycle
from grpo_lib.rollout.engines.vllm import VLLMEngine
from tests.algorithms.test_ratio import fake_batch, make_cfg


@contextmanager
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def changed_fraction(actor: Actor, batch) -> float:
    """One optimizer step on `batch`; the fraction of parameter elements with a non-zero gradient that changed."""
    before = {n: fsdp.full_tensor(p.detach()).clone() for n, p in actor.model.named_parameters()}
    actor.accumulate_gradients(batch)
    got_grad = {n: fsdp.full_tensor(p.grad) != 0 for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.optimizer.step()
    changed = total = 0
    for n, p in actor.model.named_parameters():
        if n in got_grad:
            moved = fsdp.full_tensor(p.detach()) != before[n]
            changed += int((moved & got_grad[n]).sum())
            total += int(got_grad[n].sum())
    assert total > 0, "no parameter received a gradient: the check would prove nothing"
    return changed / total


LR_1E6 = ("actor.lr=1e-6", "actor.weight_decay=0.0")


def test_bf16_compute_with_fp32_master_moves_every_weight_at_lr_1e6(tiny_model_dir):
    """Adam's first step moves each weight by ~lr = 1e-6. A float32 master weight of ~0.02 keeps it (ulp ~2e-9);
    a bfloat16 weight rounds it away (ulp at 0.02 is ~1.2e-4), so pure-bf16 AdamW leaves the model unchanged."""
    torch.manual_seed(0)
    cfg = make_cfg(tiny_model_dir, *LR_1E6, "actor.fsdp_config.param_dtype=bfloat16")
    batch = fake_batch(cfg)
    with one_process_group():
        actor = Actor(cfg, device=torch.device("cpu"))
        params = list(actor.model.parameters())
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params), "master weights: float32 shards"
        seen = []
        layer = fsdp.decoder_layers(actor.model)[0]
        handle = layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        fraction = changed_fraction(actor, batch)
        handle.remove()
        assert seen and set(seen) == {torch.bfloat16}, f"compute dtype inside the forward: {seen}"
        state = [v for s in actor.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert state and all(v.dtype == torch.float32 for v in state), "AdamW state is float32"
    assert fraction >= 0.99, f"bf16 compute + fp32 master: only {fraction:.1%} of the weights with a gradient moved"

    # Pure bf16 (what `model.dtype: auto` gave on GPU before): bf16 weights, bf16 AdamW state, same update code.
    torch.manual_seed(0)
    pure = Actor(make_cfg(tiny_model_dir, *LR_1E6), device=torch.device("cpu"))
    pure.model.to(torch.bfloat16)
    pure.optimizer = torch.optim.AdamW(pure.model.parameters(), lr=1e-6, weight_decay=0.0)
    pure_fraction = changed_fraction(pure, batch)
    assert pure_fraction < 0.5, f"pure bf16 AdamW moved {pure_fraction:.1%}: the check cannot tell the two apart"


def test_lora_with_bf16_compute_trains_after_a_reference_pass_came_first(tiny_model_dir):
    """LoRA + KL with bf16 compute (the GPU default): the step's first forward through the actor is the reference pass
    inside peft's disable_adapter(), which turns requires_grad off on the adapters. FSDP2 fixes each unit's reduce dtype
    at its first forward from the parameters requiring grad, so it once kept none: the update's bf16 gradients then
    failed to land on the fp32 adapter shards ("assign a gradient with dtype BFloat16 ... grad_dtype Float")."""
    from grpo_lib.model.reference import AdapterDisabledReference

    cfg = make_cfg(tiny_model_dir, "actor.fsdp_config.param_dtype=bfloat16", "model.lora_rank=4", "model.lora_alpha=8",
                   "actor.use_kl_loss=true")
    batch = fake_batch(cfg)
    with one_process_group():
        torch.manual_seed(0)
        actor = Actor(cfg, device=torch.device("cpu"))
        batch.ref_logprobs = AdapterDisabledReference(actor, cfg).compute_logprobs(batch)  # the first pass of a step
        metrics = actor.update(batch)
        grads = [p for p in actor.model.parameters() if p.requires_grad]
        assert grads and all(p.dtype == torch.float32 for p in grads), "adapter master weights stay float32"
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_nonfinite_steps"] == 0, metrics


def test_hf_export_keeps_the_dtype_the_model_was_saved_in(tiny_model_dir, tmp_path):
    """A bf16 hub model trains with float32 master weights; its Hugging Face export is bf16 again (half the disk of the
    master weights, what the preflight disk estimate assumes) and its config.json says so, so loaders reading
    "auto" do not upcast it. A float32 model exports float32 (the CPU tests' exactness)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    bf16_dir = tmp_path / "bf16_model"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for model_dir, want in ((bf16_dir, torch.bfloat16), (tiny_model_dir, torch.float32)):
        actor = Actor(make_cfg(model_dir), device=torch.device("cpu"))
        assert actor.master_dtype == torch.float32 and actor.export_dtype == want
        out = tmp_path / f"export_{want}".replace("torch.", "")
        actor.save_hf(out, tokenizer)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == {"BF16" if want == torch.bfloat16 else "F32"}, dtypes
        assert AutoConfig.from_pretrained(out).dtype == want
        exported = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
        for name, p in actor.model.named_parameters():
            torch.testing.assert_close(exported[name], p.detach().to(want).float(), rtol=0, atol=0, msg=name)


def test_fsdp_update_equals_unsharded_update(tiny_model_dir):
    """Same batch, same seed: the FSDP2 actor (1 process, float32, with gradient checkpointing) and the plain actor
    give the same metrics and weights."""
    cfg = make_cfg(tiny_model_dir, "actor.grad_clip=1e-3")  # the clip binds: sharded clipping is exercised
    batch = fake_batch(cfg)
    torch.manual_seed(0)
    plain = Actor(cfg, device=torch.device("cpu"))
    plain_metrics = plain.update(batch)
    with one_process_group():
        torch.manual_seed(0)
        sharded = Actor(make_cfg(tiny_model_dir, "actor.grad_clip=1e-3", "model.enable_gradient_checkpointing=true"),
                        device=torch.device("cpu"))
        sharded_metrics = sharded.update(batch)
        weights = dict(sharded.named_weights())
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert sharded_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5), key
    assert plain_metrics["actor/grad_norm"] > 1e-3, "the clip must bind for this test to check clipping"
    for name, tensor in plain.named_weights():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert "lm_head.weight" in weights and torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]), (
        "tied embeddings: the push stream carries lm_head.weight")
    for key in ("memory/actor_params_mb", "memory/peak_mb"):
        assert sharded_metrics[key] > 0, key
    # One process: FSDP2 moves nothing (2 processes: tests/model/test_multiprocess.py counts every byte); no group: no metric.
    assert sharded_metrics["perf/collective_mb_per_update"] == 0.0
    assert "perf/collective_mb_per_update" not in plain_metrics


def test_offload_keys_change_nothing_on_cpu(tiny_model_dir):
    """On a CPU machine the offload keys move nothing (device == host) and training is identical with and without."""
    batch = fake_batch(make_cfg(tiny_model_dir))
    results = []
    with one_process_group():
        for offload in ("false", "true"):
            torch.manual_seed(0)
            cfg = make_cfg(tiny_model_dir, f"actor.fsdp_config.param_offload={offload}",
                           f"actor.fsdp_config.optimizer_offload={offload}")
            actor = Actor(cfg, device=torch.device("cpu"))
            metrics = actor.update(batch)
            actor.offload()
            results.append((metrics["actor/pg_loss"], dict(actor.named_weights())))
    assert results[0][0] == results[1][0]
    for name, tensor in results[0][1].items():
        assert torch.equal(tensor, results[1][1][name]), name


def test_reference_is_sharded_and_matches_the_initial_actor(tiny_model_dir):
    """The reference's shards stay on the host between uses (ref.fsdp_config.param_offload) and score like the actor
    before its first update: the KL loss of step 1 is 0, then grows with every update at lr 1e-3."""
    cfg = make_cfg(tiny_model_dir, "actor.use_kl_loss=true", "ref.param_offload=true")  # the old spelling is an alias
    assert cfg.ref.fsdp_config.param_offload
    batch = fake_batch(cfg)
    with one_process_group():
        torch.manual_seed(0)
        actor = Actor(cfg, device=torch.device("cpu"))
        reference = Reference(cfg, device=torch.device("cpu"))
        assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in reference.model.parameters())
        ref_lp = reference.compute_logprobs(batch)  # [B, T]
        assert all(p.to_local().device.type == "cpu" for p in reference.model.parameters()), "shards back on the host"
        torch.testing.assert_close(actor.compute_logprobs(batch), ref_lp, rtol=0, atol=1e-6)
        batch.ref_logprobs = ref_lp
        kl = [actor.update(batch)["actor/kl_loss"] for _ in range(3)]  # steps 1-3 on the same batch, one update each
    assert abs(kl[0]) < 1e-9 and 1e-6 < kl[1] < kl[2], f"KL must be 0 at step 1 (actor == reference) and grow: {kl}"



def test_packing_check_runs_inside_one_forward_of_the_fsdp_root(tiny_model_dir):
    """Issue 41 defect 9: the start-up packing check runs as one forward of the FSDP2 root (`fsdp.in_root_forward`), so
    FSDP2's root pre-forward (on CUDA: the all-gather streams wait for the current stream, inputs to the device) runs
    for the root's own state before any of the check's model calls, and the root's post-forward after them. Before,
    the Hugging Face model was called directly after `unshard()`: the root never became the forward's root (the first
    decoder layer did, mid-call)."""
    cfg = make_cfg(tiny_model_dir, "model.use_remove_padding=true")
    with one_process_group():
        actor = Actor(cfg, device=torch.device("cpu"))
        root = actor.policy._get_fsdp_state()  # torch 2.11-2.13: FSDPModule's state; _state_ctx.iter_forward_root
        seen = []  # at each of the check's Hugging Face model calls: the state that ran the root pre-forward
        handle = actor.model.register_forward_pre_hook(lambda m, args: seen.append(root._state_ctx.iter_forward_root))
        try:
            actor.check_packing()
        finally:
            handle.remove()
        after = root._state_ctx.iter_forward_root
    assert len(seen) >= 4, f"the check made {len(seen)} model calls: it compares 3 alone and at least 1 packed"
    assert all(state is root for state in seen), (
        f"the check's model calls ran under the forward root {seen}, not the FSDP2 root's state {root}")
    assert after is None, "FSDP2's root post-forward must run after the check (it resets the forward root)"


def test_an_error_inside_the_root_forward_is_raised_after_fsdp2s_post_forward(tiny_model_dir):
    """`fsdp.in_root_forward`: a function that raises inside the root forward has its exception carried out and raised
    after FSDP2's post-forward ran (raised inside, the root would stay gathered and in its forward state, and the next
    forward would skip the root pre-forward); the policy scores as before afterwards."""
    from grpo_lib.model import fsdp

    cfg = make_cfg(tiny_model_dir)
    ids = torch.tensor([[3, 5, 7, 9]])
    with one_process_group():
        actor = Actor(cfg, device=torch.device("cpu"))
        root = actor.policy._get_fsdp_state()  # torch 2.11-2.13: FSDPModule's state; _state_ctx.iter_forward_root
        with torch.no_grad():
            before, _ = actor.policy(ids, torch.ones_like(ids), temperature=1.0)

        def broken(model):
            model(input_ids=ids)  # the decoder ran (its layers gathered) before the error
            raise ValueError("inside the root forward")

        with pytest.raises(ValueError, match="inside the root forward"):
            fsdp.in_root_forward(actor.policy, broken)
        assert root._state_ctx.iter_forward_root is None, "FSDP2's root post-forward must have run"
        with torch.no_grad():
            after, _ = actor.policy(ids, torch.ones_like(ids), temperature=1.0)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


class _FakeLLM:
    """Stands in for vllm.LLM: consumes the weights iterator like reload_weights and records what was alive."""

    def __init__(self, dtype):
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
        self.loaded, self.produced_ahead = [], []

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        for name, tensor in kwargs["weights_iterator"]:
            self.loaded.append((name, tensor))
            self.produced_ahead.append(self.produced - len(self.loaded))

    def reset_prefix_cache(self):
        pass


def test_push_streams_in_bounded_buckets_and_casts():
    """10 tensors of 1 MiB (float32) pushed in 2-MiB buckets of bfloat16 (0.5 MiB each): at most 4 are ever
    gathered ahead of the engine, never the whole model, and every tensor arrives cast and unchanged."""
    llm = _FakeLLM(torch.bfloat16)
    llm.produced = 0
    tensors = [(f"layer{i}.weight", torch.randn(512, 512)) for i in range(10)]

    def lazily_gathered():
        for item in tensors:
            llm.produced += 1
            yield item

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.cfg = llm, SimpleNamespace(update_weights_bucket_megabytes=2)
    engine.lifecycle = Lifecycle(frees_memory=False, discards_weights=False)  # a fresh engine: ready, a push is legal
    engine.push_weights(lazily_gathered())
    assert [n for n, _ in llm.loaded] == [n for n, _ in tensors]
    assert all(t.dtype == torch.bfloat16 for _, t in llm.loaded)
    assert all(torch.equal(t, src.to(torch.bfloat16)) for (_, t), (_, src) in zip(llm.loaded, tensors))
    assert max(llm.produced_ahead) <= 3, f"tensors held ahead of the engine: {llm.produced_ahead}"


def test_tied_embedding_gathered_once_per_push(tiny_model_dir, monkeypatch):
    """The embedding and the tied lm_head are one parameter: one gather (a full all-gather of the largest tensor),
    yielded under both names, and every other tensor gathered exactly once."""
    from transformers import AutoModelForCausalLM

    from grpo_lib.model import fsdp

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.tie_word_embeddings, "the tiny model ties its embeddings"
    gathered = []
    monkeypatch.setattr(fsdp, "full_tensor", lambda t: gathered.append(t.shape) or t)
    pushed = dict(fsdp.gathered_state(model))
    assert "lm_head.weight" in pushed and pushed["lm_head.weight"] is pushed["model.embed_tokens.weight"]
    assert len(gathered) == len(pushed) - 1, f"{len(gathered)} gathers for {len(pushed)} names"
    assert set(pushed) == set(model.state_dict()) | {"lm_head.weight"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: on CPU the host is the device")
def test_offload_moves_shards_to_host_and_back_on_gpu(tiny_model_dir):
    cfg = make_cfg(tiny_model_dir, "actor.fsdp_config.param_offload=true", "actor.fsdp_config.optimizer_offload=true",
                   "actor.use_kl_loss=true", "ref.fsdp_config.param_offload=true")
    batch = fake_batch(cfg)
    device = torch.device("cuda", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        actor, reference = Actor(cfg, device=device), Reference(cfg, device=device)
        batch.ref_logprobs = reference.compute_logprobs(batch)
        assert all(p.to_local().device.type == "cpu" for p in reference.model.parameters())
        actor.update(batch)
        state = [v for s in actor.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert state and all(v.device.type == "cpu" for v in state), "optimizer state offloaded after the update"
        dict(actor.named_weights())
        assert fsdp.params_device(actor.model).type == "cuda"
        actor.offload()
        assert fsdp.params_device(actor.model).type == "cpu"
        actor.update(batch)  # loads params and optimizer state back
    finally:
        dist.destroy_process_group()


def test_plan_prints_the_collectives_of_each_choice():
    """--print-plan's collective section for the Qwen3-4B recipe on 4 processes: today's bytes per mini-batch per
    process are M (2 c + r) P with M = 320 micro-batches, c = 2 (bf16 gathers), r = 4 (fp32 reduce-scatters), P = the
    model's parameters (tests/data/qwen3_4b_config.json: 4,022,468,096); every opt-in choice lowers them."""
    import json
    import re
    from pathlib import Path

    from grpo_lib.config import load_config
    from grpo_lib.planning import plan, memory

    repo = Path(__file__).resolve().parents[2]
    sizes = memory.model_sizes(json.loads((repo / "tests" / "data" / "qwen3_4b_config.json").read_text()))
    assert sizes.params == 4_022_468_096

    def total_gib(*overrides):
        cfg = load_config(str(repo / "recipes" / "qwen3_4b_gsm8k.yaml"), list(overrides), world_size=4)
        lines = plan.collective_lines(cfg, sizes, world_size=4, gpu_gb=80)
        today = float(re.search(r"today's schedule \(per micro-batch\): ([0-9.]+) GiB", "\n".join(lines)).group(1))
        this = float(re.search(r"= ([0-9.]+) GiB \(", "\n".join(lines)).group(1))
        return today, this

    today, default = total_gib()
    assert today == pytest.approx(320 * (2 * 2 + 4) * sizes.params / 2**30, abs=0.05)
    assert default < today, "keep_root_gathered (the default) saves the root's re-gathers"
    _, deferred = total_gib("actor.fsdp_config.defer_grad_reduce=all")
    _, both = total_gib("actor.fsdp_config.defer_grad_reduce=all", "actor.fsdp_config.reshard_after_forward=false")
    assert both < deferred < default and today / both > 4, (today, default, deferred, both)
