"""grpo_lib.rollout.engines without an engine: the lifecycle state machine, the registry, the hf sampler's logits processing,
validation sampling and the rollout config checks.

Each test would fail if the behaviour broke: an illegal order must raise (it would hang or re-map memory on a
GPU); an unknown rollout.name is a config error naming the registered engines, found without importing torch.
Seeds and TP shares: tests/core/test_seeds.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from grpo_lib.config import ConfigError, load_config
from grpo_lib.rollout.engines.base import Lifecycle, LifecycleError
from grpo_lib.rollout.engines.hf import process_logits
from grpo_lib.trainer.rounds import val_sampling
from tests.conftest import REPO


# ------------------------------------------------------------------------------------------------ lifecycle
def walk(lifecycle: Lifecycle, names: list[str]) -> None:
    for name in names:
        with lifecycle.transition(name):
            pass


def test_lifecycle_legal_cycle():
    life = Lifecycle(frees_memory=True, discards_weights=False)
    cycle = ["generate", "release", "restore_weights", "push", "reset_prefix_cache", "restore_cache", "generate"]
    walk(life, cycle + cycle[1:])
    assert life.state == "ready"


@pytest.mark.parametrize("names,message", [
    (["release", "generate"], "generate while released"),
    (["release", "restore_weights", "generate"], "generate while weights_only"),  # no generation while partly restored
    (["release", "restore_weights", "restore_all"], "restore_all while weights_only"),  # no full restore after a partial one
    (["release", "restore_cache"], "restore_cache while released"),
    (["release", "push"], "push while released"),
    (["restore_weights"], "restore_weights while ready"),
    (["release", "release"], "release while released"),
])
def test_lifecycle_refuses_illegal_order(names, message):
    life = Lifecycle(frees_memory=False, discards_weights=False)  # checked on CPU too, where the engines move nothing
    with pytest.raises(LifecycleError, match=message):
        walk(life, names)


def test_a_release_that_discards_the_weights_needs_a_push_before_the_cache():
    life = Lifecycle(frees_memory=True, discards_weights=True)  # vLLM's sleep level 2
    walk(life, ["release", "restore_weights"])
    with pytest.raises(LifecycleError, match="release discarded the weights"):
        walk(life, ["restore_cache"])
    walk(life, ["push", "reset_prefix_cache", "restore_cache", "generate"])


# ------------------------------------------------------------------------------------------------ registry
def test_unknown_rollout_name_exits_2_naming_the_registered_engines(capsys):
    """verl spells SGLang rollout.name=sglang; here it is a config error (exit 2) listing the engines there are."""
    import train_grpo

    assert train_grpo.main([str(REPO / "recipes/tiny_cpu.yaml"), "rollout.name=sglang"]) == 2
    err = capsys.readouterr().err
    assert "rollout.name='sglang' is not supported: use one of ['hf', 'vllm']" in err, err


def test_the_registry_imports_without_torch():
    """Config validation reads ENGINE_NAMES: importing the registry must pull in neither torch nor an engine module."""
    code = ("import sys, grpo_lib.rollout.engines as e; names = list(e.ENGINE_NAMES); "
            "heavy = [m for m in ('torch', 'vllm', 'transformers', 'grpo_lib.rollout.engines.base') if m in sys.modules]; "
            "assert not heavy, heavy; print(names)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "['vllm', 'hf']", proc.stdout


def test_every_registered_name_resolves_to_an_engine_class():
    from grpo_lib.rollout.engines import ENGINE_NAMES, engine_class
    from grpo_lib.rollout.engines.base import RolloutEngine

    protocols = [c for c in RolloutEngine.__mro__ if getattr(c, "_is_protocol", False) and c.__module__ == RolloutEngine.__module__]
    methods = sorted({m for c in protocols for m in vars(c) if not m.startswith("_") and callable(getattr(RolloutEngine, m))})
    assert "pop_metrics" in methods and "release" in methods, methods
    for name in ENGINE_NAMES:
        cls = engine_class(name)
        missing = [m for m in methods + ["from_config"] if not callable(getattr(cls, m, None))]
        assert not missing, f"engine {name!r} ({cls.__name__}) lacks {missing}"
    with pytest.raises(ValueError, match=r"unknown engine 'sglang': the registered engines are \['vllm', 'hf'\]"):
        engine_class("sglang")


def test_engine_modules_import_base_never_each_other():
    """No import circle: vllm.py and hf.py build on base.py; base.py knows neither; the registry imports none at load."""
    import ast

    def imported(name: str) -> set[str]:
        tree = ast.parse((REPO / "grpo_lib" / "rollout" / "engines" / f"{name}.py").read_text())
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | \
               {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}

    engines = {"grpo_lib.rollout.engines.base", "grpo_lib.rollout.engines.vllm", "grpo_lib.rollout.engines.hf"}
    assert imported("base") & engines == set()
    assert imported("vllm") & engines == {"grpo_lib.rollout.engines.base"}
    assert imported("hf") & engines == {"grpo_lib.rollout.engines.base"}
    assert imported("__init__") & engines == {"grpo_lib.rollout.engines.base"}  # under TYPE_CHECKING only (the test above)


# ------------------------------------------------------------------------------------------------ sampling
def test_val_kwargs_do_sample_false_is_greedy_whatever_the_temperature(tmp_path):
    base = ["model.path=m", "data.train_files=[a]", "actor.ppo_micro_batch_size_per_gpu=1", "rollout.n=2", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "data.max_response_length=9"]
    greedy = val_sampling(load_config(None, base + ["rollout.val_kwargs.temperature=0.7"]))
    assert greedy == dict(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=9, logprobs=False)  # validation reads no engine logprobs
    sampled = val_sampling(load_config(None, base + ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0.7",
                                                     "rollout.val_kwargs.top_p=0.9", "rollout.val_kwargs.n=3"]))
    assert sampled == dict(n=3, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=9, logprobs=False)
    with pytest.raises(ConfigError, match="do_sample"):  # n greedy responses would be identical: pass@n == mean@n
        load_config(None, base + ["rollout.val_kwargs.temperature=0.7", "rollout.val_kwargs.n=3"])


def test_process_logits_matches_vllm_semantics():
    # temperature 1: top_k 2 keeps the two largest; top_p 0.5 keeps the top token alone (p = e^2 / (e^2 + e + 1) = 0.67)
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    assert torch.equal(process_logits(logits, temperature=1.0, top_k=2, top_p=1.0), torch.tensor([[2.0, 1.0, float("-inf")]]))
    assert torch.equal(process_logits(logits, temperature=1.0, top_k=-1, top_p=0.5), torch.tensor([[2.0, float("-inf"), float("-inf")]]))
    # top_p 0.9: the top two hold 0.91 >= 0.9, the last token (0.09) is dropped; temperature 2 halves the logits first
    assert torch.equal(process_logits(logits, temperature=1.0, top_k=-1, top_p=0.9), torch.tensor([[2.0, 1.0, float("-inf")]]))
    assert torch.equal(process_logits(logits, temperature=2.0, top_k=-1, top_p=1.0), torch.tensor([[1.0, 0.5, 0.0]]))


# ------------------------------------------------------------------------------------------------ config
def test_tp_size_must_divide_process_count_and_hf_has_no_tp():
    base = ["model.path=m", "data.train_files=[a]", "actor.ppo_micro_batch_size_per_gpu=1", "rollout.n=2", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4"]
    load_config(None, base + ["rollout.tensor_model_parallel_size=2"], world_size=4)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=3 must divide the process count 4"):
        load_config(None, base + ["rollout.tensor_model_parallel_size=3"], world_size=4)
    with pytest.raises(ConfigError, match="rollout.name=hf with rollout.tensor_model_parallel_size=2"):
        load_config(None, base + ["rollout.tensor_model_parallel_size=2", "rollout.name=hf"], world_size=2)


def test_cli_tp_size_not_dividing_exits_2():
    proc = subprocess.run([sys.executable, str(REPO / "train_grpo.py"), "recipes/tiny_cpu.yaml", "rollout.tensor_model_parallel_size=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rollout.tensor_model_parallel_size=2 must divide the process count 1" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_template_kwargs_reach_the_template(tiny_model_dir, tmp_path):
    """data.apply_chat_template_kwargs (Qwen3's enable_thinking) is passed to apply_chat_template, leaf overrides too."""
    from transformers import AutoTokenizer

    from grpo_lib.rollout.data import load_prompts, render_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                               "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
                               "<think>\n\n</think>\n\n{% endif %}")
    msgs = [{"role": "user", "content": "What is 3 + 4?"}]
    assert "<think>" not in render_text(msgs, tokenizer, apply_chat_template=True, system_prompt=None)
    cfg = load_config(None, ["model.path=m", "data.train_files=[a]", "actor.ppo_micro_batch_size_per_gpu=1", "rollout.n=2",
                             "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                             "+data.apply_chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    path = tmp_path / "rows.jsonl"
    path.write_text('{"data_source": "s", "prompt": [{"role": "user", "content": "What is 3 + 4?"}], "reward_model": {"ground_truth": "7"}}\n')
    data = load_prompts([str(path)], tokenizer, cfg.data)
    assert tokenizer.decode(data.prompt_ids[0]).endswith("<think>\n\n</think>\n\n"), tokenizer.decode(data.prompt_ids[0])


# ------------------------------------------------------------------------------------------------ each engine's settings
TINY = ["model.path=m", "data.train_files=[a]", "actor.ppo_micro_batch_size_per_gpu=1", "rollout.n=2", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4"]


def test_each_engine_module_checks_its_own_keys():
    """vLLM's rules live in engines/vllm_settings.py, the hf engine's in engines/hf_settings.py: each refuses a bad value of
    its own keys through its own key_problems and says nothing of the other's (vLLM has tensor parallelism; the hf
    engine has no LLM(...) arguments to clash with). Validation asks the run's engine's module (engines/settings.py)."""
    from grpo_lib.rollout.engines import hf_settings, settings, vllm_settings

    cfg = load_config(None, TINY + ["rollout.tensor_model_parallel_size=2"], world_size=2)
    cfg.rollout.engine_kwargs = {"seed": 3, "block_size": 16}  # as if past validation: the modules are asked directly
    cfg.rollout.enable_chunked_prefill, cfg.rollout.max_num_batched_tokens = False, 8
    clash, budget = vllm_settings.key_problems(cfg)
    assert clash == "rollout.engine_kwargs.seed clashes with trainer.seed, which sets vLLM's seed: drop it and set trainer.seed"
    assert budget.startswith("rollout.max_num_batched_tokens=8 is smaller than one sequence"), budget
    (no_tp,) = hf_settings.key_problems(cfg)
    assert no_tp.startswith("rollout.name=hf with rollout.tensor_model_parallel_size=2: the transformers engine has no tensor"), no_tp
    # the dispatcher: only the run's engine's rules, and the other engine's keys that are set
    assert settings.key_problems(cfg) == [clash, budget]
    cfg.rollout.name = "hf"
    unused = ("rollout.engine_kwargs={'seed': 3, 'block_size': 16} are vLLM's LLM(...) settings, but rollout.name='hf': drop "
              "them or use rollout.name=vllm")
    assert settings.key_problems(cfg) == [no_tp, unused]
    cfg.rollout.name, cfg.rollout.engine_kwargs, cfg.rollout.hf_use_torch_compile = "vllm", {}, True
    (compile_key,) = settings.key_problems(cfg)[1:]
    assert compile_key.startswith("rollout.hf_use_torch_compile=true compiles the transformers engine, but rollout.name='vllm'")
    # and validation reaches them: load_config refuses each with the same message
    with pytest.raises(ConfigError) as error:
        load_config(None, TINY + ["rollout.engine_kwargs.seed=3"])
    assert clash in str(error.value)


def test_the_engine_settings_import_no_torch():
    """Config validation asks the engines' settings modules, so they stay as light as the config (no torch, no vLLM)."""
    code = ("import sys; import grpo_lib.config; import grpo_lib.rollout.engines.settings; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'grpo_lib.rollout.engines.vllm', 'grpo_lib.rollout.engines.hf') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_the_vllm_engine_module_sets_its_own_environment():
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core in this process) is set by grpo_lib/rollout/engines/vllm.py when it is
    imported, before it imports vLLM; train_grpo.py no longer sets it, and a value the user exported wins."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    show = "import os; print(os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING'))"
    runs = {"script": f"import train_grpo; {show}", "engine": f"import grpo_lib.rollout.engines.vllm; {show}"}
    out = {name: subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
           for name, code in runs.items()}
    assert out["script"].stdout.strip() == "None", out["script"].stdout + out["script"].stderr[-2000:]
    assert out["engine"].stdout.strip() == "0", out["engine"].stdout + out["engine"].stderr[-2000:]
    user = subprocess.run([sys.executable, "-c", runs["engine"]], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert user.stdout.strip() == "1", user.stdout + user.stderr[-2000:]
