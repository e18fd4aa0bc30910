"""DESIGN invariant 1 across processes: 2 CPU processes (gloo) give the 1-process full-batch gradient and loss.

`tests/scripts/grad_worker.py` is launched with
`python -m accelerate.commands.launch --multi_gpu --num_processes 2` (accelerate accepts --multi_gpu on a
CPU-only machine and starts torch.distributed.run underneath; the process group falls back to gloo). Each
process takes a share of the fixed mini-batch's groups (`tests/scripts/grad_case.py`) and writes its all-reduced
gradients; this test compares them with the gradient of the plain full-batch loss computed here, in one process.
Also: `plan_rank_balance` (pure) and `balance_across_ranks` (in the worker). Run:
`.venv/bin/python -m pytest tests/model/test_multiprocess.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lib.algorithms import LOSS_AGG_MODES
from grpo_lib.model.actor import load_model
from grpo_lib.model.batching import plan_rank_balance
from tests.conftest import launch
from tests.scripts import grad_case as case

pytestmark = pytest.mark.multiprocess  # tiers: conftest.py

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Model + batch on disk, the 2-process worker run, and the 1-process model to compute references with."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("multiprocess")
    model_dir = case.write_tiny_model(root / "model")
    model = load_model(str(model_dir), dtype=torch.float32, device=torch.device("cpu"))
    batch = case.make_batch(model)
    torch.save(batch, root / "batch.pt")
    out = root / "out"
    cmd = [REPO / "tests" / "scripts" / "grad_worker.py", model_dir, root / "batch.pt", out]
    proc = launch(cmd, procs=2, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} on 2 processes exited {proc.returncode}\n--- stderr ---\n{proc.stderr[-6000:]}\n--- stdout ---\n{proc.stdout[-2000:]}")
    return dict(model_dir=model_dir, model=model, batch=batch, out=out, refs={})


def load(launched, name: str) -> list[dict]:
    return [torch.load(launched["out"] / f"rank{r}" / f"{name}.pt", weights_only=False) for r in range(2)]


def reference(launched, loss_agg_mode: str = "token-mean", holes: bool = False, extra: tuple[str, ...] = ()):
    if (loss_agg_mode, holes, extra) not in launched["refs"]:
        cfg = case.make_config(launched["model_dir"], loss_agg_mode=loss_agg_mode, extra=extra)
        batch = case.with_holes(launched["batch"]) if holes else launched["batch"]
        grads, loss = case.reference_grads(launched["model"], batch, cfg)
        launched["refs"][loss_agg_mode, holes, extra] = (grads, loss, cfg)
    return launched["refs"][loss_agg_mode, holes, extra]


def check_against_one_process(launched, records: list[dict], loss_agg_mode: str, what: str, holes: bool = False,
                              extra: tuple[str, ...] = ()) -> None:
    expected, expected_loss, cfg = reference(launched, loss_agg_mode, holes, extra)
    for rank, record in enumerate(records):  # tolerances derived in grad_case (GRAD_TOL, LOSS_REL_TOL)
        case.assert_close_grads(record["grads"], expected, f"{what} rank {rank}")
        assert case.metrics_loss(record["metrics"], cfg) == pytest.approx(expected_loss, rel=case.LOSS_REL_TOL), f"{what} rank {rank}"
    assert all(r["sharded"] for r in records), f"{what}: the actor's parameters are not FSDP2 DTensors"
    for name in expected:
        assert torch.equal(records[0]["grads"][name], records[1]["grads"][name]), f"{what}: ranks disagree on {name}"
    assert records[0]["forwards"] == records[1]["forwards"], f"{what}: every process runs the same number of forwards"


@pytest.mark.parametrize("holes", [False, True], ids=["contiguous", "holes"])
@pytest.mark.parametrize("setting", ["fixed1-padded", "budget60-packed"])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_two_processes_give_the_full_batch_gradient(launched, loss_agg_mode, setting, holes):
    """Also with loss-mask holes: the global token / sequence counts are the loss mask's, over both processes."""
    records = load(launched, f"{'holes-' if holes else ''}even-{loss_agg_mode}-{setting}")
    assert [r["rows"] for r in records] == [4, 4]
    check_against_one_process(launched, records, loss_agg_mode, f"{loss_agg_mode} {setting} holes={holes}", holes)


