"""Issue 19: the training phase measured on fake tensors (grpo_lib/planning/measure.py), the token budget that fits, `auto`,
the host-memory line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_lib.config import ConfigError, load_config
from grpo_lib.planning.plan import print_plan
from grpo_lib.planning.memory import (
    GIB,
    all_gathers_per_mini_batch,
    auto_budget_notes,
    fitting_budget,
    host_memory,
    memory_plan,
    model_sizes,
)

REPO = Path(__file__).resolve().parents[2]
QWEN3_4B = REPO / "tests" / "data" / "qwen3_4b_config.json"
RECIPE = REPO / "recipes" / "qwen3_4b_gsm8k.yaml"
SMALL = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 1000,
         "tie_word_embeddings": True, "max_position_embeddings": 512}
SMALL_OVERRIDES = ["data.max_prompt_length=64", "data.max_response_length=64", "actor.ppo_max_token_len_per_gpu=200"]


@pytest.mark.slow  # ~20 s: torch.distributed / transformers imports and two FSDP2 builds
def test_fake_measurement_equals_a_real_tensor_run_of_the_same_code():
    """The same update on real tensors (a small model, the fake process group for the collectives) gives the tracker's
    byte counts of the fake run exactly: the fake-mode helpers change no allocation."""
    from grpo_lib.planning.measure import measure_update

    cfg = load_config(RECIPE, SMALL_OVERRIDES, world_size=4)
    fake = measure_update(cfg, SMALL, world_size=4, fake=True)
    real = measure_update(cfg, SMALL, world_size=4, fake=False)
    assert fake.micro_batch_tokens == real.micro_batch_tokens == [128, 72]
    assert fake.backward == real.backward and fake.optimizer_step == real.optimizer_step
    assert fake.backward["Sharded Param"] > 0 and fake.backward["OptState"] > 0  # the steady state: moments exist


def test_measure_warns_on_an_unverified_torch_and_refuses_one_without_its_private_apis(monkeypatch):
    """Issue 41 item 2: another torch (the lent GPU's 2.11) is measured with a warning, not refused; a torch that lacks
    a private name the measurement uses is refused with that name."""
    from grpo_lib.planning import measure

    assert measure.check_torch("2.13.0+cpu") is None and measure.check_torch("2.13.1+cu130") is None
    assert "unverified torch version 2.11.0+cu130" in measure.check_torch("2.11.0+cu130")
    assert measure.missing_private_api() == []  # every name is there in the installed torch
    monkeypatch.setattr(measure, "PRIVATE_API", (*measure.PRIVATE_API, ("torch.distributed._tools.mem_tracker",
                                                                                  "_GoneInThisVersion")))
    with pytest.raises(measure.MeasureError, match="lacks the private APIs.*mem_tracker._GoneInThisVersion"):
        measure.check_torch("2.11.0+cu130")


def test_print_plan_measure_without_the_private_apis_exits_2_without_numbers(capsys, monkeypatch):
    from grpo_lib.planning import measure

    monkeypatch.setattr(measure, "missing_private_api", lambda: ["torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker"])
    code = print_plan([str(RECIPE), "--print-plan", "--measure", "--model-config", str(QWEN3_4B)], measure=measure.measure_lines)
    captured = capsys.readouterr()
    assert code == 2 and "peak per GPU" in captured.out  # the analytic plan is printed first
    assert "lacks the private APIs --measure uses: torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker" in captured.err
    assert "measured peak" not in captured.out + captured.err
    assert measure.main([str(RECIPE)]) == 2


def test_print_plan_measure_on_an_unverified_torch_prints_the_numbers_with_a_warning(tmp_path, capsys, monkeypatch):
    """Issue 41 item 2: on torch 2.11 (the lent GPU image's) --measure ran nothing (it refused every torch but 2.13).
    Now it measures, says the version is unverified, and prints its self-check (fake vs real tensors on this torch:
    equal here) beside the measured and the analytic numbers."""
    from grpo_lib.planning import measure

    monkeypatch.setattr(measure.torch, "__version__", "2.11.0+cu130")
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    code = measure.main([str(RECIPE), *SMALL_OVERRIDES, "--model-config", str(tmp_path / "config.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    measured = out[out.index("measured training phase"):]
    assert "WARNING: unverified torch version 2.11.0+cu130" in measured
    assert "self-check on torch 2.11.0+cu130: a small model measured on fake tensors equals the same update" in measured
    assert "measured peak" in measured and "analytic training phase" in measured and "training phase" in out


@pytest.mark.slow  # ~15 s: a small model measured through the command line
def test_print_plan_measure_prints_the_measured_phase_beside_the_plan(tmp_path, capsys):
    from grpo_lib.planning import measure

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    code = measure.main([str(RECIPE), *SMALL_OVERRIDES, "--model-config", str(tmp_path / "config.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "training phase" in out and "measured training phase (rank 0 of 4" in out
    assert "micro-batch 128 + 72 tokens" in out and "measured peak" in out and "analytic training phase" in out


def test_budget_lengths_fill_the_budget():
    from grpo_lib.planning.measure import budget_lengths

    assert budget_lengths(3000, 2048) == [2048, 952]
    assert budget_lengths(8192, 2048) == [2048] * 4
    assert budget_lengths(2048, 2048) == [2048]


@pytest.mark.slow
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.001])  # the head chunk's planned bytes per logit: 12, with a bonus 24
def test_qwen3_4b_measured_peak_within_10_percent_of_the_analytic_training_phase(entropy_coeff):
    """Rank 0 of 4, a 2048 + 952-token micro-batch: our update on fake tensors at full size (~1 min on a shared 2-core
    CPU) against the plan's training phase without the CUDA context (which the CPU measurement cannot see)."""
    from grpo_lib.planning.measure import measure_update

    cfg = load_config(RECIPE, [f"actor.entropy_coeff={entropy_coeff}"], world_size=4)
    config = json.loads(QWEN3_4B.read_text())
    measured = measure_update(cfg, config, world_size=4)
    parts = memory_plan(cfg, model_sizes(config), world_size=4, gpu_bytes=80 * GIB)
    analytic = parts["training phase"] - parts["CUDA context + NCCL"]
    assert abs(measured.peak / analytic - 1) <= 0.10, (measured, analytic / GIB)
    # the terms the tracker names, against the plan's: shards exact, AdamW's step temporary exact
    assert measured.backward["Sharded Param"] == parts["actor master weights"]
    # fused AdamW (the GPU path, measured as such): no temporary beyond the moments (the plan says 0)
    assert measured.optimizer_step["OptState"] - parts["AdamW state"] == pytest.approx(parts["AdamW step temporary"], abs=64 * 2**10)


def test_fitting_budget_from_the_activation_slope():
    """The largest budget whose layers' backward fits 90% of the GPU: (0.9 x G - budget-free terms) / slope, rounded
    down to 1024 tokens; at least one sequence; at most the process's share of a mini-batch."""
    cfg = load_config(RECIPE, world_size=4)
    sizes = model_sizes(json.loads(QWEN3_4B.read_text()))
    parts = memory_plan(cfg, sizes, world_size=4, gpu_bytes=80 * GIB, tokens=1024)
    slope = 36 * 2560 * 2 + 2 * (3 * 2560 + 2 * 4096 + 2 * 1024 + 4 * 9728)  # bytes per token (checkpointed)
    expected = int((0.9 * 80 * GIB - (parts["layers' backward"] - parts["activations"])) // slope) // 1024 * 1024
    best = fitting_budget(cfg, sizes, world_size=4, gpu_bytes=80 * GIB)
    assert best == expected and best > 3000
    fitted = memory_plan(cfg, sizes, world_size=4, gpu_bytes=80 * GIB, tokens=best)
    assert fitted["training phase"] <= 0.9 * 80 * GIB < memory_plan(cfg, sizes, world_size=4, gpu_bytes=80 * GIB,
                                                                     tokens=best + 1024)["layers' backward"]
    assert fitting_budget(cfg, sizes, world_size=4, gpu_bytes=16 * GIB) == 2048  # nothing fits: one sequence
    # 320 trajectories per process per mini-batch; 3000 tokens hold one 2048-token sequence: 320 micro-batches x 2
    assert all_gathers_per_mini_batch(cfg, 3000, 4) == 640
    assert all_gathers_per_mini_batch(cfg, 2048 * 40, 4) == 16


def test_auto_resolves_in_the_plan_and_is_validated(capsys):
    code = print_plan([str(RECIPE), "actor.ppo_max_token_len_per_gpu=auto", "--print-plan", "--model-config", str(QWEN3_4B)])
    out = capsys.readouterr().out
    assert code == 0, out
    cfg = load_config(RECIPE, world_size=4)
    best = fitting_budget(cfg, model_sizes(json.loads(QWEN3_4B.read_text())), world_size=4, gpu_bytes=80 * GIB)
    assert f"actor.ppo_max_token_len_per_gpu=auto -> {best}" in out
    assert f"update micro-batch bound: {best} tokens per process" in out
    assert "(80.0x fewer)" not in out or "640 at" in out
    with pytest.raises(ConfigError, match="actor.ppo_max_token_len_per_gpu"):
        load_config(RECIPE, ["actor.ppo_max_token_len_per_gpu=automatic"], world_size=4)
    with pytest.raises(ConfigError, match="ref.log_prob_max_token_len_per_gpu"):
        load_config(RECIPE, ["ref.log_prob_max_token_len_per_gpu=fit"], world_size=4)


def test_auto_at_setup_on_cpu_and_on_a_gpu(tmp_path):
    """At setup: on CPU `auto` is max(one sequence, 16384) and says so; with a GPU's memory the plan's largest fit."""
    (tmp_path / "config.json").write_text(QWEN3_4B.read_text())
    overrides = [f"model.path={tmp_path}", "actor.ppo_max_token_len_per_gpu=auto", "rollout.log_prob_max_token_len_per_gpu=auto"]
    cfg = load_config(RECIPE, overrides, world_size=4)
    assert cfg.ref.log_prob_max_token_len_per_gpu == "auto"  # follows the actor's (derived default)
    notes = auto_budget_notes(cfg, world_size=4, gpu_bytes=None)
    assert cfg.actor.ppo_max_token_len_per_gpu == cfg.rollout.log_prob_max_token_len_per_gpu == 16384
    assert len(notes) == 3 and "no GPU to fit" in notes[0]
    cfg = load_config(RECIPE, overrides, world_size=4)
    notes = auto_budget_notes(cfg, world_size=4, gpu_bytes=80 * GIB)
    assert cfg.actor.ppo_max_token_len_per_gpu == fitting_budget(load_config(RECIPE, world_size=4),
                                                                 model_sizes(json.loads(QWEN3_4B.read_text())),
                                                                 world_size=4, gpu_bytes=80 * GIB)
    assert cfg.rollout.log_prob_max_token_len_per_gpu > cfg.actor.ppo_max_token_len_per_gpu  # no-grad: no activations kept
    assert "fits 90% of this GPU's 80 GiB" in notes[0]
    assert auto_budget_notes(load_config(RECIPE, world_size=4), world_size=4, gpu_bytes=None) == []  # seed: verl's 3000


def test_host_memory_line_by_hand():
    """Qwen3-4B on 4 processes: process 0 alone reads fp32 4P and the bf16 reference 2P at start (the others receive
    their shards by broadcast, onto the GPU); resident after: the reference's
    pinned shards (2P over the machine) and vLLM's level-1 sleep backup (bf16, 2P / TP per process, and its CUDA-graph
    pool per process: tests/planning/test_plan_context.py)."""
    cfg = load_config(RECIPE, world_size=4)
    sizes = model_sizes(json.loads(QWEN3_4B.read_text()))
    P = sizes.params
    host = host_memory(cfg, sizes, world_size=4)
    assert host["start"] == 4 * P + 2 * P
    assert host["resident"] == 2 * P + 2 * P * 4 / 2 + host["engine graph pool backup"]


def test_print_plan_measure_without_the_measuring_function_exits_2(capsys):
    assert print_plan([str(RECIPE), "--print-plan", "--measure"]) == 2
    assert "python -m grpo_lib.planning.measure" in capsys.readouterr().err


def test_the_plans_optimizer_step_term_is_what_the_chosen_adamw_allocates():
    """Issue 28 item 3: on CUDA the actor's AdamW is the fused kernel (`actor.make_optimizer`), which updates in place,
    and the plan's "AdamW step temporary" for a GPU run is 0. Measured on real tensors with torch's MemTracker around a
    step after the first (the moments exist): the fused step allocates no temporary; torch's default on CUDA (foreach)
    holds a float32 copy of every local shard at once (4 P / W bytes: 3.75 GiB for Qwen3-4B on 4, which the plan's
    old 0.72 GiB missed), so it is not the path taken."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mem_tracker import _MemRefType

    import torch

    from grpo_lib.model.actor import make_optimizer

    cfg = load_config(RECIPE, world_size=4)
    sizes = (4096, 1024, 1024, 512)  # one shard's tensors, the first the largest (the embedding's)

    def step_temporary(optimizer_of) -> int:
        params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        optimizer = optimizer_of(params)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()  # the moments exist, as at every step after the first
        tracker = MemTracker()
        tracker.track_external(*params, optimizer)
        with tracker:
            optimizer.step()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        return peak[_MemRefType.OPT] - 2 * 4 * sum(sizes)  # above the fp32 moments: the step's temporaries

    gpu = make_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.actor, device_type="cuda")
    assert gpu.defaults["fused"] is True
    parts = memory_plan(cfg, model_sizes(json.loads(QWEN3_4B.read_text())), world_size=4, gpu_bytes=80 * GIB)
    assert parts["AdamW step temporary"] == 0
    # fused: at most one float32 scalar per tensor (its step counter's update: 1.6 KB for Qwen3-4B's ~400 tensors)
    assert step_temporary(lambda ps: make_optimizer(ps, cfg.actor, device_type="cuda")) <= 4 * len(sizes)
    assert step_temporary(lambda ps: torch.optim.AdamW(ps, foreach=True)) >= 4 * sum(sizes)  # what fused avoids (+ scalars)
    cpu = make_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.actor, device_type="cpu")
    assert not cpu.defaults["fused"] and cpu.defaults["foreach"] is False  # CPU keeps the per-tensor loop (its default)


@pytest.mark.slow  # ~10 s: a small model measured, the tiny model loaded
def test_measured_actor_is_built_through_the_runs_constructor(tiny_model_dir, monkeypatch):
    """Issue 29 item 6: `--measure` builds the real Actor (`Actor.from_model` -> `Actor._build`, the path `Actor.__init__`
    takes after loading), so an attribute a future change sets while building an actor reaches the measured one: the
    measured actor has exactly the attributes of a run's, a new one included, with the GPU's choices on the CPU."""
    import torch

    from grpo_lib.model.actor import Actor
    from grpo_lib.planning.measure import measure_update

    built, original = [], Actor._build

    def with_a_new_field(self, *args, **kwargs):  # a later change adding an attribute to the actor's construction
        original(self, *args, **kwargs)
        self.new_field = "set while building"
        built.append(self)

    monkeypatch.setattr(Actor, "_build", with_a_new_field)
    measure_update(load_config(RECIPE, SMALL_OVERRIDES, world_size=4), SMALL, world_size=4)
    (measured,) = built
    run = Actor(load_config(None, [f"model.path={tiny_model_dir}", "data.train_files=[unused.parquet]", "rollout.n=2",
                                   "actor.use_dynamic_bsz=true", "rollout.log_prob_use_dynamic_bsz=true"]),
                device=torch.device("cpu"))
    assert built[1] is run and set(vars(measured)) == set(vars(run)), set(vars(measured)) ^ set(vars(run))
    assert measured.new_field == "set while building"
    # the GPU's choices: bf16 gathers (param_dtype auto on a GPU), no CPU autocast, fused AdamW, the fake group's size
    assert measured.param_dtype == torch.bfloat16 and measured.compute_dtype == measured.master_dtype == torch.float32
    assert measured.optimizer.defaults["fused"] is True and run.optimizer.defaults["fused"] is False
    assert measured.world_size == 4 and measured.collective_bytes is not None


def test_measure_refuses_torch_compile():
    """The measured update is eager: with actor.use_torch_compile the actor would compile its layers on fake tensors."""
    from grpo_lib.planning.measure import MeasureError, measure_update

    cfg = load_config(RECIPE, [*SMALL_OVERRIDES, "actor.use_torch_compile=true"], world_size=4)
    with pytest.raises(MeasureError, match="actor.use_torch_compile=false"):
        measure_update(cfg, SMALL, world_size=4)
