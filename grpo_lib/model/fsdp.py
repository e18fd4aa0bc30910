"""FSDP2 sharding of the actor and the reference, their offload between phases, gathering full weights, memory.

How the model is sharded (one path on CPU and GPU; applied by our code, accelerate's FSDP plugin is not used):
- `fully_shard` on every decoder layer (the classes in the model's `_no_split_modules`, as verl does) and on a
  root `LogprobModel` that wraps the Hugging Face model. The root holds the embeddings, the final norm and
  the output head (tied or not).
- Why a wrapper as the root: `grpo_lib.model.logprobs.token_logprobs` runs the model with `logits_to_keep=1` and
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
- Host memory at start: only process 0 reads the checkpoint (`reads_weights`); every other process builds the
  architecture on the meta device (no memory). After `fully_shard`, each process allocates its own shards and process
  0 broadcasts the weights into them one tensor at a time (`fill_from_rank0`: torch.distributed.checkpoint's
  `set_model_state_dict(..., broadcast_from_rank0=True)`), so a process other than 0 never holds more than its shards
  plus one full tensor, and process 0's full copy is freed (and given back to the OS) once the shards are filled.
  `tests/model/test_fsdp_host_memory.py` measures it on 2 processes with a 73M-parameter model.
- Collectives of the update (`mini_batch_collectives`, actor.fsdp_config.*): the root stays gathered across a
  mini-batch's micro-batches by default; keeping the layers gathered from forward to backward and reduce-scattering
  once per mini-batch are opt-in (they cost memory: `--print-plan` says how much). `count_collectives` counts every
  all-gather's and reduce-scatter's bytes (the metric perf/collective_mb_per_update).

Offload (verl's `param_offload` / `optimizer_offload` for the actor): `offload_params` moves the local shards to
CPU while vLLM generates and `load_params` brings them back for the logprob pass, the update and the push;
the optimizer state moves the same way around the optimizer step. The reference uses FSDP2's
`CPUOffloadPolicy` instead: its shards live in CPU memory always and each unit is copied to the device only
for its own forward (its buffers, the rotary tables, stay on the device). On a CPU machine both are no-ops (the device is the CPU).
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from grpo_lib.core.distributed import broadcast_object, has_group
from grpo_lib.core.perf import vm_hwm_mb
from grpo_lib.model.logprobs import TokenScores, token_logprobs, token_scores


class LogprobModel(nn.Module):
    """FSDP2 root: `forward` = `token_logprobs(self.model, ...)`, so decoder and chunked head share one root forward.

    Example: `policy(ids, mask, temperature=1.0)` -> (logprobs [b, T], entropy or None), as `token_logprobs`; with
    `extra_ids` or `topk` (on-policy distillation's top-k) the whole `TokenScores` of `token_scores`.
    `in_root_forward(policy, fn)` runs any other use of the model (the start-up packing check) as one root forward.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                run_inside=None, **kwargs):
        if run_inside is not None:  # in_root_forward: an exception is returned, so FSDP2's post-forward still runs
            try:
                return run_inside(self.model)
            except Exception as error:  # noqa: BLE001 - re-raised by in_root_forward once the root forward is done
                return _Raised(error)
        if kwargs.get("extra_ids") is not None or kwargs.get("topk", 0) > 0:
            scores = token_scores(self.model, input_ids, attention_mask, **kwargs)
            return TokenScores(*(t.clone() if t is not None else None for t in scores))  # not views (below)
        logprobs, entropy = token_logprobs(self.model, input_ids, attention_mask, **kwargs)  # [b, T] each
        # Not views: FSDP2 hangs its pre-backward hook (root re-gather) on the outputs; a view loses it to in-place ops.
        return logprobs.clone(), (entropy.clone() if entropy is not None else None)


