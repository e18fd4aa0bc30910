"""The config's schema: one dataclass per recipe section, each field with its default and a docstring (units, reference).

The lowest layer of `grpo_lib.config` (schema <- checks <- load): it imports nothing of the trainer. A field's
metadata declares what the code must know about the key beyond its type:

    metadata={"runtime": True}        a value set by load_config, not by the user (`Config.ignored`)
    may_change_on_resume(default)     may differ between a checkpoint and the run resuming it (speed, memory, logging,
                                      length of the run); grpo_lib/checkpoints/checkpoint.py reads `resume_may_change_keys()`

The config reference (docs/REFERENCE.md) is generated from the field docstrings (`python -m grpo_lib.config --update-docs`).

Units (docs/DESIGN.md): `data.train_batch_size` and `actor.ppo_mini_batch_size` count *prompts* (global);
`actor.ppo_micro_batch_size_per_gpu` counts *trajectories* per process; token budgets count prompt +
response tokens per process.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_lib.config.fields import may_change_on_resume
from grpo_lib.config.schema_distillation import DistillationConfig
from grpo_lib.config.schema_reward_model import JudgeConfig, RewardModelConfig
from grpo_lib.config.schema_rollout import MultiTurnConfig, RolloutConfig, ValKwargsConfig  # noqa: F401 (re-exported)

# --------------------------------------------------------------------------------------------- field metadata


# --------------------------------------------------------------------------------------------- sections


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training parquet/jsonl files (a single string is accepted). Rows in verl's schema."""
    val_files: list[str] = may_change_on_resume(default_factory=list)
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
    """Seed of the prompt order (reproducible; the sampler position is part of the resumable state), in [0, 2**32 - 1]."""
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
    use_remove_padding: bool = may_change_on_resume(False)
    """Pack a micro-batch into one row of whole sequences (restarting position_ids, boundaries passed to a varlen
    attention: flash_attention_2 where installed on CUDA, else grpo_varlen, grpo_lib/model/attention.py) when that computes
    < 90% of its padded [rows, longest] block; on grpo_varlen the responses to one prompt share it (the prompt runs
    through the decoder once per micro-batch, its gradient summed over them), which pays even without length spread;
    a micro-batch where neither pays stays padded (perf/packed, perf/shared_prefix, perf/real_token_fraction). Checked
    at start-up to isolate sequences."""
    enable_gradient_checkpointing: bool = may_change_on_resume(False)
    """Activation checkpointing in the actor's decoder layers (memory for compute)."""
    trust_remote_code: bool = False
    """Passed to transformers and vLLM."""
    lora_rank: int = 0
    """LoRA rank r (0: full fine-tuning). With r > 0 only the peft adapters train; the reference is the same model
    with adapters disabled (no second copy) and the engine gets merged weights (grpo_lib/model/lora.py)."""
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
    """vanilla (PPO clip, dual clip), gspo, cispo, sapo, geo_mean (GMPO), clip_cov, kl_cov, dppo_tv, dppo_kl, gpg, dro
    (docs/ALGORITHMS.md). sapo and geo_mean aggregate their loss seq-mean-token-mean whatever loss_agg_mode says, as
    verl; gspo aggregates with loss_agg_mode, as verl 0.9.1 (its recipes set seq-mean-token-mean). verl's bypass_mode is
    refused."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of a micro-batch's loss tokens (at least 1) whose loss and gradient are dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower end of the covariance band (lb, ub) the dropped tokens are picked from, at random."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper end of that band."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of a micro-batch's loss tokens (at least 1, the largest covariances) given the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of that penalty, ppo_kl_coef x |lp - old|."""
    dro_beta: float | None = None
    """dro: weight of the quadratic log-ratio penalty beta / 2 x (lp - old)^2; required (> 0) with loss_mode dro."""


