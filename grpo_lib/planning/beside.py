"""The models beside the policy in the memory plan: the distillation teacher's and the reward model's sizes from their
config.json, and the set-up checks that refuse a teacher, a reward model or a judge engine that does not fit the GPU
beside the policy (their terms are `planning.memory`'s `teacher_terms` / `reward_model_terms` / judge engine share).
Torch-free, like the plan."""

from __future__ import annotations

from grpo_lib.config import Config
from grpo_lib.planning.memory import GIB, ModelSizes, find_model_config, memory_plan, model_sizes


def reward_model_sizes(cfg: Config, explicit: str | None = None) -> tuple[ModelSizes | None, str]:
    """The reward model's sizes from its config.json ((None, why) when it is off or the file is not reachable)."""
    if not cfg.reward_model.enable:
        return None, "reward model off"
    config_json, where = find_model_config(cfg.reward_model.model.path, explicit)
    return (model_sizes(config_json) if config_json is not None else None), where


def scorer_fit_problem(cfg: Config, *, world_size: int, gpu_bytes: float | None) -> str | None:
    """At setup, before any weight loads: why the reward model and / or the judge engine do not fit this GPU beside the
    policy (the plan's peak with them, and the teacher with distillation, above the GPU), or None (it fits, no GPU, no
    config.json to plan from)."""
    if gpu_bytes is None or not (cfg.reward_model.enable or cfg.judge.enable):
        return None
    policy_json, _ = find_model_config(cfg.model.path, None)
    rm, where = reward_model_sizes(cfg)
    teacher, _ = teacher_sizes(cfg)
    if policy_json is None or (cfg.reward_model.enable and rm is None):
        return None
    plan = memory_plan(cfg, model_sizes(policy_json), world_size=world_size, gpu_bytes=gpu_bytes, reward_model=rm, teacher=teacher)
    if plan["peak"] <= gpu_bytes:
        return None
    what = ([f"reward_model.model.path={cfg.reward_model.model.path!r} ({rm.params / 1e9:.2f}B parameters, {where}; shards "
             f"{plan['reward model'] / GIB:.1f} GiB)"] if cfg.reward_model.enable else []) + \
        ([f"judge.gpu_memory_utilization={cfg.judge.gpu_memory_utilization} ({plan['judge engine share'] / GIB:.1f} GiB, "
          "resident)"] if cfg.judge.enable else [])
    return (f"{' and '.join(what)} do not fit beside the policy: the memory plan's peak is {plan['peak'] / GIB:.1f} GiB per "
            f"GPU of {gpu_bytes / GIB:.0f} GiB; keep the reward model's shards on the host "
            "(reward_model.model.fsdp_config.param_offload=true), lower reward_model.micro_batch_size_per_gpu, "
            "judge.gpu_memory_utilization or rollout.gpu_memory_utilization, or launch more processes (`--print-plan` shows "
            "every term)")


def teacher_sizes(cfg: Config, explicit: str | None = None) -> tuple[ModelSizes | None, str]:
    """The distillation teacher's sizes from its config.json ((None, why) without distillation or without the file)."""
    if not cfg.distillation.enabled:
        return None, "distillation off"
    config_json, where = find_model_config(cfg.distillation.teacher_models.teacher_model.model_path, explicit)
    return (model_sizes(config_json) if config_json is not None else None), where


def teacher_fit_problem(cfg: Config, *, world_size: int, gpu_bytes: float | None) -> str | None:
    """At setup, before any weight loads: why the teacher does not fit this GPU (its memory plan's peak, with the
    teacher, above the GPU), or None (it fits, no GPU to fit, distillation off, no config.json to plan from)."""
    if gpu_bytes is None or not cfg.distillation.enabled:
        return None
    student_json, _ = find_model_config(cfg.model.path, None)
    teacher, where = teacher_sizes(cfg)
    if student_json is None or teacher is None:
        return None
    plan = memory_plan(cfg, model_sizes(student_json), world_size=world_size, gpu_bytes=gpu_bytes, teacher=teacher)
    if plan["peak"] <= gpu_bytes:
        return None
    return (f"distillation.teacher_models.teacher_model.model_path={cfg.distillation.teacher_models.teacher_model.model_path!r}"
            f" ({teacher.params / 1e9:.2f}B parameters, {where}) does not fit: the memory plan's peak is "
            f"{plan['peak'] / GIB:.1f} GiB per GPU of {gpu_bytes / GIB:.0f} GiB (at the {plan['training phase at']}, teacher "
            f"shards {plan['teacher'] / GIB:.1f} GiB); keep its shards on the host (ref.fsdp_config.param_offload=true), "
            "lower ref.log_prob_max_token_len_per_gpu or launch more processes (`--print-plan` shows every term)")
