"""Typed configuration: the recipe's dataclasses, their checks and loading, in three layers.

    from grpo_lib.config import load_config, ConfigError
    cfg = load_config("recipes/tiny_cpu.yaml", ["actor.lr=1e-6"], world_size=1)   # or raises ConfigError (exit 2)

    schema.py     one dataclass per recipe section, field docstrings (units), field metadata (reference.py: the config reference)
    checks.py     derived defaults (resolved once), validation (every problem at once), installation checks
    load.py       recipe YAML + dotted overrides + verl's aliases (verl_keys.py) -> Config, then checks.validate
    verl_keys.py  verl's spellings: aliases, keys accepted and ignored, keys refused (data, read by load.py)

Imports go one way only, schema <- checks <- load, and no submodule imports this package's names: this file only
re-exports them. Nothing here imports torch, so a bad config exits before anything heavy loads (DESIGN invariant 4).
May import: core, and rollout's torch-free engine settings (`rollout.engines.settings`: each engine checks its own keys).
"""

from grpo_lib.config.checks import (engine_logprobs_needed, environment_problems, mini_batch_sizes, resolve_defaults,
                                    validate)
from grpo_lib.config.load import launch_world_size, load_config, parse_overrides, read_raw
from grpo_lib.config.reference import reference_markdown
from grpo_lib.config.schema import (ActorConfig, ActorFSDPConfig, AlgorithmConfig, Config, ConfigError, CustomRewardConfig,
                                    DataConfig, FilterGroupsConfig, Gsm8kRewardConfig, KLCtrlConfig, ModelConfig,
                                    PolicyLossConfig, RefConfig, RefFSDPConfig, RewardConfig, RolloutConfig,
                                    RolloutCorrectionConfig, TrainerConfig, ValKwargsConfig)

__all__ = [
    "ActorConfig", "ActorFSDPConfig", "AlgorithmConfig", "Config", "ConfigError", "CustomRewardConfig", "DataConfig",
    "FilterGroupsConfig", "Gsm8kRewardConfig", "KLCtrlConfig", "ModelConfig", "PolicyLossConfig", "RefConfig",
    "RefFSDPConfig", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "TrainerConfig", "ValKwargsConfig",
    "engine_logprobs_needed", "environment_problems", "launch_world_size", "load_config", "mini_batch_sizes",
    "parse_overrides", "read_raw", "reference_markdown", "resolve_defaults", "validate",
]
