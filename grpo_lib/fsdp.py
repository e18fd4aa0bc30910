"""FSDP2 sharding of the actor and the reference, their offload between phases, gathering full weights, memory.

How the model is sharded (one path on CPU and GPU; applied by our code, accelerate's FSDP plugin is not used):
- `fully_shard` on every decoder layer (the classes in the model's `_no_split_modules`, as verl does) and on a
  root `LogprobModel` that wraps the Hugging Face model. The root holds the embeddings, the final norm and
  the output head (tied or not).
- Why a wrapper as the root: `grpo_lib.logprobs.token_logprobs` runs the model with `logits_to_keep=1` and
  applies the output head to the captured hidden states *outside* the model's forward, chunk by chunk. Were
  the HF model the root, FSDP2 would reshard the root's parameters when its forward returns and the head
  would then see sharded DTensors; with tied embeddings the head cannot be its own FSDP unit (its weight is
  the embedding's). `LogprobModel.forward` calls `token_logprobs` itself, so the decoder and the chunked head
  run inside ONE root forward: the root's parameters are unsharded for all of it, resharded after it, and
  unsharded again by FSDP's pre-backward hook on the returned logprobs (also for the head's checkpointed
  recomputation). There is still exactly one logprob function (DESIGN invariant 2).
- `actor.model` stays the Hugging Face model: after `fully_shard` its parameters ARE the sharded DTensors
  (FSDP2 swaps them in place), so `actor.model.state_dict()` / `named_parameters()` keep Hugging Face names.
  Every forward must go through the wrapper (`actor.policy`).
- Mixed precision: `MixedPrecisionPolicy(param_dtype, reduce_dtype)`. The sharded parameters (the master
  weights) and AdamW's state stay float32; each unit is all-gathered and cast to param_dtype (bf16 on GPU) for
  its forward / backward, gradients are reduce-scattered in reduce_dtype (float32) into float32 shards.
- Without a process group (plain `python train_grpo.py` on CPU) nothing is sharded; the wrapper still runs,
  so the forward path is the same.

Offload (verl's `param_offload` / `optimizer_offload` for the actor): `offload_params` moves the local shards to
CPU while vLLM generates and `load_params` brings them back for the logprob pass, the update and the push;
the optimizer state moves the same way around the optimizer step. The reference uses FSDP2's
`CPUOffloadPolicy` instead: its shards live in CPU memory always and each unit is copied to the device only
for its own forward. On a CPU machine both are no-ops (the device is the CPU).
"""

from __future__ import annotations

import resource
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from grpo_lib.distributed import has_group
from grpo_lib.logprobs import token_logprobs


class LogprobModel(nn.Module):
    """FSDP2 root: `forward` = `token_logprobs(self.model, ...)`, so decoder and chunked head share one root forward.

    Example: `policy(ids, mask, temperature=1.0)` -> (logprobs [b, T], entropy or None), as `token_logprobs`.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        logprobs, entropy = token_logprobs(self.model, input_ids, attention_mask, **kwargs)  # [b, T] each
        # Not views: FSDP2 hangs its pre-backward hook (root re-gather) on the outputs; a view loses it to in-place ops.
        return logprobs.clone(), (entropy.clone() if entropy is not None else None)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (classes named in `model._no_split_modules`), each one FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]  # FSDP2 subclasses them
    assert layers, (f"{type(model).__name__} names no _no_split_modules decoder-layer class, so FSDP2 cannot find its "
                    "layers; this trainer supports Hugging Face causal LMs that do (Qwen, Llama, Mistral, ...)")
    return layers


def shard(model: nn.Module, *, device: torch.device, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
          cpu_offload: bool = False) -> LogprobModel:
    """Wrap `model` (on the host) in a `LogprobModel` and, when a process group exists, `fully_shard` its layers and
    the root: each unit is moved to `device` and sharded in turn (to host memory with `cpu_offload`). Without a
    group the whole model moves to `device` (only a CPU run has no group: `distributed.init_distributed`)."""
    policy = LogprobModel(model)
    if not has_group():
        return policy.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # reshard_after_forward=True on the root too (FSDP2's default keeps the ROOT unsharded after its forward, which
    # would leave the embeddings and head whole after every no-grad pass, forever for the reference).
    kwargs = dict(mesh=mesh, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                  # pinned host memory: each forward copies every unit to the device, asynchronously only from pinned pages
                  offload_policy=CPUOffloadPolicy(pin_memory=True) if cpu_offload and device.type != "cpu" else OffloadPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)
    # FSDP2 fixes each unit's mixed-precision dtypes (the reduce dtype among them) at its first forward, from the
    # parameters that require grad AT THAT MOMENT. With LoRA the first forward would be the reference pass inside
    # peft's disable_adapter(), which turns requires_grad off on the adapters: every unit would then keep no reduce
    # dtype, the update's bf16 gradients would be reduce-scattered in bf16 and fail to land on the fp32 shards. So
    # the first forward runs here, on every process (it all-gathers), while the trainable set is the real one.
    with torch.no_grad():
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)  # [1, 2]
        policy(ids, torch.ones_like(ids))
    return policy


# ------------------------------------------------------------------------------------------ full weights


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathered from the shards (a collective: every process calls it in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gathered_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) of every entry of `model.state_dict()`, gathered ONE AT A TIME.

    Only the tensor being yielded is whole; a parameter shared by several names (tied embeddings: the embedding and
    `lm_head.weight`) is gathered once and yielded under all of them in a row. Every process must consume the
    iterator to its end, in step (each gather is a collective; the grouping follows the model's structure, the same
    on every process).
    """
    state = model.state_dict()
    groups = names_by_tensor(model, state)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in state:  # the engine keeps its old head unless it is pushed (vLLM fact)
        groups[id(model.get_input_embeddings().weight)].append("lm_head.weight")
    for names in groups.values():
        full = full_tensor(state[names[0]].detach())
        for name in names:
            yield name, full