@torch.no_grad()
def in_root_forward(policy: LogprobModel, fn):
    """`fn(policy.model)` (the Hugging Face model) inside ONE no-grad forward of the root `policy`, through its
    `__call__`, so FSDP2 runs it as it runs a scored pass: the root's pre-forward (the all-gather streams wait for the
    current stream, the inputs move to the device), the root's parameters (embeddings, final norm, head) gathered for
    all of `fn`, each decoder layer gathered for its own forward, everything resharded after. An exception of `fn` is
    carried out of the forward and raised here, after FSDP2's post-forward ran (raised inside, it would leave the root
    gathered and in its forward state). Every process calls it (it all-gathers). Without a process group it is
    `fn(policy.model)`. Example: `in_root_forward(policy, check_packing_isolated)` -> None."""
    result = policy(run_inside=fn)
    if isinstance(result, _Raised):
        raise result.error
    return result


class _Raised:
    """An exception of `in_root_forward`'s function, returned through the root forward (FSDP2 passes it through)."""

    def __init__(self, error: Exception):
        self.error = error


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (classes named in `model._no_split_modules`), each one FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]  # FSDP2 subclasses them
    assert layers, (f"{type(model).__name__} names no _no_split_modules decoder-layer class, so FSDP2 cannot find its "
                    "layers; this trainer supports Hugging Face causal LMs that do (Qwen, Llama, Mistral, ...)")
    return layers


def reads_weights() -> bool:
    """True on the one process that reads the model's files (process 0, or the only process); the others build the
    architecture on the meta device and receive their shards from it in `shard`."""
    return not has_group() or dist.get_rank() == 0


def shard(model: nn.Module, *, device: torch.device, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
          cpu_offload: bool = False, fill: bool = True) -> LogprobModel:
    """Wrap `model` in a `LogprobModel` and, when a process group exists, `fully_shard` its layers and the root, then
    fill the shards from process 0 (`fill_from_rank0`; `fill=False` skips it: the memory measurement's fake tensors
    hold no values to broadcast). `model` holds its weights on the host on process 0 and is an
    empty meta-device build on the others (`reads_weights`); its shards land on `device` (in host memory with
    `cpu_offload`). Without a group the whole model moves to `device` (only a CPU run has no group:
    `distributed.init_distributed`)."""
    policy = LogprobModel(model)
    if not has_group():
        return policy.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert on_meta != reads_weights(), (
        f"process {dist.get_rank()}: the model must be read on process 0 only and built on the meta device elsewhere "
        f"(actor.load_model(..., empty=not fsdp.reads_weights())); this one is {'empty' if on_meta else 'loaded'}")
    full_state = model.state_dict() if reads_weights() and fill else {}  # process 0's full tensors (no copy), for the broadcast
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # reshard_after_forward=True on the root too (FSDP2's default keeps the ROOT unsharded after its forward, which
    # would leave the embeddings and head whole after every no-grad pass, forever for the reference).
    kwargs = dict(mesh=mesh, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                  # pinned host memory: each forward copies every unit to the device, asynchronously only from pinned pages
                  offload_policy=CPUOffloadPolicy(pin_memory=True) if cpu_offload and device.type != "cpu" else OffloadPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)
    shard_device = torch.device("cpu") if cpu_offload else device  # where this process's shards live
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device=shard_device)  # this process's shards, not filled yet
    # One device type per collective on every process (docs/DESIGN.md, invariant 10): fully_shard moved process 0's
    # buffers to `device`, the meta build put the others' beside their shards, so all of them go to the shards'
    # device for the broadcasts, then to `device` for the forward.
    move_buffers(model, shard_device)
    if fill:
        fill_from_rank0(model, full_state)
    del full_state
    move_buffers(model, device)
    # FSDP2 fixes each unit's mixed-precision dtypes (the reduce dtype among them) at its first forward, from the
    # parameters that require grad AT THAT MOMENT. With LoRA the first forward would be the reference pass inside
    # peft's disable_adapter(), which turns requires_grad off on the adapters: every unit would then keep no reduce
    # dtype, the update's bf16 gradients would be reduce-scattered in bf16 and fail to land on the fp32 shards. So
    # the first forward runs here, on every process (it all-gathers), while the trainable set is the real one.
    with torch.no_grad():
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)  # [1, 2]
        if model.get_output_embeddings() is None:  # a classifier (the reward model): no logprobs, its own forward
            in_root_forward(policy, lambda hf_model: hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)))
        else:
            policy(ids, torch.ones_like(ids))
    release_freed_host_memory()  # process 0's full copy and, on CPU, the forward's gathered units (host memory there)
    return policy


