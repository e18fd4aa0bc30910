"""Each engine's settings, by `rollout.name`: the torch-free half of the engine registry (`grpo_lib/rollout/engines/__init__.py`
holds the classes). Every engine module `grpo_lib/rollout/engines/<name>_settings.py` owns the rules of its own rollout.* keys
and what it asks of the installation, and has three functions:

    key_problems(cfg)                 its keys' rules, when it is the run's engine (config validation, exit 2 at load)
    unused_key_problems(cfg)          its keys set while another engine runs (they would be ignored without a word)
    library_problems(cfg)             its settings against the installed library (train_grpo.py, with the other
                                      installation checks; --print-plan notes them)

Config validation (`grpo_lib/config/checks.py`) calls `key_problems` below for the engine-specific rules and keeps
the engine-independent ones (value ranges, the tensor-parallel size dividing the process count).
"""

from __future__ import annotations

from grpo_lib.core.names import ENGINE_NAMES
from grpo_lib.rollout.engines import hf_settings, vllm_settings

ENGINE_SETTINGS = {"vllm": vllm_settings, "hf": hf_settings}
assert tuple(ENGINE_SETTINGS) == ENGINE_NAMES, f"grpo_lib/core/names.py ENGINE_NAMES {ENGINE_NAMES} != {tuple(ENGINE_SETTINGS)}"


def key_problems(cfg) -> list[str]:
    """The run's engine's rules of its own keys, then every other engine's keys that are set; [] for an unknown
    rollout.name (validation names it). Example: rollout.name=hf with engine_kwargs {"swap_space": 4} -> ["rollout.
    engine_kwargs={'swap_space': 4} are vLLM's LLM(...) settings, but rollout.name='hf': ..."]."""
    name = cfg.rollout.name
    if name not in ENGINE_SETTINGS:
        return []
    p = ENGINE_SETTINGS[name].key_problems(cfg)
    for other, module in ENGINE_SETTINGS.items():
        if other != name:
            p += module.unused_key_problems(cfg)
    return p


def can_abort(name: str) -> bool:
    """Whether the engine `name` can stop a generate call midway and return its unfinished responses as far as they got
    (`generate(stop=...)`, which rollout.partial_rollout needs): each settings module's CAN_ABORT."""
    module = ENGINE_SETTINGS.get(name)
    return bool(getattr(module, "CAN_ABORT", False))


def library_problems(cfg) -> list[str]:
    """The run's engine's settings against its installed library, one problem per line (exit 2 at start)."""
    module = ENGINE_SETTINGS.get(cfg.rollout.name)
    return [] if module is None else module.library_problems(cfg)
