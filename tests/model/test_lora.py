"""LoRA (grpo_lib/model/lora.py) in one process, without an engine: what trains, what stays frozen, the reference for free,
merged weights, and adapter / merged saves.

Uses the fixed tiny model and mini-batch of `tests/scripts/grad_case.py`. The engine side (pushes, vLLM loading the
merged export, 1 vs 2 processes) is in tests/train/test_lora_e2e.py. Run: `python -m pytest tests/model/test_lora.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lib.config import ConfigError
from grpo_lib.model import lora
from grpo_lib.model.actor import Actor
from grpo_lib.model.fsdp import LogprobModel
from grpo_lib.model.passes import logprobs_over_batch
from grpo_lib.model.reference import AdapterDisabledReference
from tests.conftest import launch
from tests.scripts import grad_case as case
from tests.helpers.tolerances import adamw_flip_bound, assert_close_after_adamw

LORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.weight_decay=0.1")


def lora_config(model_dir, *, extra=(), **kwargs):
    return case.make_config(model_dir, extra=LORA + tuple(extra), **kwargs)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>")))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)  # the machine is shared; the model is tiny
    return case.write_tiny_model(tmp_path_factory.mktemp("lora") / "model")


@pytest.fixture(scope="module")
def trained(model_dir):
    """An actor with LoRA after 3 updates (packing + token budget + gradient checkpointing), and its start state."""
    cfg = lora_config(model_dir, remove_padding=True, max_tokens=100, extra=("model.enable_gradient_checkpointing=true",))
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    start = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    batch = case.make_batch(actor.model)
    metrics = [actor.update(batch) for _ in range(3)]
    return dict(cfg=cfg, actor=actor, start=start, batch=batch, metrics=metrics)


def test_config_rejects_bad_lora_values(model_dir):
    with pytest.raises(ConfigError, match="model.lora_rank=-1"):
        case.make_config(model_dir, extra=("model.lora_rank=-1",))
    with pytest.raises(ConfigError, match="rollout.lora_mode=adapter with rollout.name=hf: that engine cannot serve"):
        case.make_config(model_dir, extra=LORA + ("rollout.lora_mode=adapter", "rollout.name=hf"))
    with pytest.raises(ConfigError, match="model.lora_adapter_path"):
        case.make_config(model_dir, extra=("model.lora_adapter_path=somewhere",))


def test_target_module_that_matches_nothing_is_named(model_dir, tmp_path):
    cfg = lora_config(model_dir, extra=("model.target_modules=[q_proj,qkv_proj]",))
    problems = lora.check_lora_setup(cfg)
    assert len(problems) == 1 and "model.target_modules: 'qkv_proj' matches no module" in problems[0], problems
    assert "q_proj" in problems[0] and "down_proj" in problems[0], "the message lists the model's linear layers"
    assert lora.check_lora_setup(lora_config(model_dir, extra=("model.target_modules=[q_proj,v_proj]",))) == []
    assert lora.check_lora_setup(lora_config(model_dir)) == []  # all-linear
    bad_path = lora_config(model_dir, extra=(f"model.lora_adapter_path={tmp_path}",))
    assert "model.lora_adapter_path" in lora.check_lora_setup(bad_path)[0]


def test_only_adapters_train_and_base_stays_bit_identical(trained):
    actor, start = trained["actor"], trained["start"]
    params = dict(actor.model.named_parameters())
    adapter_names = {n for n, p in params.items() if p.requires_grad}
    assert adapter_names and all(".lora_A." in n or ".lora_B." in n for n in adapter_names), sorted(adapter_names)[:4]
    # 2 layers x 7 linear layers (q k v o gate up down) x (A, B)
    assert len(adapter_names) == 2 * 7 * 2, sorted(adapter_names)
    optimizer_ids = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert optimizer_ids == {id(params[n]) for n in adapter_names}, "the optimizer must hold the adapter parameters only"
    for name, p in params.items():
        if name in adapter_names:
            assert not torch.equal(p, start[name]), f"adapter {name} did not change in 3 updates"
        else:
            assert torch.equal(p, start[name]), f"base weight {name} changed (weight decay or a gradient reached it)"
            assert p.grad is None, f"frozen {name} got a gradient"
    assert all(m["actor/grad_norm"] > 0 for m in trained["metrics"])


def test_reference_is_the_base_model_exactly(trained, model_dir):
    """Adapters disabled on the trained actor == the separate base-model reference of full fine-tuning, bit for bit
    (same micro-batches and packing: the reference pass's own settings)."""
    from grpo_lib.model.reference import Reference

    cfg, actor, batch = trained["cfg"], trained["actor"], trained["batch"]
    ref = AdapterDisabledReference(actor, cfg).compute_logprobs(batch)  # [B, T]
    expected = Reference(cfg, device=torch.device("cpu")).compute_logprobs(batch)  # [B, T]
    assert torch.equal(ref, expected), f"max diff {(ref - expected).abs().max()}"
    trained_lp = actor.compute_logprobs(batch)  # adapters back on after the context
    assert (trained_lp - expected).abs().max() > 1e-4, "the adapters changed nothing: the test would prove nothing"


def test_merged_weights_score_like_the_actor_and_leave_the_base_alone(trained, model_dir):
    cfg, actor, batch, start = trained["cfg"], trained["actor"], trained["batch"], trained["start"]
    merged = dict(actor.named_weights())
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert set(merged) == set(base.state_dict()), "merged names must be the base model's Hugging Face names"
    base.load_state_dict(merged)
    base.eval()
    got = logprobs_over_batch(LogprobModel(base), batch, temperature=cfg.rollout.temperature, remove_padding=False, max_tokens=None,
                              micro_batch_size=8, device=torch.device("cpu"))  # [B, T]
    torch.testing.assert_close(got, actor.compute_logprobs(batch), rtol=0, atol=1e-5)
    for name, p in actor.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, start[name]), f"computing merged weights modified {name}"
    unmerged = dict(lora.merged_named_weights(actor.model, merge=False))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(unmerged[q], start[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    assert not torch.equal(merged[q], unmerged[q])


def test_saved_adapter_and_merged_folder_reload(trained, model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    cfg, actor, batch = trained["cfg"], trained["actor"], trained["batch"]
    tokenizer = tiny_tokenizer()
    lora.save_lora_checkpoint(actor.model, tokenizer, tmp_path, export_dtype=actor.export_dtype, save_merged_folder=True)
    expected = actor.compute_logprobs(batch)  # [B, T]
    kw = dict(temperature=cfg.rollout.temperature, remove_padding=False, max_tokens=None, micro_batch_size=8, device=torch.device("cpu"))
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tmp_path / "adapter")
    torch.testing.assert_close(logprobs_over_batch(LogprobModel(reloaded.eval()), batch, **kw), expected, rtol=0, atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(logprobs_over_batch(LogprobModel(merged), batch, **kw), expected, rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(tmp_path / "merged") is not None


def test_start_from_saved_adapter(trained, model_dir, tmp_path):
    """model.lora_adapter_path: the new actor starts where the saved one was, and keeps training its adapters."""
    actor, batch = trained["actor"], trained["batch"]
    tokenizer = tiny_tokenizer()
    lora.save_lora_checkpoint(actor.model, tokenizer, tmp_path, export_dtype=actor.export_dtype, save_merged_folder=False)
    assert not (tmp_path / "merged").exists()
    cfg = lora_config(model_dir, extra=(f"model.lora_adapter_path={tmp_path / 'adapter'}",))
    resumed = Actor(cfg, device=torch.device("cpu"))
    torch.testing.assert_close(resumed.compute_logprobs(batch), actor.compute_logprobs(batch), rtol=0, atol=1e-6)
    assert len(lora.adapter_parameters(resumed.model)) == len(lora.adapter_parameters(actor.model))


def merge_delta(adapter_2: dict, adapter_1: dict, weight_name: str) -> torch.Tensor:
    """B2 @ A2 - B1 @ A1 of the LoRA layer whose base weight is `weight_name` (zeros for a weight without adapters)."""
    stem = weight_name.removesuffix(".weight")
    def product(adapter):
        a = [t for n, t in adapter.items() if f"{stem}.lora_A" in n]
        b = [t for n, t in adapter.items() if f"{stem}.lora_B" in n]
        assert len(a) == len(b) <= 1, f"{weight_name}: adapters {len(a)} A, {len(b)} B"
        return b[0].float() @ a[0].float() if a else torch.zeros(())  # [out, in]
    return product(adapter_2) - product(adapter_1)


@pytest.mark.multiprocess
def test_two_processes_match_one(model_dir, tmp_path):
    """2 gloo processes (FSDP2 when the actor shards), half the groups each: the same metrics (rtol 1e-4), adapters
    and merged weights as 1 process on the whole mini-batch; base weights bit-identical with no gradient."""
    from tests.conftest import REPO
    from tests.scripts import lora_worker

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = case.make_batch(model)
    torch.save(batch, tmp_path / "batch.pt")
    proc = launch([REPO / "tests" / "scripts" / "lora_worker.py", model_dir, tmp_path / "batch.pt", tmp_path], procs=2)
    assert proc.returncode == 0, f"--- stderr ---\n{proc.stderr[-6000:]}\n--- stdout ---\n{proc.stdout[-2000:]}"
    two = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    one = lora_worker.run(model_dir, batch, world_size=1, rank=0)
    assert one["base_unchanged"] and one["base_grads_none"]
    for r, got in enumerate(two):
        assert got["sharded"], f"process {r}: the actor was not sharded with FSDP2"
        assert got["base_unchanged"], f"process {r}: a base weight shard changed"
        assert got["base_grads_none"], f"process {r}: a frozen base weight got a gradient"
        for step, (m1, m2) in enumerate(zip(one["metrics"], got["metrics"])):
            for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), f"update {step} {key}: 1 process {m1[key]}, 2: {m2[key]}"
        # Adapters after 3 AdamW steps: round-off relative to each tensor's scale, except rare elements whose gradient
        # is within round-off of zero (AdamW's sign-flip bound, tests/helpers/tolerances.py; lr 1e-2, weight decay 0.1).
        assert got["adapter"].keys() == one["adapter"].keys()
        for name, t in one["adapter"].items():
            bound = adamw_flip_bound(lr=1e-2, optimizer_steps=3, weight_decay=0.1, weight_scale=float(t.abs().max()))
            assert_close_after_adamw(got["adapter"][name], t, flip_bound=bound, name=f"process {r} {name}")
        # Merged weights: W + s * B @ A with s = lora_alpha / r = 2, so the 2-process merge must equal the 1-process one
        # plus s * (B2 @ A2 - B1 @ A1) of the adapters compared above, within round-off of the weight's scale.
        assert got["merged"].keys() == one["merged"].keys()
        for name, t in one["merged"].items():
            expected = t.float() + 2.0 * merge_delta(got["adapter"], one["adapter"], name)
            torch.testing.assert_close(got["merged"][name].float(), expected, rtol=1e-4, atol=1e-4 * float(t.abs().max()),
                                       msg=lambda m: f"{name}: {m}")
    for r, share in enumerate(lora_worker.SHARES):
        mine = [i for i, g in enumerate(batch.group_ids) if g in share]
        width = two[r]["ref"].shape[1]
        torch.testing.assert_close(two[r]["ref"], one["ref"][mine][:, :width], rtol=0, atol=1e-5)


def test_lora_export_gathers_everything_before_writing(monkeypatch, tmp_path):
    """Every gather of the LoRA export (collectives under FSDP2) comes before process 0's first write: a write that
    fails on process 0 (full disk) must not leave the others waiting in a gather it never joins."""
    from pathlib import Path
    from types import SimpleNamespace

    events = []
    monkeypatch.setattr(lora, "adapter_state", lambda model: events.append("gather adapter") or {})

    def merged(model):
        events.append("gather merged")
        yield "w", torch.zeros(1)

    monkeypatch.setattr(lora, "merged_named_weights", merged)
    monkeypatch.setattr(lora, "write_hf_folder", lambda model, path, *a: events.append(f"write {Path(path).name}"))
    model = SimpleNamespace(save_pretrained=lambda path, **kw: events.append(f"write {Path(path).name}"), get_base_model=lambda: None)
    tokenizer = SimpleNamespace(save_pretrained=lambda path: None)
    lora.save_lora_checkpoint(model, tokenizer, tmp_path, export_dtype=torch.float32, save_merged_folder=True, write=True)
    assert events == ["gather adapter", "gather merged", "write adapter", "write merged"], events
    events.clear()
    lora.save_lora_checkpoint(model, tokenizer, tmp_path, export_dtype=torch.float32, save_merged_folder=True, write=False)
    assert events == ["gather adapter", "gather merged"], "the other processes gather the same, write nothing"
