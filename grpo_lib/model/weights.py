"""Full fine-tuning or LoRA, decided once: what the actor trains, pushes to the engine and exports, and its KL reference.

`weights_for(cfg)` is the only place where the actor and the training loop decide LoRA vs full fine-tuning (config
validation and the plan read `model.lora_rank` for their own checks); the actor holds what it returns and calls it
for each of these, so neither the actor nor the training loop branches on LoRA:

| | `FullWeights` | `LoraWeights` (`model.lora_rank > 0`, grpo_lib/model/lora.py) |
|---|---|---|
| `wrap(model)` | the model as loaded: every weight trains | peft adapters; the base is frozen |
| `named_weights(model)` | every weight, gathered from its shards | base + scale * B A, merged into new tensors |
| `save_hf(...)` | one Hugging Face folder | `adapter/` (peft) and, with trainer.save_merged, `merged/` |
| `reference(...)` | a frozen copy of model.path | the actor itself with its adapters off |

Both take and return plain `nn.Module`s; the reference classes live in grpo_lib/model/actor.py beside the logprob pass
they share, so `reference` is handed a constructor for each kind and picks one (this module imports no actor).
Example: `weights_for(cfg)` with `model.lora_rank=16` -> `LoraWeights`; `weights.reference(frozen_copy=f,
adapters_off=g)` -> `g()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from grpo_lib.model import fsdp, lora


class FullWeights:
    """Full fine-tuning: every weight trains, is pushed and exported; the initial policy needs a model of its own."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def named_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor), gathered one at a time; with tied embeddings `lm_head.weight` is included."""
        return fsdp.gathered_state(model)

    pushes_adapter = False  # the engine is pushed every weight (`named_weights`)

    def save_hf(self, model: torch.nn.Module, path: Path, tokenizer, *, export_dtype: torch.dtype, write: bool) -> None:
        """One Hugging Face folder at `path`, in `export_dtype`. Every process calls it (the shards are gathered one by
        one); the process with `write` (process 0) keeps a CPU copy of each and writes."""
        state = {}
        for name, tensor in self.named_weights(model):
            tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings  # saved as the embedding
            if write and not tied_head:  # in the dtype the model came in (bf16 for hub models: half of fp32)
                state[name] = tensor.detach().to("cpu", dtype=export_dtype, copy=True)
        if write:
            fsdp.write_hf_folder(model, path, state, tokenizer, export_dtype)

    def reference(self, *, frozen_copy: Callable, adapters_off: Callable):
        """Every weight trains, so the initial policy survives only in model.path: a frozen copy of it."""
        return frozen_copy()


class LoraWeights:
    """LoRA (grpo_lib/model/lora.py): only the adapters train; the engine and the merged export get base + adapters."""

    def __init__(self, cfg):
        self.cfg = cfg

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The peft PeftModel around `model`: base frozen, adapters trainable (fresh, or from model.lora_adapter_path)."""
        return lora.apply_lora(model, self.cfg.model)

    def named_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Base + scaled adapters under the base model's Hugging Face names, new tensors (the base is not modified)."""
        return lora.merged_named_weights(model)

    @property
    def pushes_adapter(self) -> bool:
        """rollout.lora_mode=adapter: the engine is pushed the adapter alone (`adapter`), not the merged weights."""
        return self.cfg.rollout.lora_mode == "adapter"

    def adapter(self, model: torch.nn.Module):
        """The adapter for the engine (`lora.adapter_push`: its tensors and config; the engine keeps its base weights)."""
        return lora.adapter_push(model)

    def save_hf(self, model: torch.nn.Module, path: Path, tokenizer, *, export_dtype: torch.dtype, write: bool) -> None:
        """`path/adapter` (peft format) and, with trainer.save_merged, `path/merged` (`lora.save_lora_checkpoint`)."""
        lora.save_lora_checkpoint(model, tokenizer, path, export_dtype=export_dtype,
                                  save_merged_folder=self.cfg.trainer.save_merged, write=write)

    def reference(self, *, frozen_copy: Callable, adapters_off: Callable):
        """The base never trains, so the actor with its adapters off is the initial policy: no second model."""
        return adapters_off()


def weights_for(cfg) -> FullWeights | LoraWeights:
    """The one decision between full fine-tuning and LoRA (`model.lora_rank > 0`)."""
    return LoraWeights(cfg) if lora.lora_on(cfg) else FullWeights()
