"""The per-GPU memory plan of a run, from the model's config.json alone (no model, no torch): the terms, the phases,
host memory, and the token budgets that fit (`auto`). Printed by `--print-plan` (grpo_lib/planning/plan.py), resolved at set-up
for `auto` budgets (train_grpo.py), measured against on fake tensors by grpo_lib/planning/measure.py.

The memory plan (bytes per GPU; P parameters, W processes, FSDP shards everything over all W; c the compute dtype's
bytes, 2 for bf16; V x H the vocabulary x hidden; root = the FSDP2 root unit: embedding, untied head, final norm):

    actor master weights   4 P / W       fp32 (model.dtype auto on GPU: fp32 master, bf16 compute)
    gradients              4 P / W       fp32, sharded (LoRA: adapter parameters only)
    AdamW state            8 P / W       fp32 exp_avg + exp_avg_sq (LoRA: adapter parameters only)
    AdamW step temporary   0 on GPU      fused AdamW (`actor.make_optimizer`) updates in place (torch's default on CUDA,
                                         foreach, would hold 4 P / W); the CPU twin's per-tensor loop: 2 x 4 E / W, two
                                         fp32 temporaries of the largest local tensor (the embedding)
    gathered units         c x (root + one layer)   the bf16 all-gathered root and decoder layer
    reference              2 P / W       bf16 sharded; 0 when ref.fsdp_config.param_offload (resident between uses on CPU) or LoRA
    activations            tokens x per-token bytes of the update's micro-batch bound (checkpointing: one layer
                           input per layer kept, one layer recomputed; without: every layer's saved tensors)
    output head chunk      12 x 1024 x V  one chunk recomputed in the backward, per logit: the fp32 logits (4), the
                           softmax the log-probability function keeps for its backward (4), the entropy's product
                           temporary (4) (the bf16 logits are freed at the cast); its backward holds less (the
                           softmax, the fp32 and bf16 gradients: 4 + 4 + 2); 24 x 1024 x V with an entropy bonus
                           (actor.entropy_coeff != 0: autograd's entropy graph keeps the fp32 logits and its own
                           softmax beside the function's; both measured by plan_measure)
    head weight gradient   c x V x H     accumulated over the chunks until the root's backward
    embedding gradient     2 c V H (tied: the embedding's gradient and the sum, three V x H alive), c V H untied
    root reduce-scatter    4 x root / W  the root's fp32 reduce-scatter output
    vLLM share             rollout.gpu_memory_utilization x GPU size during generation; with
                           rollout.free_cache_engine the KV cache is freed and the weights offloaded for training
    CUDA context + NCCL    per process, outside vLLM's share: the context (1 GiB, an estimate) + NCCL's buffers of
                           each communicator it is in (`nccl_bytes`: the trainer's world of W ranks, the engine's TP
                           group with vLLM's symmetric-memory all-reduce buffer; from NCCL's and vLLM's defaults)
    teacher                2 P_t / W     distillation's teacher, sharded like the reference (0 when offloaded); its pass
                           (a phase) gathers its units, its head chunk and one layer's no-grad activations
                           (`teacher_terms`); a teacher that does not fit is refused at setup (`planning.beside`)


Phases: generation (weights + AdamW + reference + vLLM share + context); training = the largest of the layers'
backward (weights + gradients + AdamW + gathered units + activations + head chunk + head gradient), the root's backward
(the bf16 root, the head and embedding gradients, the reduce-scatter) and the optimizer step; resume (checkpoint.load
creates AdamW's state with the engine released, as before an update). Peak = the largest phase; margin = the GPU less
the peak, the room left for what no term counts (the caching allocator's fragmentation, FSDP2's prefetch of the next
unit, the estimates' errors). The host-memory line counts what the processes of one machine load at start and keep
resident after (`host_memory`). Measured against the real update on fake tensors:
`--measure` (grpo_lib/planning/measure.py; tests/planning/test_plan_measure.py holds the Qwen3-4B plan within 10% of it).

Token budgets that fit: the largest actor.ppo_max_token_len_per_gpu whose layers' backward fits FIT_FRACTION of the
GPU (activations are the only term that grows with it), and the no-grad log-prob passes' budget; `auto` as the value
of those keys takes them (`resolve_auto_budgets`: here for --gpu-memory-gb, at setup for the device's memory).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from grpo_lib.config import Config
from grpo_lib.core.dtypes import DTYPE_BYTES, resolve as resolve_dtype
from grpo_lib.core.preflight import hub_snapshot


GIB = 2**30
HEAD_CHUNK_TOKENS = 1024  # grpo_lib.model.logprobs.token_logprobs' default chunk_size


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


def gpu_dtype_bytes(name: str) -> int:
    """Bytes per element of a config dtype on the GPU ('auto' is bfloat16 there)."""
    return DTYPE_BYTES[resolve_dtype(name, on_gpu=True)]


def lora_params(sizes: ModelSizes, rank: int) -> int:
    """Adapter parameters of LoRA rank `rank` on every linear layer of the decoder (all-linear; an upper bound for a
    shorter target list): rank x (in + out) per layer, for q, k, v, o, gate, up, down."""
    h, q, kv, i = sizes.hidden, sizes.q_dim, sizes.kv_dim, sizes.intermediate
    per_layer = rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return sizes.layers * per_layer


def push_bytes(cfg: Config, sizes: ModelSizes) -> dict[str, float]:
    """Bytes one weight push hands the engine: merged (every weight in the engine's dtype, rollout.dtype) and, with LoRA,
    the adapter alone (rollout.lora_mode=adapter: float32 A and B of every all-linear layer, `lora_params`).
    Example: Qwen3-4B in bf16: merged 2 x 4.02e9 = 7.5 GiB; rank 64: 4 x 132M = 504 MiB; rank 16: 126 MiB."""
    out = {"merged": float(gpu_dtype_bytes(cfg.rollout.dtype) * sizes.params)}
    if cfg.model.lora_rank > 0:
        out["adapter"] = float(4 * lora_params(sizes, cfg.model.lora_rank))
    return out


HEAD_BYTES_PER_LOGIT = 12  # the output head's recompute, per logit of one chunk (see the module docstring)
HEAD_BYTES_PER_LOGIT_ENTROPY_GRAD = 24  # the same with an entropy bonus (actor.entropy_coeff != 0)
CUDA_CONTEXT_BYTES = 1.0 * GIB  # CUDA context, loaded kernels, cuBLAS / cuBLASLt workspaces per process (an estimate)
# NCCL's device buffers, per communicator and GPU, from NCCL's defaults (src/include/device.h, src/transport/nvls.cc).
# The sizes are NCCL's; how many channels it opens and which algorithms it connects it chooses at run time
# (NCCL_DEBUG=INFO prints them), so the totals are estimates for NVLink H100 / H200 machines: every channel with both
# the ring and the tree connected (high: NCCL connects an algorithm at its first use), NVLS before its rounding (low):
NCCL_CONNECTION_BYTES = 4 * 2**20 + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16  # 9.19 MiB: one connection's three protocols,
#   Simple (NCCL_BUFFSIZE 4 MiB), LL128 (120 elements x 640 threads x NCCL_STEPS 8 x 8 B) and LL (8 lines x 512
#   threads x 8 steps x 16 B); the receiving GPU holds them
NCCL_CHANNELS = 32  # channels NCCL opens on NVLink H100 / H200 (an estimate: it picks 16-32 there, fewer over PCIe)
NCCL_CONNECTIONS = 2  # incoming connections per channel: the ring's and the tree's
NCCL_NVLS_BYTES_PER_RANK = 16 * 2 * 128 * 2**10 * 8  # 32 MiB: NVLS (NVLink SHARP, NVSwitch machines; NCCL turns it on
#   above 2 GPUs) holds 16 channels (NVLS_NCHANNELS_SM90) x 2 (reduce, broadcast) x NCCL_NVLS_CHUNKSIZE 128 KiB x 8
#   steps per rank of the communicator, rounded up to the multicast granularity (not counted: a lower estimate)
# vLLM's tensor-parallel all-reduce on Hopper also holds a torch symmetric-memory buffer (VLLM_ALLREDUCE_USE_SYMM_MEM,
# on by default): vLLM 0.32's SYMM_MEM_ALL_REDUCE_MAX_SIZES for sm90, by TP size.
VLLM_SYMM_MEM_BYTES = {2: 64 * 2**20, 4: 32 * 2**20, 6: 64 * 2**20, 8: 64 * 2**20}
# vLLM 0.32 keeps its CUDA-graph pool across a sleep by copying it to pinned host memory (CuMemBackend.suspend offloads
# the "cudagraph" and "runtime" tags at every level, "weights" at level 1). The graphs share one pool, which holds the
# largest captured batch's transient tensors: VLLM_CAPTURE_TOKENS_MAX (vLLM's max_cudagraph_capture_size default,
# min(2 x rollout.max_num_seqs, 512)) tokens x one layer's transients (an estimate; vLLM logs the size it measured,
# "CUDA graph pool memory: X GiB (actual)"). The "runtime" pool (block tables, attention metadata) is MiBs with
# FlashAttention and not counted.
VLLM_CAPTURE_TOKENS_MAX = 512
FIT_FRACTION = 0.9  # a token budget "fits" when its training phase uses at most this share of the GPU (allocator slack)
BUDGET_STEP = 1024  # `auto` token budgets are multiples of this


def nccl_bytes(ranks: int) -> float:
    """Device bytes each GPU holds for one NCCL communicator of `ranks` ranks (an estimate, the constants above):
    nothing for one rank, NCCL_CHANNELS x NCCL_CONNECTIONS connections' buffers for 2 or more, and NVLS's
    buffers above 2 (NCCL enables NVLS only there).

    Examples: nccl_bytes(1) = 0; nccl_bytes(2) = 32 x 2 x 9.19 MiB = 588 MiB; nccl_bytes(4) = 588 + 4 x 32 = 716 MiB.
    """
    if ranks < 2:
        return 0.0
    nvls = NCCL_NVLS_BYTES_PER_RANK * ranks if ranks > 2 else 0
    return float(NCCL_CHANNELS * NCCL_CONNECTIONS * NCCL_CONNECTION_BYTES + nvls)


def context_terms(cfg: Config, *, world_size: int) -> dict[str, float]:
    """Per-process device memory outside the terms of the model and outside vLLM's share: the CUDA context and the
    NCCL communicators this process is in: the trainer's world (FSDP2's all-gathers and reduce-scatters, the reference's
    and the teacher's; `world_size` ranks) and the engine's tensor-parallel group (vLLM's own communicator, with its
    symmetric-memory all-reduce buffer). Example: 4 processes, TP 2: 1 GiB + 716 MiB + (588 + 64) MiB = 2.34 GiB."""
    tp = cfg.rollout.tensor_model_parallel_size
    return {"CUDA context": float(CUDA_CONTEXT_BYTES),
            f"NCCL trainer world ({world_size})": nccl_bytes(world_size),
            f"NCCL vLLM TP group ({tp})": nccl_bytes(tp) + (VLLM_SYMM_MEM_BYTES.get(tp, 0) if tp > 1 else 0)}


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
                master_bytes: int = 4, with_engine: bool = True, tokens: int | None = None,
                teacher: ModelSizes | None = None, reward_model: ModelSizes | None = None) -> dict[str, float]:
    """Bytes per GPU of each component, the phases and the peak (see the module docstring for the formulas).

    Components are their full sizes; the phases count what is on the GPU then: actor weights offloaded
    (actor.fsdp_config.param_offload) leave the GPU while vLLM generates, AdamW state offloaded
    (actor.fsdp_config.optimizer_offload) is on it only for the optimizer step. `tokens`: the update's micro-batch
    bound (default: the config's). `teacher`: the distillation teacher's sizes (its terms and its pass,
    `teacher_terms`); None plans without one. `reward_model`: the reward model's sizes (`reward_model_terms`, its pass
    beside the awake engine); None plans without one. The judge's engine share (judge.enable) needs no sizes.
    """
    a, P, W = cfg.actor, sizes.params, world_size
    param_offload, optim_offload = a.fsdp_config.param_offload, a.fsdp_config.optimizer_offload
    if compute_bytes is None:  # the actor's compute dtype (actor.fsdp_config.param_dtype) on a GPU
        compute_bytes = gpu_dtype_bytes(a.fsdp_config.param_dtype)
    if tokens is None:
        tokens = update_tokens(cfg)
    head_tokens = min(tokens, HEAD_CHUNK_TOKENS)
    kl = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    trained = lora_params(sizes, cfg.model.lora_rank) if cfg.model.lora_rank > 0 else P  # LoRA: only adapters get grads / AdamW
    full = cfg.model.lora_rank == 0  # the embedding / head train (LoRA: frozen, no gradient)
    root, vh = root_params(sizes), sizes.vocab * sizes.hidden
    tied = sizes.params < sizes.layers * sizes.layer_params + 2 * sizes.embed_params
    context = context_terms(cfg, world_size=W) if with_engine else {}  # the CPU twin has neither
    ctx = sum(context.values())
    # FSDP2 units exist on every GPU run (one process starts a 1-process group there); with_engine=False plans the CPU
    # twin, where one process has no group and nothing is gathered
    sharded = W > 1 or with_engine
    parts = {
        "actor master weights": master_bytes * P / W,
        "gradients": master_bytes * trained / W,
        "AdamW state": 2 * master_bytes * trained / W,
        # fused AdamW on GPU: in place; the CPU twin's per-tensor loop: two float32 temporaries of the largest local tensor
        "AdamW step temporary": 0.0 if with_engine else 2 * master_bytes * (sizes.embed_params if full else 0) / W,
        "gathered units": float(compute_bytes * (root + sizes.layer_params)) if sharded else 0.0,
        "reference": 0.0 if (not kl or cfg.model.lora_rank > 0 or cfg.ref.fsdp_config.param_offload) else gpu_dtype_bytes(cfg.model.dtype) * P / W,
        "activations": float(tokens * activation_bytes_per_token(cfg, sizes, compute_bytes)),
        "output head chunk": float((HEAD_BYTES_PER_LOGIT if a.entropy_coeff == 0 else HEAD_BYTES_PER_LOGIT_ENTROPY_GRAD)
                                   * head_tokens * sizes.vocab),
        "head weight gradient": float(compute_bytes * vh) if full else 0.0,
        "embedding gradient": float((2 if tied else 1) * compute_bytes * vh) if full else 0.0,
        "root reduce-scatter": master_bytes * root / W if (sharded and full) else 0.0,
        "vLLM share": cfg.rollout.gpu_memory_utilization * gpu_bytes if with_engine else 0.0,
        "CUDA context + NCCL": ctx,  # its parts: context_terms
    }
    if teacher is not None and cfg.distillation.enabled:
        parts.update(teacher_terms(cfg, teacher, world_size=world_size, compute_bytes=compute_bytes, sharded=sharded))
    if reward_model is not None and cfg.reward_model.enable:
        parts.update(reward_model_terms(cfg, reward_model, world_size=world_size, compute_bytes=compute_bytes, sharded=sharded))
    if cfg.judge.enable:  # the judge's own vLLM engine, resident through every phase (grpo_lib/rollout/judge.py says why)
        parts["judge engine share"] = cfg.judge.gpu_memory_utilization * gpu_bytes if with_engine else 0.0
    weights, grads, adam = parts["actor master weights"], parts["gradients"], parts["AdamW state"]
    # frozen models resident on the GPU through every phase
    ref = parts["reference"] + parts.get("teacher", 0.0) + parts.get("reward model", 0.0) + parts.get("judge engine share", 0.0)
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
    if "teacher" in parts:  # the teacher's pass, with the engine asleep, before the old-logprob pass and the update
        phases["teacher pass"] = ((0.0 if param_offload else weights) + (0.0 if optim_offload else adam) + ref
                                  + engine_in_training + ctx + parts["teacher gathered units"]
                                  + parts["teacher head chunk"] + parts["teacher activations"])
    scoring = parts.get("reward model gathered units", 0.0) + parts.get("reward model activations", 0.0)
    if scoring:  # the reward model's pass right after generation, the policy's engine still awake
        parts["scoring phase"] = parts["generation phase"] + scoring
    parts.update(phases)
    parts["training phase"] = max(phases.values())
    parts["training phase at"] = max(phases, key=phases.get)  # type: ignore[assignment]  (a name, not bytes)
    # checkpoint.load creates AdamW's state (a zero-gradient step: gradients, moments, the step's temporary) with the
    # engine released (train_grpo.py's setup releases it before the load, as a step does before its update)
    parts["resume phase"] = weights + grads + adam + parts["AdamW step temporary"] + ref + engine_in_training + ctx
    parts["peak"] = max(parts["generation phase"], parts.get("scoring phase", 0.0), parts["training phase"], parts["resume phase"])
    parts["margin"] = gpu_bytes - parts["peak"]  # < 0: does not fit
    return parts


PHASES = ("layers' backward", "root's backward", "optimizer step", "teacher pass", "generation phase", "scoring phase",
          "training phase",
          "training phase at", "resume phase", "peak", "margin")


def teacher_terms(cfg: Config, teacher: ModelSizes, *, world_size: int, compute_bytes: int, sharded: bool) -> dict[str, float]:
    """The distillation teacher's bytes per GPU (grpo_lib/model/teacher.py: sharded like the reference, no optimizer):

        teacher                 d P_t / W      its shards in model.dtype (d: 2 in bf16); 0 with ref.fsdp_config.param_offload
        teacher gathered units  c (root_t + one layer_t)   its pass gathers a unit at a time (copied in when offloaded)
        teacher head chunk      12 x 1024 x V_t   its output head's float32 chunk (the logits, the softmax, the top-k)
        teacher activations     tokens x one layer's transient tensors + the residual stream, no grad (the reference
                                pass's token bound ref.log_prob_*)

    Example: Qwen3-8B (8.19B parameters) in bf16 on 4 GPUs, not offloaded: 2 x 8.19e9 / 4 = 3.8 GiB resident."""
    d = cfg.data
    tokens = (cfg.ref.log_prob_max_token_len_per_gpu if cfg.ref.log_prob_use_dynamic_bsz else
              (cfg.ref.log_prob_micro_batch_size_per_gpu or 1) * (d.max_prompt_length + d.max_response_length))
    tokens = tokens if isinstance(tokens, int) else CPU_AUTO_BUDGET  # `auto` not resolved yet: the CPU default
    return {
        "teacher": 0.0 if cfg.ref.fsdp_config.param_offload else gpu_dtype_bytes(cfg.model.dtype) * teacher.params / world_size,
        "teacher gathered units": float(compute_bytes * (root_params(teacher) + teacher.layer_params)) if sharded else 0.0,
        "teacher head chunk": float(HEAD_BYTES_PER_LOGIT * min(tokens, HEAD_CHUNK_TOKENS) * teacher.vocab),
        "teacher activations": float(tokens * (logprob_bytes_per_token(teacher, compute_bytes) + compute_bytes * teacher.hidden)),
    }


def reward_model_terms(cfg: Config, rm: ModelSizes, *, world_size: int, compute_bytes: int, sharded: bool) -> dict[str, float]:
    """The reward model's bytes per GPU (grpo_lib/model/reward_model.py: sharded like the reference, no optimizer, one label):

        reward model                  d P_r / W      its shards in model.dtype; 0 with reward_model.model.fsdp_config.param_offload
        reward model gathered units   c (root_r + one layer_r)   its forward gathers a unit at a time
        reward model activations      tokens x one layer's transient tensors + the residual stream, no grad (its bound:
                                      forward_max_token_len_per_gpu, or micro_batch_size_per_gpu x the longest sequence)

    Its pass runs right after generation with the policy's engine still awake (`scoring phase`). Example: a 7B reward
    model in bf16 on 4 GPUs, not offloaded: 2 x 7.6e9 / 4 = 3.5 GiB resident."""
    r, d = cfg.reward_model, cfg.data
    tokens = r.forward_max_token_len_per_gpu if r.use_dynamic_bsz else r.micro_batch_size_per_gpu * (d.max_prompt_length +
                                                                                                     d.max_response_length)
    return {
        "reward model": 0.0 if r.model.fsdp_config.param_offload else gpu_dtype_bytes(cfg.model.dtype) * rm.params / world_size,
        "reward model gathered units": float(compute_bytes * (root_params(rm) + rm.layer_params)) if sharded else 0.0,
        "reward model activations": float(tokens * (logprob_bytes_per_token(rm, compute_bytes) + compute_bytes * rm.hidden)),
    }


def update_tokens(cfg: Config) -> int:
    """The update's micro-batch bound in tokens: the token budget, or micro-batch size x the longest sequence."""
    a, d = cfg.actor, cfg.data
    return a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu * (d.max_prompt_length +
                                                                                                  d.max_response_length)


