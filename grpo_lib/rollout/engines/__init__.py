"""The generation engines by `rollout.name`: a lazy name -> "module:Class" table, like verl's rollout registry.

Importing this package imports neither torch nor an engine library, so config validation reads `ENGINE_NAMES`
without them; `engine_class` imports only the module of the engine a run uses.

    vllm  grpo_lib/rollout/engines/vllm.py  VLLMEngine: vLLM in the training process (the default)
    hf    grpo_lib/rollout/engines/hf.py    HFEngine: a transformers sampling loop, for machines without vLLM

Each registered class satisfies `RolloutEngine` (`grpo_lib/rollout/engines/base.py`: the union of `Generator`, `WeightSink` and
`ColocatedMemory`, with the lifecycle both engines share) and has `from_config(cfg, *, on_cpu, world_size)`, the
constructor `build_engine` calls; it resolves what it derives from the config (vLLM's CPU KV-cache size) into values
of its own and never writes to `cfg`. Each engine's settings (the rules of its own rollout.* keys, its environment,
its library) are its `<name>_settings.py`, torch-free, dispatched by `grpo_lib/rollout/engines/settings.py`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from grpo_lib.core.names import ENGINE_NAMES
from grpo_lib.rollout.engines import settings as engine_settings

if TYPE_CHECKING:
    from grpo_lib.rollout.engines.base import RolloutEngine

_ENGINES = {
    "vllm": "grpo_lib.rollout.engines.vllm:VLLMEngine",
    "hf": "grpo_lib.rollout.engines.hf:HFEngine",
}
assert tuple(_ENGINES) == ENGINE_NAMES, f"grpo_lib/core/names.py ENGINE_NAMES {ENGINE_NAMES} != the registry {tuple(_ENGINES)}"


def engine_class(name: str) -> type[RolloutEngine]:
    """The class registered as `name`, its module imported now. engine_class("hf") -> grpo_lib.rollout.engines.hf.HFEngine."""
    if name not in _ENGINES:
        raise ValueError(f"unknown engine {name!r}: the registered engines are {list(ENGINE_NAMES)}")
    module, _, class_name = _ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), class_name)


def build_engine(cfg, *, on_cpu: bool, world_size: int) -> RolloutEngine:
    """The engine `cfg.rollout.name` names, started once per process (all ranks together under a launcher)."""
    return engine_class(cfg.rollout.name).from_config(cfg, on_cpu=on_cpu, world_size=world_size)


def settings_problems(cfg) -> list[str]:
    """What the installed engine library says of the run's engine settings, one problem per line (exit 2 at start,
    train_grpo.py, with the other installation checks): for vLLM, installed at all and rollout.engine_kwargs against the
    keyword arguments it takes. Each engine's own module answers (`grpo_lib/rollout/engines/settings.py`: torch-free, vLLM is
    not imported); the rules of its keys that need no library ran with config validation."""
    return engine_settings.library_problems(cfg)
