"""Fail early: every problem a run can know before its first step exits 2 within seconds, naming the key, the file
(with its line for YAML) or the row -- before the tokenizer, the data or the engine load (issue 11)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import run_main
from tests.conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]


def assert_fails_early(result, *needles: str) -> None:
    """Exit 2 with every needle in stderr and no traceback. `run_main` (tests/helpers/cli.py) refuses GRPOTrainer.setup (or,
    with setup=True, the engine), so the exit provably came before anything heavy loaded."""
    assert result.returncode == 2, f"expected exit 2, got {result.returncode}:\n{result.stderr[-3000:]}"
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("override, needle", [
    ("actor.lr=-1e-6", "actor.lr=-1e-06: the learning rate must be a finite number >= 0"),
    ("actor.lr=nan", "actor.lr=nan"),
    ("rollout.temperature=0", "rollout.temperature=0.0: training needs a temperature > 0; 0 is greedy decoding: the rollout.n=8"),
    ("actor.clip_ratio=1.5", "actor.clip_ratio=1.5: the PPO clip epsilon must lie in (0, 1)"),
    ("actor.fsdp_config.param_dtype=float16", "actor.fsdp_config.param_dtype=float16: float16 gradients need loss scaling"),
    ("actor.clip_ratio=0", "actor.clip_ratio=0.0"),
    ("actor.clip_ratio_low=5", "actor.clip_ratio_low=5.0: a clip epsilon must lie in (0, 1)"),
    ("actor.clip_ratio_high=5", "actor.clip_ratio_high=5.0"),
    ("rollout.top_p=0", "rollout.top_p=0.0: nucleus sampling needs 0 < top_p <= 1"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5"),
    ("actor.kl_loss_coef=-0.1", "actor.kl_loss_coef=-0.1: a KL coefficient must be >= 0"),
    ("algorithm.kl_ctrl.kl_coef=-0.1", "algorithm.kl_ctrl.kl_coef=-0.1: a KL coefficient must be >= 0"),
    ("trainer.total_training_steps=0", "trainer.total_training_steps=0: must be >= 1"),
    ("trainer.total_training_steps=-3", "trainer.total_training_steps=-3: must be >= 1"),
    ("reward.timeout_s=0", "reward.timeout_s=0.0: seconds, must be > 0"),
    ("reward.max_error_fraction=1.5", "reward.max_error_fraction=1.5: a fraction in [0, 1]"),
    ("reward.functions=[{name: accuracy, weight: .nan}]", "reward.functions[0].weight=nan: must be a finite number"),
    ("reward.functions=[{name: fluency}]", "reward.functions[0]={'name': 'fluency'}"),
    ("rollout.val_kwargs.n=4", "rollout.val_kwargs.n=4 with rollout.val_kwargs.temperature=0"),
    ("actor.grad_clip=-1", "actor.grad_clip=-1.0"),
    ("trainer.val_generations_to_log=-1", "trainer.val_generations_to_log=-1: must be >= 0"),
    # issue 20 item 8: a negative prompt-order seed crashed numpy after the engine started; 0 processes per machine
    # suggested "launch 0"
    ("data.seed=-1", "data.seed=-1: a seed must lie in [0, 2**32 - 1]"),
    ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node=0: must be >= 1 (processes per machine)"),
])
def test_value_out_of_range_exits_2_naming_the_key(monkeypatch, override, needle):
    assert_fails_early(run_main(monkeypatch, "recipes/tiny_cpu.yaml", override), needle)


# issue 31 item 3: keys that passed every check and failed after the data, the reward workers or the engine were up
# (vLLM's EngineArgs refusing an unknown keyword, numpy's "Seed must be between 0 and 2**32 - 1" inside vLLM's init),
# and two spellings of one setting of which one was dropped without a word
ISSUE_31_KEYS = {
    "trainer.seed=-1": (["trainer.seed=-1"], ["trainer.seed=-1: a seed must lie in [0, 2**32 - 1]"]),
    "trainer.seed=2**32": (["trainer.seed=4294967296"], ["trainer.seed=4294967296: a seed must lie in [0, 2**32 - 1]"]),
    "data.seed=2**32": (["data.seed=4294967296"], ["data.seed=4294967296: a seed must lie in [0, 2**32 - 1]"]),
    "global then per-gpu": (["actor.ppo_micro_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4"],
                            ["actor.ppo_micro_batch_size=8 (global", "actor.ppo_micro_batch_size_per_gpu=4 are both set"]),
    "per-gpu then global, verl's spelling": (
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_micro_batch_size=8"],
        ["actor.ppo_micro_batch_size=8 (global", "actor.ppo_micro_batch_size_per_gpu=4 are both set",
         "8 // 1 process = 8 per process, not 4"]),
    "old-logprob pass": (["rollout.log_prob_micro_batch_size=8", "rollout.log_prob_micro_batch_size_per_gpu=4"],
                         ["rollout.log_prob_micro_batch_size=8 (global", "rollout.log_prob_micro_batch_size_per_gpu=4"]),
    "mapping then its leaf": (
        ["data.apply_chat_template_kwargs={enable_thinking: true}", "data.apply_chat_template_kwargs.enable_thinking=false"],
        ["data.apply_chat_template_kwargs.enable_thinking is set by two overrides with different values: "
         "#1 'data.apply_chat_template_kwargs={enable_thinking: true}' and #2"]),
    "leaf then its mapping": (
        ["data.apply_chat_template_kwargs.enable_thinking=false", "data.apply_chat_template_kwargs={enable_thinking: true}"],
        ["data.apply_chat_template_kwargs.enable_thinking is set by two overrides with different values"]),
    "a value and entries of one engine key": (
        ["rollout.engine_kwargs.compilation_config=3", "rollout.engine_kwargs.compilation_config.level=3"],
        ["rollout.engine_kwargs.compilation_config is given both a value (3) and entries (compilation_config.level)"]),
    "unknown vLLM keyword": (["rollout.engine_kwargs.no_such_vllm_flag=3"],
                             ["rollout.engine_kwargs.no_such_vllm_flag: not an argument of the installed vLLM"]),
    "vLLM keyword typo": (["actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtyp=fp8"],
                          ["rollout.engine_kwargs.kv_cache_dtyp: not an argument", "did you mean 'kv_cache_dtype'"]),
}


@pytest.mark.parametrize("case", list(ISSUE_31_KEYS))
def test_engine_seed_and_alias_keys_exit_2_before_anything_heavy(monkeypatch, case):
    overrides, needles = ISSUE_31_KEYS[case]
    assert_fails_early(run_main(monkeypatch, "recipes/tiny_cpu.yaml", *overrides), *needles)


def test_config_error_exits_2_without_importing_torch():
    """`python train_grpo.py recipes/tiny_cpu.yaml actor.lr_typo=1` exits 2 naming the key and never imports torch
    (train_grpo.py runs as __main__, its exit path included; only --print-plan and later checks need torch)."""
    code = textwrap.dedent("""
        import runpy, sys
        sys.argv = ["train_grpo.py", "recipes/tiny_cpu.yaml", "actor.lr_typo=1"]
        try:
            runpy.run_path("train_grpo.py", run_name="__main__")
        except SystemExit as exc:
            print("exit", exc.code, "torch imported" if "torch" in sys.modules else "no torch")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["exit", "2", "no", "torch"], proc.stdout + proc.stderr[-3000:]
    assert "unknown key 'actor.lr_typo'; did you mean 'actor.lr'?" in proc.stderr, proc.stderr[-3000:]


