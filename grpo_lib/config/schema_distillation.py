"""The `distillation:` section of the config (verl's key names): on-policy distillation from a teacher model.

A teacher scores the student's own rollouts token by token; the student is trained towards it, alone or beside the
GRPO loss (docs/ALGORITHMS.md, "On-policy distillation"). Defaults are those of verl's
`verl/trainer/config/distillation/distillation.yaml` (what a verl run uses; its dataclass defaults differ).

One teacher, `teacher_models.teacher_model`: verl's multi-teacher routing (more entries, `teacher_key`) is not
implemented. verl serves the teacher from its own GPU pool; here it is sharded with FSDP2 over the trainer's
processes like the KL reference (grpo_lib/model/teacher.py), so verl's pool and inference-server keys are accepted and
ignored (grpo_lib/config/verl_keys.py says why).

Field docstrings feed the config reference (docs/REFERENCE.md), as in `grpo_lib.config.schema` (which includes this section).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TeacherModelConfig:
    model_path: str | None = None
    """The teacher's Hugging Face folder or hub name (required with distillation.enabled). It must share model.path's
    tokenizer (checked at start, before any weight loads). Stored in model.dtype like the reference, computing in
    actor.fsdp_config.param_dtype, its shards in CPU memory between uses with ref.fsdp_config.param_offload, and scored
    by the reference pass's micro-batch keys (ref.log_prob_*) at temperature 1 (verl's teacher logprobs)."""


@dataclass
class TeacherModelsConfig:
    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)


@dataclass
class DistillationLossConfig:
    loss_mode: str = "k3"
    """Per-token divergence: a sampled-token estimator of KL(student || teacher) (k1 / kl, abs, k2 / mse, k3 /
    low_var_kl: actor.kl_loss_type's estimators) or forward_kl_topk, sum over the teacher's top-k tokens of
    p_teacher x (log p_teacher - log p_student)."""
    topk: int = 32
    """k of forward_kl_topk: the teacher's k most likely tokens at each response position (ignored by the estimators)."""
    use_task_rewards: bool = True
    """true: loss = the GRPO loss (policy, KL and entropy terms) + distillation_loss_coef x the distillation term;
    false: the distillation term alone (rewards are still computed and logged, they train nothing)."""
    distillation_loss_coef: float = 1.0
    """Weight of the distillation term next to the GRPO loss (only with use_task_rewards; alone it is 1)."""
    loss_max_clamp: float | None = None
    """Clamp each token's divergence to [-this, this] before it trains (k1 can be negative). null: no clamp."""
    log_prob_min_clamp: float | None = None
    """forward_kl_topk: clamp the teacher's and the student's top-k log-probabilities from below to this before the
    divergence (as verl; the sampled-token estimators do not read it). null: no clamp."""
    use_policy_gradient: bool = False
    """true: on-policy distillation's policy gradient, the negative per-token divergence (detached) is the advantage of
    a PPO clipped loss (clip_ratio_low / high below); false: the divergence is backpropagated directly (GKD). k1 / kl
    need true (their gradient does not depend on the teacher)."""
    policy_loss_mode: str = "vanilla"
    """The policy loss of use_policy_gradient; only vanilla (as verl)."""
    clip_ratio: float = 0.2
    """PPO clip epsilon of use_policy_gradient; default of clip_ratio_low / clip_ratio_high."""
    clip_ratio_low: float | None = 0.2
    """Lower clip epsilon of use_policy_gradient (ratio >= 1 - low). null: clip_ratio."""
    clip_ratio_high: float | None = 0.2
    """Upper clip epsilon of use_policy_gradient (ratio <= 1 + high). null: clip_ratio."""


@dataclass
class DistillationConfig:
    enabled: bool = False
    """On-policy distillation from distillation.teacher_models.teacher_model (verl's distillation.enabled)."""
    teacher_models: TeacherModelsConfig = field(default_factory=TeacherModelsConfig)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
