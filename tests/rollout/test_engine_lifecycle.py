"""Whole runs of train_grpo with a recording fake vLLM (tests/scripts/fake_llm.py): the order of engine calls a GPU
would see, engine starts, and the seeds and requests of every sample.

Only `vllm.LLM` is faked; `VLLMEngine` and its lifecycle state machine run as they are, told that sleep is real
(as on a GPU with rollout.free_cache_engine). The recorder checks the order with its own model of the GPU
memory state, so a wrong order in train_grpo.py / step.py fails here even if the state machine were wrong too.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.conftest import REPO, launch, merge_overrides, read_metrics, tiny_overrides
from tests.scripts.fake_llm import install

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == "0")
'''


# The fake engine serves no weights (it scores every token -1.0), so the weight probe, on by default, would rightly stop
# these runs at step 1 (exit 3): they check the call order, not the weights (tests/rollout/test_weight_probe.py, test_trust.py).
NO_PROBE = ("trainer.weight_probe=false",)


def names(events, *, actor: bool = False) -> list[str]:
    """Raw calls as short names: generate:train (n > 1), generate:val, score, wake_up:weights, ... (with `actor`, also
    the actor's placement and passes: actor_on_device / actor_on_host / actor_forward)."""
    out = []
    for e in events:
        if e[0].startswith("actor_") and not actor:
            continue
        if e[0] == "generate":
            out.append("generate:train" if e[2][0][0] > 1 else "generate:val")
        elif e[0] == "wake_up":
            out.append("wake_up:" + (",".join(e[1]) if e[1] else "ALL"))
        else:
            out.append(e[0])
    return out


def check_gpu_order(calls: list[str]) -> None:
    """An independent model of the device: what each raw call needs mapped."""
    state = "awake"
    for i, c in enumerate(calls):
        where = f"call {i} ({c}) in {calls}"
        if c == "sleep":
            assert state == "awake", where
            state = "asleep"
        elif c == "wake_up:weights":
            assert state == "asleep", where
            state = "weights"
        elif c == "wake_up:kv_cache":
            assert state == "weights", where
            state = "awake"
        elif c == "wake_up:ALL":
            raise AssertionError(f"untagged wake: {where}")
        elif c in ("reload_weights", "reset_prefix_cache"):
            assert state == "weights", f"push / reset outside the weights-only state: {where}"
        elif c.startswith("generate") or c == "score":
            assert state == "awake", f"generation while not fully awake: {where}"
        elif c == "empty_cache":  # before the weights wake (the update's blocks) and before the KV cache (the push's)
            assert state in ("asleep", "weights"), where
        elif c == "checkpoint_load":  # a resume creates the AdamW state on the device: the engine's memory must be free
            assert state == "asleep", f"checkpoint.load with the engine's memory mapped: {where}"


@pytest.mark.slow
def test_lifecycle_order_three_steps_one_engine_start(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    fake = install(monkeypatch)
    import train_grpo

    out = tmp_path / "run"
    code = train_grpo.main([str(REPO / "recipes/tiny_cpu.yaml"), *tiny_overrides(
        tiny_model_dir, arith_data, out, "rollout.free_cache_engine=true", "trainer.val_before_train=true", "trainer.test_freq=1",
        "trainer.check_weight_sync=true", "reward.num_workers=0", "trainer.logger=[jsonl]", *NO_PROBE)])
    assert code == 0
    assert fake.starts == 1, f"{fake.starts} engine starts in one run"
    calls = names(fake.events)
    check_gpu_order(calls)
    step = ["generate:train", "sleep", "empty_cache", "wake_up:weights", "reload_weights", "reset_prefix_cache", "empty_cache",
            "wake_up:kv_cache", "score", "generate:val"]
    assert calls == ["start", "generate:val"] + step * 3, calls
    assert [e[1] for e in fake.events if e[0] == "sleep"] == [1, 1, 1], "rollout.sleep_level 1 expected"
    rows = read_metrics(out)
    assert len(rows) == 3
    total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    for row in rows:  # per-phase peaks (CPU: this process's VmHWM, reset at each phase's start; tests/core/test_perf_memory.py)
        phases = [row[f"memory/{name}_peak_mb"] for name in ("gen", "update", "push")]
        assert all(50 < mb < total_mb for mb in phases), row  # a process with torch and a model holds > 50 MiB
        assert row["memory/peak_mb"] == max(phases), row


@pytest.mark.slow
def test_actor_offloaded_before_every_kv_wake_and_generation(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """With actor.fsdp_config.param_offload / optimizer_offload the actor's shards are on the host whenever the engine
    maps its KV cache or generates: at the first generation, after the push (before wake_up(kv_cache), not after it:
    mapping the KV cache needs the memory at once), after a checkpoint's export (which gathers the shards) and after
    a resume; and on the device for each of its forward passes (the weight-sync check runs after the offload). On CPU
    the moves are no-ops, so the placement the code asks for is recorded (tests/scripts/fake_llm.py). No KL term:
    every recorded forward is the actor's."""
    fake = install(monkeypatch)
    import train_grpo
    from grpo_lib.checkpoints import checkpoint
    from grpo_lib.rollout import engines

    real_load = checkpoint.load

    def load(*args, **kwargs):  # recorded in the engine's call list, with the engine's own state machine's state
        fake.events.append(("checkpoint_load", engines_seen[0].lifecycle.state if engines_seen else None))
        return real_load(*args, **kwargs)

    engines_seen, fake_build = [], engines.build_engine

    def build_engine(*args, **kwargs):  # keeps the run's VLLMEngine (over the fake) to read its lifecycle state
        engines_seen.insert(0, fake_build(*args, **kwargs))
        return engines_seen[0]

    monkeypatch.setattr(checkpoint, "load", load)
    monkeypatch.setattr(engines, "build_engine", build_engine)
    out = tmp_path / "run"
    base = tiny_overrides(tiny_model_dir, arith_data, out, "rollout.free_cache_engine=true",
                          "actor.fsdp_config.param_offload=true", "actor.fsdp_config.optimizer_offload=true",
                          "trainer.val_before_train=true", "trainer.test_freq=1", "trainer.save_freq=1",
                          "trainer.check_weight_sync=true", "actor.use_kl_loss=false", "reward.num_workers=0", "trainer.logger=[jsonl]",
                          *NO_PROBE)
    recipe = str(REPO / "recipes/tiny_cpu.yaml")
    assert train_grpo.main([recipe, *merge_overrides(*base, "trainer.total_training_steps=2")]) == 0
    first = names(fake.events, actor=True)
    fake.events.clear()
    assert train_grpo.main([recipe, *merge_overrides(*base, "trainer.total_training_steps=3")]) == 0  # resumes from step 2
    resumed = names(fake.events, actor=True)
    for calls in (first, resumed):
        check_gpu_order([c for c in calls if not c.startswith("actor_")])
        actor = "device"  # built on the device
        for i, c in enumerate(calls):
            if c.startswith("actor_on_"):
                actor = c.removeprefix("actor_on_")
            elif c == "wake_up:kv_cache" or c.startswith("generate"):
                assert actor == "host", f"call {i} ({c}) with the actor's shards on the device: {calls}"
            elif c == "actor_forward":
                assert actor == "device", f"call {i}: an actor forward with its shards on the host: {calls}"
    assert "reload_weights" in resumed[:resumed.index("generate:train")], "a resume serves the checkpoint's weights"
    assert "checkpoint_load" not in first and resumed.count("checkpoint_load") == 1, resumed
    assert [e[1] for e in fake.events if e[0] == "checkpoint_load"] == ["released"], "the engine's state at checkpoint.load"
    engine_calls = [c for c in resumed if not c.startswith("actor_")]
    at = engine_calls.index("checkpoint_load")  # released just before; woken with the resumed weights before generating
    assert engine_calls[at - 1:at + 7] == ["sleep", "checkpoint_load", "empty_cache", "wake_up:weights", "reload_weights",
                                           "reset_prefix_cache", "empty_cache", "wake_up:kv_cache"], engine_calls
    assert len(read_metrics(out)) == 3


@pytest.mark.slow
def test_level2_sleep_pushes_before_every_wake(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    fake = install(monkeypatch)
    import train_grpo

    code = train_grpo.main([str(REPO / "recipes/tiny_cpu.yaml"), *tiny_overrides(
        tiny_model_dir, arith_data, tmp_path / "run", "rollout.sleep_level=2", "trainer.total_training_steps=2",
        "reward.num_workers=0", "trainer.logger=[jsonl]", *NO_PROBE)])
    assert code == 0
    calls = names(fake.events)
    check_gpu_order(calls)
    assert [e[1] for e in fake.events if e[0] == "sleep"] == [2, 2]
    for i, c in enumerate(calls):
        if c == "wake_up:kv_cache":
            assert calls[i - 3:i] == ["reload_weights", "reset_prefix_cache", "empty_cache"], calls


def launch_fake(tmp_path, tiny_model_dir, arith_data, name: str, tp: int):
    """2 processes, DAPO with exactly 2 generation rounds per step (the fake alternates uninformative / varied)."""

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    out = tmp_path / name
    overrides = tiny_overrides(
        tiny_model_dir, arith_data, out / "run",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=4", f"reward.custom.path={reward}",
        "trainer.total_training_steps=2", "actor.ppo_mini_batch_size=2", f"rollout.tensor_model_parallel_size={tp}",
        "trainer.val_before_train=true", "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0",
        "rollout.val_kwargs.n=1", "reward.num_workers=0", "trainer.logger=[jsonl]", *NO_PROBE)
    proc = launch([REPO / "tests/scripts/fake_llm.py", out, REPO / "recipes/tiny_cpu.yaml", *overrides], procs=2)
    if proc.returncode != 0:
        pytest.fail(f"fake 2-process run exited {proc.returncode}\n{proc.stderr[-5000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, read_metrics(out / "run")


def sample_seeds(events, purpose_n_gt_1: bool = True) -> list[tuple[tuple, int]]:
    """(prompt token ids, seed) of every training sample in the recorded generate calls."""
    seeds = []
    for e in events:
        if e[0] == "generate" and (e[2][0][0] > 1) == purpose_n_gt_1:
            for prompt, (n, _, _, _, seed) in zip(e[1], e[2]):
                seeds += [(tuple(prompt), seed + k) for k in range(n)]
    return seeds


@pytest.fixture(scope="module")
def fake_runs(tiny_model_dir, arith_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_runs")
    return {tp: launch_fake(root, tiny_model_dir, arith_data, f"tp{tp}", tp) for tp in (1, 2)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dapo_two_rounds_two_processes_no_seed_shared(fake_runs):
    ranks, metrics = fake_runs[1]
    assert [m["batch/gen_rounds"] for m in metrics] == [2.0, 2.0], "the run must take 2 rounds per step to test round seeds"
    train = [s for r in ranks for _, s in sample_seeds(r["events"])]
    val = [s for r in ranks for _, s in sample_seeds(r["events"], purpose_n_gt_1=False)]
    # 2 steps x 2 rounds x 4 prompts x 4 samples, split over 2 processes; validation: 8 prompts x 1 sample
    assert len(train) == 2 * 2 * 4 * 4 and len(val) == 8
    duplicates = [s for s, c in Counter(train + val).items() if c > 1]
    assert not duplicates, f"samples share seeds: {duplicates}"
    for r in ranks:
        assert r["starts"] == 1 and [e for e in r["events"] if e[0] == "start"] == [["start", 1, 1]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_group_identical_requests_same_samples_as_tp1(fake_runs):
    (tp1, m1), (tp2, m2) = fake_runs[1], fake_runs[2]
    gen = [[e for e in r["events"] if e[0] in ("generate", "score")] for r in tp2]
    assert gen[0] == gen[1], "the two ranks of a TP group submitted different requests"
    assert [e[1:] for e in tp2[0]["events"] if e[0] == "start"] == [[2, 1]], "engine TP size / seed"
    # the group generates what the two TP-1 processes generated together: same prompts, same seeds
    assert sorted(sample_seeds(tp2[0]["events"])) == sorted(s for r in tp1 for s in sample_seeds(r["events"]))
    for a, b in zip(m1, m2):
        for key in ("reward/mean", "batch/kept_groups", "response/length_mean", "actor/pg_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), f"step {a['step']} {key}: TP 1 {a[key]} vs TP 2 {b[key]}"


@pytest.mark.slow
def test_setup_leaves_the_resolved_config_as_it_was(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """GRPOTrainer.setup writes nothing into the config load_config resolved: the CPU KV-cache size is the engine's own
    value (VLLMEngine.from_config, here over the fake LLM), and the `auto` token budget, which needs the device, is
    resolved into the trainer's own copy. Before, setup wrote both into the caller's config."""
    import copy

    fake = install(monkeypatch)
    import train_grpo
    from grpo_lib.core import perf
    from grpo_lib.rollout import engines
    from grpo_lib.rollout.engines.vllm import VLLMEngine

    built = []

    def build_engine(cfg, *, on_cpu, world_size):  # the real constructor of a run, over the fake LLM
        built.append(VLLMEngine.from_config(cfg, on_cpu=on_cpu, world_size=world_size, llm_factory=fake))
        return built[-1]

    monkeypatch.setattr(engines, "build_engine", build_engine)
    seen = {}
    real_setup = train_grpo.GRPOTrainer.setup

    def setup(trainer):
        handed, before = trainer.cfg, copy.deepcopy(trainer.cfg)
        real_setup(trainer)
        seen.update(handed=handed, before=before, own=trainer.cfg)

    monkeypatch.setattr(train_grpo.GRPOTrainer, "setup", setup)
    monkeypatch.setattr(train_grpo.GRPOTrainer, "train", lambda trainer: 0)  # set-up only: no step
    code = train_grpo.main([str(REPO / "recipes/tiny_cpu.yaml"), *tiny_overrides(
        tiny_model_dir, arith_data, tmp_path / "run", "rollout.kv_cache_memory_bytes=null", "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=auto", "reward.num_workers=0", "trainer.logger=[jsonl]", *NO_PROBE)])
    assert code == 0 and len(built) == 1
    handed, before, own = seen["handed"], seen["before"], seen["own"]
    assert handed == before, "setup wrote into the config it was handed"
    assert handed.rollout.kv_cache_memory_bytes is None and handed.actor.ppo_max_token_len_per_gpu == "auto"
    expected_kv = perf.resolve_kv_cache_bytes(handed, world_size=1, engine_dtype="float32")
    assert built[0].kv_cache_bytes == expected_kv == built[0].llm.kwargs["kv_cache_memory_bytes"]  # what LLM(...) got
    assert own is not handed and own.actor.ppo_max_token_len_per_gpu == 16384  # CPU: max(one sequence, CPU_AUTO_BUDGET)