def test_yaml_syntax_error_in_recipe_names_file_and_line(tmp_path, monkeypatch):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("data:\n  train_batch_size: 8\nactor:\n  lr: [1e-6\n  ppo_epochs: 1\n")
    assert_fails_early(run_main(monkeypatch, str(recipe)), f"recipe {str(recipe)!r} is not valid YAML: line 5")


def test_value_set_in_a_recipe_names_its_line(tmp_path, monkeypatch):
    """A value out of range in the recipe points at the recipe's line; the same key overridden points at nothing."""
    recipe = tmp_path / "mine.yaml"
    text = (REPO / "recipes" / "tiny_cpu.yaml").read_text().replace("  use_kl_loss: true\n", "  use_kl_loss: true\n  clip_ratio_low: 5\n")
    recipe.write_text(text)
    line = text.splitlines().index("  clip_ratio_low: 5") + 1
    assert_fails_early(run_main(monkeypatch, str(recipe)), f"actor.clip_ratio_low=5.0: a clip epsilon must lie in (0, 1) (DAPO's clip-higher: 0.28) "
                                    f"({recipe} line {line})")


def test_yaml_syntax_error_in_override_names_the_override(monkeypatch):
    assert_fails_early(run_main(monkeypatch, "recipes/tiny_cpu.yaml", "data.train_files=[a.parquet"), "override 'data.train_files=[a.parquet': the value is not valid YAML")


