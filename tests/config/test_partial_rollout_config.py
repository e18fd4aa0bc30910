"""rollout.partial_rollout's bad settings exit 2 before anything loads, naming the key and the fix
(grpo_lib/config/checks.py `partial_rollout_problems`)."""

from __future__ import annotations

import pytest

from grpo_lib.config import Config
from grpo_lib.config.checks import partial_rollout_problems, partial_rollout_warnings, validate
from grpo_lib.rollout.engines import hf_settings
from tests.helpers.cli import run_main


def carry(**keys) -> Config:
    cfg = Config()
    cfg.model.path, cfg.data.train_files, cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size = "m", ["t.parquet"], 8, 8
    cfg.actor.ppo_micro_batch_size_per_gpu, cfg.rollout.n = 2, 4
    cfg.rollout.partial_rollout.enable = True
    for key, value in keys.items():
        section, name = key.rsplit("__", 1) if "__" in key else ("rollout.partial_rollout", key)
        obj = cfg
        for part in section.replace("__", ".").split("."):
            obj = getattr(obj, part)
        setattr(obj, name, value)
    return cfg


def test_a_valid_carry_over_config_has_no_problem():
    assert validate(carry(active_batch_size=16, max_staleness=2)) == []
    assert validate(carry()) == []  # null: twice the batch
    assert validate(carry(active_batch_size=8, max_staleness=0)) == []  # the synchronous step


@pytest.mark.parametrize("keys, words", [
    ({"max_staleness": -1}, "rollout.partial_rollout.max_staleness=-1: must be >= 0"),
    ({"max_staleness": 0}, "rollout.partial_rollout.max_staleness=0 with active_batch_size=16 above data.train_batch_size=8"),
    ({"active_batch_size": 12}, "rollout.partial_rollout.active_batch_size=12: must be a multiple of data.train_batch_size=8"),
    ({"active_batch_size": 4}, "rollout.partial_rollout.active_batch_size=4: must be a multiple"),
    ({"rollout.multi_turn__enable": True}, "rollout.partial_rollout.enable=true with rollout.multi_turn.enable=true: not supported"),
    ({"algorithm.filter_groups__enable": True}, "with algorithm.filter_groups.enable=true: not supported"),
    ({"algorithm__adv_estimator": "remax"}, "with algorithm.adv_estimator=remax: not supported"),
    ({"actor__behav_imp_weight_cap": 0.0}, "actor.behav_imp_weight_cap=0.0: must be > 0"),
])
def test_each_bad_setting_is_named(keys, words):
    problems = validate(carry(**keys))
    assert any(words in p for p in problems), problems


def test_an_engine_that_cannot_abort_is_refused(monkeypatch):
    monkeypatch.setattr(hf_settings, "CAN_ABORT", False)
    problems = partial_rollout_problems(carry(rollout__name="hf", active_batch_size=16))
    assert any("rollout.name='hf': that engine cannot stop a generation midway" in p for p in problems), problems
    assert partial_rollout_problems(carry(rollout__name="vllm", active_batch_size=16)) == []


def test_staleness_without_the_decoupled_loss_is_warned_about():
    assert partial_rollout_warnings(carry()) == []
    warning = partial_rollout_warnings(carry(actor__use_decoupled_loss=False))
    assert warning and "actor.use_decoupled_loss=false" in warning[0]
    assert partial_rollout_warnings(carry(actor__use_decoupled_loss=False, max_staleness=0)) == []


def test_the_command_line_exits_2_naming_the_key(monkeypatch, tiny_model_dir, arith_data, tmp_path):
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", f"model.path={tiny_model_dir}", f"data.train_files=[{arith_data['train']}]",
                      f"trainer.default_local_dir={tmp_path}", "rollout.partial_rollout.enable=true",
                      "rollout.partial_rollout.max_staleness=-2")
    assert result.returncode == 2 and "rollout.partial_rollout.max_staleness=-2" in result.stderr, result.stderr


# ------------------------------------------------------------------------------------------------ split roles
def split(**keys) -> Config:
    return carry(**{"enable": False, **keys})


@pytest.mark.parametrize("launch, keys, words", [
    (2, {"rollout__n_gpus_per_node": 2, "rollout__tensor_model_parallel_size": 2},
     "rollout.n_gpus_per_node=2 of 2 process(es) leaves no process to train"),
    (4, {"rollout__n_gpus_per_node": 2}, "the engine's processes are one engine's tensor-parallel group; set "
                                         "rollout.tensor_model_parallel_size=2"),
    (2, {"rollout__n_gpus_per_node": -1}, "rollout.n_gpus_per_node=-1: must be >= 0"),
    (2, {"rollout__n_gpus_per_node": 1, "rollout.multi_turn__enable": True}, "with rollout.multi_turn.enable=true: not supported"),
    (2, {"rollout__n_gpus_per_node": 1, "enable": True}, "with rollout.partial_rollout.enable=true: not supported"),
    (2, {"rollout__n_gpus_per_node": 1, "algorithm__adv_estimator": "remax"}, "with algorithm.adv_estimator=remax: not supported"),
    (2, {"rollout__n_gpus_per_node": 1, "actor__behav_imp_weight_cap": 0.0}, "actor.behav_imp_weight_cap=0.0: must be > 0"),
])
def test_a_bad_split_is_named(launch, keys, words):
    problems = validate(split(**keys), world_size=launch)
    assert any(words in p for p in problems), problems


def test_a_split_counts_the_training_processes_for_the_batch():
    assert validate(split(rollout__n_gpus_per_node=1), world_size=3) == []  # 8 prompts over 2 trainers
    problems = validate(split(rollout__n_gpus_per_node=1), world_size=4)  # 8 prompts over 3 trainers
    assert any("data.train_batch_size=8 prompts does not split across 3 processes" in p for p in problems), problems