@pytest.mark.parametrize("loss", list(case.LOSS_OVERRIDES))
def test_every_policy_loss_on_two_processes_gives_the_full_batch_gradient(launched, loss):
    """Each other policy loss (its forced aggregation or token-mean; grad_case.LOSS_OVERRIDES), on the holed batch
    split over 2 processes and packed under the smallest budget: the 1-process full-batch gradient and loss."""
    mode, extra = case.loss_case(loss)
    check_against_one_process(launched, load(launched, f"loss-{loss}"), mode, f"{loss} on 2 processes", True, extra)


COLLECTIVE_CHOICES = ["per-micro-batch", "default", "no-reshard-after-forward", "defer-root", "defer-all", "all-three"]
SAME_ARITHMETIC = {"default", "no-reshard-after-forward"}  # they only skip gathers of values that did not change


@pytest.mark.parametrize("setting", ["fixed1-padded", "budget60-packed"])
@pytest.mark.parametrize("choice", COLLECTIVE_CHOICES)
def test_collective_choices_give_the_full_batch_gradient(launched, choice, setting):
    """Every actor.fsdp_config choice of the update's collectives (tests/scripts/grad_worker.py COLLECTIVE_CHOICES)
    gives the 1-process full-batch gradient within GRAD_TOL (a deferred reduce-scatter sums the micro-batches before
    averaging over processes instead of after: the same sum in another float32 order, which GRAD_TOL bounds), and the
    choices that only skip re-gathers give today's (per-micro-batch) gradient bit for bit."""
    records = load(launched, f"collectives-{choice}-{setting}")
    check_against_one_process(launched, records, "token-mean", f"{choice} {setting}")
    if choice in SAME_ARITHMETIC:
        today = load(launched, f"collectives-per-micro-batch-{setting}")
        for name, grad in records[0]["grads"].items():
            assert torch.equal(grad, today[0]["grads"][name]), f"{choice} {setting}: {name} differs from today's schedule"


@pytest.mark.parametrize("setting", ["fixed1-padded", "budget60-packed"])
def test_collective_bytes_follow_the_schedule(launched, setting):
    """Bytes counted by `fsdp.count_collectives` per mini-batch of M micro-batches, from R and L, the bytes of one
    all-gather of the root and of all decoder layers (float32 on CPU, so a unit's reduce-scatter moves as many bytes as
    its all-gather). Today: every unit is gathered for the forward and again for the backward and reduce-scattered
    once per micro-batch: 2M (R + L) + M (R + L)."""
    unit = torch.load(launched["out"] / "rank0" / "unit_bytes.pt")
    R, L = unit["root"], sum(v for k, v in unit.items() if k.startswith("layer"))
    assert R > 0 and L > 0
    for choice in COLLECTIVE_CHOICES:
        records = load(launched, f"collectives-{choice}-{setting}")
        M = records[0]["forwards"]
        assert M > 1, "several micro-batches per mini-batch, or the choices cannot differ"
        expected = {  # (all-gather bytes, reduce-scatter bytes)
            "per-micro-batch": (2 * M * (R + L), M * (R + L)),
            "default": (R + 2 * M * L, M * (R + L)),  # keep_root_gathered: the root once per mini-batch
            "no-reshard-after-forward": (R + M * L, M * (R + L)),  # layers gathered once per micro-batch
            "defer-root": (R + 2 * M * L, R + M * L),
            "defer-all": (R + 2 * M * L, R + L),
            "all-three": (R + M * L, R + L),
        }[choice]
        for rec in records:
            got = (rec["collectives"]["all_gather"], rec["collectives"]["reduce_scatter"])
            assert got == expected, f"{choice} {setting} rank {rec['rows']}: {got} != {expected} (M={M}, R={R}, L={L})"


