"""`--print-plan`: batch arithmetic, divisibility checks, resolved defaults and the memory plan, with no model loaded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lib.config import load_config
from grpo_lib.planning.memory import memory_plan, model_sizes
from grpo_lib.planning.plan import print_plan

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
QWEN3_4B = DATA / "qwen3_4b_config.json"


def plan(capsys, *argv: str) -> tuple[int, str]:
    code = print_plan([*argv, "--print-plan"])
    captured = capsys.readouterr()
    assert code == 0 or captured.err.startswith("error: "), "errors go to stderr"
    assert code != 0 or "peak per GPU" in captured.out, "exit 0 only with every part of the plan, the memory plan included"
    return code, captured.out + captured.err


def test_seed_numbers_qwen3_4b_on_4_gpus(capsys):
    """The seed's arithmetic: 512 prompts x 5 = 2560 trajectories, mini-batch 256 x 5 = 1280, so 2 updates per step."""
    code, out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), "--model-config", str(QWEN3_4B))
    assert code == 0, out
    for needle in ("on 4 processes (from trainer.n_gpus_per_node x trainer.nnodes)",
                   "trajectories per step: 512 x 5 = 2560",
                   "mini-batch: 256 prompts x 5 = 1280 trajectories",
                   "512 / 256 = 2 updates per epoch x 1 epochs = 2 optimizer updates per step",
                   "trajectories per process per mini-batch: 1280 / 4 = 320",
                   "update micro-batch bound: 3000 tokens per process",
                   "data.train_batch_size >= actor.ppo_mini_batch_size: 512 >= 256 ok",
                   "trainer.n_gpus_per_node x trainer.nnodes = 4 x 1 = 4 processes ok",
                   "rollout.log_prob_max_token_len_per_gpu=3000", "ref.log_prob_use_dynamic_bsz=True",
                   "model: 4.02B parameters", "peak per GPU"):
        assert needle in out, f"{needle!r} not in:\n{out}"


def test_failing_batch_check_exits_2_with_numbers(capsys):
    code, out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), "data.train_batch_size=128")
    assert code == 2
    assert "actor.ppo_mini_batch_size=256 is larger than data.train_batch_size=128" in out, out


def test_uneven_last_mini_batch_is_planned_like_verl(capsys):
    code, out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), "data.train_batch_size=500", "--model-config", str(QWEN3_4B))
    assert code == 0, out
    assert "500 = 1 x 256 + 244 (the last mini-batch smaller, as in verl) = 2 updates per epoch" in out, out


def test_mini_batch_not_splitting_over_planned_processes_exits_2(capsys):
    code, out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), "trainer.n_gpus_per_node=3")
    assert code == 2 and "ppo_mini_batch_size=256 prompts does not split across 3 processes" in out, out


def test_process_count_sources(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    tiny = str(REPO / "recipes/tiny_cpu.yaml")
    assert "on 2 processes (from the current launch" in plan(capsys, tiny)[1]
    assert "on 4 processes (from --num-processes)" in plan(capsys, tiny, "--num-processes", "4")[1]
    # the recipe's launch keys win over the flag
    assert "on 8 processes (from trainer.n_gpus_per_node" in plan(capsys, tiny, "--num-processes", "4", "trainer.n_gpus_per_node=8")[1]


def test_steps_per_epoch_from_the_data_files(capsys, arith_data, tiny_model_dir):
    code, out = plan(capsys, str(REPO / "recipes/tiny_cpu.yaml"), f"data.train_files=[{arith_data['train']}]", f"model.path={tiny_model_dir}",
                     "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "trainer.total_training_steps=null",
                     "trainer.total_epochs=3")
    assert code == 0, out
    assert "steps per epoch: 64 rows // 8 = 8" in out and "total steps: 24 (3 epochs x 8)" in out, out


def test_without_model_config_prints_batch_plan_and_exits_with_its_own_code(capsys, tmp_path, monkeypatch):
    """Issue 31 item 4: a hub name that is not cached exited 0 without the memory plan, so a script gating on the exit
    code could not tell. Now 0 means every part was computed; a plan without its memory part exits
    EXIT_NO_MEMORY_PLAN (5), saying so on stderr with the flag that gets it."""
    from grpo_lib.planning.plan import EXIT_NO_MEMORY_PLAN

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    code = print_plan([str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), "--print-plan"])
    captured = capsys.readouterr()
    assert code == EXIT_NO_MEMORY_PLAN == 5, captured.err
    assert "trajectories per step: 512 x 5 = 2560" in captured.out
    assert "the memory plan needs the model's config.json" in captured.out and "peak per GPU" not in captured.out
    assert captured.err.startswith("error: the plan has no memory part") and "--model-config FILE" in captured.err, captured.err
    assert f"(exit code {EXIT_NO_MEMORY_PLAN})" in captured.err
    code, out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), "--model-config", str(QWEN3_4B))
    assert code == 0 and "peak per GPU" in out, "the same plan with the config.json given is whole: exit 0"


