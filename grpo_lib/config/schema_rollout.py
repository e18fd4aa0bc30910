"""The `rollout:` section of the config (verl's key names): the engine, its sampling, its memory, multi-turn episodes and
validation's sampling. Field docstrings feed the config reference (docs/REFERENCE.md), as in `grpo_lib.config.schema`
(which includes this section).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grpo_lib.config.fields import may_change_on_resume


@dataclass
class ValKwargsConfig:
    do_sample: bool = False
    """false: greedy validation (verl's default; temperature/top_p/top_k ignored); true: sample with the keys below."""
    temperature: float = 0.0
    """Validation sampling temperature when do_sample (0: greedy)."""
    top_p: float = 1.0
    """Validation nucleus threshold when do_sample."""
    top_k: int = -1
    """Validation top-k when do_sample (-1: off)."""
    n: int = 1
    """Responses per validation prompt (independent of rollout.n)."""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts with tool calls (grpo_lib/rollout/episodes.py): the model calls the tools of tool_config_path during
    its response, their outputs join the context with loss_mask 0. Off: single-turn generation, unchanged."""
    format: Literal["hermes"] = "hermes"
    """Tool-call format in the assistant's text. hermes (Qwen's, what a Qwen chat template with tools= asks for):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    max_assistant_turns: int | None = None
    """Most assistant turns (generations) per episode; the episode ends after that turn, a tool call in it unanswered.
    None: no limit but data.max_response_length (verl's default)."""
    max_user_turns: int | None = None
    """Most tool-response turns per episode (one per assistant turn with tool calls, whatever the number of calls in it).
    None: no limit but data.max_response_length (verl's default)."""
    max_parallel_calls: int = 1
    """Tool calls run per assistant turn: the first ones in the text (verl's key and default 1); later calls of the same
    turn are not run and get no response (counted as tools/dropped_calls)."""
    tool_config_path: str | None = None
    """verl's tool config YAML (`tools: - class_name: pkg.module.Class, config: {...}, tool_schema: {type: function,
    function: {name, description, parameters}}`); with enable, this or function_tool_path (or both). The classes are
    imported and run as your code."""
    function_tool_path: str | None = None
    """verl's function tools: a Python file whose `@function_tool` functions (typed, Google-style docstrings) are tools,
    their schemas inferred as verl infers them (grpo_lib/tools/functions.py); alongside tool_config_path, whose tool
    names it may not repeat (refused at start naming both files, exit 2). Imported and run as your code."""
    max_tool_response_length: int = 256
    """Characters of one tool response the model sees (verl's unit and default); a longer one is cut on
    tool_response_truncate_side with a "(truncated)" marker and counted (tools/truncated_responses)."""
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of an over-long tool response is kept (verl's names): left keeps the start, right keeps the end,
    middle keeps half of max_tool_response_length from each end (verl's default)."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call (create, execute, calc_reward or release) may take; a slower call is answered with a timeout
    message and counted (tools/timeouts). A synchronous execute of a tool that keeps no per-episode state runs in a
    worker process, killed at this timeout (docs/TOOLS.md); any other synchronous call runs in a thread of its own
    that cannot be killed: the episode moves on, the call is counted as abandoned (tools/abandoned) and its thread
    finishes on its own; 64 abandoned calls of one tool still running, or a turn whose calls have not all returned
    30 s past this timeout (an async tool blocking the event loop; calls waiting for a worker process add a timeout and
    the worker's start-up bound, reward.import_timeout_s, per wave of them), stop the run after saving (exit 3)."""


@dataclass
class PartialRolloutConfig:
    enable: bool = False
    """Carry-over rollouts on the same GPUs (grpo_lib/rollout/carry.py, docs/TRAINING.md): a step's generation stops as
    soon as train_batch_size groups are complete; the unfinished responses keep their tokens, behaviour logprobs and
    weight versions and are resumed first in the next step's round, re-prefilled under the new weights. The loss then
    reweights their older tokens (actor.use_decoupled_loss). Single-turn rollouts only (no multi-turn, DAPO filter or
    remax baseline yet); both engines (vllm at any TP size, hf)."""
    active_batch_size: int | None = None
    """Prompt groups kept in flight, a multiple of data.train_batch_size (None: twice it, resolved at load). The round stops when
    train_batch_size of them are complete, i.e. at the share train_batch_size / active_batch_size; equal to
    train_batch_size nothing is carried and the step is the synchronous one."""
    max_staleness: int = 1
    """K: no trained token is more than K weight versions older than the weights being trained. A group that would
    break it if carried once more finishes in its round; one that still would (more complete groups than a step
    trains) is dropped (rollout/dropped_stale_responses) and generated again from its prompt. 0 only with
    active_batch_size equal to train_batch_size (otherwise every carried response would be thrown away)."""


@dataclass
class RolloutConfig:
    name: str = "vllm"
    """Generation engine: vllm (colocated vLLM) or hf (transformers, a hand-written sampling loop with a KV cache;
    for machines without vLLM; no tensor parallelism)."""
    n: int = 1
    """Responses sampled per prompt (the GRPO group size); grpo needs >= 2."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    gpu_memory_utilization: float = may_change_on_resume(0.5)
    """Fraction of GPU memory vLLM may take (weights + KV cache). Ignored on CPU."""
    kv_cache_memory_bytes: int | None = may_change_on_resume(None)
    """KV cache size in bytes; None: from gpu_memory_utilization on GPU; on CPU sized from the batch (rollout.n x
    prompts per process x max model length x KV bytes per token, at most 1/4 of available RAM: grpo_lib/core/perf.py)."""
    tensor_model_parallel_size: int = may_change_on_resume(1)
    """vLLM tensor parallel size within each group of processes."""
    free_cache_engine: bool = may_change_on_resume(True)
    """Free the KV cache and offload weights between generations (vLLM sleep mode; no-op on CPU)."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level with free_cache_engine: 1 offloads weights to CPU memory, 2 discards them (less host memory;
    safe because a full weight push always follows the wake)."""
    enforce_eager: bool = may_change_on_resume(False)
    """Run vLLM's model eagerly. False (verl's default): torch.compile (CPU) / CUDA graphs (GPU), compiled once and
    cached on disk (~/.cache/vllm); faster decoding for a one-off compile at the first start."""
    max_num_seqs: int = may_change_on_resume(256)
    """Max concurrent sequences in the engine."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype. auto: float32 on CPU (exact match with the trainer), bfloat16 on GPU."""
    update_weights_bucket_megabytes: int = may_change_on_resume(512)
    """Most MiB of gathered, engine-dtype weights held at once while pushing the actor's weights to the engine
    (verl's key and default); the push never holds a second full copy of the model."""
    val_kwargs: ValKwargsConfig = may_change_on_resume(default_factory=ValKwargsConfig)
    log_prob_micro_batch_size_per_gpu: int | None = may_change_on_resume(None)
    """Trajectories per no-grad old-logprob forward per process (verl's name for that pass). None:
    actor.ppo_micro_batch_size_per_gpu (resolved at load; --print-plan shows it)."""
    log_prob_micro_batch_size: int | None = may_change_on_resume(None)
    """verl's older global spelling of the above (summed over processes; divided by the process count at load)."""
    log_prob_use_dynamic_bsz: bool | None = may_change_on_resume(None)
    """Old-logprob pass micro-batched by token budget. None: actor.use_dynamic_bsz (resolved at load)."""
    log_prob_max_token_len_per_gpu: int | Literal["auto"] | None = may_change_on_resume(None)
    """Token budget (prompt + response) of the old-logprob pass per process. None: actor.ppo_max_token_len_per_gpu
    (resolved at load). `auto`: the largest no-grad budget that fits the device (memory plan, at setup)."""
    lora_mode: Literal["merged", "adapter"] = may_change_on_resume("merged")
    """With model.lora_rank > 0: how the engine gets the adapters. merged: base + scaled B @ A per weight, pushed
    like full weights (exact, any engine). adapter (vLLM only): the engine keeps model.path's base weights and each push
    hands it the adapter alone (tens of MB instead of the whole model), served through vLLM's LoRA layers as a new
    adapter per push (docs/TRAINING.md "LoRA"); target modules vLLM cannot take (embed_tokens, lm_head) fall back to
    merged, said at start."""
    enable_chunked_prefill: bool = may_change_on_resume(True)
    """vLLM chunked prefill (verl's key and default True): long prompts are prefilled in pieces of at most
    max_num_batched_tokens, next to running decodes. Always off on CPU: a chunked prefill rewinds the request's seeded
    generator, which CPU generators cannot do."""
    max_num_batched_tokens: int = may_change_on_resume(8192)
    """Tokens vLLM schedules per engine step (verl's key and default 8192). With enable_chunked_prefill false it must
    be at least data.max_prompt_length + data.max_response_length; on CPU (no chunking) the engine takes the larger of
    the two."""
    engine_kwargs: dict = may_change_on_resume(default_factory=dict)
    """Keyword arguments passed unchanged to vllm.LLM(...) (rollout.name=vllm), e.g. {kv_cache_dtype: fp8,
    compilation_config: {cudagraph_capture_sizes: [1, 8, 32]}}; verl's actor_rollout_ref.rollout.engine_kwargs.vllm.*
    lands here (its engine_kwargs.sglang.* is ignored). Each name is checked at start against the installed vLLM's
    LLM(...) / EngineArgs arguments (exit 2 with the closest names). disable_custom_all_reduce defaults to true, as verl
    always sets it; a key the trainer sets from one of its own keys (max_num_seqs: rollout.max_num_seqs, ...) or needs
    (logprobs_mode, seed, ...) is refused naming both (engines/vllm_settings.py VLLM_OWN_KWARGS)."""
    hf_use_torch_compile: bool = may_change_on_resume(False)
    """rollout.name=hf only: torch.compile the engine model's forward (dynamic shapes: the batch shrinks as rows
    finish and the KV cache grows every step), the same tokens as eager. Off by default: on CPU it measured 0.90x of
    eager's time after a 52 s compile at the first call (bench/results_generate_hf_compile_cpu.md), worth it only for
    long runs; on GPUs without vLLM, untried."""
    n_gpus_per_node: int = 0
    """One-step-off on split GPUs (verl's one-step-off key; grpo_lib/trainer/split.py, docs/TRAINING.md): the last this-many
    processes of the launch run the engine (one engine: its tensor-parallel group, so equal to
    tensor_model_parallel_size), the others train with FSDP2; the engine generates step k+1 with the weights of step k-1
    while the trainer updates on step k, weights travel in buckets over a collective (NCCL on GPU, gloo on CPU). 0: the
    engine is colocated in every training process (the default)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    partial_rollout: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
