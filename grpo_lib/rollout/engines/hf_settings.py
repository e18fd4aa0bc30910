"""What `rollout.name: hf` asks of the config, checked at load with the rest of validation; torch-free (the engine
itself, `grpo_lib/rollout/engines/hf.py`, imports torch and transformers; transformers' version is the project-wide check of
`config.checks.environment_problems`, the actor needs it whatever the engine).

    key_problems         the rules of the hf engine's own rollout.* keys (no tensor parallelism)
    unused_key_problems  its keys (rollout.hf_use_torch_compile) set while another engine runs
    library_problems     nothing beyond the actor's own transformers check
"""

from __future__ import annotations

CAN_ABORT = True  # generate(stop=...) returns unfinished responses as far as they got (its own decode loop stops between steps)


def key_problems(cfg) -> list[str]:
    """The hf engine's rules, with rollout.name=hf: each process generates alone, so no tensor parallelism.

    Example: rollout.tensor_model_parallel_size=2 -> ["rollout.name=hf with rollout.tensor_model_parallel_size=2: ..."].
    """
    tp = cfg.rollout.tensor_model_parallel_size
    if tp != 1:
        return [f"rollout.name=hf with rollout.tensor_model_parallel_size={tp}: the transformers engine has no tensor "
                "parallelism; set rollout.tensor_model_parallel_size=1 or rollout.name=vllm"]
    return []


def unused_key_problems(cfg) -> list[str]:
    """The hf engine's keys set while rollout.name names another engine, which would ignore them without a word."""
    if cfg.rollout.hf_use_torch_compile:
        return [f"rollout.hf_use_torch_compile=true compiles the transformers engine, but rollout.name={cfg.rollout.name!r}: "
                "drop it (vLLM compiles unless rollout.enforce_eager) or use rollout.name=hf"]
    return []


def library_problems(cfg) -> list[str]:
    """Nothing of the hf engine's own: transformers is checked for every run (config.checks.environment_problems)."""
    return []
