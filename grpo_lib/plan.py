"""`python train_grpo.py RECIPE [key=value ...] --print-plan`: the run's numbers before it spends GPU hours.

Loads no model and no engine. Prints the batch arithmetic (prompts and trajectories per step, optimizer updates,
trajectories per process per mini-batch, micro-batch bounds of each pass), steps per epoch from the data files'
row counts (parquet metadata, no rows read), every divisibility check with its numbers, every derived default as
config validation resolved it, the verl keys accepted without effect, and a memory plan per GPU from the model's
`config.json` (a local folder, the Hugging Face hub cache, or `--model-config FILE`).

Flags: `--num-processes N` (default: trainer.n_gpus_per_node x trainer.nnodes when given, else the current
launch's WORLD_SIZE), `--gpu-memory-gb G` (default 80), `--model-config FILE`.

Exit codes, so a script can gate on the plan: 0 the plan fits (or has no model config.json to plan memory from);
2 a config or flag problem, as the run itself would report it; 4 (`EXIT_DOES_NOT_FIT`) the peak per GPU is larger than
--gpu-memory-gb ("DOES NOT FIT" in the plan).

The memory plan (bytes per GPU; P parameters, W processes, FSDP shards everything over all W):

    actor master weights   4 P / W       fp32 (model.dtype auto on GPU: fp32 master, bf16 compute)
    gradients              4 P / W       fp32, sharded; freed after each optimizer step (LoRA: adapter parameters only)
    AdamW state            8 P / W       fp32 exp_avg + exp_avg_sq (LoRA: adapter parameters only)
    gathered units         2 x 2 x U     bf16 all-gathered unit (largest of a decoder layer and the embedding), x2 prefetch
    reference              2 P / W       bf16 sharded; 0 when ref.fsdp_config.param_offload (resident between uses on CPU) or LoRA
    activations            tokens x per-token bytes of the update's micro-batch bound (checkpointing: one layer
                           input per layer kept, one layer recomputed; without: every layer's saved tensors)
    output head chunk      3 x 1024 x V x 4   float32 logits, log-softmax and its gradient of one 1024-token chunk
    vLLM share             rollout.gpu_memory_utilization x GPU size during generation; with
                           rollout.free_cache_engine the KV cache is freed and the weights offloaded for training

Peak = max(generation phase, training phase). Activation sizes are an upper-bound estimate (bf16 saved tensors
of a Llama/Qwen decoder layer: norms, q/k/v/o, the 4 MLP intermediates), not a measurement; the CPU check in
tests/test_plan.py holds the plan within 2x of a measured update's peak RSS.
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


def memory_plan(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_bytes: float, compute_bytes: int | None = None,
                master_bytes: int = 4, with_engine: bool = True) -> dict[str, float]:
    """Bytes per GPU of each component, the phases and the peak (see the module docstring for the formulas).

    Components are their full sizes; the phases count what is on the GPU then: actor weights offloaded
    (actor.fsdp_config.param_offload) leave the GPU while vLLM generates, AdamW state offloaded
    (actor.fsdp_config.optimizer_offload) is on it only for the optimizer step.
    """
    a, d, P, W = cfg.actor, cfg.data, sizes.params, world_size
    param_offload, optim_offload = a.fsdp_config.param_offload, a.fsdp_config.optimizer_offload
    if compute_bytes is None:  # the actor's compute dtype (actor.fsdp_config.param_dtype) on a GPU
        compute_bytes = _dtype_bytes(a.fsdp_config.param_dtype)
    tokens = a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu * (d.max_prompt_length +
                                                                                                     d.max_response_length)
    per_layer_token = compute_bytes * (3 * sizes.hidden + 2 * sizes.q_dim + 2 * sizes.kv_dim + 4 * sizes.intermediate)
    if cfg.model.enable_gradient_checkpointing:
        act = tokens * (sizes.layers * sizes.hidden * compute_bytes + per_layer_token)
    else:
        act = tokens * sizes.layers * per_layer_token
    head_tokens = min(tokens, HEAD_CHUNK_TOKENS)
    kl = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    trained = lora_params(sizes, cfg.model.lora_rank) if cfg.model.lora_rank > 0 else P  # LoRA: only adapters get grads / AdamW
    parts = {
        "actor master weights": master_bytes * P / W,
        "gradients": master_bytes * trained / W,
        "AdamW state": 2 * master_bytes * trained / W,
        "gathered units": (2 * compute_bytes * max(sizes.layer_params, sizes.embed_params)) if W > 1 else 0.0,
        "reference": 0.0 if (not kl or cfg.model.lora_rank > 0 or cfg.ref.fsdp_config.param_offload) else _dtype_bytes(cfg.model.dtype) * P / W,
        "activations": float(act),
        "output head chunk": 3.0 * head_tokens * sizes.vocab * 4,
        "vLLM share": cfg.rollout.gpu_memory_utilization * gpu_bytes if with_engine else 0.0,
    }
    weights, adam, ref = parts["actor master weights"], parts["AdamW state"], parts["reference"]
    engine_in_training = 0.0 if cfg.rollout.free_cache_engine else parts["vLLM share"]
    backward = (weights + parts["gradients"] + (0.0 if optim_offload else adam) + ref + parts["gathered units"]
                + parts["activations"] + parts["output head chunk"] + engine_in_training)
    optimizer_step = weights + parts["gradients"] + adam + ref + engine_in_training
    parts["generation phase"] = (0.0 if param_offload else weights) + (0.0 if optim_offload else adam) + ref + parts["vLLM share"]
    parts["training phase"] = max(backward, optimizer_step)
    parts["peak"] = max(parts["generation phase"], parts["training phase"])
    return parts


def memory_lines(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_gb: float) -> tuple[list[str], bool]:
    """The memory plan's lines and whether its peak fits in `gpu_gb` GiB."""
    parts = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)
    lines = [f"model: {sizes.params / 1e9:.2f}B parameters ({sizes.layers} layers, hidden {sizes.hidden}, vocab {sizes.vocab}); "
             f"sharded over {world_size} processes"]
    lines += [f"  {name:<22} {value / GIB:7.2f} GiB" for name, value in parts.items()
              if name not in ("generation phase", "training phase", "peak")]
    sleep = "KV cache freed, weights offloaded" if cfg.rollout.free_cache_engine else "engine stays resident"
    offloaded = [name for name, on in (("actor weights", cfg.actor.fsdp_config.param_offload),
                                       ("AdamW", cfg.actor.fsdp_config.optimizer_offload)) if on]
    held = " + ".join([n for n in ("actor weights", "AdamW") if n not in offloaded] + ["reference", "vLLM share"])
    lines.append(f"  generation phase       {parts['generation phase'] / GIB:7.2f} GiB ({held}"
                 + (f"; offloaded: {', '.join(offloaded)})" if offloaded else ")"))
    lines.append(f"  training phase         {parts['training phase'] / GIB:7.2f} GiB ({sleep})")
    fits = parts["peak"] <= gpu_gb * GIB
    lines.append(f"  peak per GPU           {parts['peak'] / GIB:7.2f} GiB of {gpu_gb:g} GiB: {'fits' if fits else 'DOES NOT FIT'}")
    return lines, fits


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


