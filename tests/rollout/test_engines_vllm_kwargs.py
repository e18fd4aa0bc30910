"""What reaches vllm.LLM(...): rollout.engine_kwargs (and verl's engine_kwargs.vllm.* spelling) unchanged, the
scheduling keys rollout.max_num_batched_tokens / enable_chunked_prefill, verl's disable_custom_all_reduce default,
and the keys the trainer sets itself refused naming both. A recording factory stands in for vllm.LLM (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_lib.config import ConfigError, load_config
from grpo_lib.rollout.engines.vllm import VLLMEngine
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "tiny_cpu.yaml"


class RecordingLLM:
    """vllm.LLM's constructor, recorded: `calls` holds the keyword arguments of every construction."""

    calls: list[dict] = []

    def __init__(self, **kwargs):
        type(self).calls.append(kwargs)

    def get_tokenizer(self):
        return SimpleNamespace(pad_token_id=0, eos_token_id=1)


def llm_kwargs(*overrides: str, on_cpu: bool = False, world_size: int = 1) -> dict:
    """The kwargs VLLMEngine.from_config passes to LLM(...) for tiny_cpu.yaml + `overrides`."""
    cfg = load_config(RECIPE, list(overrides), world_size=world_size)
    RecordingLLM.calls = []
    VLLMEngine(model_path=cfg.model.path, cfg=cfg.rollout, max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
               seed=cfg.trainer.seed, on_cpu=on_cpu, world_size=world_size, llm_factory=RecordingLLM)
    (kwargs,) = RecordingLLM.calls
    return kwargs


