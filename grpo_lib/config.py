"""Typed configuration: one dataclass per recipe section, YAML + dotted overrides, verl aliases, validation.

A recipe is plain YAML whose sections mirror verl's config with the `actor_rollout_ref.` prefix dropped
(`actor.ppo_epochs` for verl's `actor_rollout_ref.actor.ppo_epochs`). Overrides follow on the command line
as `key=value` with dotted keys; values are parsed as YAML scalars (`actor.lr=1e-6`, `trainer.logger=[console]`).
verl's full spelling is accepted as an alias, so a verl user's override lines work unchanged.

`load_config` checks everything before anything heavy loads (DESIGN invariant 4) and raises `ConfigError`
listing every problem with its key and fix; `train_grpo.py` turns that into exit code 2.

Units (docs/DESIGN.md): `data.train_batch_size` and `actor.ppo_mini_batch_size` count *prompts* (global);
`actor.ppo_micro_batch_size_per_gpu` counts *trajectories* per process; token budgets count prompt +
response tokens per process.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# --------------------------------------------------------------------------------------------- sections


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training parquet/jsonl files (a single string is accepted). Rows in verl's schema."""
    val_files: list[str] = field(default_factory=list)
    """Validation files; empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages, or a plain string."""
    train_batch_size: int = 1024
    """Prompts per training step, global across processes. Trajectories per step = this x rollout.n."""
    max_prompt_length: int = 512
    """Prompt tokens (after the chat template). Longer prompts are filtered or truncated, see below."""
    max_response_length: int = 512
    """Generated tokens per response (vLLM max_tokens)."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length before training (the count is logged)."""
    truncation: Literal["error", "left", "right"] = "error"
    """What to do with a prompt that is still too long: error (names file and row), left or right cut."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template (add_generation_prompt=True)."""
    system_prompt: str | None = None
    """Optional system message put in front of every prompt that has none."""
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of the tokenizer's apply_chat_template (verl's name), e.g. {enable_thinking: false}
    so Qwen3 answers without a thinking block (it thinks by default and runs into max_response_length)."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch."""
    seed: int = 1
    """Seed of the prompt order (reproducible; the sampler position is part of the resumable state)."""
    invalid_rows: Literal["drop", "error"] = "drop"
    """Rows whose ground truth is missing, None, NaN or empty can never score: drop them (counted, logged as
    data/invalid_rows) or stop with an error naming the file and row."""


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model folder or hub name (actor, reference and vLLM all load it)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Storage dtype of the frozen reference model. auto: float32 on CPU, bfloat16 on GPU. The trained actor
    always keeps float32 master weights and AdamW state; its compute dtype is actor.fsdp_config.param_dtype."""
    use_remove_padding: bool = False
    """Pack each micro-batch into rows of whole sequences (>= 512 tokens each) with restarting position_ids: no pad
    tokens computed except each row's short pad segment. Checked at start-up to isolate sequences."""
    enable_gradient_checkpointing: bool = False
    """Activation checkpointing in the actor's decoder layers (memory for compute)."""
    trust_remote_code: bool = False
    """Passed to transformers and vLLM."""
    lora_rank: int = 0
    """LoRA rank r (0: full fine-tuning). With r > 0 only the peft adapters train; the reference is the same model
    with adapters disabled (no second copy) and the engine gets merged weights (grpo_lib/lora.py)."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is (lora_alpha / lora_rank) * B @ A (verl's default 16)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: `all-linear` (every linear layer except the output head) or a list of module
    name suffixes such as [q_proj, v_proj]; each must match a module of the model."""
    lora_dropout: float = 0.0
    """Dropout on the adapter input during training (0: off; logprob passes never drop)."""
    lora_adapter_path: str | None = None
    """Start from this saved peft adapter folder (adapter_config.json + weights) instead of a fresh one; its rank,
    alpha and target modules then come from the folder."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """vanilla (PPO clip, dual clip) or gspo (sequence-level ratio)."""


@dataclass
class ActorFSDPConfig:
    param_offload: bool = False
    """Move the actor's parameter shards to CPU while vLLM generates; back for logprobs, update and push (verl)."""
    optimizer_offload: bool = False
    """Move AdamW's state shards to CPU between optimizer steps (verl)."""
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype: each FSDP2 unit is gathered and cast to it for forward/backward; master weights stay float32.
    auto: bfloat16 on GPU, float32 on CPU (verl's mixed_precision.param_dtype). On CPU a lower dtype runs the actor's
    passes under torch.autocast (grpo_lib/perf.py); it pays only on CPUs with AMX / AVX512-BF16. float16 is refused
    (it would need loss scaling)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter (verl's mixed_precision.reduce_dtype)."""


@dataclass
class RefFSDPConfig:
    param_offload: bool = True
    """Keep the reference's parameter shards in CPU memory; each unit is copied to the accelerator only for its
    forward (FSDP2 CPUOffloadPolicy; no-op on CPU). Alias: ref.param_offload."""


@dataclass
class ActorConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW (verl: actor.optim.lr)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up, in optimizer steps; constant afterwards."""
    grad_clip: float = 1.0
    """Max global gradient norm per optimizer step (0 disables clipping)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer update, global (x rollout.n trajectories)."""
    ppo_epochs: int = 1
    """Passes over each step's trajectories."""
    shuffle: bool = False
    """Shuffle trajectories (whole groups) between mini-batches each epoch."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Trajectories per forward/backward per process (memory only; None with use_dynamic_bsz)."""
    ppo_micro_batch_size: int | None = None
    """verl's older global spelling: trajectories per forward/backward summed over all processes. When set (and the
    per-GPU key is not), ppo_micro_batch_size_per_gpu = this / processes (resolved at load)."""
    use_dynamic_bsz: bool = False
    """Build micro-batches by token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Tokens (prompt + response) per forward/backward per process when use_dynamic_bsz."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon; default of clip_ratio_low / clip_ratio_high."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon (ratio >= 1 - low). None: clip_ratio (resolved at load; --print-plan shows it)."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (ratio <= 1 + high); DAPO's clip-higher uses 0.28. None: clip_ratio (resolved at load)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (docs/ALGORITHMS.md)."""
    loss_scale_factor: float | None = None
    """Divisor of seq-mean-token-sum-norm (Dr. GRPO). None: data.max_response_length (resolved at load)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    use_kl_loss: bool = False
    """Add kl_loss_coef x KL(actor || reference) to the loss (GRPO's form)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """kl/k1, abs, mse/k2, low_var_kl/k3, and straight-through '+' forms (k3+ ...)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (loss -= entropy_coeff x entropy). Entropy is logged either way (computed without grad
    from the same logits when the coefficient is 0)."""
    use_torch_compile: bool = False
    """torch.compile each decoder layer of the actor (dynamic shapes) for the update and logprob passes. Off by default:
    a one-off compile of tens of seconds on CPU for about 10% of the update (bench/results_cpu.md)."""
    fsdp_config: ActorFSDPConfig = field(default_factory=ActorFSDPConfig)


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
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (weights + KV cache). Ignored on CPU."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes; None: from gpu_memory_utilization on GPU; on CPU sized from the batch (rollout.n x
    prompts per process x max model length x KV bytes per token, at most 1/4 of available RAM: grpo_lib/perf.py)."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor parallel size within each group of processes."""
    free_cache_engine: bool = True
    """Free the KV cache and offload weights between generations (vLLM sleep mode; no-op on CPU)."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level with free_cache_engine: 1 offloads weights to CPU memory, 2 discards them (less host memory;
    safe because a full weight push always follows the wake)."""
    enforce_eager: bool = False
    """Run vLLM's model eagerly. False (verl's default): torch.compile (CPU) / CUDA graphs (GPU), compiled once and
    cached on disk (~/.cache/vllm); faster decoding for a one-off compile at the first start."""
    max_num_seqs: int = 256
    """Max concurrent sequences in the engine."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype. auto: float32 on CPU (exact match with the trainer), bfloat16 on GPU."""
    update_weights_bucket_megabytes: int = 512
    """Most MiB of gathered, engine-dtype weights held at once while pushing the actor's weights to the engine
    (verl's key and default); the push never holds a second full copy of the model."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Trajectories per no-grad old-logprob forward per process (verl's name for that pass). None:
    actor.ppo_micro_batch_size_per_gpu (resolved at load; --print-plan shows it)."""
    log_prob_micro_batch_size: int | None = None
    """verl's older global spelling of the above (summed over processes; divided by the process count at load)."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Old-logprob pass micro-batched by token budget. None: actor.use_dynamic_bsz (resolved at load)."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget (prompt + response) of the old-logprob pass per process. None: actor.ppo_max_token_len_per_gpu
    (resolved at load)."""
    lora_mode: Literal["merged", "adapter"] = "merged"
    """With model.lora_rank > 0: how the engine gets the adapters. merged: base + scaled B @ A per weight, pushed
    like full weights (exact, any engine)."""


@dataclass
class RefConfig:
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Trajectories per reference forward per process. None: actor.ppo_micro_batch_size_per_gpu (resolved at load)."""
    log_prob_micro_batch_size: int | None = None
    """verl's older global spelling of the above (summed over processes; divided by the process count at load)."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Reference pass micro-batched by token budget. None: actor.use_dynamic_bsz (resolved at load)."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget (prompt + response) of the reference pass per process. None: actor.ppo_max_token_len_per_gpu
    (resolved at load)."""


@dataclass
class KLCtrlConfig:
    type: Literal["fixed"] = "fixed"
    """Only a fixed coefficient is supported."""
    kl_coef: float = 0.001
    """Weight of the KL penalty subtracted from token rewards (use_kl_in_reward)."""


@dataclass
class RolloutCorrectionConfig:
    mode: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling between vLLM's sampling logprobs and the trainer's."""
    cap: float = 2.0
    """Upper bound of the importance weight."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose scores are all equal and generate more prompts."""
    max_num_gen_batches: int = 10
    """Most generate rounds per step (0: unlimited); the step trains on what it has after that."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """grpo or rloo."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group std (GRPO); false gives Dr. GRPO."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef x KL from token rewards before advantages."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty (same names as actor.kl_loss_type)."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class CustomRewardConfig:
    path: str | None = None
    """Python file with fn(data_source, solution_str, ground_truth, extra_info) (verl's signature)."""
    name: str = "compute_score"
    """Function name in that file."""


@dataclass
class Gsm8kRewardConfig:
    mode: Literal["strict", "flexible"] = "strict"
    """strict: the number after '####'; flexible: the last number in the response."""


@dataclass
class RewardConfig:
    functions: list[dict] = field(default_factory=lambda: [{"name": "accuracy", "weight": 1.0}])
    """Reward functions and weights: accuracy (rule by data_source), format, custom."""
    custom: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    gsm8k: Gsm8kRewardConfig = field(default_factory=Gsm8kRewardConfig)
    timeout_s: float = 10.0
    """Seconds one response may take to score; slower ones score 0 and are counted."""
    num_workers: int = 2
    """Processes scoring in parallel (0: in-process, no timeout). Helpers are added while calls hang."""
    max_error_fraction: float = 0.5
    """Stop the run (exit 3) after a step in which more than this fraction of responses had a reward call that
    raised, returned no number or timed out: their zero rewards would train the policy on noise."""


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    """Passes over the training prompts (ignored when total_training_steps is set)."""
    total_training_steps: int | None = None
    """Steps to run; None: total_epochs x steps per epoch."""
    save_freq: int = -1
    """Save a checkpoint (weights, optimizer, sampler, RNG: everything to resume) every this many steps
    (-1: only at the end, and on SIGTERM / SIGINT)."""
    save_hf: bool = True
    """Also write a Hugging Face export into each checkpoint (global_step_N/actor), loadable by transformers and vLLM."""
    max_ckpt_to_keep: int | None = None
    """Keep only the newest this many checkpoints (the oldest is deleted after the new one is complete); None: keep all.
    verl: max_actor_ckpt_to_keep."""
    resume_mode: str = "auto"
    """auto: continue from the newest complete checkpoint in default_local_dir (or start fresh if it has none);
    disable: refuse a folder that already holds a run (exit 2); resume_path: continue from resume_from_path. verl's names."""
    resume_from_path: str | None = None
    """A global_step_N checkpoint folder, used with resume_mode=resume_path."""
    max_bad_steps: int = 5
    """Stop with exit code 3 after this many consecutive steps with an update skipped for a non-finite loss or
    gradient norm (one such step is skipped and counted; a run that keeps producing them has diverged)."""
    test_freq: int = -1
    """Validate every this many steps (-1: never, except val_before_train)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    val_only: bool = False
    """Validate once (rollout.val_kwargs) and exit: no training step, no checkpoint."""
    val_generations_to_log: int = 0
    """(prompt, response, score) rows written per validation to val_generations.jsonl in the run folder and as
    a TensorBoard text summary (verl: trainer.log_val_generations). 0: none."""
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard", "jsonl"])
    """Metric sinks: console, tensorboard, jsonl, wandb (optional: `pip install wandb`; the run is named
    project_name / experiment_name)."""
    default_local_dir: str = "outputs/run"
    """Run folder: metrics.jsonl, TensorBoard events, checkpoints."""
    seed: int = 1
    """Seed of torch, sampling and shuffling."""
    balance_batch: bool = True
    """Assign trajectories to processes by balanced token counts (whole groups stay together)."""
    tune_allocator: bool = True
    """Set glibc malloc's mmap threshold, trim threshold and top pad at start-up so freed activation memory is reused
    instead of returned to the OS and page-faulted back every micro-batch (grpo_lib/perf.py; no-op without glibc)."""
    check_weight_sync: bool = False
    """After every push, compare the engine's logprobs of one trajectory with the actor's (temperature 1) and
    log the largest difference as `debug/weight_sync_max_abs_diff` (costs one tiny forward each)."""
    project_name: str = "grpo"
    """Project of the run in wandb; with experiment_name, the run's name in TensorBoard (text `run/name`)."""
    experiment_name: str = "run"
    """Name of the run in wandb and TensorBoard."""
    n_gpus_per_node: int | None = None
    """verl launch key: processes per machine. When given, n_gpus_per_node x nnodes must equal the launched process
    count (checked; exit 2). None: taken from the launch. --print-plan plans for this many processes."""
    nnodes: int | None = None
    """verl launch key: machines. None: 1 when n_gpus_per_node is given (verl's default), else from the launch."""
    critic_warmup: int = 0
    """verl key: steps that train only the critic. GRPO has no critic, so it must be 0."""
    save_merged: bool = False
    """With model.lora_rank > 0: each checkpoint also holds `merged/`, a full Hugging Face folder (base + adapters)
    that transformers and vLLM load directly; the adapter itself (peft format) is always saved."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ignored: dict[str, str] = field(default_factory=dict, metadata={"runtime": True})
    """Runtime value, not a key: verl keys accepted without effect (key=value -> reason), printed once at start."""


# --------------------------------------------------------------------------------------------- loading


class ConfigError(ValueError):
    """All problems found in a config, one per line, each naming its key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


from grpo_lib.verl_keys import IGNORED, REFUSED, _canonical, _match  # noqa: E402,F401 (verl's spellings; re-exported)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _all_leaf_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted key of the dataclass tree -> its type annotation."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if f.metadata.get("runtime"):
            continue  # set by load_config, not by the user
        if dataclasses.is_dataclass(hint):
            keys.update(_all_leaf_keys(hint, f"{prefix}{f.name}."))
        else:
            keys[f"{prefix}{f.name}"] = hint
    return keys


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against `hint`, converting harmless cases (int -> float, str -> [str]); raise TypeError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        errors = []
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except TypeError as exc:
                errors.append(str(exc))
        raise TypeError(errors[0])
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise TypeError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise TypeError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_hint,) = typing.get_args(hint) or (Any,)
        return [_coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"{key}: expected true/false, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError(f"{key}: expected a number, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError(f"{key}: expected an integer, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"{key}: expected a string, got {value!r}")
    if hint is dict:
        if isinstance(value, dict):
            return value
        raise TypeError(f"{key}: expected a mapping, got {value!r}")
    return value


def _build(cls: type, values: dict[str, Any], prefix: str = ""):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, f"{prefix}{f.name}.")
        elif f"{prefix}{f.name}" in values:
            kwargs[f.name] = values[f"{prefix}{f.name}"]
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """["actor.lr=1e-6", "trainer.logger=[console]"] -> {"actor.lr": 1e-06, "trainer.logger": ["console"]}."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"override {item!r}: expected key=value (for example actor.lr=1e-6)"])
        key, raw = item.split("=", 1)
        try:
            parsed[key.strip().lstrip("+")] = yaml.safe_load(raw) if raw.strip() != "" else None
        except yaml.YAMLError as exc:
            raise ConfigError([f"override {item!r}: the value is not valid YAML ({_yaml_problem(exc)}); quote it or fix the "
                               "brackets, for example data.train_files=[a.parquet,b.parquet]"]) from None
    return parsed


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A parser error as one line: what is wrong and where (1-based line and column), no traceback."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{what}" + (f" ({context})" if context else "")


def read_raw(recipe: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The recipe's keys and the overrides, flattened, in our spelling (verl's aliases applied), not yet checked."""
    tree: dict = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError([f"recipe file {str(path)!r} does not exist: pass a YAML file such as recipes/tiny_cpu.yaml"])
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError([f"recipe {str(path)!r} is not valid YAML: {_yaml_problem(exc)}"]) from None
        if not isinstance(tree, dict):
            raise ConfigError([f"recipe {str(path)!r}: the top level must be a mapping of sections (data:, actor:, ...)"])
    raw = {_canonical(k): v for k, v in _flatten(tree).items()}
    for key, value in parse_overrides(overrides or []).items():
        key = _canonical(key)
        raw.pop(_OTHER_SPELLING.get(key, ""), None)  # an override of one spelling replaces the recipe's other one
        raw[key] = value
    return raw


# verl's older global micro-batch keys and their per-process successors (one of each pair may be set).
_OTHER_SPELLING = {}
for _global in ("actor.ppo_micro_batch_size", "rollout.log_prob_micro_batch_size", "ref.log_prob_micro_batch_size"):
    _OTHER_SPELLING[_global], _OTHER_SPELLING[_global + "_per_gpu"] = _global + "_per_gpu", _global


def launch_world_size(raw: dict[str, Any]) -> int | None:
    """trainer.n_gpus_per_node x trainer.nnodes from raw keys (nnodes defaults to 1), or None when not given."""
    per_node, nodes = raw.get("trainer.n_gpus_per_node"), raw.get("trainer.nnodes")
    if isinstance(per_node, int) and not isinstance(per_node, bool) and per_node >= 1:
        return per_node * (nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1 else 1)
    return None


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None, *, world_size: int = 1) -> Config:
    """Read a recipe, apply overrides, check types and batch arithmetic; raise ConfigError with every problem."""
    raw = read_raw(recipe, overrides)
    known = _all_leaf_keys(Config)
    problems, values, ignored = [], {}, {}
    for key, value in raw.items():
        mapping = next((k for k in known if known[k] is dict and key.startswith(k + ".")), None)
        if mapping is not None:  # a dict-valued key written leaf by leaf: data.apply_chat_template_kwargs.enable_thinking=false
            values.setdefault(mapping, {})[key[len(mapping) + 1:]] = value
            continue
        if key not in known and _match(key, REFUSED) is not None:
            problems.append(f"{key}={value!r} is not supported: {_match(key, REFUSED)}")
            continue
        if key not in known and _match(key, IGNORED) is not None:
            reason, accepted = _match(key, IGNORED)
            if accepted is not None and value not in accepted:
                problems.append(f"{key}={value!r} is not supported ({reason}): only {list(accepted)} is accepted; drop the line")
            else:
                ignored[f"{key}={value!r}"] = reason
            continue
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "; see the config reference in README.md"
            problems.append(f"unknown key {key!r}{hint}")
            continue
        try:
            values[key] = _coerce(value, known[key], key)
        except TypeError as exc:
            problems.append(f"wrong type: {exc}")
    config = _build(Config, values)  # keys with problems keep their defaults, so every problem is reported at once
    config.ignored = ignored
    from grpo_lib.config_checks import validate  # it reads these dataclasses: imported here, not at the top

    problems += validate(config, world_size=world_size)
    if problems:
        lines = _recipe_lines(recipe, overrides)
        raise ConfigError([_with_line(problem, lines, recipe) for problem in problems])
    return config


def _key_lines(node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line of its value in a composed YAML mapping (same leaves as `_flatten`)."""
    found: dict[str, int] = {}
    if not isinstance(node, yaml.MappingNode):
        return found
    for key_node, value_node in node.value:
        dotted = f"{prefix}{key_node.value}"
        if isinstance(value_node, yaml.MappingNode) and value_node.value:
            found.update(_key_lines(value_node, dotted + "."))
        else:
            found[dotted] = key_node.start_mark.line + 1
    return found


def _recipe_lines(recipe, overrides: list[str] | None) -> dict[str, int]:
    """Canonical key -> its line in the recipe, for keys the overrides do not replace ({} without a recipe)."""
    if recipe is None:
        return {}
    overridden = {_canonical(k) for k in parse_overrides(overrides or [])}
    lines = _key_lines(yaml.compose(Path(recipe).read_text()))
    return {_canonical(k): line for k, line in lines.items() if _canonical(k) not in overridden}


def _with_line(problem: str, lines: dict[str, int], recipe) -> str:
    """Append where the recipe sets the key a problem names: "actor.lr=-1.0: ..." -> "... (recipe.yaml line 18)"."""
    for key in sorted(lines, key=len, reverse=True):
        if problem.startswith((f"{key}=", f"{key}:", f"wrong type: {key}:", f"unknown key {key!r}")):
            return f"{problem} ({recipe} line {lines[key]})"
    return problem


def reference_markdown() -> str:
    """The config reference table (README.md embeds it): key, default, meaning — read from the field docstrings."""
    import ast
    import inspect

    docs: dict[str, dict[str, str]] = {}
    tree = ast.parse(inspect.getsource(__import__(__name__, fromlist=["x"])))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body, docs[node.name] = node.body, {}
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[node.name][a.target.id] = " ".join(str(b.value.value).split())

    lines = []

    def walk(cls, prefix: str):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("runtime"):
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{prefix}{f.name}` | `{default!r}` | {docs.get(cls.__name__, {}).get(f.name, '')} |")

    for f in dataclasses.fields(Config):
        if f.metadata.get("runtime"):
            continue
        lines.append(f"\n**{f.name}**\n\n| key | default | meaning |\n|---|---|---|")
        walk(typing.get_type_hints(Config)[f.name], f"{f.name}.")
    return "\n".join(lines).strip() + "\n"


def update_readme(readme: str | Path = "README.md") -> None:
    """Rewrite the tables between '## Config reference' (after its intro paragraph) and the next '## '."""
    path = Path(readme)
    text = path.read_text()
    start = text.index("## Config reference")
    first_table = text.index("**data**", start)
    end = text.index("\n## ", first_table)
    path.write_text(text[:first_table] + reference_markdown() + text[end:])


if __name__ == "__main__":
    import sys

    if "--update-readme" in sys.argv:
        update_readme()
    else:
        print(reference_markdown())