@dataclass
class ActorFSDPConfig:
    param_offload: bool = may_change_on_resume(False)
    """Move the actor's parameter shards to CPU while vLLM generates; back for logprobs, update and push (verl)."""
    optimizer_offload: bool = may_change_on_resume(False)
    """Move AdamW's state shards to CPU between optimizer steps (verl)."""
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype: each FSDP2 unit is gathered and cast to it for forward/backward; master weights stay float32.
    auto: bfloat16 on GPU, float32 on CPU (verl's mixed_precision.param_dtype). On CPU a lower dtype runs the actor's
    passes under torch.autocast (grpo_lib/core/perf.py); it pays only on CPUs with AMX / AVX512-BF16. float16 is refused
    (it would need loss scaling)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter (verl's mixed_precision.reduce_dtype)."""
    # FSDP2 collectives of the update's micro-batches (grpo_lib/model/fsdp.py mini_batch_collectives; --print-plan shows
    # each one's bytes per mini-batch and memory). None changes the gradient beyond float32 summation order.
    keep_root_gathered: bool = True
    """Gather the root unit (embeddings, final norm, output head: the largest unit) once per mini-batch instead of
    twice per micro-batch; it stays gathered between the micro-batches. No cost at the peak: the root is gathered
    through every micro-batch's forward and backward anyway. false: FSDP2's per-micro-batch schedule."""
    reshard_after_forward: bool = True
    """Free each decoder layer's gathered weights after its forward and gather them again for its backward (verl's
    fsdp_config.reshard_after_forward). false: one all-gather per layer per micro-batch instead of two, for every
    layer's weights in param_dtype held from the forward to the backward (2 bytes x the layers' parameters in bf16)."""
    defer_grad_reduce: Literal["none", "root", "all"] = "none"
    """Reduce-scatter the gradients once per mini-batch, in the last micro-batch's backward, instead of after every
    micro-batch: none; root (the root's unsharded gradient, 4 x vocab x hidden bytes in float32, is held across the
    micro-batches); all (every unit's: the whole model's unsharded gradient, 4 bytes per parameter, held; use it when
    the plan shows that it fits). Same gradient up to float32 summation order."""


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
    ppo_micro_batch_size_per_gpu: int | None = may_change_on_resume(None)
    """Trajectories per forward/backward per process (memory only; None with use_dynamic_bsz)."""
    ppo_micro_batch_size: int | None = may_change_on_resume(None)
    """verl's older global spelling: trajectories per forward/backward summed over all processes. When set (and the
    per-GPU key is not), ppo_micro_batch_size_per_gpu = this / processes (resolved at load)."""
    use_dynamic_bsz: bool = may_change_on_resume(False)
    """Build micro-batches by token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: int | Literal["auto"] = may_change_on_resume(16384)
    """Tokens (prompt + response) per forward/backward per process when use_dynamic_bsz. `auto`: the largest that fits
    the device, from the memory plan at setup (`--print-plan` shows the choice; on CPU 16384)."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon; default of clip_ratio_low / clip_ratio_high."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon (ratio >= 1 - low). None: clip_ratio (resolved at load; --print-plan shows it)."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (ratio <= 1 + high); DAPO's clip-higher uses 0.28. None: clip_ratio (resolved at load)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1); dppo_tv / dppo_kl: the cap of their truncated IS ratio."""
    tau_pos: float = 1.0
    """sapo: temperature of the soft gate on tokens with a positive advantage (must be > 0)."""
    tau_neg: float = 1.05
    """sapo: temperature of the soft gate on the other tokens (must be > 0)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (docs/ALGORITHMS.md).
    token-sum: the mini-batch's plain sum over loss tokens, no denominator (verl 0.9)."""
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
    mask_truncated_responses: bool = False
    """Leave responses cut at data.max_response_length (finish reason `length`) out of the loss: their loss_mask is all 0,
    so they add no token and no sequence to any loss count (TRL's mask_truncated_completions). Their score stays in their
    group's advantage baseline. Off (verl, TRL's default): truncated responses train like the others."""
    use_decoupled_loss: bool = True
    """Decoupled PPO (AReaL) where the batch holds tokens of older weights (rollout.partial_rollout's carried responses):
    the ratio is taken against the proximal policy (the old-logprob pass: this step's weights before the update) and
    each such token is weighted by min(exp(proximal - behaviour), behav_imp_weight_cap), behaviour being the engine's
    logprob from the weights that sampled it (docs/ALGORITHMS.md). Tokens of the current weights keep today's loss
    exactly (rollout correction included), so without stale tokens nothing changes. false: stale tokens are trained
    as if on-policy (a warning at start)."""
    behav_imp_weight_cap: float = 5.0
    """Cap of the decoupled loss's behaviour weight (AReaL's name; > 0)."""
    use_torch_compile: bool = may_change_on_resume(False)
    """torch.compile each decoder layer of the actor (dynamic shapes) for the update and logprob passes. Off by default:
    a one-off compile of tens of seconds on CPU for about 10% of the update (bench/results_cpu.md)."""
    fsdp_config: ActorFSDPConfig = field(default_factory=ActorFSDPConfig)


@dataclass
class RefConfig:
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Trajectories per reference forward per process. None: actor.ppo_micro_batch_size_per_gpu (resolved at load)."""
    log_prob_micro_batch_size: int | None = None
    """verl's older global spelling of the above (summed over processes; divided by the process count at load)."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Reference pass micro-batched by token budget. None: actor.use_dynamic_bsz (resolved at load)."""
    log_prob_max_token_len_per_gpu: int | Literal["auto"] | None = None
    """Token budget (prompt + response) of the reference pass per process. None: actor.ppo_max_token_len_per_gpu
    (resolved at load). `auto`: the largest no-grad budget that fits the device (memory plan, at setup)."""


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
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "seq_reward"
    """Per-response value whose all-equal groups are dropped (verl's names; its DAPO scripts use acc). acc: the accuracy
    reward's correct (1) / wrong (0), or a custom reward's `acc` field (else its score, as verl's DAPO manager); score: the weighted reward before the overlong
    penalty; seq_reward: the score the advantages use (reward + reward.overlong_buffer penalty); seq_final_reward: the
    same, since the in-reward KL penalty is computed after dynamic sampling (with use_kl_in_reward it is refused)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator (verl's names, docs/ALGORITHMS.md): grpo, rloo, grpo_passk, opo, gpg, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax (one more, greedy, generation per prompt for its baseline); grpo_vectorized and
    rloo_vectorized are verl's spellings of grpo and rloo."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group std (GRPO); false gives Dr. GRPO."""
    gamma: float = 1.0
    """Discount per response token of reinforce_plus_plus's returns, in [0, 1] (verl's default 1.0; the other
    estimators ignore it). Only loss tokens count as steps: a tool's output in a multi-turn episode is not discounted."""
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
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's soft overlong punishment (verl: reward_model.overlong_buffer.*, or its DAPO scripts'
    reward_model.reward_kwargs.overlong_buffer_cfg.*): a response longer than max_resp_len - len tokens gets
    min(-(length - (max_resp_len - len)) / len x penalty_factor, 0) added to its score (docs/ALGORITHMS.md)."""
    len: int = 0
    """Tokens of the buffer before max_resp_len in which the penalty grows linearly from 0 to -penalty_factor; must be
    > 0 with enable (verl's default 0; DAPO uses 4096 of 20480)."""
    penalty_factor: float = 1.0
    """Penalty at the full max_resp_len (verl's default 1.0)."""
    max_resp_len: int | None = None
    """Length the buffer ends at, in response tokens (verl: reward_model.reward_kwargs.max_resp_len). None:
    data.max_response_length (what verl's DAPO scripts pass)."""


@dataclass
class RewardConfig:
    functions: list[dict] = field(default_factory=lambda: [{"name": "accuracy", "weight": 1.0}])
    """Reward functions and weights: accuracy (rule by data_source), format, custom; reward_model and judge (the learned
    scorers of the reward_model: and judge: sections, docs/TRAINING.md "Reward models and judges")."""
    custom: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    gsm8k: Gsm8kRewardConfig = field(default_factory=Gsm8kRewardConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    timeout_s: float = may_change_on_resume(10.0)
    """Seconds one response may take to score; slower ones score 0 and are counted."""
    import_timeout_s: float = may_change_on_resume(120.0)
    """Seconds custom.path may take to import, in the trainer and in each reward worker (timeout_s covers calls only);
    a slower import stops the run at setup (exit 2) naming the file, instead of hanging it."""
    num_workers: int = may_change_on_resume(2)
    """Processes scoring in parallel (0: in-process, no timeout). Helpers are added while calls hang."""
    max_error_fraction: float = may_change_on_resume(0.5)
    """Stop the run (exit 3) after a step in which more than this fraction of responses had a reward call that
    raised, returned no number or timed out: their zero rewards would train the policy on noise."""


@dataclass
class TrainerConfig:
    total_epochs: int = may_change_on_resume(1)
    """Passes over the training prompts (ignored when total_training_steps is set)."""
    total_training_steps: int | None = may_change_on_resume(None)
    """Steps to run; None: total_epochs x steps per epoch."""
    save_freq: int = may_change_on_resume(-1)
    """Save a checkpoint (weights, optimizer, sampler, RNG: everything to resume) every this many steps
    (-1: only at the end, and on SIGTERM / SIGINT)."""
    save_hf: bool = may_change_on_resume(True)
    """Also write a Hugging Face export into each checkpoint (global_step_N/actor), loadable by transformers and vLLM."""
    max_ckpt_to_keep: int | None = may_change_on_resume(None)
    """Keep only the newest this many checkpoints (the oldest is deleted after the new one is complete); None: keep all.
    verl: max_actor_ckpt_to_keep."""
    resume_mode: str = may_change_on_resume("auto")
    """auto: continue from the newest complete checkpoint in default_local_dir (or start fresh if it has none);
    disable: refuse a folder that already holds a run (exit 2); resume_path: continue from resume_from_path. verl's names."""
    resume_from_path: str | None = may_change_on_resume(None)
    """A global_step_N checkpoint folder, used with resume_mode=resume_path."""
    discard_newer_checkpoints: bool = may_change_on_resume(False)
    """With resume_mode=resume_path at a step of this run folder that has newer complete checkpoints: delete them (and
    the metrics after that step) and continue from it. False: such a resume exits 2 listing them; nothing is deleted."""
    max_bad_steps: int = may_change_on_resume(5)
    """Stop with exit code 3 after this many consecutive steps with an update skipped for a non-finite loss or
    gradient norm (one such step is skipped and counted; a run that keeps producing them has diverged)."""
    test_freq: int = may_change_on_resume(-1)
    """Validate every this many steps (-1: never, except val_before_train)."""
    val_before_train: bool = may_change_on_resume(False)
    """Validate once before the first step."""
    val_only: bool = may_change_on_resume(False)
    """Validate once (rollout.val_kwargs) and exit: no training step, no checkpoint."""
    val_generations_to_log: int = may_change_on_resume(0)
    """(prompt, response, score) rows written per validation to val_generations.jsonl in the run folder and as
    a TensorBoard text summary (verl: trainer.log_val_generations). 0: none."""
    logger: list[str] = may_change_on_resume(default_factory=lambda: ["console", "tensorboard", "jsonl"])
    """Metric sinks: console, tensorboard, jsonl, wandb (optional: `pip install wandb`; the run is named
    project_name / experiment_name)."""
    default_local_dir: str = may_change_on_resume("outputs/run")
    """Run folder: metrics.jsonl, TensorBoard events, checkpoints."""
    seed: int = 1
    """Seed of torch, sampling and shuffling, in [0, 2**32 - 1] (vLLM seeds numpy with it)."""
    balance_batch: bool = may_change_on_resume(True)
    """Assign trajectories to processes by balanced token counts (whole groups stay together)."""
    tune_allocator: bool = may_change_on_resume(True)
    """Set glibc malloc's mmap threshold, trim threshold and top pad at start-up so freed activation memory is reused
    instead of returned to the OS and page-faulted back every micro-batch (grpo_lib/core/perf.py; no-op without glibc)."""
    check_weight_sync: bool = may_change_on_resume(False)
    """After every push, compare the engine's logprobs of one trajectory with the actor's (temperature 1) and
    log the largest difference as `debug/weight_sync_max_abs_diff` (costs one tiny forward each)."""
    weight_probe: bool = may_change_on_resume(True)
    """Every step's rollouts are proven to come from the actor's weights: the engine scores a fixed probe (the first 32
    tokens of the first training prompt) inside each generation call, the actor scored it when the engine got its
    weights (setup, each push): `rollout/weight_probe_abs_diff` (mean over the probe), and a difference above the
    tolerance (3 x the largest difference of the run's first 3 probes, at least a floor tied to the compute dtype, within its bound) stops the run before the step's update, saving the last completed step (exit 3)
    (grpo_lib/rollout/weight_probe.py). One actor forward of 32 tokens and one more request in the generation batch per step."""
    project_name: str = may_change_on_resume("grpo")
    """Project of the run in wandb; with experiment_name, the run's name in TensorBoard (text `run/name`)."""
    experiment_name: str = may_change_on_resume("run")
    """Name of the run in wandb and TensorBoard."""
    n_gpus_per_node: int | None = may_change_on_resume(None)
    """verl launch key: processes per machine. When given, n_gpus_per_node x nnodes must equal the launched process
    count (checked; exit 2). None: taken from the launch. --print-plan plans for this many processes."""
    nnodes: int | None = may_change_on_resume(None)
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
    ref: RefConfig = may_change_on_resume(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    ignored: dict[str, str] = field(default_factory=dict, metadata={"runtime": True, "resume_may_change": True})
    """Runtime value, not a key: verl keys accepted without effect (key=value -> reason), printed once at start; may
    change on resume."""


# --------------------------------------------------------------------------------------------- the key tree


class ConfigError(ValueError):
    """All problems found in a config, one per line, each naming its key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def resume_may_change_keys(cls: type = Config, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys declared `may_change_on_resume`, in field order; a marked section or mapping gives a prefix
    ending in "." (every key under it). Example: (..., "trainer.nnodes", "ref.", "ignored.")."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if f.metadata.get("resume_may_change"):
            whole = dataclasses.is_dataclass(hint) or hint is dict or typing.get_origin(hint) is dict
            keys.append(key + "." if whole else key)
        elif dataclasses.is_dataclass(hint):
            keys += resume_may_change_keys(hint, key + ".")
    return tuple(keys)


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
