"""Rewards: built-in scores by data_source, a format reward, custom reward files, and the per-step scorer.

    from grpo_lib.rewards import RewardScorer, compute_score, format_score, load_custom_reward
    compute_score("openai/gsm8k", "... #### 72", "72")  # -> 1.0

Modules: `gsm8k` (`####` answers), `math` (`\\boxed{}` + math-verify), `registry` (dispatch by data_source),
`custom` (verl-style reward files), `pool` (worker processes with timeouts), `scorer` (weights, metrics).
May import: core (the registries' names, a worker that dies with its parent).
"""

from grpo_lib.rewards.custom import load_custom_reward
from grpo_lib.rewards.registry import MATH_SOURCES, compute_score, format_score, registered_sources
from grpo_lib.rewards.scorer import FUNCTION_NAMES, RewardOutput, RewardScorer

__all__ = [
    "FUNCTION_NAMES",
    "MATH_SOURCES",
    "RewardOutput",
    "RewardScorer",
    "compute_score",
    "format_score",
    "load_custom_reward",
    "registered_sources",
]
