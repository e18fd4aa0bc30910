"""grpo_lib.core.distributed: every helper on 2 processes with the group built as on GPU minus NCCL ("cpu:gloo";
on GPU "cpu:gloo,cuda:nccl", so these CPU-tensor reductions run over gloo there too), and the identity with one.

Run: .venv/bin/python -m pytest tests/core/test_distributed.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lib.core import distributed as D

REPO = Path(__file__).resolve().parents[2]


def test_backend_string_carries_gloo_for_cpu_tensors_on_gpu():
    assert D.backend_string(cuda=True) == "cpu:gloo,cuda:nccl"
    assert D.backend_string(cuda=False) == "cpu:gloo"


@pytest.mark.multiprocess
def test_every_helper_on_two_processes(tmp_path):
    from tests.conftest import torchrun_records

    records = torchrun_records("dist_worker.py", str(tmp_path), out_dir=tmp_path)
    for r, rec in enumerate(records):
        assert rec["backend"] == "cpu:gloo", rec["backend"]
        assert (rec["is_on"], rec["has_group"], rec["world_size"], rec["rank"]) == (True, True, 2, r)
        assert rec["sum"] == 4.0 and rec["min"] == 9.0 and rec["max"] == 10.0
        assert rec["gathered"] == [{"rank": 0, "items": [0]}, {"rank": 1, "items": [0, 1]}]
        assert rec["broadcast"] == "from rank 1"
        # issue 29 item 3: 40 metrics (10 sums, 10 maxes, 10 mins, 10 means over a count) in 3 all-reduces, one per
        # kind (the SUM packs the totals and the count: 21 numbers), with the values of 41 single-number all-reduces
        assert rec["reduction_equal"] and rec["reduction_calls"] == [21, 10, 10] and rec["helper_calls"] == 41, rec


def test_helpers_are_the_identity_without_a_group():
    assert not D.has_group() and not D.is_on() and D.world_size() == 1 and D.rank() == 0
    assert D.all_reduce_sum(2) == 2.0 and D.all_reduce_min(3) == 3.0 and D.all_reduce_max(4) == 4.0
    assert D.all_gather_object("x") == ["x"] and D.broadcast_object("y") == "y"
    D.barrier()


def test_gpus_the_cuda_build_cannot_use_are_an_error_not_a_cpu_run(tmp_path, monkeypatch):
    """A CUDA build of torch on a machine whose driver lists GPUs, yet torch.cuda.is_available() is False (a driver
    older than the build's CUDA): the trainer would silently pick the CPU. It is reported instead, unless the
    machine has no NVIDIA GPU, the build is a CPU one, or CUDA_VISIBLE_DEVICES hides the GPUs on purpose."""
    import torch

    from grpo_lib.core import distributed

    gpus = tmp_path / "gpus"
    gpus.mkdir()
    monkeypatch.setattr(distributed, "NVIDIA_GPUS_DIR", str(gpus))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert distributed.gpu_visibility_problem() is None, "no GPU listed by the driver"
    for i in range(4):
        (gpus / f"0000:0{i}:00.0").mkdir()
    problem = distributed.gpu_visibility_problem()
    assert problem and "lists 4 GPU(s)" in problem and "CUDA 13.0" in problem and "CUDA_VISIBLE_DEVICES=" in problem, problem
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert distributed.gpu_visibility_problem() is None, "GPUs hidden on purpose"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert distributed.gpu_visibility_problem() is None, "a CPU build of torch: a CPU run is what was installed"


def test_more_processes_than_visible_gpus_is_an_error(monkeypatch):
    """LOCAL_RANK 2 with 2 visible GPUs: named with the fix instead of "invalid device ordinal" from set_device."""
    import torch

    from grpo_lib.core import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.gpu_visibility_problem() is None
    monkeypatch.setenv("LOCAL_RANK", "2")
    problem = distributed.gpu_visibility_problem()
    assert problem and "LOCAL_RANK=2 but only 2 GPU(s) are visible" in problem and "--num_processes" in problem, problem


def test_reduction_without_a_group_is_the_same_arithmetic():
    r = D.Reduction()
    r.count("tokens", 0)  # a mean over nothing divides by 1, as the trainer's max(count, 1.0)
    r.mean("m", 3.0, over="tokens")
    r.sum("s", 2)
    r.max("x", 5)
    r.min("y", -1)
    assert r.reduce() == {"s": 2.0, "m": 3.0, "x": 5.0, "y": -1.0}


def test_a_steps_metrics_take_a_handful_of_all_reduces_whatever_their_number(tiny_model_dir, monkeypatch):
    """Issue 29 item 3: a step's metrics (rollouts, advantages, the update, timings, memory) are reduced in one packed
    all-reduce per kind: counted on a recording group (every all-reduce recorded, the tensor left as one process's) while
    the step's phases run in the trainer's order on the tiny actor and a fake engine. The counts do not grow with the
    metrics: the rollouts' 2 (sums and means, the longest response), the advantages' 1, the update's 3 per optimizer
    step (the loss counts, the skip decision, the metrics) and 1 (the memory peak), the timings' 1, the phase peaks' 1."""
    import torch
    import torch.distributed as dist

    from grpo_lib.config import load_config
    from grpo_lib.core.perf import PhaseMemory
    from grpo_lib.model.actor import Actor
    from grpo_lib.trainer import rounds
    from grpo_lib.trainer import step
    from tests.train.test_algorithm_recipes import CyclingSampler, FakeData, FakeEngine, FakeScorer

    recorded: list[int] = []
    monkeypatch.setattr(D, "is_on", lambda: True)  # reductions run; the recording all-reduce leaves one process's values
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, **kw: recorded.append(t.numel()))
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.train_files=[unused.parquet]", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "rollout.n=3",
                             "actor.ppo_epochs=2", "reward.num_workers=0"])
    counts = {}

    def phase(name, fn):
        start = len(recorded)
        out = fn()
        counts[name] = len(recorded) - start
        return out

    timings: dict[str, float] = {}
    batch, gen_metrics = phase("rollouts", lambda: rounds.collect_rollouts(cfg, FakeEngine(), FakeScorer(), FakeData(),
                                                                          CyclingSampler(), step=1, world_size=1, rank=0,
                                                                          timings=timings))
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    adv_metrics = phase("advantages", lambda: step.compute_advantages(cfg, batch))
    plan = actor.plan_step(batch)
    batch.old_logprobs = actor.compute_logprobs(batch, plan)
    train_metrics = phase("update", lambda: actor.update(batch, plan))
    memory = PhaseMemory(torch.device("cpu"))
    memory.begin("update")
    timing_metrics = phase("timings", lambda: step.reduce_timings({**timings, "timing_s/update": 1.0, "timing_s/step": 2.0}))
    memory_metrics = phase("memory", memory.metrics)
    optimizer_steps = sum(len(epoch) for epoch in plan.epochs)
    assert optimizer_steps == 4  # 2 epochs x 2 mini-batches
    assert counts == {"rollouts": 2, "advantages": 1, "update": 3 * optimizer_steps + 1, "timings": 1,
                      "memory": 1 if memory_metrics else 0}, counts
    metrics = {**gen_metrics, **adv_metrics, **train_metrics, **timing_metrics, **memory_metrics}
    assert len(metrics) >= 30 and sum(counts.values()) < len(metrics) / 1.5, (len(metrics), counts)  # 30 metrics, 18 all-reduces