def test_unwritable_output_folder_exits_2_before_models_load(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, blocker / "run"))
    assert_fails_early(result, f"trainer.default_local_dir={str(blocker / 'run')!r} cannot be written")


def test_less_free_disk_than_one_checkpoint_exits_2_with_the_numbers(arith_data, tmp_path, monkeypatch):
    """A model folder whose safetensors header declares 4e12 bf16 parameters (the file holds only the header):
    one checkpoint would need about 4e12 x 12 bytes + 8e12 bytes, more than any test disk has."""
    model = tmp_path / "huge_model"
    model.mkdir()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2_000_000, 2_000_000], "data_offsets": [0, 8 * 10**12]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", *tiny_overrides(model, arith_data, tmp_path / "run"))
    assert_fails_early(result, "GiB free, less than one checkpoint", "4000000.0 M parameters x 12 bytes",
                       "trainer.default_local_dir=")


def test_checkpoint_estimate_of_the_tiny_model(tiny_model_dir):
    """The estimate reads the real parameter count: fp32 weights + AdamW moments (12 bytes/param) + the export."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_lib.core.preflight import checkpoint_bytes, model_size

    params, disk_bytes = model_size(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # tied embeddings are stored once in the file and counted once by parameters()
    assert params == sum(p.numel() for p in model.parameters()), "the header's count is the model's"
    assert checkpoint_bytes(params, disk_bytes) == params * 12 + disk_bytes


def test_checkpoint_estimate_of_a_hub_model_reads_its_downloaded_snapshot(tiny_model_dir, tmp_path, monkeypatch):
    """model.path=Org/Name (a hub name): the disk check reads the weights of its snapshot in the Hugging Face cache
    (it used to skip every hub model, so a real run was never checked); not downloaded yet: skipped."""
    import shutil

    from grpo_lib.core.preflight import model_size

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_size("Org/Tiny") is None, "not downloaded: nothing to read"
    snapshot = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / "0123abc"
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")  # as a download leaves it
    assert model_size("Org/Tiny") == model_size(str(tiny_model_dir))


def test_invalid_rows_error_names_file_and_row(tiny_model_dir, tmp_path, monkeypatch):
    """A row with a null ground truth and data.invalid_rows=error exits 2 naming file and row, before the engine."""
    import pandas as pd

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1? Answer after ####."}],
             "reward_model": {"style": "rule", "ground_truth": None if i == 5 else str(i + 1)}} for i in range(8)]
    data = {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    pd.DataFrame(rows).to_parquet(data["train"])
    pd.DataFrame(rows[:2]).to_parquet(data["test"])
    # setup runs (tokenizer + data load), the engine is refused: the row is reported before it
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, data, tmp_path / "run"),
                      "data.invalid_rows=error", setup=True)
    assert_fails_early(result, f"data file {str(data['train'])!r} row 5 (0-based): reward_model.ground_truth is None")


def test_invalid_utf8_in_a_jsonl_file_names_the_file_byte_and_line(tiny_model_dir, tmp_path, monkeypatch):
    """A latin-1 byte in a .jsonl data file (issue 20 item 8): exit 2 naming the file, the byte offset and the line, not a
    UnicodeDecodeError traceback. Line 1 is 9 bytes with its newline; in line 2, '{"b": "caf' is 10 more: byte 19."""
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"a": 1}\n{"b": "caf\xe9"}\n')
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, {"train": data, "test": data},
                                                                             tmp_path / "run"), setup=True)
    assert_fails_early(result, f"data file {str(data)!r} is not valid UTF-8: byte 19 (line 2)", "iconv")


# ------------------------------------------------------------------ broken model folders (issue 20 item 6)
# A truncated or missing weights file used to fail inside vLLM after the engine started, a 0-byte one crashed the
# disk estimate (struct.error), a folder with only config.json was reported as "no chat template".

def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _shard_missing(folder: Path) -> None:
    """An index naming two shards, the second one not downloaded."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    names = json.loads(safetensors_json(folder / "model-00001-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in names}
    weight_map["lm_head.extra"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def safetensors_json(path: Path) -> str:
    """The JSON header of a safetensors file minus __metadata__, as text: {tensor name: entry}."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header.pop("__metadata__", None)
    return json.dumps(header)


BROKEN_MODELS = {  # name -> (how the tiny model's copy is broken, what the message says)
    "weights missing": (lambda f: (f / "model.safetensors").unlink(), "holds no weights (no *.safetensors"),
    "only config.json": (lambda f: [p.unlink() for p in f.iterdir() if p.name != "config.json"], "holds no weights"),
    "0-byte weights": (lambda f: (f / "model.safetensors").write_bytes(b""),
                       "model.safetensors is damaged: it is 0 bytes, shorter than the 8-byte header length"),
    "truncated weights": (_truncate, "model.safetensors is damaged: it is truncated: "),
    "garbage header": (lambda f: (f / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{" + b"\0" * 64),
                       "model.safetensors is damaged: its header is not valid JSON"),
    "a shard missing": (_shard_missing, "model.safetensors.index.json lists 2 weight files and 1 are missing "
                                        "(model-00002-of-00002.safetensors)"),
    "no config.json": (lambda f: (f / "config.json").unlink(), "has no config.json, so it is not a Hugging Face model folder"),
    "config.json not JSON": (lambda f: (f / "config.json").write_text("{not json"), "config.json cannot be read as JSON"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_MODELS))
def test_broken_model_folder_exits_2_naming_the_file_before_setup(case, tiny_model_dir, arith_data, tmp_path, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    breaks, needle = BROKEN_MODELS[case]
    breaks(model)
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", *tiny_overrides(model, arith_data, tmp_path / "run"))
    assert_fails_early(result, f"model.path={str(model)!r}", needle, "download or copy the model again")


def test_complete_model_folders_and_hub_names_pass_the_model_check(tiny_model_dir, tmp_path):
    """The tiny model (one safetensors file) and a sharded copy of it pass; a hub name is left to the download."""
    import shutil

    from grpo_lib.core.preflight import check_model_folder

    assert check_model_folder(str(tiny_model_dir)) == []
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, sharded)
    _shard_missing(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.extra"]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert check_model_folder(str(sharded)) == []
    assert check_model_folder("Org/Not-Downloaded") == []


def test_reward_file_that_blocks_at_import_exits_2_naming_it(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """reward.import_timeout_s (issue 20 item 7): a custom reward file that waits at import used to hang setup forever."""
    reward = tmp_path / "waits_reward.py"
    reward.write_text("import time\ntime.sleep(600)\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0\n")
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, tmp_path / "run",
                                                                             f"reward.custom.path={reward}",
                                                                             "reward.import_timeout_s=1"), setup=True)
    assert_fails_early(result, f"custom reward file {reward} did not finish importing within reward.import_timeout_s=1.0 s")
