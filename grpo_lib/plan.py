"""`python train_grpo.py RECIPE [key=value ...] --print-plan`: the run's numbers before it spends GPU hours.

Loads no model and no engine. Prints the batch arithmetic (prompts and trajectories per step, optimizer updates,
trajectories per process per mini-batch, micro-batch bounds of each pass), steps per epoch from the data files'
row counts (parquet metadata, no rows read), every divisibility check with its numbers, every derived default as
config validation resolved it, the verl keys accepted without effect, and a memory plan per GPU from the model's
`config.json` (a local folder, the Hugging Face hub cache, or `--model-config FILE`).

Flags: `--num-processes N` (default: trainer.n_gpus_per_node x trainer.nnodes when given, else the current
launch's WORLD_SIZE), `--gpu-memory-gb G` (default 80), `--model-config FILE`, `--measure` (the training phase measured
on fake tensors; train_grpo.py or `python -m grpo_lib.plan_measure` passes the measuring function in, so this module
imports neither torch nor transformers).

Exit codes, so a script can gate on the plan: 0 the plan fits (or has no model config.json to plan memory from);
2 a config or flag problem, as the run itself would report it; 4 (`EXIT_DOES_NOT_FIT`) the peak per GPU is larger than
--gpu-memory-gb ("DOES NOT FIT" in the plan).

The memory plan (bytes per GPU; P parameters, W processes, FSDP shards everything over all W; c the compute dtype's
bytes, 2 for bf16; V x H the vocabulary x hidden; root = the FSDP2 root unit: embedding, untied head, final norm):

    actor master weights   4 P / W       fp32 (model.dtype auto on GPU: fp32 master, bf16 compute)
    gradients              4 P / W       fp32, sharded (LoRA: adapter parameters only)
    AdamW state            8 P / W       fp32 exp_avg + exp_avg_sq (LoRA: adapter parameters only)
    AdamW step temporary   2 x 4 E / W   foreach AdamW: two fp32 temporaries of the largest local tensor (the embedding)
    gathered units         c x (root + one layer)   the bf16 all-gathered root and decoder layer
    reference              2 P / W       bf16 sharded; 0 when ref.fsdp_config.param_offload (resident between uses on CPU) or LoRA
    activations            tokens x per-token bytes of the update's micro-batch bound (checkpointing: one layer
                           input per layer kept, one layer recomputed; without: every layer's saved tensors)
    output head chunk      12 x 1024 x V  one chunk recomputed in the backward, per logit: the fp32 logits (4), the
                           softmax the log-probability function keeps for its backward (4), the entropy's product
                           temporary (4) (the bf16 logits are freed at the cast); its backward holds less (the
                           softmax, the fp32 and bf16 gradients: 4 + 4 + 2)
    head weight gradient   c x V x H     accumulated over the chunks until the root's backward
    embedding gradient     2 c V H (tied: the embedding's gradient and the sum, three V x H alive), c V H untied
    root reduce-scatter    4 x root / W  the root's fp32 reduce-scatter output
    vLLM share             rollout.gpu_memory_utilization x GPU size during generation; with
                           rollout.free_cache_engine the KV cache is freed and the weights offloaded for training
    CUDA context + NCCL    1.5 GiB       per process, outside vLLM's share (an estimate)

Phases: generation (weights + AdamW + reference + vLLM share + context); training = the largest of the layers'
backward (weights + gradients + AdamW + gathered units + activations + head chunk + head gradient), the root's backward
(the bf16 root, the head and embedding gradients, the reduce-scatter) and the optimizer step; resume (checkpoint.load
creates AdamW's state with the engine released, as before an update). Peak = the largest phase. The host-memory line counts what the processes
of one machine load at start and keep resident after. Measured against the real update on fake tensors:
`--measure` (grpo_lib/plan_measure.py; tests/test_plan_measure.py holds the Qwen3-4B plan within 10% of it).

Token budgets that fit: the largest actor.ppo_max_token_len_per_gpu whose layers' backward fits FIT_FRACTION of the
GPU (activations are the only term that grows with it), and the no-grad log-prob passes' budget; `auto` as the value
of those keys takes them (`resolve_auto_budgets`: here for --gpu-memory-gb, at setup for the device's memory).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo_lib.config import Config, ConfigError, launch_world_size, load_config, read_raw
from grpo_lib.config.checks import environment_problems, mini_batch_sizes, needs_old_logprobs
from grpo_lib.dtypes import DTYPE_BYTES, resolve as resolve_dtype
from grpo_lib.preflight import hub_snapshot

GIB = 2**30
EXIT_DOES_NOT_FIT = 4  # --print-plan's exit code when the memory plan's peak per GPU exceeds --gpu-memory-gb
HEAD_CHUNK_TOKENS = 1024  # grpo_lib.logprobs.token_logprobs' default chunk_size


@dataclass
class ModelSizes:
    params: int  # all parameters (tied embeddings counted once)
    layer_params: int  # one decoder layer
    embed_params: int  # the input embedding (vocab x hidden)
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # kv heads x head_dim


def model_sizes(config: dict) -> ModelSizes:
    """Parameter counts of a Llama/Qwen2/Qwen3-style decoder from its config.json.

    >>> s = model_sizes({"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    ...                  "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True,
    ...                  "model_type": "qwen3"})
    >>> round(s.params / 1e9, 2)  # Qwen3-4B
    4.02
    """
    h, layers, vocab, inter = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads  # config.json (a file format), not our config
    head_dim = config.get("head_dim") or h // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if config.get("attention_bias", config.get("model_type") == "qwen2"):
        attn += q_dim + 2 * kv_dim
    if config.get("model_type") == "qwen3":
        attn += 2 * head_dim  # q_norm, k_norm
    layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h
    params = embed + layers * layer + h + (0 if config.get("tie_word_embeddings", False) else embed)
    return ModelSizes(params=params, layer_params=layer, embed_params=embed, hidden=h, layers=layers, vocab=vocab,
                      intermediate=inter, q_dim=q_dim, kv_dim=kv_dim)


def find_model_config(model_path: str, explicit: str | None) -> tuple[dict | None, str]:
    """(config.json contents, where it came from) or (None, why not): explicit file, local folder, then hub cache."""
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    candidates.append(Path(model_path).expanduser() / "config.json")
    snapshot = hub_snapshot(model_path)
    if snapshot is not None:
        candidates.append(snapshot / "config.json")
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text()), str(path)
    return None, f"no config.json for model.path={model_path!r} (not a local folder, not in the Hugging Face hub cache)"


def count_rows(files: list[str]) -> int | None:
    """Rows of parquet (from the footer metadata) and jsonl files; None when a file is missing or unreadable."""
    total = 0
    for name in files:
        path = Path(name).expanduser()
        if not path.is_file():
            return None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        elif path.suffix in (".jsonl", ".json"):
            with open(path, "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            return None
    return total


def _micro_bound(dynamic: bool, tokens: int | None, count: int | None) -> str:
    return f"{tokens} tokens per process (use_dynamic_bsz)" if dynamic else f"{count} trajectories per process"


def batch_lines(cfg: Config, world_size: int) -> list[str]:
    d, a, r, t = cfg.data, cfg.actor, cfg.rollout, cfg.trainer
    n, seq = r.n, d.max_prompt_length + d.max_response_length
    sizes = mini_batch_sizes(d.train_batch_size, a.ppo_mini_batch_size)
    updates_per_epoch = len(sizes)
    per_proc_mini = a.ppo_mini_batch_size * n // world_size
    split = (f"{d.train_batch_size} / {a.ppo_mini_batch_size} = {updates_per_epoch}" if sizes[-1] == a.ppo_mini_batch_size else
             f"{d.train_batch_size} = {len(sizes) - 1} x {a.ppo_mini_batch_size} + {sizes[-1]} (the last mini-batch smaller, "
             f"as in verl) = {updates_per_epoch}")
    lines = [
        f"processes: {world_size}; engines: {world_size // r.tensor_model_parallel_size} (tensor parallel "
        f"{r.tensor_model_parallel_size})",
        f"prompts per step: {d.train_batch_size}; trajectories per step: {d.train_batch_size} x {n} = {d.train_batch_size * n}",
        f"mini-batch: {a.ppo_mini_batch_size} prompts x {n} = {a.ppo_mini_batch_size * n} trajectories; "
        f"{split} updates per epoch x {a.ppo_epochs} epochs "
        f"= {updates_per_epoch * a.ppo_epochs} optimizer updates per step",
        f"trajectories per process per mini-batch: {a.ppo_mini_batch_size * n} / {world_size} = {per_proc_mini}",
        f"sequence length: {d.max_prompt_length} prompt + {d.max_response_length} response = {seq} tokens at most",
        f"update micro-batch bound: {_micro_bound(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, a.ppo_micro_batch_size_per_gpu)}",
    ]
    if a.use_dynamic_bsz:
        fewest = math.ceil(per_proc_mini * seq / a.ppo_max_token_len_per_gpu)
        full = math.ceil(per_proc_mini / max(1, a.ppo_max_token_len_per_gpu // seq))
        lines.append(f"  when every sequence is full length: {a.ppo_max_token_len_per_gpu} // {seq} = "
                     f"{a.ppo_max_token_len_per_gpu // seq} per micro-batch, {full} micro-batches per mini-batch "
                     f"(shorter sequences pack tighter: no fewer than {fewest})")
    else:
        lines.append(f"  {math.ceil(per_proc_mini / a.ppo_micro_batch_size_per_gpu)} micro-batches per mini-batch")
    old = _micro_bound(r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu, r.log_prob_micro_batch_size_per_gpu)
    lines.append(f"old-logprob pass: {'runs' if needs_old_logprobs(cfg) else 'skipped (one on-policy update per step)'}; "
                 f"bound {old}")
    kl = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref = _micro_bound(cfg.ref.log_prob_use_dynamic_bsz, cfg.ref.log_prob_max_token_len_per_gpu, cfg.ref.log_prob_micro_batch_size_per_gpu)
    lines.append(f"reference pass: {'runs (KL term on)' if kl else 'skipped (no KL term)'}; bound {ref}")
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        rounds = fg.max_num_gen_batches or "unlimited"
        lines.append(f"dynamic sampling (DAPO): up to {rounds} generate rounds of {d.train_batch_size} prompts per step until "
                     f"{d.train_batch_size} groups have differing scores")
    rows = count_rows(d.train_files)
    if rows is None:
        lines.append(f"steps per epoch: unknown (data.train_files {d.train_files} not found); total steps: "
                     + (f"{t.total_training_steps} (trainer.total_training_steps)" if t.total_training_steps else
                        f"{t.total_epochs} epochs x steps per epoch"))
    else:
        per_epoch = rows // d.train_batch_size
        total = t.total_training_steps or t.total_epochs * per_epoch
        how = "trainer.total_training_steps" if t.total_training_steps else f"{t.total_epochs} epochs x {per_epoch}"
        lines.append(f"steps per epoch: {rows} rows // {d.train_batch_size} = {per_epoch} (before the overlong-prompt filter); "
                     f"total steps: {total} ({how})")
        if per_epoch == 0:
            lines.append(f"  PROBLEM: {rows} rows are fewer than data.train_batch_size={d.train_batch_size}: the run would stop "
                         "at the data loader (exit 2); lower data.train_batch_size or add data")
    return lines


def check_lines(cfg: Config, world_size: int) -> list[str]:
    """Every divisibility check with its numbers (load_config already refused a failing one)."""
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    checks = [
        ("actor.ppo_mini_batch_size % processes", a.ppo_mini_batch_size, world_size),
        ("data.train_batch_size % processes", d.train_batch_size, world_size),
        ("processes % rollout.tensor_model_parallel_size", world_size, r.tensor_model_parallel_size),
    ]
    lines = [f"data.train_batch_size >= actor.ppo_mini_batch_size: {d.train_batch_size} >= {a.ppo_mini_batch_size} ok"]
    lines += [f"{name}: {x} % {y} = {x % y} ok" for name, x, y in checks]
    t = cfg.trainer
    if t.n_gpus_per_node is not None:
        lines.append(f"trainer.n_gpus_per_node x trainer.nnodes = {t.n_gpus_per_node} x {t.nnodes} = {world_size} processes ok")
    return lines


def resolved_lines(cfg: Config) -> list[str]:
    a, r, ref = cfg.actor, cfg.rollout, cfg.ref
    return [
        f"actor.clip_ratio_low={a.clip_ratio_low} actor.clip_ratio_high={a.clip_ratio_high} (default: actor.clip_ratio={a.clip_ratio})",
        f"actor.loss_scale_factor={a.loss_scale_factor} (default: data.max_response_length; used by seq-mean-token-sum-norm)",
        f"rollout.log_prob_use_dynamic_bsz={r.log_prob_use_dynamic_bsz} rollout.log_prob_max_token_len_per_gpu="
        f"{r.log_prob_max_token_len_per_gpu} rollout.log_prob_micro_batch_size_per_gpu={r.log_prob_micro_batch_size_per_gpu}",
        f"ref.log_prob_use_dynamic_bsz={ref.log_prob_use_dynamic_bsz} ref.log_prob_max_token_len_per_gpu="
        f"{ref.log_prob_max_token_len_per_gpu} ref.log_prob_micro_batch_size_per_gpu={ref.log_prob_micro_batch_size_per_gpu}",
        f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} trainer.nnodes={cfg.trainer.nnodes} (None: from the launch)",
    ]


def _dtype_bytes(name: str) -> int:
    """Bytes per element of a config dtype on the GPU ('auto' is bfloat16 there)."""
    return DTYPE_BYTES[resolve_dtype(name, on_gpu=True)]


def lora_params(sizes: ModelSizes, rank: int) -> int:
    """Adapter parameters of LoRA rank `rank` on every linear layer of the decoder (all-linear; an upper bound for a
    shorter target list): rank x (in + out) per layer, for q, k, v, o, gate, up, down."""
    h, q, kv, i = sizes.hidden, sizes.q_dim, sizes.kv_dim, sizes.intermediate
    per_layer = rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return sizes.layers * per_layer


HEAD_BYTES_PER_LOGIT = 12  # the output head's recompute, per logit of one chunk (see the module docstring)
CUDA_CONTEXT_BYTES = 1.5 * GIB  # CUDA context + cuBLAS workspace + NCCL buffers per process, outside vLLM's share (estimate)
FIT_FRACTION = 0.9  # a token budget "fits" when its training phase uses at most this share of the GPU (allocator slack)
BUDGET_STEP = 1024  # `auto` token budgets are multiples of this


def root_params(sizes: ModelSizes) -> int:
    """Parameters of the FSDP2 root unit: the embedding (and an untied head) and the final norm."""
    return sizes.params - sizes.layers * sizes.layer_params


def activation_bytes_per_token(cfg: Config, sizes: ModelSizes, compute_bytes: int) -> int:
    """The update's activation slope: bytes per token of the micro-batch bound (checkpointed: every layer's input kept
    plus one recomputed layer's saved tensors; without checkpointing every layer's saved tensors)."""
    per_layer_token = compute_bytes * (3 * sizes.hidden + 2 * sizes.q_dim + 2 * sizes.kv_dim + 4 * sizes.intermediate)
    if cfg.model.enable_gradient_checkpointing:
        return sizes.layers * sizes.hidden * compute_bytes + per_layer_token
    return sizes.layers * per_layer_token


def logprob_bytes_per_token(sizes: ModelSizes, compute_bytes: int) -> int:
    """A no-grad logprob pass's slope: one layer's transient tensors per token (nothing is kept for a backward)."""
    return compute_bytes * (3 * sizes.hidden + 2 * sizes.q_dim + 2 * sizes.kv_dim + 4 * sizes.intermediate)


def memory_plan(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_bytes: float, compute_bytes: int | None = None,
                master_bytes: int = 4, with_engine: bool = True, tokens: int | None = None) -> dict[str, float]:
    """Bytes per GPU of each component, the phases and the peak (see the module docstring for the formulas).

    Components are their full sizes; the phases count what is on the GPU then: actor weights offloaded
    (actor.fsdp_config.param_offload) leave the GPU while vLLM generates, AdamW state offloaded
    (actor.fsdp_config.optimizer_offload) is on it only for the optimizer step. `tokens`: the update's micro-batch
    bound (default: the config's).
    """
    a, P, W = cfg.actor, sizes.params, world_size
    param_offload, optim_offload = a.fsdp_config.param_offload, a.fsdp_config.optimizer_offload
    if compute_bytes is None:  # the actor's compute dtype (actor.fsdp_config.param_dtype) on a GPU
        compute_bytes = _dtype_bytes(a.fsdp_config.param_dtype)
    if tokens is None:
        tokens = update_tokens(cfg)
    head_tokens = min(tokens, HEAD_CHUNK_TOKENS)
    kl = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    trained = lora_params(sizes, cfg.model.lora_rank) if cfg.model.lora_rank > 0 else P  # LoRA: only adapters get grads / AdamW
    full = cfg.model.lora_rank == 0  # the embedding / head train (LoRA: frozen, no gradient)
    root, vh = root_params(sizes), sizes.vocab * sizes.hidden
    tied = sizes.params < sizes.layers * sizes.layer_params + 2 * sizes.embed_params
    ctx = CUDA_CONTEXT_BYTES if with_engine else 0.0
    # FSDP2 units exist on every GPU run (one process starts a 1-process group there); with_engine=False plans the CPU
    # twin, where one process has no group and nothing is gathered
    sharded = W > 1 or with_engine
    parts = {
        "actor master weights": master_bytes * P / W,
        "gradients": master_bytes * trained / W,
        "AdamW state": 2 * master_bytes * trained / W,
        # foreach AdamW's step: a float32 temporary of the largest local tensor and its square root's sibling
        "AdamW step temporary": 2 * master_bytes * (sizes.embed_params if full else 0) / W,
        "gathered units": float(compute_bytes * (root + sizes.layer_params)) if sharded else 0.0,
        "reference": 0.0 if (not kl or cfg.model.lora_rank > 0 or cfg.ref.fsdp_config.param_offload) else _dtype_bytes(cfg.model.dtype) * P / W,
        "activations": float(tokens * activation_bytes_per_token(cfg, sizes, compute_bytes)),
        "output head chunk": float(HEAD_BYTES_PER_LOGIT * head_tokens * sizes.vocab),
        "head weight gradient": float(compute_bytes * vh) if full else 0.0,
        "embedding gradient": float((2 if tied else 1) * compute_bytes * vh) if full else 0.0,
        "root reduce-scatter": master_bytes * root / W if (sharded and full) else 0.0,
        "vLLM share": cfg.rollout.gpu_memory_utilization * gpu_bytes if with_engine else 0.0,
        "CUDA context + NCCL": ctx,
    }
    weights, grads, adam, ref = parts["actor master weights"], parts["gradients"], parts["AdamW state"], parts["reference"]
    engine_in_training = 0.0 if cfg.rollout.free_cache_engine else parts["vLLM share"]
    held = weights + grads + (0.0 if optim_offload else adam) + ref + engine_in_training + ctx
    phases = {
        "layers' backward": held + parts["gathered units"] + parts["activations"] + parts["output head chunk"]
                            + parts["head weight gradient"],
        "root's backward": held + compute_bytes * root + parts["head weight gradient"] + parts["embedding gradient"]
                           + parts["root reduce-scatter"],
        "optimizer step": weights + grads + adam + parts["AdamW step temporary"] + ref + engine_in_training + ctx,
    }
    parts["generation phase"] = (0.0 if param_offload else weights) + (0.0 if optim_offload else adam) + ref + parts["vLLM share"] + ctx
    parts.update(phases)
    parts["training phase"] = max(phases.values())
    parts["training phase at"] = max(phases, key=phases.get)  # type: ignore[assignment]  (a name, not bytes)
    # checkpoint.load creates AdamW's state (a zero-gradient step: gradients, moments, the step's temporary) with the
    # engine released (train_grpo.py's setup releases it before the load, as a step does before its update)
    parts["resume phase"] = weights + grads + adam + parts["AdamW step temporary"] + ref + engine_in_training + ctx
    parts["peak"] = max(parts["generation phase"], parts["training phase"], parts["resume phase"])
    return parts


PHASES = ("layers' backward", "root's backward", "optimizer step", "generation phase", "training phase", "training phase at",
          "resume phase", "peak")


def update_tokens(cfg: Config) -> int:
    """The update's micro-batch bound in tokens: the token budget, or micro-batch size x the longest sequence."""
    a, d = cfg.actor, cfg.data
    return a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu * (d.max_prompt_length +
                                                                                                  d.max_response_length)


def host_memory(cfg: Config, sizes: ModelSizes, *, world_size: int) -> dict[str, float]:
    """Host bytes per machine (all W processes of one machine): what the start loads and what stays resident.

    Start: process 0 alone reads the whole model in float32 (and the reference in model.dtype) and broadcasts it into
    the shards (fsdp.shard); the others build on the meta device and receive their shards (on GPU, on the device).
    Resident: the reference's shards in pinned memory (ref.fsdp_config.param_offload), vLLM's level-1 sleep backup of
    its weights (bf16, one TP shard per process), the offloaded actor shards / AdamW state when those keys are on.
    """
    P, W = sizes.params, world_size
    kl = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref_on_host = kl and cfg.model.lora_rank == 0
    ref_bytes = _dtype_bytes(cfg.model.dtype) * P
    fc = cfg.actor.fsdp_config
    start = 4 * P + (ref_bytes if ref_on_host else 0)  # process 0's full copies, read once per machine
    resident = (ref_bytes if ref_on_host and cfg.ref.fsdp_config.param_offload else 0.0)
    if cfg.rollout.free_cache_engine and cfg.rollout.sleep_level == 1:
        resident += _dtype_bytes(cfg.rollout.dtype) * P * W / cfg.rollout.tensor_model_parallel_size
    resident += (4 * P if fc.param_offload else 0) + (8 * P if fc.optimizer_offload else 0)
    return {"start": float(start), "resident": float(resident)}


def fitting_budget(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_bytes: float,
                   slope: float | None = None) -> int:
    """The largest actor.ppo_max_token_len_per_gpu (a multiple of BUDGET_STEP) whose training phase fits in
    FIT_FRACTION of the GPU, from the activation slope (bytes per token; default the analytic one), at least one
    sequence and at most this process's share of a mini-batch (no micro-batch can hold more).

    Example (Qwen3-4B, 4 processes, 80 GiB): the update's budget-free terms are ~19.5 GiB, the slope ~0.28 MiB per token,
    so ~0.9 x 80 - 19.5 GiB / 0.28 MiB ~= 190k tokens.
    """
    d = cfg.data
    seq = d.max_prompt_length + d.max_response_length
    compute_bytes = _dtype_bytes(cfg.actor.fsdp_config.param_dtype)
    slope = slope or activation_bytes_per_token(cfg, sizes, compute_bytes)
    base = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_bytes, tokens=HEAD_CHUNK_TOKENS)
    if max(base["root's backward"], base["optimizer step"]) > FIT_FRACTION * gpu_bytes:
        return seq  # nothing fits: the smallest budget (the plan says DOES NOT FIT)
    room = FIT_FRACTION * gpu_bytes - (base["layers' backward"] - base["activations"])
    tokens = int(room // slope) // BUDGET_STEP * BUDGET_STEP if room > 0 else 0
    most = max(seq, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // world_size * seq)
    return max(seq, min(tokens, most))


def fitting_logprob_budget(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_bytes: float) -> int:
    """The largest no-grad logprob budget (old-logprob and reference passes) that fits like `fitting_budget`: the pass
    holds the weights, AdamW, the gathered units, the head chunk and one layer's transient tensors per token."""
    d = cfg.data
    seq = d.max_prompt_length + d.max_response_length
    compute_bytes = _dtype_bytes(cfg.actor.fsdp_config.param_dtype)
    base = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_bytes, tokens=HEAD_CHUNK_TOKENS)
    fixed = (base["actor master weights"] + base["AdamW state"] + base["reference"] + base["gathered units"]
             + base["output head chunk"] + base["CUDA context + NCCL"])
    room = FIT_FRACTION * gpu_bytes - fixed
    slope = logprob_bytes_per_token(sizes, compute_bytes) + compute_bytes * sizes.hidden  # + the residual stream
    tokens = int(room // slope) // BUDGET_STEP * BUDGET_STEP if room > 0 else 0
    most = max(seq, cfg.data.train_batch_size * cfg.rollout.n // world_size * seq)
    return max(seq, min(tokens, most))


AUTO_KEYS = ("actor.ppo_max_token_len_per_gpu", "rollout.log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu")
CPU_AUTO_BUDGET = 16384  # what `auto` means without a GPU to fit (verl's default ppo_max_token_len_per_gpu)


def resolve_auto_budgets(cfg: Config, sizes: ModelSizes | None, *, world_size: int, gpu_bytes: float | None) -> dict[str, int]:
    """Replace every `auto` token budget (AUTO_KEYS) in `cfg` by the largest that fits; returns {key: value chosen}.

    gpu_bytes: one device's memory (torch.cuda.mem_get_info's total at setup; --gpu-memory-gb in the plan). Without a
    GPU (None) or without the model's config.json (sizes None) there is nothing to fit: `auto` is then CPU_AUTO_BUDGET
    (at least one full sequence), and the caller says so.
    """
    passes = (("actor.ppo_max_token_len_per_gpu", cfg.actor), ("rollout.log_prob_max_token_len_per_gpu", cfg.rollout),
              ("ref.log_prob_max_token_len_per_gpu", cfg.ref))
    wanted = [(key, section) for key, section in passes if getattr(section, key.split(".")[1]) == "auto"]
    if not wanted:
        return {}
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    chosen = {}
    for key, section in wanted:
        if sizes is None or gpu_bytes is None:
            value = max(seq, CPU_AUTO_BUDGET)
        elif key.startswith("actor."):
            value = fitting_budget(cfg, sizes, world_size=world_size, gpu_bytes=gpu_bytes)
        else:
            value = fitting_logprob_budget(cfg, sizes, world_size=world_size, gpu_bytes=gpu_bytes)
        setattr(section, key.split(".")[1], value)
        chosen[key] = value
    return chosen


def auto_budget_notes(cfg: Config, *, world_size: int, gpu_bytes: float | None) -> list[str]:
    """At setup: resolve `auto` token budgets with this device's memory (model.path's config.json) and say what was
    chosen; on CPU (gpu_bytes None) say that `auto` is CPU_AUTO_BUDGET there."""
    if not any(getattr(section, key.split(".")[1]) == "auto"
               for key, section in zip(AUTO_KEYS, (cfg.actor, cfg.rollout, cfg.ref))):
        return []
    config_json, where = find_model_config(cfg.model.path, None)
    sizes = model_sizes(config_json) if config_json is not None else None
    chosen = resolve_auto_budgets(cfg, sizes, world_size=world_size, gpu_bytes=gpu_bytes)
    if gpu_bytes is None or sizes is None:
        why = "no GPU to fit" if gpu_bytes is None else f"no model config.json to plan from ({where})"
        return [f"{key}=auto -> {value} ({why}: max(one sequence, {CPU_AUTO_BUDGET}))" for key, value in chosen.items()]
    return [f"{key}=auto -> {value} (the largest whose memory plan fits {FIT_FRACTION:.0%} of this GPU's "
            f"{gpu_bytes / GIB:.0f} GiB)" for key, value in chosen.items()]


def all_gathers_per_mini_batch(cfg: Config, tokens: int, world_size: int) -> int:
    """All-gathers of the whole model per mini-batch per process when every sequence is full length: two per
    micro-batch (forward, and backward's re-gather)."""
    d = cfg.data
    seq = d.max_prompt_length + d.max_response_length
    per_proc_mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // world_size
    return 2 * math.ceil(per_proc_mini / max(1, tokens // seq))


def memory_lines(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_gb: float) -> tuple[list[str], bool]:
    """The memory plan's lines and whether its peak fits in `gpu_gb` GiB."""
    parts = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)
    lines = [f"model: {sizes.params / 1e9:.2f}B parameters ({sizes.layers} layers, hidden {sizes.hidden}, vocab {sizes.vocab}); "
             f"sharded over {world_size} processes"]
    lines += [f"  {name:<26} {value / GIB:7.2f} GiB" for name, value in parts.items() if name not in PHASES]
    sleep = "KV cache freed, weights offloaded" if cfg.rollout.free_cache_engine else "engine stays resident"
    offloaded = [name for name, on in (("actor weights", cfg.actor.fsdp_config.param_offload),
                                       ("AdamW", cfg.actor.fsdp_config.optimizer_offload)) if on]
    held = " + ".join([n for n in ("actor weights", "AdamW") if n not in offloaded] + ["reference", "vLLM share", "CUDA context"])
    lines.append(f"  generation phase           {parts['generation phase'] / GIB:7.2f} GiB ({held}"
                 + (f"; offloaded: {', '.join(offloaded)})" if offloaded else ")"))
    lines.append(f"  training phase             {parts['training phase'] / GIB:7.2f} GiB (at the {parts['training phase at']}; "
                 f"{sleep})")
    lines.append(f"  resume phase               {parts['resume phase'] / GIB:7.2f} GiB (checkpoint.load creates AdamW's "
                 f"state; {'the engine released' if cfg.rollout.free_cache_engine else 'the engine stays resident'})")
    fits = parts["peak"] <= gpu_gb * GIB
    lines.append(f"  peak per GPU               {parts['peak'] / GIB:7.2f} GiB of {gpu_gb:g} GiB: {'fits' if fits else 'DOES NOT FIT'}")
    host = host_memory(cfg, sizes, world_size=world_size)
    lines.append(f"  host memory per machine    {host['start'] / GIB:7.2f} GiB at start (process 0 reads the model in "
                 f"float32 once and broadcasts it into the shards), {host['resident'] / GIB:.2f} GiB resident after "
                 "(reference shards, vLLM's sleep backup, offloaded state)")
    return lines, fits


def budget_lines(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_gb: float) -> list[str]:
    """What token budgets fit (defect 7 of issue 19): the largest that fit, what `auto` chooses, the all-gathers saved."""
    gpu = gpu_gb * GIB
    best = fitting_budget(cfg, sizes, world_size=world_size, gpu_bytes=gpu)
    best_lp = fitting_logprob_budget(cfg, sizes, world_size=world_size, gpu_bytes=gpu)
    slope = activation_bytes_per_token(cfg, sizes, _dtype_bytes(cfg.actor.fsdp_config.param_dtype))
    lines = [f"largest actor.ppo_max_token_len_per_gpu that fits {FIT_FRACTION:.0%} of {gpu_gb:g} GiB: {best} "
             f"(activations {slope / 2**20:.3f} MiB per token; `auto` chooses this)"]
    if cfg.actor.use_dynamic_bsz:
        now = cfg.actor.ppo_max_token_len_per_gpu
        before, after = all_gathers_per_mini_batch(cfg, now, world_size), all_gathers_per_mini_batch(cfg, best, world_size)
        lines.append(f"  all-gathers of the model per mini-batch per process (full-length sequences): {before} at {now} tokens, "
                     f"{after} at {best} ({before / after:.1f}x fewer)")
    lines.append(f"largest rollout.log_prob_max_token_len_per_gpu / ref.log_prob_max_token_len_per_gpu that fits: {best_lp} "
                 "(no-grad passes; `auto` chooses this)")
    return lines


# ------------------------------------------------------------------ FSDP2 collectives of the update (issue 21)


def collective_lines(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_gb: float) -> list[str]:
    """Bytes all-gathered and reduce-scattered per mini-batch per process by the update, today's FSDP2 schedule and this
    config's (actor.fsdp_config.keep_root_gathered / reshard_after_forward / defer_grad_reduce), and each choice's
    memory cost per GPU; M = micro-batches per mini-batch when every sequence is full length (the batch section's).

    With R / L the root's / all layers' parameters, c / r the param / reduce dtype bytes and T_R / T_L their trained
    parameters: today = 2 M c (R + L) gathered + M r (T_R + T_L) reduce-scattered; keep_root_gathered gathers the root
    once (c R), reshard_after_forward=false the layers once per micro-batch (M c L), defer_grad_reduce root / all
    reduce-scatters the root / every unit once (r T). tests/test_multiprocess.py checks these counts on 2 processes.
    """
    a, d, fc = cfg.actor, cfg.data, cfg.actor.fsdp_config
    if world_size < 2:
        return ["one process: the shards are the whole model, no all-gather or reduce-scatter moves data"]
    seq = d.max_prompt_length + d.max_response_length
    per_proc = a.ppo_mini_batch_size * cfg.rollout.n // world_size
    M = math.ceil(per_proc / max(1, a.ppo_max_token_len_per_gpu // seq)) if a.use_dynamic_bsz else \
        math.ceil(per_proc / a.ppo_micro_batch_size_per_gpu)
    c, r = _dtype_bytes(fc.param_dtype), DTYPE_BYTES[fc.reduce_dtype]
    L = sizes.layers * sizes.layer_params
    R = sizes.params - L
    lora = cfg.model.lora_rank > 0
    TR, TL = (0, lora_params(sizes, cfg.model.lora_rank)) if lora else (R, L)

    def traffic(keep_root: bool, reshard: bool, defer: str) -> tuple[float, float]:
        gathered = (c * R if keep_root else 2 * M * c * R) + (2 if reshard else 1) * M * c * L
        reduced = (r * TR if defer in ("root", "all") else M * r * TR) + (r * TL if defer == "all" else M * r * TL)
        return gathered, reduced

    today = sum(traffic(False, True, "none"))
    ag, rs = traffic(fc.keep_root_gathered, fc.reshard_after_forward, fc.defer_grad_reduce)
    extra = {  # memory per GPU each choice adds at the training peak
        "reshard_after_forward": 0.0 if fc.reshard_after_forward else c * L,
        "defer_grad_reduce": {"none": 0.0, "root": r * TR, "all": r * (TR + TL)}[fc.defer_grad_reduce],
    }
    training = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)["training phase"]
    lines = [
        f"M = {M} micro-batches per mini-batch (every sequence full length); param_dtype {c} B, reduce_dtype {r} B; root "
        f"{R / 1e6:.0f}M parameters, layers {L / 1e6:.0f}M",
        f"  today's schedule (per micro-batch): {today / GIB:.1f} GiB per mini-batch per process",
        f"  this config (keep_root_gathered={fc.keep_root_gathered}, reshard_after_forward={fc.reshard_after_forward}, "
        f"defer_grad_reduce={fc.defer_grad_reduce}): all-gather {ag / GIB:.1f} + reduce-scatter {rs / GIB:.1f} = "
        f"{(ag + rs) / GIB:.1f} GiB ({today / (ag + rs):.2f}x fewer)",
        "  choices (actor.fsdp_config.*), bytes saved per mini-batch per process, memory added at the training peak:",
        f"    keep_root_gathered=true        -{(2 * M - 1) * c * R / GIB:.1f} GiB; +0 GiB (the root is gathered through every "
        "micro-batch anyway)",
        f"    reshard_after_forward=false    -{M * c * L / GIB:.1f} GiB; +{c * L / GIB:.2f} GiB (every layer gathered from "
        "forward to backward)",
        f"    defer_grad_reduce=root         -{(M - 1) * r * TR / GIB:.1f} GiB; +{r * TR / GIB:.2f} GiB (the root's unsharded "
        "gradient)",
        f"    defer_grad_reduce=all          -{(M - 1) * r * (TR + TL) / GIB:.1f} GiB; +{r * (TR + TL) / GIB:.2f} GiB (every "
        "unit's unsharded gradient)",
        f"  training phase with this config's choices: {(training + sum(extra.values())) / GIB:.2f} GiB of {gpu_gb:g} "
        f"({'fits' if training + sum(extra.values()) <= gpu_gb * GIB else 'DOES NOT FIT'})",
    ]
    return lines


_MISSING = "<missing>"  # the value of a flag given last, without one
_EXAMPLE = {"--num-processes": "4", "--gpu-memory-gb": "80", "--model-config": "tests/data/qwen3_4b_config.json"}


def check_flags(flags: dict[str, str | None]) -> tuple[dict, list[str]]:
    """--num-processes, --gpu-memory-gb and --model-config as given -> (their values, problems naming the flag and the fix).

    Example: {"--num-processes": "0", "--gpu-memory-gb": "nan", "--model-config": None} -> two problems (>= 1 process;
    a finite number of GiB > 0); {"--num-processes": "4", "--gpu-memory-gb": "80", ...} -> ({... 4, 80.0 ...}, []).
    """
    values: dict = {"--num-processes": None, "--gpu-memory-gb": None, "--model-config": None}
    problems = [f"{flag} needs a value (for example {flag} {_EXAMPLE[flag]})" for flag, given in flags.items() if given == _MISSING]
    processes, gpu_gb, config_file = (None if flags[f] == _MISSING else flags[f] for f in values)
    if processes is not None:
        try:
            values["--num-processes"] = int(processes)
        except ValueError:
            problems.append(f"--num-processes {processes!r}: expected a whole number of processes, for example --num-processes 4")
        else:
            if values["--num-processes"] < 1:
                problems.append(f"--num-processes {processes}: must be >= 1 (the processes the run would launch)")
    if gpu_gb is not None:
        try:
            values["--gpu-memory-gb"] = float(gpu_gb)
        except ValueError:
            values["--gpu-memory-gb"] = math.nan
        if not (math.isfinite(values["--gpu-memory-gb"]) and values["--gpu-memory-gb"] > 0):
            problems.append(f"--gpu-memory-gb {gpu_gb}: must be a finite number of GiB > 0 (one GPU's memory, for example "
                            "--gpu-memory-gb 80)")
    if config_file is not None:
        values["--model-config"] = config_file
        if not Path(config_file).expanduser().is_file():
            problems.append(f"--model-config {config_file!r}: no such file; give a model's config.json (for example "
                            "--model-config tests/data/qwen3_4b_config.json), or leave the flag out to read model.path's")
    return values, problems


def print_plan(argv: list[str], measure=None) -> int:
    """argv: RECIPE [key=value ...] with --print-plan and the optional flags; returns the exit code.

    `measure`: with --measure, a function (cfg, config.json dict, sizes, world_size, parts, gpu_bytes) -> lines that measures the
    training phase (grpo_lib.plan_measure.measure_lines; passed in by train_grpo.py / `python -m grpo_lib.plan_measure`,
    so this module stays light)."""
    args, flags = [], {"--num-processes": None, "--gpu-memory-gb": "80", "--model-config": None}
    wants_measure = "--measure" in argv
    if wants_measure and measure is None:
        print("error: --measure needs the measuring module: python train_grpo.py RECIPE --print-plan --measure, or "
              "python -m grpo_lib.plan_measure RECIPE", file=sys.stderr)
        return 2
    it = iter(a for a in argv if a not in ("--print-plan", "--measure"))
    for item in it:
        key = item.split("=", 1)[0]
        if key in flags:
            flags[key] = item.split("=", 1)[1] if "=" in item else next(it, _MISSING)
        else:
            args.append(item)
    if not args:
        print("error: --print-plan needs a recipe: python train_grpo.py RECIPE.yaml [key=value ...] --print-plan", file=sys.stderr)
        return 2
    values, problems = check_flags(flags)
    if problems:
        print("error: " + "\n".join(problems), file=sys.stderr)
        return 2
    gpu_gb = values["--gpu-memory-gb"]
    try:
        raw = read_raw(args[0], args[1:])
        launched = launch_world_size(raw)
        if launched is not None:
            world_size, source = launched, "trainer.n_gpus_per_node x trainer.nnodes"
        elif values["--num-processes"] is not None:
            world_size, source = values["--num-processes"], "--num-processes"
        else:
            world_size, source = int(os.environ.get("WORLD_SIZE", "1")), "the current launch (WORLD_SIZE)"
        cfg = load_config(args[0], args[1:], world_size=world_size)
        config_json, where = find_model_config(cfg.model.path, values["--model-config"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # unreadable, not JSON (json.JSONDecodeError is a ValueError)
        print(f"error: the model's config.json cannot be read ({exc}); pass --model-config FILE with a readable one",
              file=sys.stderr)
        return 2
    sizes = None
    if config_json is not None:
        try:
            sizes = model_sizes(config_json)
        except (KeyError, TypeError) as exc:
            print(f"error: {where} is not a decoder model's config.json (no usable {exc}); pass --model-config FILE with the "
                  "model's own config.json", file=sys.stderr)
            return 2
    auto = resolve_auto_budgets(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)
    out = [f"plan for {args[0]} on {world_size} processes (from {source})", "", "batch:"]
    out += [f"  {line}" for line in batch_lines(cfg, world_size)]
    out += ["", "divisibility checks:"] + [f"  {line}" for line in check_lines(cfg, world_size)]
    out += ["", "derived defaults (resolved once, in config validation):"] + [f"  {line}" for line in resolved_lines(cfg)]
    why = (f"the largest that fits {gpu_gb:g} GiB, below" if sizes is not None else
           f"no model config.json to plan from: max(one sequence, {CPU_AUTO_BUDGET})")
    out += [f"  {key}=auto -> {value} ({why})" for key, value in auto.items()]
    if cfg.ignored:
        out += ["", "verl keys accepted and ignored (performance only):"] + [f"  {k}: {why}" for k, why in cfg.ignored.items()]
    for problem in environment_problems(cfg):
        out += ["", f"note: the run itself would exit 2: {problem}"]
    out += ["", f"memory plan per GPU ({gpu_gb:g} GiB):"]
    fits = True
    if sizes is None:
        out += [f"  the memory plan needs the model's config.json: {where}; pass --model-config FILE"]
    else:
        lines, fits = memory_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb)
        out += [f"  config: {where}"] + [f"  {line}" for line in lines]
        out += ["", "FSDP2 collectives of the update:"] + [f"  {line}" for line in
                                                          collective_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb)]
        out += ["", "token budgets that fit:"] + [f"  {line}" for line in budget_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb)]
        if wants_measure:
            print("\n".join(out), flush=True)
            out = ["", f"measured training phase (rank 0 of {world_size}, our update on fake tensors, {where}):"]
            parts = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)
            try:
                out += [f"  {line}" for line in measure(cfg, config_json, sizes, world_size, parts, gpu_gb * GIB)]
            except RuntimeError as exc:  # plan_measure.MeasureError: another torch version, LoRA, a launch
                print("\n".join(out) + f"\nerror: {exc}", file=sys.stderr)
                return 2
    print("\n".join(out))
    if not fits:
        print(f"error: the plan DOES NOT FIT in {gpu_gb:g} GiB per GPU (exit code {EXIT_DOES_NOT_FIT}): see the memory plan "
              "above; offload (actor.fsdp_config.param_offload / optimizer_offload), a lower rollout.gpu_memory_utilization "
              "or token budget, or more processes lower the peak", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0