# Process 0's weights are broadcast in chunks of about this many bytes; the host's freed heap pages are given back
# between chunks, so on a CPU machine a process holds its shards plus at most one chunk of full tensors.
FILL_CHUNK_BYTES = 64 * 2**20


def fill_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Fill the FSDP2-sharded `model`'s shards from process 0's `full_state` (its `state_dict()` before sharding; empty
    elsewhere): each tensor is broadcast and every process copies its own slice into its shard
    (`set_model_state_dict(..., broadcast_from_rank0=True)`, one tensor at a time, in chunks of FILL_CHUNK_BYTES with
    `release_freed_host_memory` between them). Buffers outside the state dict (the rotary tables are non-persistent)
    are broadcast too, so every process holds process 0's.

    A parameter shared by several names (tied embeddings: the embedding and `lm_head.weight`) is broadcast once.
    Example: 2 processes, a 294 MB float32 model: process 1 holds its 147 MB of shards plus at most one chunk of full
    tensors, where loading the model would take 294 MB (tests/model/test_fsdp_host_memory.py measures it).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # Every broadcast below runs on the shards' device type, the same on every process (one offload policy for all):
    # a tensor on another one would pick another backend of the group here than on the others (a hang).
    local = {(t.to_local() if isinstance(t, DTensor) else t).device.type for t in (*model.parameters(), *model.buffers())}
    assert len(local) == 1, (f"process {dist.get_rank()}: shards and buffers on {sorted(local)}; the broadcasts need "
                             "one device type (fsdp.shard moves the buffers beside the shards)")
    chunks, size = [[]], 0  # each entry: the names of one tensor (first one broadcast, the others tied to it)
    for names in names_by_tensor(model, full_state).values() if full_state else []:
        if size >= FILL_CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(names)
        size += full_state[names[0]].numel() * full_state[names[0]].element_size()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)  # strict: checked below
    loaded = set()
    for i in range(broadcast_object(len(chunks))):  # every process makes the same calls
        set_model_state_dict(model, {names[0]: full_state[names[0]] for names in chunks[i]} if full_state else {},
                             options=options)
        loaded.update(broadcast_object([name for names in chunks[i] for name in names] if full_state else None))
        release_freed_host_memory()
    missing = sorted(set(model.state_dict()) - loaded)
    assert not missing, f"process 0's state dict lacks {missing[:5]} ({len(missing)} entries): those shards would stay unfilled"
    for _, buffer in model.named_buffers(remove_duplicate=False):  # every module's own: the same count on every process
        dist.broadcast(buffer, src=0)  # (a buffer shared by two modules on process 0 is two tensors after to_empty)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer of `model` (whole on every process: FSDP2 shards parameters only) onto `device`."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def release_freed_host_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc `malloc_trim(0)`); False where there is no glibc.

    glibc keeps freed blocks below its mmap threshold in the heap (all blocks under 256 MiB with trainer.tune_allocator),
    and trims only the top of the heap: the full model freed after sharding would stay resident for the whole run."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


# ------------------------------------------------------------------------------------------ collectives per mini-batch