def print_plan(argv: list[str]) -> int:
    """argv: RECIPE [key=value ...] with --print-plan and the optional flags; returns the exit code."""
    args, flags = [], {"--num-processes": None, "--gpu-memory-gb": "80", "--model-config": None}
    it = iter(a for a in argv if a != "--print-plan")
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
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = [f"plan for {args[0]} on {world_size} processes (from {source})", "", "batch:"]
    out += [f"  {line}" for line in batch_lines(cfg, world_size)]
    out += ["", "divisibility checks:"] + [f"  {line}" for line in check_lines(cfg, world_size)]
    out += ["", "derived defaults (resolved once, in config validation):"] + [f"  {line}" for line in resolved_lines(cfg)]
    if cfg.ignored:
        out += ["", "verl keys accepted and ignored (performance only):"] + [f"  {k}: {why}" for k, why in cfg.ignored.items()]
    for problem in environment_problems(cfg):
        out += ["", f"note: the run itself would exit 2: {problem}"]
    try:
        config_json, where = find_model_config(cfg.model.path, values["--model-config"])
    except (OSError, ValueError) as exc:  # unreadable, not JSON (json.JSONDecodeError is a ValueError)
        print(f"error: the model's config.json cannot be read ({exc}); pass --model-config FILE with a readable one",
              file=sys.stderr)
        return 2
    out += ["", f"memory plan per GPU ({gpu_gb:g} GiB):"]
    fits = True
    if config_json is None:
        out += [f"  the memory plan needs the model's config.json: {where}; pass --model-config FILE"]
    else:
        try:
            sizes = model_sizes(config_json)
        except (KeyError, TypeError) as exc:
            print(f"error: {where} is not a decoder model's config.json (no usable {exc}); pass --model-config FILE with the "
                  "model's own config.json", file=sys.stderr)
            return 2
        lines, fits = memory_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb)
        out += [f"  config: {where}"] + [f"  {line}" for line in lines]
        out += ["", "FSDP2 collectives of the update:"] + [f"  {line}" for line in
                                                          collective_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb)]
    print("\n".join(out))
    if not fits:
        print(f"error: the plan DOES NOT FIT in {gpu_gb:g} GiB per GPU (exit code {EXIT_DOES_NOT_FIT}): see the memory plan "
              "above; offload (actor.fsdp_config.param_offload / optimizer_offload), a lower rollout.gpu_memory_utilization "
              "or token budget, or more processes lower the peak", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0
