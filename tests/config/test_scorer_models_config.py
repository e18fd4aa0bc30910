"""The reward model's and the judge's settings (grpo_lib/config/scorer_models.py): bad ones exit 2 before anything heavy
loads, naming the key and the fix; an enabled scorer joins reward.functions with its weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_lib.config import Config
from grpo_lib.config.checks import validate
from grpo_lib.config.scorer_models import model_functions_on, template_problem
from tests.helpers.cli import run_main


def base(**sections) -> Config:
    cfg = Config()
    cfg.model.path, cfg.data.train_files, cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size = "m", ["t.parquet"], 8, 8
    cfg.actor.ppo_micro_batch_size_per_gpu, cfg.rollout.n = 2, 4
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 16
    for dotted, value in sections.items():
        *path, name = dotted.split("__")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, name, value)
    return cfg


def model_folder(tmp_path: Path, name: str, **config) -> str:
    folder = tmp_path / name
    folder.mkdir()
    config = {"architectures": ["Qwen3ForSequenceClassification"], "max_position_embeddings": 2048, "vocab_size": 384, **config}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def template(tmp_path: Path, text: str) -> str:
    path = tmp_path / "judge.txt"
    path.write_text(text)
    return str(path)


def test_an_enabled_scorer_joins_reward_functions_with_weight_one(tmp_path):
    cfg = base(reward_model__enable=True, reward_model__model__path=model_folder(tmp_path, "rm"))
    assert validate(cfg) == []
    assert cfg.reward.functions == [{"name": "accuracy", "weight": 1.0}, {"name": "reward_model", "weight": 1.0}]
    assert model_functions_on(cfg) == ["reward_model"]
    listed = base(reward_model__enable=True, reward_model__model__path=model_folder(tmp_path, "rm2"),
                  reward__functions=[{"name": "reward_model", "weight": 0.5}])
    assert validate(listed) == [] and listed.reward.functions == [{"name": "reward_model", "weight": 0.5}], "the RM alone (verl)"


@pytest.mark.parametrize("config, keys, words", [
    ({"architectures": ["Qwen3ForCausalLM"]}, {}, "has no classification head (architectures ['Qwen3ForCausalLM'])"),
    ({"id2label": {"0": "a", "1": "b"}}, {}, "has 2 labels: a reward model scores with one"),
    ({"max_position_embeddings": 64}, {}, "max_position_embeddings is 64 tokens, below data.max_prompt_length + "
                                          "data.max_response_length = 80"),
    ({}, {"reward_model__max_length": 32}, "reward_model.max_length is 32 tokens, below"),
    ({}, {"reward_model__micro_batch_size_per_gpu": 0}, "reward_model.micro_batch_size_per_gpu=0: must be >= 1"),
    ({}, {"reward_model__use_dynamic_bsz": True, "reward_model__forward_max_token_len_per_gpu": 40},
     "reward_model.forward_max_token_len_per_gpu=40 is below one sequence"),
    ({}, {"rollout__n_gpus_per_node": 1}, "with rollout.n_gpus_per_node (one-step-off on split GPUs) is not built"),
])
def test_a_bad_reward_model_is_named(tmp_path, config, keys, words):
    cfg = base(reward_model__enable=True, reward_model__model__path=model_folder(tmp_path, "rm", **config), **keys)
    problems = validate(cfg, world_size=2)
    assert any(words in p for p in problems), problems


def test_a_reward_model_of_another_vocabulary_needs_input_tokenizer(tmp_path):
    policy = model_folder(tmp_path, "policy", architectures=["Qwen3ForCausalLM"], vocab_size=151936)
    cfg = base(model__path=policy, reward_model__enable=True, reward_model__model__path=model_folder(tmp_path, "rm"))
    assert any("set reward_model.model.input_tokenizer=" in p for p in validate(cfg)), validate(cfg)
    cfg = base(model__path=policy, reward_model__enable=True, reward_model__model__path=model_folder(tmp_path, "rm2"),
               reward_model__model__input_tokenizer=policy)
    assert validate(cfg) == []


def test_a_listed_scorer_must_be_enabled():
    problems = validate(base(reward__functions=[{"name": "judge", "weight": 1.0}]))
    assert any("reward.functions lists 'judge' but judge.enable=false" in p for p in problems), problems
    problems = validate(base(reward_model__enable=True))
    assert any("reward_model.enable=true needs reward_model.model.path" in p for p in problems), problems


@pytest.mark.parametrize("text, words", [
    ("Score this: {prompt}", "has no {response} placeholder"),
    ("{response} {answer}", "unknown placeholder(s) ['answer']"),
    ("{response} {", "not a valid template"),
])
def test_a_judge_template_must_hold_the_response(tmp_path, text, words):
    assert words in template_problem(template(tmp_path, text))
    problems = validate(base(judge__enable=True, judge__model_path="j", judge__prompt_template=template(tmp_path, text)))
    assert any(words in p for p in problems), problems


@pytest.mark.parametrize("keys, words", [
    ({"judge__score_parser": "mine"}, "judge.score_parser='mine': use one of"),
    ({"judge__score_parser": "nowhere.py:parse"}, "the file 'nowhere.py' does not exist"),
    ({"judge__score_scale": 0.0}, "judge.score_scale=0.0: must be > 0"),
    ({"judge__score_tag": "a b"}, "judge.score_tag='a b'"),
    ({"judge__gpu_memory_utilization": 1.5}, "judge.gpu_memory_utilization=1.5"),
    ({"rollout__tensor_model_parallel_size": 2}, "judge.enable with rollout.tensor_model_parallel_size > 1 is not built"),
    ({"judge__model_path": None}, "judge.enable=true needs judge.model_path"),
])
def test_a_bad_judge_setting_is_named(tmp_path, keys, words):
    cfg = base(**{"judge__enable": True, "judge__model_path": "j", "judge__prompt_template": template(tmp_path, "{response}"),
                  **keys})
    problems = validate(cfg, world_size=2)
    assert any(words in p for p in problems), problems
    assert validate(base(judge__enable=True, judge__model_path="j", judge__prompt_template=template(tmp_path, "{response}"))) == []


def test_the_command_line_exits_2_naming_the_key(monkeypatch, tiny_model_dir, arith_data, tmp_path):
    """A causal LM given as the reward model, and a judge template without {response}: exit 2 before anything loads."""
    common = ("recipes/tiny_cpu.yaml", f"model.path={tiny_model_dir}", f"data.train_files=[{arith_data['train']}]",
              f"trainer.default_local_dir={tmp_path / 'run'}")
    result = run_main(monkeypatch, *common, "reward_model.enable=true", f"reward_model.model.path={tiny_model_dir}")
    assert result.returncode == 2 and f"reward_model.model.path='{tiny_model_dir}' has no classification head" in result.stderr, \
        result.stderr
    result = run_main(monkeypatch, *common, "judge.enable=true", f"judge.model_path={tiny_model_dir}",
                      f"judge.prompt_template={template(tmp_path, 'Grade: {prompt}')}")
    assert result.returncode == 2 and "has no {response} placeholder" in result.stderr, result.stderr


@pytest.mark.parametrize("keys, words", [
    ({"rollout__name": "hf"}, "rollout.lora_mode=adapter with rollout.name=hf: that engine cannot serve a LoRA adapter"),
    ({"rollout__n_gpus_per_node": 1}, "rollout.lora_mode=adapter with rollout.n_gpus_per_node (one-step-off on split GPUs) is not built"),
    ({"model__lora_rank": 1024}, "vLLM serves adapters up to rank 512"),
])
def test_adapter_sync_with_an_engine_that_cannot_serve_it_is_named(keys, words):
    cfg = base(**{"model__lora_rank": 8, "rollout__lora_mode": "adapter", **keys})
    problems = validate(cfg, world_size=2)
    assert any(words in p for p in problems), problems
    assert validate(base(model__lora_rank=8, rollout__lora_mode="adapter")) == []


def test_adapter_sync_falls_back_to_merged_for_modules_vllm_cannot_take_and_says_so():
    cfg = base(model__lora_rank=8, rollout__lora_mode="adapter", model__target_modules=["q_proj", "lm_head"])
    assert validate(cfg) == []
    assert cfg.rollout.lora_mode == "merged"
    assert "['lm_head'], which vLLM's LoRA layers do not take" in cfg.ignored["rollout.lora_mode=adapter"]


def test_the_command_line_exits_2_for_adapter_sync_on_the_hf_engine(monkeypatch, tiny_model_dir, arith_data, tmp_path):
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", f"model.path={tiny_model_dir}", f"data.train_files=[{arith_data['train']}]",
                      f"trainer.default_local_dir={tmp_path}", "model.lora_rank=8", "rollout.lora_mode=adapter", "rollout.name=hf")
    assert result.returncode == 2 and "that engine cannot serve a LoRA adapter" in result.stderr, result.stderr
