"""LoRA with peft on an `nn.Module`: adapters, the adapters-off context, merged weights for the engine, adapter saves.

With `model.lora_rank > 0` the actor is a peft `PeftModel`: every targeted linear layer y = W x gets a trainable
low-rank update, y = W x + (lora_alpha / lora_rank) * B A x (A: [r, in], B: [out, r], B starts at 0 so step 0 is
the base model). Only A and B are trainable: they alone reach the optimizer (so the base is never decayed), get
gradients and are averaged over processes. What follows from that:

- Reference for free: the KL reference is the initial policy, which is the same model with the adapters switched
  off (`adapters_disabled`), so no second model is loaded (`grpo_lib.model.reference.AdapterDisabledReference`).
- Push: the engine serves plain Hugging Face weights. `merged_named_weights` yields, per parameter, W + scale * B A
  computed into a new tensor (the actor's W is never modified in place) under the base model's HF names, streamed
  like the full push. Pushing the base (`merge=False`) restores the base model in the engine.
- Checkpoints: `save_lora_checkpoint` writes the adapter in peft format (`PeftModel.from_pretrained` loads it) and,
  with trainer.save_merged, a full HF folder (transformers and vLLM load it).

Every function here takes the model (or the config); nothing here knows the actor. Whether a run uses LoRA at all is
decided once, in `grpo_lib.model.weights.weights_for`.

Adapter-only push (rollout.lora_mode=adapter, vLLM only): `adapter_push` hands the engine the adapter tensors alone
(tens of MB where the merged model is GB); the engine keeps its base weights and serves base + adapter through vLLM's
LoRA layers (grpo_lib/rollout/engines/vllm_lora.py), as verl does. merged (the default) stays: any engine, any module.
Run the tests: `python -m pytest tests/model/test_lora.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from grpo_lib.model.fsdp import full_tensor, names_by_tensor, write_hf_folder

# peft's parameter names inside a LoRA-wrapped linear layer: <layer>.base_layer.weight (the frozen W),
# <layer>.lora_A.<adapter>.weight, <layer>.lora_B.<adapter>.weight (and lora_embedding_* for embeddings).
_ADAPTER_PARAM = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def lora_on(cfg) -> bool:
    return cfg.model.lora_rank > 0


def check_lora_setup(cfg) -> list[str]:
    """Problems with the LoRA keys that need the model's structure (cheap: config.json + a meta-device build).

    Called before the engine starts. Returns messages naming the key; empty list: fine.
    Example: target_modules [q_proj, qkv] on Qwen3 -> ["model.target_modules: 'qkv' matches no module ..."].
    """
    m = cfg.model
    if not lora_on(cfg):
        return []
    problems = []
    if m.lora_adapter_path is not None:
        adapter_config = Path(m.lora_adapter_path) / "adapter_config.json"
        if not adapter_config.is_file():
            problems.append(f"model.lora_adapter_path={m.lora_adapter_path!r}: no adapter_config.json there; point it at a "
                            "folder written by PeftModel.save_pretrained (a checkpoint's actor/adapter folder)")
        return problems  # rank, alpha and targets come from the adapter folder
    if m.target_modules == ["all-linear"]:
        return problems
    if "all-linear" in m.target_modules:
        return problems + [f"model.target_modules={m.target_modules}: all-linear cannot be combined with other names; "
                           "use all-linear alone or a list of module names"]
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
    names = [name for name, _ in model.named_modules()]
    linear = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)})
    for target in m.target_modules:
        if not any(name == target or name.endswith("." + target) for name in names):
            problems.append(f"model.target_modules: {target!r} matches no module of {m.path}; its linear layers are "
                            f"{linear} (or use all-linear)")
    return problems


def apply_lora(model: torch.nn.Module, model_cfg) -> torch.nn.Module:
    """Wrap `model` in a peft PeftModel with trainable adapters (fresh, or loaded from model.lora_adapter_path).

    Every base parameter is frozen (requires_grad False); adapter parameters are trainable and in the model dtype.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if model_cfg.lora_adapter_path is not None:
        peft_model = PeftModel.from_pretrained(model, model_cfg.lora_adapter_path, is_trainable=True)
    else:
        targets = "all-linear" if model_cfg.target_modules == ["all-linear"] else list(model_cfg.target_modules)
        peft_model = get_peft_model(model, LoraConfig(
            r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, target_modules=targets,
            lora_dropout=model_cfg.lora_dropout, bias="none", task_type="CAUSAL_LM"))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(_ADAPTER_PARAM.search(n) for n in trainable), (
        f"after wrapping, the trainable parameters must be the adapters only; got {trainable[:5]}")
    return peft_model


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable (adapter) parameters; with LoRA off, every parameter."""
    return [p for p in model.parameters() if p.requires_grad]


def hf_name(peft_name: str) -> str:
    """A base parameter's name inside the peft-wrapped model -> its Hugging Face name.

    Example: "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    -> "model.layers.0.self_attn.q_proj.weight".
    """
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_named_weights(model: torch.nn.Module, *, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the base model with the adapters merged in (merge=True) or left out (merge=False).

    Per LoRA layer: W + (lora_alpha / r) * B @ A, summed in float32 into a NEW tensor of W's dtype (W itself is never
    touched). Stored tensors are all-gathered from their FSDP2 shards (`fsdp.full_tensor`, a collective: every
    process must consume the iterator to its end, in step). Adapter tensors are not yielded. Streams: one merged
    tensor alive at a time; a tensor shared by two names (tied embeddings) is gathered once.
    """
    from peft.tuners.lora import LoraLayer

    lora_layers = {f"{name}.base_layer.weight": module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    states = model.state_dict()
    for names in names_by_tensor(model, states).values():
        if _ADAPTER_PARAM.search(names[0]):
            continue
        stored = full_tensor(states[names[0]].detach())
        for name in names:
            module = lora_layers.get(name)
            full = stored
            if merge and module is not None:
                full = (stored.float() + _delta_weight(module, states, name)).to(stored.dtype)  # [out, in]
            yield hf_name(name), full


def _delta_weight(module, states: dict[str, torch.Tensor], weight_name: str) -> torch.Tensor:
    """scale * B @ A of one LoRA linear layer (sum over its active adapters), float32 [out, in]."""
    prefix = weight_name.removesuffix("base_layer.weight")
    delta = None
    for adapter in module.active_adapters:
        a = full_tensor(states[f"{prefix}lora_A.{adapter}.weight"].detach()).float()  # [r, in]
        b = full_tensor(states[f"{prefix}lora_B.{adapter}.weight"].detach()).float()  # [out, r]
        d = module.scaling[adapter] * (b @ a)  # [out, in]
        if getattr(module, "fan_in_fan_out", False):
            d = d.T
        delta = d if delta is None else delta + d
    return delta


def adapters_disabled(model: torch.nn.Module):
    """Context in which the peft-wrapped `model` computes its base model, the initial policy (adapters switched off)."""
    return model.disable_adapter()


def reference_note(cfg) -> str:
    """The one log line saying what the ref.* keys do with LoRA on."""
    return ("LoRA: the KL reference is the actor with its adapters disabled (no second model); "
            f"ref.fsdp_config.param_offload={cfg.ref.fsdp_config.param_offload} has nothing to do")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only (peft names, full, on CPU); a collective under FSDP2 like `merged_named_weights`."""
    return {name: full_tensor(t.detach()).cpu() for name, t in model.state_dict().items() if _ADAPTER_PARAM.search(name)}


def adapter_push(model: torch.nn.Module):
    """The adapter alone for the engine (rollout.lora_mode=adapter, grpo_lib/rollout/engines/vllm_lora.py): its tensors
    under PEFT's saved names (the adapter name dropped: `...q_proj.lora_A.weight`), full and on the host, and the LoRA
    config vLLM needs. A collective under FSDP2, like `merged_named_weights`."""
    from grpo_lib.core.types import AdapterWeights

    peft_config = model.peft_config[model.active_adapter]
    # copies, never the actor's own storage (on CPU `adapter_state` may return the parameters themselves): vLLM folds the
    # scaling into lora_B in place (`LoRALayerWeights.optimize`), which would scale the actor's trained B with it
    tensors = {name.replace(f".{model.active_adapter}.", "."): t.to("cpu", copy=True) for name, t in adapter_state(model).items()}
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    config = {"r": peft_config.r, "lora_alpha": peft_config.lora_alpha, "target_modules": targets, "bias": "none",
              "use_rslora": bool(getattr(peft_config, "use_rslora", False)), "use_dora": bool(getattr(peft_config, "use_dora", False)),
              # per-module ranks / alphas of an adapter loaded from model.lora_adapter_path (vLLM's PEFTHelper reads them)
              "rank_pattern": dict(getattr(peft_config, "rank_pattern", None) or {}),
              "alpha_pattern": dict(getattr(peft_config, "alpha_pattern", None) or {})}
    return AdapterWeights(tensors=tensors, config=config)


def save_lora_checkpoint(model: torch.nn.Module, tokenizer, path: Path, *, export_dtype: torch.dtype, save_merged_folder: bool,
                         write: bool = True) -> None:
    """A LoRA model's Hugging Face save: `path/adapter` (peft format + tokenizer) and, if asked, `path/merged` (full HF
    folder, in `export_dtype`: the dtype model.path was saved in).

    Every process calls it (under FSDP2 the tensors are gathered from the shards); the process with
    `write` (process 0) writes. Reload the adapter with
    `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model.path), path / "adapter")`;
    start a run from it with `model.lora_adapter_path=path/adapter`.
    """
    adapter_dir, merged_dir = Path(path) / "adapter", Path(path) / "merged"
    # Every gather (a collective) comes before any write: a write failing on process 0 (a full disk) must not leave
    # the other processes waiting in a gather process 0 never joins (checkpoint.save then stops all of them).
    state = adapter_state(model)
    merged = {}
    if save_merged_folder:
        for name, tensor in merged_named_weights(model):
            if write:
                merged[name] = tensor.to("cpu", dtype=export_dtype, copy=True)
    if not write:
        return
    adapter_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(adapter_dir, state_dict=state)  # peft keeps the adapter keys: adapter_config + weights
    tokenizer.save_pretrained(adapter_dir)
    if save_merged_folder:  # in the dtype model.path was saved in, like the full export
        write_hf_folder(model.get_base_model(), merged_dir, merged, tokenizer, export_dtype)
