"""The supported names of the algorithm and engine registries, torch-free, so config validation can check them without torch.

`grpo_lib.algorithms` holds the functions behind these names and asserts at import that its registries match
these tuples exactly (they cannot drift), as `grpo_lib.rollout.engines` does for ENGINE_NAMES; `grpo_lib.config.checks` refuses any other name with the list.
"""

ADV_ESTIMATOR_ALIASES: dict[str, str] = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
"""verl's other spellings of an estimator here -> its name here (verl's vectorized twins of the same formula)."""
ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "grpo_passk", "opo", "gpg", "reinforce_plus_plus",
                                   "reinforce_plus_plus_baseline", "remax") + tuple(ADV_ESTIMATOR_ALIASES)
"""algorithm.adv_estimator (grpo_lib/algorithms/advantages.py): the estimators, then the aliases."""
REFUSED_ADV_ESTIMATORS: dict[str, str] = {
    "gae": "GAE needs a value model (a critic), which this trainer does not train; use grpo, rloo or reinforce_plus_plus",
    "optimal_token_baseline": "verl's optimal token baseline is not implemented here; use opo (its per-group optimal baseline) or grpo",
    "tir_optimal_token_baseline": "verl's multi-turn optimal token baseline is not implemented here; use opo or grpo",
}
"""verl's other estimator names, refused with the reason."""
GROUP_ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "grpo_passk", "opo", "gpg", "reinforce_plus_plus_baseline",
                                         "grpo_vectorized", "rloo_vectorized")
"""Estimators whose baseline is the prompt's group (they need rollout.n >= 2)."""
ADV_ESTIMATOR_KEYS: dict[str, tuple[str, ...]] = {"grpo": ("norm_adv_by_std_in_grpo",), "grpo_vectorized": ("norm_adv_by_std_in_grpo",),
                                                 "grpo_passk": ("norm_adv_by_std_in_grpo",), "reinforce_plus_plus": ("gamma",)}
"""The algorithm.* keys an estimator reads besides its name (the plan prints their values)."""
GREEDY_BASELINE_ESTIMATORS: tuple[str, ...] = ("remax",)
"""Estimators whose baseline is the score of one more, greedy, response per prompt (the trainer generates it)."""
KL_BASE_TYPES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""KL estimators (k1, abs, k2, k3 and their verl spellings)."""
KL_TYPES: tuple[str, ...] = KL_BASE_TYPES + tuple(f"{name}+" for name in KL_BASE_TYPES)
"""actor.kl_loss_type and algorithm.kl_penalty: the estimators plus their straight-through '+' forms."""
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                   "seq-mean-token-sum-norm")
"""actor.loss_agg_mode."""
POLICY_LOSS_MODES: tuple[str, ...] = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv",
                                      "dppo_kl", "gpg", "dro")
"""actor.policy_loss.loss_mode (grpo_lib/algorithms/policy_losses.py)."""
# gspo follows verl 0.9.1, whose compute_policy_loss_gspo aggregates with the configured loss_agg_mode (seq-mean-token-mean
# is only its default argument; verl before 0.9.1 forced it); sapo and geo_mean are forced there, and here
FORCED_AGG: dict[str, str] = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
"""Policy losses whose own aggregation verl fixes, whatever actor.loss_agg_mode says (which still aggregates the KL
and entropy terms): SAPO averages per sequence; geo_mean's loss is per sequence."""
REFUSED_POLICY_LOSS_MODES: dict[str, str] = {
    "bypass_mode": ("verl's bypass_mode (old logprobs taken from the rollout engine, PPO-clip or REINFORCE on them, with "
                    "rollout-correction rejection) is not implemented: use another loss_mode (vanilla, cispo, ...) with "
                    "algorithm.rollout_correction.mode=token|sequence (truncated IS on the engine/trainer mismatch)"),
}
"""verl loss modes refused with the reason (config validation)."""
ROLLOUT_IS_MODES: tuple[str, ...] = ("none", "token", "sequence")
"""algorithm.rollout_correction.mode."""
ENGINE_NAMES: tuple[str, ...] = ("vllm", "hf")
"""rollout.name (grpo_lib/rollout/engines/__init__.py maps each to its class)."""
JUDGE_TEMPLATE_TOKENS = 1024
"""The judge engine's context beyond prompt + response + its answer: room for the template (grpo_lib/rollout/judge.py's
engine, the config's check of the judge's max_position_embeddings)."""
MODEL_REWARD_FUNCTIONS: tuple[str, ...] = ("reward_model", "judge")
"""reward.functions[].name of the learned scorers (reward_model:, judge:), scored in the trainer's processes, not by the
rule workers (grpo_lib/trainer/step.py adds them)."""
REWARD_FUNCTIONS: tuple[str, ...] = ("accuracy", "format", "custom") + MODEL_REWARD_FUNCTIONS
"""reward.functions[].name (grpo_lib/rewards/scorer.py combines the rules; the models join in grpo_lib/trainer/step.py)."""
DISTILLATION_LOSS_MODES: tuple[str, ...] = KL_BASE_TYPES + ("forward_kl_topk",)
"""distillation.distillation_loss.loss_mode (grpo_lib/algorithms/distillation.py): the sampled-token KL estimators and the teacher's
top-k forward KL (verl's registered names)."""
DISTILLATION_DIRECT_REFUSED: tuple[str, ...] = ("k1", "kl")
"""loss modes refused with use_policy_gradient=false: their gradient does not depend on the teacher (verl refuses k1)."""