@pytest.mark.parametrize("setting", ["fixed1", "budget60-packed"])
@pytest.mark.parametrize("name", ["k3", "forward_kl_topk", "k1-pg-alone"])
def test_two_processes_give_the_distillation_terms_full_batch_gradient(launched, name, setting):
    """The distillation term on 2 processes (one with 3 groups, one with 1: dummy micro-batches) = the 1-process
    full-batch loss's gradient; its metrics (mean and range over the loss tokens) are the same on both processes."""
    from tests.model.test_distillation_invariance import DISTILL_CASES, distill_config, reference_distill, teacher_scores

    batch = launched["batch"].select(list(range(len(launched["batch"]))))
    teacher_scores(batch)
    cfg = distill_config(launched["model_dir"], *DISTILL_CASES[name])
    model = launched["model"]
    model.zero_grad(set_to_none=True)
    reference_distill(model, batch, cfg).backward()
    expected = case.grads_of(model)
    records = load(launched, f"distill-{name}-{setting}")
    for rank, record in enumerate(records):
        case.assert_close_grads(record["grads"], expected, f"distill {name} {setting} rank {rank}")
    for key in ("distillation/kl_mean", "distillation/loss_min", "distillation/loss_max", "distillation/loss"):
        assert records[0]["metrics"][key] == records[1]["metrics"][key], f"{key}: the processes disagree"
    m = records[0]["metrics"]
    assert m["distillation/loss_min"] <= m["distillation/kl_mean"] <= m["distillation/loss_max"]


def test_lopsided_shares_run_dummy_micro_batches(launched):
    """Process 1 holds 2 rows but runs 6 micro-batches (4 dummies) like process 0; the gradient is unchanged."""
    records = load(launched, "lopsided")
    assert [r["rows"] for r in records] == [6, 2]
    assert [r["forwards"] for r in records] == [6, 6] and [r["logprob_forwards"] for r in records] == [6, 6]
    check_against_one_process(launched, records, "token-mean", "lopsided")
    with torch.no_grad():
        naive, _ = case.naive_logprobs(launched["model"], launched["batch"])
    for rank, groups in enumerate([["g0", "g1", "g2"], ["g3"]]):
        rows = case.group_rows(launched["batch"], groups)
        logprobs = records[rank]["logprobs"]
        torch.testing.assert_close(logprobs, naive[rows, :logprobs.shape[1]], atol=case.LOGPROB_ATOL, rtol=0)


def test_balance_across_ranks_moves_whole_groups(launched):
    """141 vs 86 tokens before; after: 2 groups (4 trajectories) each, 119 vs 108 tokens, no group lost or split."""
    records = load(launched, "balanced")
    assert [r["rows"] for r in records] == [4, 4]
    assert sorted(g for r in records for g in r["group_ids"]) == ["g0", "g1", "g2", "g3"]
    assert sorted(r["tokens"] for r in records) == [108, 119]
    assert records[0]["group_ids"] == ["g1", "g2"], "process 0 keeps its heaviest group and receives g2"
    check_against_one_process(launched, records, "token-mean", "balanced")


def test_plan_rank_balance_examples_and_errors():
    assert plan_rank_balance([[(2, 90), (2, 80)], [(2, 10), (2, 20)]]) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]
    already = [[(2, 50), (2, 50)], [(2, 50), (2, 50)]]
    assert plan_rank_balance(already) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]], "a balanced batch stays put"
    with pytest.raises(ValueError, match="different numbers of trajectories"):
        plan_rank_balance([[(2, 5)], [(3, 5)]])
    with pytest.raises(ValueError, match="3 groups do not split evenly across 2"):
        plan_rank_balance([[(2, 5), (2, 5)], [(2, 5)]])


@settings(max_examples=100, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 4), per_rank=st.integers(1, 5), rows=st.integers(1, 4))
def test_plan_rank_balance_properties(data, world_size, per_rank, rows):
    tokens = st.integers(rows, 400)
    groups = [[(rows, data.draw(tokens)) for _ in range(per_rank)] for _ in range(world_size)]
    plan = plan_rank_balance(groups)
    flat = sorted(item for dest in plan for item in dest)
    assert flat == [(r, j) for r in range(world_size) for j in range(per_rank)], "every group exactly once"
    assert all(len(dest) == per_rank for dest in plan), "same number of trajectories everywhere"
    assert all(dest == sorted(dest) for dest in plan), "global order within a process"
    sums = [sum(groups[r][j][1] for r, j in dest) for dest in plan]
    before = [sum(t for _, t in g) for g in groups]
    largest = max(t for g in groups for _, t in g)
    assert max(sums) - min(sums) <= max(largest, 0), "spread within one group's tokens"
    assert max(sums) - min(sums) <= max(before) - min(before), "never worse than before"