def test_model_config_from_local_folder_and_hub_cache(capsys, tmp_path, monkeypatch, tiny_model_dir):
    out = plan(capsys, str(REPO / "recipes/tiny_cpu.yaml"), f"model.path={tiny_model_dir}")[1]
    assert f"config: {tiny_model_dir / 'config.json'}" in out and "peak per GPU" in out
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-4B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(QWEN3_4B.read_text())
    (tmp_path / "hub" / "models--Qwen--Qwen3-4B" / "refs").mkdir()
    (tmp_path / "hub" / "models--Qwen--Qwen3-4B" / "refs" / "main").write_text("abc123")  # as a download leaves it
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"))[1]
    assert "models--Qwen--Qwen3-4B" in out and "model: 4.02B parameters" in out


def test_memory_plan_arithmetic_qwen3_4b():
    """Each component by hand: P = 4,022,468,096 parameters, 4 processes, 80 GiB.

    P = embed 151936 x 2560 + 36 layers x (q 2560x4096 + k,v 2 x 2560x1024 + o 4096x2560 + mlp 3 x 2560x9728
        + norms 2 x 2560 + q/k norms 2 x 128) + final norm 2560 (tied head).
    """
    cfg = load_config(REPO / "recipes/qwen3_4b_gsm8k.yaml", world_size=4)
    sizes = model_sizes(json.loads(QWEN3_4B.read_text()))
    P = 151936 * 2560 + 36 * (2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128) + 2560
    assert sizes.params == P == 4_022_468_096
    parts = memory_plan(cfg, sizes, world_size=4, gpu_bytes=80 * 2**30)
    assert parts["actor master weights"] == 4 * P / 4 and parts["gradients"] == 4 * P / 4
    assert parts["AdamW state"] == 8 * P / 4
    assert parts["reference"] == 0.0  # ref.param_offload
    assert parts["vLLM share"] == 0.6 * 80 * 2**30
    # gradient checkpointing: 3000 tokens x (36 layer inputs x 2560 x 2 B + one layer's saved tensors)
    assert parts["activations"] == 3000 * (36 * 2560 * 2 + 2 * (3 * 2560 + 2 * 4096 + 2 * 1024 + 4 * 9728))
    # CUDA context + NCCL per process, outside vLLM's share (issue 41: per communicator): the context 1 GiB; NCCL's
    # buffers, 32 channels x 2 connections x (4 MiB Simple + 120 x 640 x 8 x 8 B LL128 + 8 x 512 x 8 x 16 B LL), for
    # the trainer's 4 ranks (+ NVLS: 4 x 32 MiB) and vLLM's TP group of 2 (no NVLS at 2; + its 64 MiB symmetric memory)
    buffers = 32 * 2 * (4 * 2**20 + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16)
    ctx = 2**30 + (buffers + 4 * 32 * 2**20) + (buffers + 64 * 2**20)
    assert parts["CUDA context + NCCL"] == ctx
    assert parts["generation phase"] == 4 * P / 4 + 8 * P / 4 + 0.6 * 80 * 2**30 + ctx
    # issue 19 defect 6, each corrected term by hand (V = 151936, H = 2560, E = V x H the tied embedding = head):
    V, H = 151936, 2560
    E = V * H
    root = E + 2560  # the FSDP2 root: embedding (= head) + final norm
    assert parts["output head chunk"] == 12 * 1024 * V  # fp32 logits 4, the kept softmax 4, the entropy's product 4
    bonus = memory_plan(load_config(REPO / "recipes/qwen3_4b_gsm8k.yaml", ["actor.entropy_coeff=0.001"], world_size=4),
                        sizes, world_size=4, gpu_bytes=80 * 2**30)
    assert bonus["output head chunk"] == 24 * 1024 * V  # + autograd's entropy graph: the fp32 logits and its softmax
    assert parts["head weight gradient"] == 2 * E  # bf16, accumulated over the chunks
    assert parts["embedding gradient"] == 2 * 2 * E  # embedding's bf16 gradient and the sum: 3 x V x H with the head's
    assert parts["root reduce-scatter"] == 4 * root / 4  # float32 reduce-scatter output of the root unit
    assert parts["AdamW step temporary"] == 0  # fused AdamW on GPU (actor.make_optimizer): in place, no temporary
    assert parts["gathered units"] == 2 * (root + sizes.layer_params)  # root + one layer in bf16
    held = 4 * P / 4 + 4 * P / 4 + 8 * P / 4 + ctx
    assert parts["layers' backward"] == held + 2 * (root + sizes.layer_params) + parts["activations"] + 12 * 1024 * V + 2 * E
    assert parts["root's backward"] == held + 2 * root + 2 * E + 4 * E + root
    assert parts["optimizer step"] == held
    assert parts["training phase"] == parts["layers' backward"]
    assert parts["resume phase"] == 4 * P / 4 + 4 * P / 4 + 8 * P / 4 + ctx  # engine released at the load
    assert parts["peak"] == max(parts["generation phase"], parts["training phase"], parts["resume phase"]) < 80 * 2**30
    no_offload = load_config(REPO / "recipes/qwen3_4b_gsm8k.yaml", ["ref.param_offload=false"], world_size=4)
    assert memory_plan(no_offload, sizes, world_size=4, gpu_bytes=80 * 2**30)["reference"] == 2 * P / 4


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_passes_print_plan(recipe, capsys):
    """Model and data paths may not exist: the config, the batch arithmetic and (given a config.json) the memory plan."""
    snapshot = {"qwen3_4b": "qwen3_4b_config.json", "qwen3_8b": "qwen3_8b_config.json", "qwen2_5_0_5b": "qwen2_5_0_5b_config.json",
                "qwen3_1_7b": "qwen3_1_7b_config.json"}
    model_config = [DATA / f for prefix, f in snapshot.items() if recipe.name.startswith(prefix)]
    extra = ["--model-config", str(model_config[0])] if model_config else []
    if "_from_8b_" in recipe.name:  # a distillation recipe: its teacher's config.json too
        extra += ["--teacher-model-config", str(DATA / "qwen3_8b_config.json")]
    if recipe.name.endswith("_rm.yaml") and model_config:  # a reward model recipe: its reward model's config.json too
        extra += ["--reward-model-config", str(DATA / "qwen3_1_7b_config.json")]
    code, out = plan(capsys, str(recipe), *extra)
    whole = "peak per GPU" in out  # a tiny recipe's model folder may not exist yet (data_prep makes it)
    assert code == (0 if whole else 5), out
    assert "optimizer updates per step" in out and "divisibility checks:" in out and "memory plan per GPU" in out
    if model_config:
        assert "fits" in out, out
        header = recipe.read_text()
        peak = re.search(r"peak per GPU\s+([\d.]+) GiB", out).group(1)
        assert f"Memory plan per GPU (--print-plan, 80 GiB): peak {peak} GiB" in header, \
            f"{recipe.name}'s header states another total than --print-plan's {peak} GiB"