def test_verl_engine_kwargs_reach_llm_unchanged_on_gpu():
    kwargs = llm_kwargs(
        "actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=32",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes=[1,8,32]",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend=FLASH_ATTN",
        "actor_rollout_ref.rollout.max_num_batched_tokens=10240", "actor_rollout_ref.rollout.enable_chunked_prefill=False")
    assert kwargs["block_size"] == 32 and kwargs["attention_backend"] == "FLASH_ATTN"
    assert kwargs["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 32]}, "a dotted leaf is vLLM's nested mapping"
    assert kwargs["max_num_batched_tokens"] == 10240 and kwargs["enable_chunked_prefill"] is False
    assert kwargs["disable_custom_all_reduce"] is True, "verl's default"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["seed"] == 1  # the trainer's own stay


def test_defaults_follow_verl_and_user_may_replace_disable_custom_all_reduce():
    kwargs = llm_kwargs()
    assert (kwargs["enable_chunked_prefill"], kwargs["max_num_batched_tokens"], kwargs["disable_custom_all_reduce"]) == (True, 8192, True)
    assert llm_kwargs("rollout.engine_kwargs.disable_custom_all_reduce=false")["disable_custom_all_reduce"] is False


def test_recipe_mapping_spelling(tmp_path):
    """verl's YAML shape (engine_kwargs: {vllm: {...}, sglang: {}}) in a recipe: vLLM's part arrives, SGLang's is ignored."""
    recipe = tmp_path / "r.yaml"
    text = RECIPE.read_text()
    assert "\nrollout:\n" in text
    recipe.write_text(text.replace("\nrollout:\n", "\nrollout:\n  engine_kwargs:\n    vllm:\n      block_size: 16\n"
                                   "      kv_cache_dtype: auto\n    sglang: {}\n", 1))
    cfg = load_config(recipe, [])
    assert cfg.rollout.engine_kwargs == {"block_size": 16, "kv_cache_dtype": "auto"}
    assert any(k.startswith("rollout.engine_kwargs.sglang") for k in cfg.ignored), cfg.ignored


def test_cpu_never_chunks_and_fits_a_whole_sequence():
    kwargs = llm_kwargs("rollout.max_num_batched_tokens=16", "data.max_prompt_length=64", "data.max_response_length=32", on_cpu=True)
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 96


@pytest.mark.parametrize("override, own", [
    ("rollout.engine_kwargs.max_num_seqs=3", "rollout.max_num_seqs"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.seed=3", "trainer.seed"),
    ("rollout.engine_kwargs.max_num_batched_tokens=64", "rollout.max_num_batched_tokens"),
    ("rollout.engine_kwargs.logprobs_mode=raw_logprobs", "processed_logprobs"),
])
def test_a_key_the_trainer_sets_is_refused_naming_both(override, own):
    """Decision: refused (exit 2) rather than user-wins. A value set in two places is refused everywhere else in the config,
    and the trainer's own keywords carry its correctness (processed logprobs are what the trainer compares)."""
    key = override.split("=")[0].replace("actor_rollout_ref.", "").replace(".vllm.", ".")
    with pytest.raises(ConfigError) as error:
        load_config(RECIPE, [override])
    assert key in str(error.value) and own in str(error.value), str(error.value)


def test_engine_refuses_a_clash_without_validation():
    cfg = load_config(RECIPE, [])
    cfg.rollout.engine_kwargs = {"max_model_len": 8}  # as if built by hand, past validation
    with pytest.raises(ValueError, match="max_model_len"):
        VLLMEngine(model_path="m", cfg=cfg.rollout, max_model_len=64, seed=0, on_cpu=False, world_size=1, llm_factory=RecordingLLM)


def test_budget_below_one_sequence_without_chunking_and_hf_engine_kwargs_refused():
    with pytest.raises(ConfigError) as error:
        load_config(RECIPE, ["rollout.enable_chunked_prefill=false", "rollout.max_num_batched_tokens=8"])
    assert "rollout.max_num_batched_tokens=8 is smaller than one sequence" in str(error.value)
    with pytest.raises(ConfigError) as error:
        load_config(RECIPE, ["rollout.name=hf", "rollout.engine_kwargs.swap_space=4"])
    assert "rollout.name='hf'" in str(error.value)


def test_hf_compile_key_refused_for_vllm_and_accepted_for_hf():
    with pytest.raises(ConfigError) as error:
        load_config(RECIPE, ["rollout.hf_use_torch_compile=true"])
    assert "rollout.hf_use_torch_compile=true" in str(error.value) and "rollout.name='vllm'" in str(error.value)
    assert load_config(RECIPE, ["rollout.name=hf", "rollout.hf_use_torch_compile=true"]).rollout.hf_use_torch_compile


# ------------------------------------------------------------------ issue 31: names the installed vLLM takes
def test_an_unknown_engine_keyword_is_named_with_the_closest_ones():
    """vLLM refused it with `EngineArgs.__init__() got an unexpected keyword` only once the data and the reward workers
    were up; now the installed vLLM's names are read before anything loads (train_grpo.py: exit 2)."""
    from grpo_lib.rollout.engines import settings_problems

    cfg = load_config(RECIPE, ["rollout.engine_kwargs.kv_cache_dtyp=fp8", "rollout.engine_kwargs.no_such_vllm_flag=3",
                               "rollout.engine_kwargs.block_size=16", "rollout.engine_kwargs.compilation_config.level=3"])
    problems = settings_problems(cfg)
    assert len(problems) == 2, problems
    typo, unknown = sorted(problems)
    assert typo.startswith("rollout.engine_kwargs.kv_cache_dtyp: not an argument of the installed vLLM") and \
        "did you mean 'kv_cache_dtype'" in typo, typo
    assert unknown.startswith("rollout.engine_kwargs.no_such_vllm_flag: not an argument") and "drop it" in unknown, unknown
    assert settings_problems(load_config(RECIPE, ["rollout.engine_kwargs.block_size=16"])) == []
    assert settings_problems(load_config(RECIPE, ["rollout.name=hf"])) == [], "another engine: nothing of vLLM's to check"


def test_engine_argument_names_come_from_vllms_source_without_importing_it():
    """Importing vLLM takes seconds (torch, its platform probes); its names are read from its source with ast."""
    import subprocess
    import sys

    code = ("import sys; from grpo_lib.rollout.engines.vllm_settings import engine_argument_names; names = engine_argument_names(); "
            "print(len(names), 'kv_cache_dtype' in names, 'chat_template' in names, 'vllm' in sys.modules, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    count, *flags = proc.stdout.split()
    assert int(count) > 100 and flags == ["True", "True", "False", "False"], proc.stdout + proc.stderr[-2000:]


@pytest.mark.slow
def test_engine_argument_names_are_what_vllm_takes():
    """The names read from the source are exactly EngineArgs' fields and LLM.__init__'s parameters (LLM passes its
    **kwargs on to EngineArgs), as the imported classes say (importing vLLM: ~13 s here, hence slow)."""
    import dataclasses
    import inspect

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.llm import LLM

    from grpo_lib.rollout.engines.vllm_settings import engine_argument_names

    expected = {f.name for f in dataclasses.fields(EngineArgs)} | \
        (set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"})
    assert engine_argument_names() == expected


# ------------------------------------------------------------------ issue 29: the resolved config is never written
def test_cpu_kv_cache_size_is_handed_to_the_engine_and_cfg_stays_as_resolved(tiny_model_dir):
    """On CPU the KV cache is sized for the run's batch (perf.resolve_kv_cache_bytes) by VLLMEngine.from_config and passed
    to LLM(...) as a value; rollout.kv_cache_memory_bytes stays None (setup used to write the size back into cfg)."""
    import copy

    from grpo_lib.core import perf

    cfg = load_config(RECIPE, [f"model.path={tiny_model_dir}", "rollout.kv_cache_memory_bytes=null"])  # the recipe sets one
    before = copy.deepcopy(cfg)
    RecordingLLM.calls = []
    engine = VLLMEngine.from_config(cfg, on_cpu=True, world_size=1, llm_factory=RecordingLLM)
    (kwargs,) = RecordingLLM.calls
    expected = perf.resolve_kv_cache_bytes(cfg, world_size=1, engine_dtype="float32")
    assert expected > 0 and kwargs["kv_cache_memory_bytes"] == expected == engine.kv_cache_bytes
    assert cfg == before and cfg.rollout.kv_cache_memory_bytes is None, "from_config wrote to the config"
    # an explicit size wins, on GPU too (there None leaves vLLM to size it from gpu_memory_utilization)
    RecordingLLM.calls = []
    VLLMEngine.from_config(load_config(RECIPE, [f"model.path={tiny_model_dir}", "rollout.kv_cache_memory_bytes=12345"]),
                           on_cpu=True, world_size=1, llm_factory=RecordingLLM)
    VLLMEngine.from_config(cfg, on_cpu=False, world_size=1, llm_factory=RecordingLLM)
    assert RecordingLLM.calls[0]["kv_cache_memory_bytes"] == 12345 and "kv_cache_memory_bytes" not in RecordingLLM.calls[1]
