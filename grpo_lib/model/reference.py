"""The frozen models: the KL reference and the distillation teacher's base (`FrozenModel`: loaded by process 0 and
sharded like the actor, no optimizer), and the reference with LoRA on (the actor's own model, adapters off).

`make_reference(actor)` picks which the run's KL term scores against (grpo_lib/model/weights.py decides: a frozen copy of
model.path, or the adapters-off actor). Every forward goes through `grpo_lib.model.passes.logprobs_over_batch`, as the
actor's own passes do, on the reference pass's knobs (ref.log_prob_*).
"""

from __future__ import annotations

import sys

import torch

from grpo_lib.core import dtypes, perf
from grpo_lib.core.distributed import rank as _rank
from grpo_lib.core.types import RolloutBatch
from grpo_lib.model import attention, fsdp, lora
from grpo_lib.model.actor import Actor, load_model
from grpo_lib.model.passes import logprobs_over_batch


def ref_pass_budget(cfg) -> dict:
    """The reference pass's micro-batch bound (ref.log_prob_*, resolved in config validation) as
    `logprobs_over_batch` / `passes.micro_batches` take it: max_tokens (None without dynamic batch sizes) and
    micro_batch_size. The KL reference and the distillation teacher both run on it."""
    r = cfg.ref
    return dict(max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                micro_batch_size=r.log_prob_micro_batch_size_per_gpu)


def make_reference(actor: Actor) -> Reference | AdapterDisabledReference:
    """The KL reference, the initial policy (build it only with a KL term). `actor.weights` picks: a frozen copy of
    model.path (`Reference`) or, with LoRA, this actor with its adapters off (`AdapterDisabledReference`)."""
    return actor.weights.reference(frozen_copy=lambda: Reference(actor.cfg, device=actor.device),
                                   adapters_off=lambda: AdapterDisabledReference(actor, actor.cfg))


class FrozenModel:
    """A model that never trains, sharded like the actor (no optimizer): the KL reference and the distillation teacher.

    Read by process 0 (the others build it on the meta device) in `model.dtype` (auto: float32 on CPU, bfloat16 on
    GPU), computing in the actor's param_dtype on the attention implementation the actor's settings choose. With
    `ref.fsdp_config.param_offload` its shards live in CPU memory (FSDP2 CPUOffloadPolicy: each unit is copied to the
    device only for its own forward)."""

    def __init__(self, cfg, path: str, *, name: str, device: torch.device, offload: bool | None = None,
                 trust_remote_code: bool | None = None, **load_kwargs):
        """`offload` (default ref.fsdp_config.param_offload), `trust_remote_code` (default model.trust_remote_code) and
        `load_kwargs` (`actor.load_model`'s: the reward model's auto_class) for a model with its own keys."""
        self.cfg, self.device = cfg, device
        fc = cfg.actor.fsdp_config
        param_dtype = dtypes.torch_dtype(fc.param_dtype, device)
        offload = cfg.ref.fsdp_config.param_offload if offload is None else offload
        remote = cfg.model.trust_remote_code if trust_remote_code is None else trust_remote_code
        remove_padding = load_kwargs.pop("remove_padding", cfg.model.use_remove_padding)  # False: padded rows (dense sdpa)
        self.model = load_model(path, dtype=dtypes.torch_dtype(cfg.model.dtype, device), device=torch.device("cpu"),
                                trust_remote_code=remote,
                                attn_implementation=attention.select_attn_implementation(
                                    device, param_dtype, remove_padding=remove_padding),
                                empty=not fsdp.reads_weights(), **load_kwargs)  # as the actor
        self.model.eval().requires_grad_(False)
        self.policy = fsdp.shard(self.model, device=device, param_dtype=param_dtype, reduce_dtype=getattr(torch, fc.reduce_dtype),
                                 cpu_offload=offload)
        print(fsdp.describe(self.model, name=name, param_dtype=param_dtype, trainable=False)
              + (", shards in CPU memory between uses" if offload else ""), flush=True)
        master = next(self.model.parameters()).dtype
        self.autocast = lambda: perf.compute_autocast(device, dtypes.torch_dtype(fc.param_dtype, device, cpu_auto=master), master)


class Reference(FrozenModel):
    """Frozen copy of the initial policy (model.path), a `FrozenModel`. Built only with a KL term."""

    def __init__(self, cfg, *, device: torch.device):
        super().__init__(cfg, cfg.model.path, name="reference", device=device)

    @perf.with_trainer_threads
    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return logprobs_over_batch(
            self.policy, batch, temperature=self.cfg.rollout.temperature, remove_padding=self.cfg.model.use_remove_padding,
            **ref_pass_budget(self.cfg), device=self.device, autocast=self.autocast)


class AdapterDisabledReference:
    """The KL reference with LoRA on: the actor's own model with its adapters switched off (the initial policy), run
    through the reference pass's knobs like `Reference`; no second model. Says once (process 0) what ref.* keys do."""

    def __init__(self, actor: Actor, cfg):
        self.actor, self.cfg = actor, cfg
        if _rank() == 0:
            print(lora.reference_note(cfg), file=sys.stderr)

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        self.actor.load_params()
        policy = self.actor.policy  # the FSDP2 root around the PeftModel: the same forward path as the actor's
        was_training = policy.training
        policy.eval()
        try:
            with lora.adapters_disabled(self.actor.model):
                return logprobs_over_batch(
                    policy, batch, temperature=self.cfg.rollout.temperature, remove_padding=self.cfg.model.use_remove_padding,
                    **ref_pass_budget(self.cfg), device=self.actor.device, autocast=self.actor.autocast)  # [B, T]
        finally:
            policy.train(was_training)