def vllm_graph_pool_bytes(cfg: Config, sizes: ModelSizes) -> float:
    """vLLM's CUDA-graph pool per engine process, which its sleep copies to pinned host memory (an estimate: the
    constants above): 0 with rollout.enforce_eager (or the hf engine), else min(2 x rollout.max_num_seqs,
    VLLM_CAPTURE_TOKENS_MAX) tokens x one layer's transient tensors in rollout.dtype. Example: Qwen3-4B in bf16,
    max_num_seqs 256: 512 x 113,664 B = 55.5 MiB."""
    if cfg.rollout.enforce_eager or cfg.rollout.name != "vllm":  # the hf engine captures no graphs
        return 0.0
    tokens = min(2 * cfg.rollout.max_num_seqs, VLLM_CAPTURE_TOKENS_MAX)
    return float(tokens * logprob_bytes_per_token(sizes, gpu_dtype_bytes(cfg.rollout.dtype)))


def host_memory(cfg: Config, sizes: ModelSizes, *, world_size: int, teacher: ModelSizes | None = None,
                reward_model: ModelSizes | None = None) -> dict[str, float]:
    """Host bytes per machine (all W processes of one machine): what the start loads and what stays resident.

    Start: process 0 alone reads the whole model in float32 (and the reference in model.dtype) and broadcasts it into
    the shards (fsdp.shard); the others build on the meta device and receive their shards (on GPU, on the device).
    Resident: the reference's shards in pinned memory (ref.fsdp_config.param_offload), vLLM's sleep backup in pinned
    memory while the engine sleeps ("engine backup": its weights at sleep level 1, bf16, one TP shard per process, and
    at every level its CUDA-graph pool, `vllm_graph_pool_bytes` per process), the offloaded actor shards / AdamW state
    when those keys are on.
    """
    P, W = sizes.params, world_size
    kl = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref_on_host = kl and cfg.model.lora_rank == 0
    ref_bytes = gpu_dtype_bytes(cfg.model.dtype) * P
    if teacher is not None and cfg.distillation.enabled:  # the teacher is read and kept like the reference
        teacher_bytes = gpu_dtype_bytes(cfg.model.dtype) * teacher.params
        ref_bytes, ref_on_host = (ref_bytes if ref_on_host else 0.0) + teacher_bytes, True
    fc, r = cfg.actor.fsdp_config, cfg.rollout
    start = 4 * P + (ref_bytes if ref_on_host else 0)  # process 0's full copies, read once per machine
    rm_bytes = gpu_dtype_bytes(cfg.model.dtype) * reward_model.params if reward_model is not None and cfg.reward_model.enable else 0.0
    start += rm_bytes  # read by process 0 like the reference
    sleeps = r.free_cache_engine  # the engine sleeps between generations: its backup is in pinned host memory then
    weights = gpu_dtype_bytes(r.dtype) * P * W / r.tensor_model_parallel_size if sleeps and r.sleep_level == 1 else 0.0
    pools = W * vllm_graph_pool_bytes(cfg, sizes) if sleeps else 0.0
    resident = (ref_bytes if ref_on_host and cfg.ref.fsdp_config.param_offload else 0.0) + weights + pools
    resident += (4 * P if fc.param_offload else 0) + (8 * P if fc.optimizer_offload else 0)
    resident += rm_bytes if cfg.reward_model.model.fsdp_config.param_offload else 0.0
    return {"start": float(start), "resident": float(resident), "engine weights backup": float(weights),
            "engine graph pool backup": float(pools)}


def fitting_budget(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_bytes: float,
                   slope: float | None = None) -> int:
    """The largest actor.ppo_max_token_len_per_gpu (a multiple of BUDGET_STEP) whose training phase fits in
    FIT_FRACTION of the GPU, from the activation slope (bytes per token; default the analytic one), at least one
    sequence and at most this process's share of a mini-batch (no micro-batch can hold more).

    Example (Qwen3-4B, 4 processes, 80 GiB): the update's budget-free terms are ~20.7 GiB, the slope ~0.28 MiB per token,
    so ~(0.9 x 80 - 20.7) GiB / 0.28 MiB ~= 185k tokens (184320).
    """
    d = cfg.data
    seq = d.max_prompt_length + d.max_response_length
    compute_bytes = gpu_dtype_bytes(cfg.actor.fsdp_config.param_dtype)
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
    compute_bytes = gpu_dtype_bytes(cfg.actor.fsdp_config.param_dtype)
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