def test_cli_print_plan_loads_no_model_and_no_engine():
    script = ("import sys, runpy; sys.argv = ['train_grpo.py', 'recipes/qwen3_4b_gsm8k.yaml', '--print-plan', '--model-config', "
              f"{str(QWEN3_4B)!r}]\ntry:\n    runpy.run_path('train_grpo.py', run_name='__main__')\nexcept SystemExit as e:\n"
              "    print('EXIT', e.code); print('HEAVY', sorted(m for m in ('vllm', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "EXIT 0" in proc.stdout and "HEAVY []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_memory_plan_within_2x_of_a_measured_cpu_update(tmp_path):
    """Plan vs measurement: one update of a 43M-parameter model on CPU (float32), peak RSS over the RSS before loading.

    Not the 2-layer demo model: its whole training state is under 1 MiB, below the tens of MiB that torch allocates
    lazily on a first backward, so the ratio would measure the allocator, not the plan. 43M parameters (a tiny model
    by any other measure) put ~1.4 GB into the terms the plan computes: weights, gradients, AdamW, activations, head.
    """
    proc = subprocess.run([sys.executable, "tests/scripts/plan_memory_case.py", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fields = proc.stdout.split()
    planned, measured = float(fields[fields.index("PLAN") + 1]), float(fields[fields.index("MEASURED") + 1])
    assert fields[fields.index("PARAMS") + 1] == fields[fields.index("ACTUAL_PARAMS") + 1], "parameter count formula is off"
    assert 0.5 <= measured / planned <= 2.0, f"plan {planned / 2**20:.0f} MiB vs measured {measured / 2**20:.0f} MiB"


def test_accelerate_configs_load_with_their_process_counts():
    """recipes/accelerate/: accelerate's own loader reads each; the counts match the names; the README uses them."""
    from accelerate.commands.config.config_args import ClusterConfig

    expected = {"1_gpu.yaml": (1, 1), "2_gpus.yaml": (2, 1), "4_gpus.yaml": (4, 1), "8_gpus.yaml": (8, 1), "2_machines.yaml": (16, 2)}
    found = {p.name: p for p in (REPO / "recipes" / "accelerate").glob("*.yaml")}
    assert set(found) == set(expected)
    readme = (REPO / "README.md").read_text()
    for name, (processes, machines) in expected.items():
        cfg = ClusterConfig.from_yaml_file(str(found[name]))
        assert (cfg.num_processes, cfg.num_machines) == (processes, machines), name
        assert str(cfg.mixed_precision) in ("no", "PrecisionType.NO"), f"{name}: the trainer sets its own dtypes"
        assert name in readme, f"README does not mention recipes/accelerate/{name}"


def test_readme_shows_the_current_qwen3_4b_plan(capsys, monkeypatch):
    """README's 4-GPU walkthrough quotes the plan verbatim; regenerate it when the plan changes."""
    monkeypatch.chdir(REPO)
    code, out = plan(capsys, "recipes/qwen3_4b_gsm8k.yaml", "--model-config", "tests/data/qwen3_4b_config.json")
    assert code == 0
    assert out.strip() in (REPO / "README.md").read_text(), "README's Qwen3-4B plan is stale: paste the output of " \
        "`python train_grpo.py recipes/qwen3_4b_gsm8k.yaml --print-plan --model-config tests/data/qwen3_4b_config.json`"


def test_offload_switches_move_memory_between_phases():
    """Actor weights offloaded leave the generation phase; AdamW offloaded is only on the GPU for the optimizer step."""
    cfg = load_config(REPO / "recipes/qwen3_4b_gsm8k.yaml", world_size=4)
    sizes = model_sizes(json.loads(QWEN3_4B.read_text()))
    base = memory_plan(cfg, sizes, world_size=4, gpu_bytes=80 * 2**30)
    cfg = load_config(REPO / "recipes/qwen3_4b_gsm8k.yaml", ["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                                                            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"], world_size=4)
    off = memory_plan(cfg, sizes, world_size=4, gpu_bytes=80 * 2**30)
    assert off["generation phase"] == base["generation phase"] - base["actor master weights"] - base["AdamW state"]
    assert off["layers' backward"] == base["layers' backward"] - base["AdamW state"]
    assert off["root's backward"] == base["root's backward"] - base["AdamW state"]
    assert off["optimizer step"] == base["optimizer step"]
    assert off["training phase"] == max(off["layers' backward"], off["root's backward"], off["optimizer step"])


# ------------------------------------------------------------------ exit codes and flags (issue 20 item 8)

def test_a_plan_that_does_not_fit_exits_4(capsys):
    """A script can gate on the plan: exit 4 when the peak per GPU exceeds --gpu-memory-gb (it used to exit 0)."""
    from grpo_lib.planning.plan import EXIT_DOES_NOT_FIT

    code, out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), "--model-config", str(QWEN3_4B), "--gpu-memory-gb", "10")
    assert (code, EXIT_DOES_NOT_FIT) == (4, 4), out
    assert "GiB of 10 GiB: DOES NOT FIT" in out and "error: the plan DOES NOT FIT in 10 GiB per GPU (exit code 4)" in out, out


@pytest.mark.parametrize("flags, needle", [
    (["--num-processes", "0"], "--num-processes 0: must be >= 1"),
    (["--num-processes", "-2"], "--num-processes -2: must be >= 1"),
    (["--num-processes", "two"], "--num-processes 'two': expected a whole number"),
    (["--gpu-memory-gb", "-5"], "--gpu-memory-gb -5: must be a finite number of GiB > 0"),
    (["--gpu-memory-gb", "nan"], "--gpu-memory-gb nan: must be a finite number of GiB > 0"),
    (["--gpu-memory-gb", "inf"], "--gpu-memory-gb inf: must be a finite number of GiB > 0"),
    (["--model-config", "tests/data/no_such_config.json"], "--model-config 'tests/data/no_such_config.json': no such file"),
    (["--gpu-memory-gb"], "--gpu-memory-gb needs a value"),
])
def test_bad_plan_flags_exit_2_naming_the_flag(capsys, monkeypatch, flags, needle):
    """--num-processes 0 was a ZeroDivisionError, -5 / nan GiB were planned, a missing --model-config was ignored."""
    monkeypatch.chdir(REPO)
    code, out = plan(capsys, "recipes/tiny_cpu.yaml", *flags)
    assert code == 2, out
    assert needle in out and "Traceback" not in out, out


def test_untied_head_terms_qwen3_8b():
    """Qwen3-8B (untied head, 8 processes): the root holds embedding AND head (2E + norm); the embedding's gradient is
    one bf16 V x H of its own (no sum with the head's), the head's another."""
    cfg = load_config(REPO / "recipes/qwen3_8b_gsm8k_math.yaml", world_size=8)
    sizes = model_sizes(json.loads((DATA / "qwen3_8b_config.json").read_text()))
    E = 151936 * 4096
    parts = memory_plan(cfg, sizes, world_size=8, gpu_bytes=80 * 2**30)
    root = 2 * E + 4096
    assert sizes.params - sizes.layers * sizes.layer_params == root
    assert parts["embedding gradient"] == 2 * E and parts["head weight gradient"] == 2 * E
    assert parts["root reduce-scatter"] == 4 * root / 8
    assert parts["gathered units"] == 2 * (root + sizes.layer_params)


@pytest.mark.parametrize("loss_mode, lines, needles", [
    ("vanilla", [], ["actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.2 actor.clip_ratio_c=3.0; aggregated actor.loss_agg_mode="]),
    ("gspo", [], ["aggregated actor.loss_agg_mode="]),
    ("cispo", ["actor.clip_ratio_high=0.28", "actor.loss_agg_mode=token-sum"],
     ["loss_mode=cispo: actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.28; aggregated actor.loss_agg_mode=token-sum"]),
    ("sapo", [], ["loss_mode=sapo: actor.tau_pos=1.0 actor.tau_neg=1.05; its loss aggregated seq-mean-token-mean (fixed for sapo",
                  "aggregates the KL and entropy terms"]),
    ("geo_mean", [], ["loss_mode=geo_mean: actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.2; its loss aggregated seq-mean-token-mean"]),
    ("clip_cov", [], ["actor.policy_loss.clip_cov_ratio=0.0002 actor.policy_loss.clip_cov_lb=1.0 actor.policy_loss.clip_cov_ub=5.0",
                      "picked within each micro-batch"]),
    ("kl_cov", ["actor.policy_loss.ppo_kl_coef=1.0"], ["actor.policy_loss.kl_cov_ratio=0.0002 actor.policy_loss.ppo_kl_coef=1.0"]),
    ("dppo_tv", [], ["loss_mode=dppo_tv: actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.2 actor.clip_ratio_c=3.0"]),
    ("dppo_kl", [], ["loss_mode=dppo_kl: actor.clip_ratio_low=0.2"]),
    ("gpg", [], ["loss_mode=gpg: aggregated actor.loss_agg_mode=token-mean"]),
    ("dro", ["actor.policy_loss.dro_beta=0.05"], ["loss_mode=dro: actor.policy_loss.dro_beta=0.05; aggregated"]),
])
def test_plan_shows_the_policy_loss_and_its_resolved_values(capsys, loss_mode, lines, needles):
    """Every verl loss line is accepted by --print-plan, which shows what the loss reads and how its loss is aggregated."""
    code, out = plan(capsys, str(REPO / "recipes/tiny_cpu.yaml"), f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *lines,
                     "--model-config", str(DATA / "qwen2_5_0_5b_config.json"))  # a full plan: exit 0
    assert code == 0, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"


def test_an_engine_setting_the_run_would_refuse_is_noted(capsys, monkeypatch):
    """train_grpo.py hands the engines' settings check to the plan: an unknown vLLM keyword is noted as the run's exit 2."""
    import train_grpo

    monkeypatch.chdir(REPO)
    code = train_grpo.main(["recipes/qwen3_4b_gsm8k.yaml", "rollout.engine_kwargs.no_such_vllm_flag=3", "--print-plan",
                            "--model-config", str(QWEN3_4B)])
    out = capsys.readouterr().out
    assert code == 0 and "note: the run itself would exit 2: rollout.engine_kwargs.no_such_vllm_flag: not an argument" in out, out