def count_collectives(policy: nn.Module) -> dict[str, int] | None:
    """Count the bytes of every FSDP2 all-gather and reduce-scatter of `policy`'s units from now on; returns the live
    counter {"all_gather": bytes, "reduce_scatter": bytes}, or None without a process group.

    Bytes of a call are its full buffer, in the dtype on the wire: the gathered unit (param_dtype) of an all-gather, the
    unsharded gradient (reduce_dtype) of a reduce-scatter; what one process sends of it is (W - 1) / W of that in a
    ring. Installed as FSDP2's custom all-gather / reduce-scatter (`set_custom_all_gather`), which run torch's own
    collectives (`dist.all_gather_into_tensor` / `dist.reduce_scatter_tensor`), so FSDP2's schedule is unchanged.
    """
    if not has_group():
        return None
    # torch's comm interfaces live in a private module (torch 2.11-2.13: _fsdp_api); FSDPModule.set_custom_* are public.
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    counter = {"all_gather": 0, "reduce_scatter": 0}

    class CountingAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            counter["all_gather"] += output_tensor.numel() * output_tensor.element_size()
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            counter["reduce_scatter"] += input_tensor.numel() * input_tensor.element_size()
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(CountingAllGather())
            module.set_custom_reduce_scatter(CountingReduceScatter())
    return counter


GRAD_REDUCE_CHOICES = ("none", "root", "all")  # actor.fsdp_config.defer_grad_reduce


@contextlib.contextmanager
def mini_batch_collectives(policy: nn.Module, *, keep_root_gathered: bool, reshard_after_forward: bool,
                           defer_grad_reduce: str):
    """The FSDP2 schedule of one mini-batch's micro-batches (actor.fsdp_config.*); yields `before(i, n)`, to call before
    micro-batch i of n. On leaving, every unit is resharded and back to the schedule of the no-grad passes.

    - keep_root_gathered: the root (embeddings, final norm, head) is all-gathered once, at the first micro-batch's
      forward, and resharded after the last one's backward (FSDP2 set_reshard_after_forward / _after_backward on the
      root only), instead of twice per micro-batch (forward, then again for the backward).
    - reshard_after_forward=False: the decoder layers stay gathered from their forward to their backward.
    - defer_grad_reduce: "root" / "all": the root's / every unit's gradients accumulate unsharded (in reduce_dtype) and
      are reduce-scattered once, in the last micro-batch's backward (set_requires_gradient_sync), instead of after
      every micro-batch. The sum is the same up to float32 summation order.
    Without a process group it does nothing. Example (2 micro-batches, keep_root_gathered, defer "all"): root gathered
    1x, each layer gathered 4x (2 per micro-batch), one reduce-scatter per unit, where the default makes 4, 4 and 2.
    """
    assert defer_grad_reduce in GRAD_REDUCE_CHOICES, f"defer_grad_reduce={defer_grad_reduce!r}: one of {GRAD_REDUCE_CHOICES}"
    if not has_group():
        yield lambda i, n: None
        return
    layers = decoder_layers(policy.model)

    def before(i: int, n: int) -> None:
        last = i == n - 1
        if keep_root_gathered:
            policy.set_reshard_after_forward(False, recurse=False)
            policy.set_reshard_after_backward(last, recurse=False)
        if defer_grad_reduce != "none":
            policy.set_requires_gradient_sync(last, recurse=defer_grad_reduce == "all")

    for layer in layers:
        layer.set_reshard_after_forward(reshard_after_forward, recurse=False)
    try:
        yield before
    finally:
        policy.set_reshard_after_forward(True)  # every unit, as fsdp.shard set them (the no-grad passes rely on it)
        policy.set_reshard_after_backward(True)
        policy.set_requires_gradient_sync(True)
        policy.reshard()  # a no-op for units already resharded


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
    """Move AdamW's per-parameter state tensors (exp_avg, exp_avg_sq; step stays where torch keeps it). Copies to the
    host are non-blocking, so the stream is synchronised before they are handed back: a host tensor filled by a
    non-blocking device-to-host copy is valid only after it."""
    moved_to_host = False
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                moved_to_host |= value.device.type == "cuda" and device.type == "cpu"
                state[key] = value.to(device, non_blocking=True)
    if moved_to_host:
        torch.cuda.current_stream().synchronize()


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
    hwm = vm_hwm_mb()
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
