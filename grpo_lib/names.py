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
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                   "seq-mean-token-sum-norm")
"""actor.loss_agg_mode."""
POLICY_LOSS_MODES: tuple[str, ...] = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv",
                                      "dppo_kl", "gpg", "dro")
"""actor.policy_loss.loss_mode (grpo_lib/policy_losses.py)."""
FORCED_AGG: dict[str, str] = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
"""Policy losses whose own aggregation verl fixes, whatever actor.loss_agg_mode says (which still aggregates the KL
and entropy terms): GSPO and SAPO average per sequence; geo_mean's loss is per sequence."""
REFUSED_POLICY_LOSS_MODES: dict[str, str] = {
    "bypass_mode": ("verl's bypass_mode (old logprobs taken from the rollout engine, PPO-clip or REINFORCE on them, with "
                    "rollout-correction rejection) is not implemented: use another loss_mode (vanilla, cispo, ...) with "
                    "algorithm.rollout_correction.mode=token|sequence (truncated IS on the engine/trainer mismatch)"),
}
"""verl loss modes refused with the reason (config validation)."""
ROLLOUT_IS_MODES: tuple[str, ...] = ("none", "token", "sequence")
"""algorithm.rollout_correction.mode."""
ENGINE_NAMES: tuple[str, ...] = ("vllm", "hf")
"""rollout.name (grpo_lib/engines/__init__.py maps each to its class)."""
REWARD_FUNCTIONS: tuple[str, ...] = ("accuracy", "format", "custom")
"""reward.functions[].name (grpo_lib/rewards/scorer.py combines them)."""