def names_by_tensor(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[object, list[str]]:
    """The names of `state` (model.state_dict()) grouped by the parameter they hold, in state_dict order: tied names
    (an embedding and `lm_head.weight`) share one group, keyed by the Parameter's id; a buffer is its own group.
    state_dict() detaches each entry, so tied entries are distinct tensor objects: only the parameters tell."""
    params = dict(model.named_parameters(remove_duplicate=False))  # tied names map to ONE Parameter object
    groups: dict[object, list[str]] = {}
    for name in state:
        groups.setdefault(id(params[name]) if name in params else name, []).append(name)
    return groups


def write_hf_folder(model: nn.Module, path, state: dict[str, torch.Tensor], tokenizer, dtype: torch.dtype) -> None:
    """Write `state` (full tensors on the host, in `dtype`) as a Hugging Face folder of `model`'s architecture, with
    the tokenizer. config.json names `dtype`: save_pretrained alone would record the in-memory float32 master dtype,
    and loaders reading "auto" would upcast the weights."""
    import copy
    from pathlib import Path

    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state)
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)


# ------------------------------------------------------------------------------------------ offload


def move_params(model: nn.Module, device: torch.device) -> None:
    """Move this process's parameter shards (and any gradients) to `device` (FSDP2 re-points its shards)."""
    model.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move AdamW's per-parameter state tensors (exp_avg, exp_avg_sq; step stays where torch keeps it)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def params_device(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    return (p.to_local() if isinstance(p, DTensor) else p).device


# ------------------------------------------------------------------------------------------ memory

MB = 2**20


def local_bytes(tensors) -> int:
    """Bytes this process holds of `tensors` (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def peak_memory_mb(device: torch.device) -> float:
    """CUDA max allocated on a GPU; on CPU this process's peak resident set (VmHWM of /proc/self/status).

    Not `getrusage().ru_maxrss`: Linux carries the launcher's high-water mark into it across fork + exec
    (bench/bench_update.py found this); VmHWM belongs to this process's own address space.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def describe(model: nn.Module, *, name: str, param_dtype: torch.dtype, trainable: bool) -> str:
    """One start-up line: how `name` is sharded and what this process holds of it."""
    params = [p for p in model.parameters()]
    sharded = any(isinstance(p, DTensor) for p in params)
    world = dist.get_world_size() if has_group() else 1
    rank = dist.get_rank() if has_group() else 0
    param_mb = local_bytes(params) / MB
    how = f"FSDP2 over {world} process(es) (decoder layers + root)" if sharded else "not sharded (no process group)"
    line = (f"[rank {rank}] {name}: {how}, compute {str(param_dtype).replace('torch.', '')}, "
            f"local params {param_mb:.1f} MiB ({str(params[0].dtype).replace('torch.', '')})")
    if trainable:
        trainable_mb = local_bytes(p for p in params if p.requires_grad) / MB
        line += f", grads {trainable_mb:.1f} MiB, AdamW state {2 * trainable_mb:.1f} MiB (float32, once created)"
    return line
