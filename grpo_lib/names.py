"""The supported names of the algorithm and engine registries, torch-free, so config validation can check them without torch.

`grpo_lib.algorithms` holds the functions behind these names and asserts at import that its registries match
these tuples exactly (they cannot drift), as `grpo_lib.engines` does for ENGINE_NAMES; `grpo_lib.config.checks` refuses any other name with the list.
"""

ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
"""algorithm.adv_estimator."""
KL_BASE_TYPES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""KL estimators (k1, abs, k2, k3 and their verl spellings)."""
KL_TYPES: tuple[str, ...] = KL_BASE_TYPES + tuple(f"{name}+" for name in KL_BASE_TYPES)
"""actor.kl_loss_type and algorithm.kl_penalty: the estimators plus their straight-through '+' forms."""
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""actor.loss_agg_mode."""
POLICY_LOSS_MODES: tuple[str, ...] = ("vanilla", "gspo")
"""actor.policy_loss.loss_mode."""
ROLLOUT_IS_MODES: tuple[str, ...] = ("none", "token", "sequence")
"""algorithm.rollout_correction.mode."""
ENGINE_NAMES: tuple[str, ...] = ("vllm", "hf")
"""rollout.name (grpo_lib/engines/__init__.py maps each to its class)."""
REWARD_FUNCTIONS: tuple[str, ...] = ("accuracy", "format", "custom")
"""reward.functions[].name (grpo_lib/rewards/scorer.py combines them)."""
DISTILLATION_LOSS_MODES: tuple[str, ...] = KL_BASE_TYPES + ("forward_kl_topk",)
"""distillation.distillation_loss.loss_mode (grpo_lib/distillation.py): the sampled-token KL estimators and the teacher's
top-k forward KL (verl's registered names)."""
DISTILLATION_DIRECT_REFUSED: tuple[str, ...] = ("k1", "kl")
"""loss modes refused with use_policy_gradient=false: their gradient does not depend on the teacher (verl refuses k1)."""
