"""The update and the old-logprob pass never make the host wait for the device inside their micro-batch loops.

A read of a device value (`.item()`, `.tolist()`, `bool()` / `float()` of a tensor, a boolean-mask index, a copy to the
host) blocks the host until the device has run everything queued before it: with one per micro-batch the host cannot
queue micro-batch i + 1 while the device computes micro-batch i, and CPU and GPU take turns (issue 41, defect 7).

- On the meta device tensors have shapes and no values: a read of one raises. The tiny actor moved there runs whole
  updates and logprob passes; the only reads allowed are stubbed below and counted: ONE per mini-batch after the last
  backward (the metrics and the gradient norm in one `.tolist()`), ONE per logprob pass (its rows to the host).
- On the CPU the host's own reads (`.item()` / `.tolist()` of host tensors: row lengths, counts) are counted over an
  update: the same number for 2 and for 8 micro-batches per mini-batch (they are read once per mini-batch).
transformers' mask preparation would check once per forward whether position ids pack several sequences
(`find_packed_sequence_indices`, an `.all()` on the device); the logprob function answers it unread where its answer
is not needed (`attention.packing_known`: varlen attention, right padding), so no stub stands in for it here.
Run: .venv/bin/python -m pytest tests/model/test_host_syncs.py
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from grpo_lib.core.devices import to_device
from grpo_lib.model.actor import Actor
from grpo_lib.model.packing import shared_prefix_rows
from grpo_lib.model.score_plan import RowFacts, prefix_lengths, shared_groups
from grpo_lib.model.update_metrics import MicroBatchSums
from tests.scripts import grad_case as case
from tests.model.test_distillation_invariance import DISTILL_CASES, distill_extra, teacher_scores


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)  # the machine is shared; the model is tiny
    return case.write_tiny_model(tmp_path_factory.mktemp("syncs") / "model")


class DeviceReads:
    """Reads of meta tensors: `.tolist()` and `.cpu()` answered with zeros of their shape and recorded (with the
    backward passes run so far); every other read of a meta tensor raises, as meta tensors do."""

    def __init__(self, monkeypatch):
        self.reads: list[tuple[str, tuple, int]] = []
        self.backwards = 0
        tolist, cpu, backward = torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.backward

        def fake_tolist(t):
            if t.is_meta:
                self.reads.append(("tolist", tuple(t.shape), self.backwards))
                return tolist(torch.zeros(t.shape, dtype=t.dtype))
            return tolist(t)

        def fake_cpu(t, *args, **kwargs):
            if t.is_meta:
                self.reads.append(("cpu", tuple(t.shape), self.backwards))
                return torch.zeros(t.shape, dtype=t.dtype)
            return cpu(t, *args, **kwargs)

        def counted_backward(t, *args, **kwargs):
            self.backwards += 1
            return backward(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "tolist", fake_tolist)
        monkeypatch.setattr(torch.Tensor, "cpu", fake_cpu)
        monkeypatch.setattr(torch.Tensor, "backward", counted_backward)


def meta_actor(cfg, *, share: bool):
    """A tiny actor built on the CPU, its batch (grad_case's 4 prompts x 2, logprobs from the CPU model, teacher
    scores), then the actor moved to the meta device (its optimizer keeps the same parameter objects)."""
    actor = Actor(cfg, device=torch.device("cpu"))
    actor.share_prefixes = share
    batch = case.make_batch(actor.model)
    teacher_scores(batch)
    actor.model.to("meta")
    actor.device = torch.device("meta")
    return actor, batch


LOSSES = {
    "kl-entropy-gap": ("algorithm.rollout_correction.mode=token",),  # KL and entropy terms, the engine gap metric
    "distill-topk": None,  # forward_kl_topk: the student scores the teacher's ids (extra_ids)
    "distill-k1-pg": None,
}
LAYOUTS = {"padded": dict(remove_padding=False), "packed": dict(remove_padding=True, share=False),
           "shared prompts": dict(remove_padding=True, share=True)}


def loss_overrides(name: str, model_dir) -> tuple[str, ...]:
    if name.startswith("distill"):
        return distill_extra(model_dir, *DISTILL_CASES["forward_kl_topk" if name == "distill-topk" else "k1-pg-alone"])
    return LOSSES[name]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_update_reads_the_device_once_per_mini_batch(model_dir, monkeypatch, layout, loss):
    """Two mini-batches (2 prompts x 2 rows each) of 2 micro-batches (a prompt's 2 rows: packed, sharing their prompt
    in the shared layout): 4 forwards and backwards on the meta device and two reads, each right after its
    mini-batch's last backward, each of every device metric and the gradient norm at once."""
    settings = LAYOUTS[layout]
    cfg = case.make_config(model_dir, remove_padding=settings["remove_padding"], micro_batch_size=2,
                           extra=("actor.ppo_mini_batch_size=2", "actor.grad_clip=1.0", *loss_overrides(loss, model_dir)))
    actor, batch = meta_actor(cfg, share=settings.get("share", True))
    reads = DeviceReads(monkeypatch)
    metrics = actor.update(batch)
    assert reads.backwards == 4, "one backward per micro-batch"
    assert [(kind, when) for kind, _, when in reads.reads] == [("tolist", 2), ("tolist", 4)], reads.reads
    device_metrics = [k for k in metrics if not k.startswith(("perf/", "memory/"))
                      and k not in ("actor/lr", "actor/skipped_nonfinite_steps")]  # host values
    assert reads.reads[0][1] == (len(device_metrics),), f"{reads.reads[0][1]} values read for {sorted(device_metrics)}"
    # the layout really ran (the perf/ counts are the host's own decisions, not read)
    assert metrics["perf/packed"] == (1.0 if settings["remove_padding"] else 0.0)
    assert (metrics["perf/shared_prefix"] > 0) == (layout == "shared prompts")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprob_pass_copies_its_rows_to_the_host_once(model_dir, monkeypatch, layout):
    """The old-logprob pass over 4 micro-batches of a prompt's 2 rows: one copy to the host for the whole
    mini-batch, no read in between; the rows come back in their order ([8, T])."""
    settings = LAYOUTS[layout]
    cfg = case.make_config(model_dir, remove_padding=settings["remove_padding"], micro_batch_size=2)
    actor, batch = meta_actor(cfg, share=settings.get("share", True))
    reads = DeviceReads(monkeypatch)
    logprobs = actor.compute_logprobs(batch)
    assert [(kind, shape) for kind, shape, _ in reads.reads] == [("cpu", tuple(batch.input_ids.shape))], reads.reads
    assert logprobs.shape == batch.input_ids.shape


class HostReads:
    """Counts of `.item()`, `.tolist()` and bool / float / int of a tensor (on the CPU every tensor is a host tensor)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def counting(self, monkeypatch):
        originals = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def counted(original):
            def read(t, *args, **kwargs):
                self.count += 1
                return original(t, *args, **kwargs)
            return read

        with monkeypatch.context() as patch:
            for name, original in originals.items():
                patch.setattr(torch.Tensor, name, counted(original))
            yield self


def test_host_reads_do_not_grow_with_the_micro_batch_count(model_dir, monkeypatch):
    """An update of the padded layout (no attention kernel reading host boundaries per layer) and an old-logprob pass
    on the CPU: the same number of reads for 2 and for 8 micro-batches per mini-batch, the metrics read once."""
    counts = {}
    for size in (4, 1):  # rows per micro-batch: 2 and 8 micro-batches of the one mini-batch
        cfg = case.make_config(model_dir, remove_padding=False, micro_batch_size=size, extra=("actor.grad_clip=1.0",))
        actor = Actor(cfg, device=torch.device("cpu"))
        batch = case.make_batch(actor.model)
        with HostReads().counting(monkeypatch) as reads:
            actor.compute_logprobs(batch)
            passes = reads.count
            metrics = actor.update(batch)
        counts[size] = (passes, reads.count - passes)
        assert metrics["actor/grad_norm"] > 0
    assert counts[4] == counts[1], f"reads (old-logprob pass, update) with 2 / 8 micro-batches: {counts[4]} / {counts[1]}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: its sync debug mode watches the real device")
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_cuda_micro_batch_loop_makes_no_synchronizing_call(model_dir, remove_padding):
    """On a GPU: the update's micro-batch loop (forwards, losses, backwards, metric sums; the one read after it excluded)
    under `torch.cuda.set_sync_debug_mode("error")`, which raises at any call that makes the host wait for the device
    (a blocking copy, `.item()`, a boolean-mask index, a stream synchronisation). A first pass warms the caches up."""
    cfg = case.make_config(model_dir, remove_padding=remove_padding, micro_batch_size=2, extra=distill_extra(
        model_dir, *DISTILL_CASES["forward_kl_topk"]) + ("algorithm.rollout_correction.mode=token",))
    batch = case.make_batch(Actor(cfg, device=torch.device("cpu")).model)  # the host batch, from the same weights
    teacher_scores(batch)
    actor = Actor(cfg, device=torch.device("cuda"))
    actor._backward_micro_batches(batch, None)  # warm-up: allocator, cuBLAS, pinned host blocks
    actor.model.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sums, facts = actor._backward_micro_batches(batch, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    metrics, _ = actor._mini_batch_metrics(sums, facts)
    assert metrics["actor/pg_loss"] != 0 and sums.perf["micro_batches"] == 4


def test_to_device_sends_a_contiguous_pinned_copy_without_waiting(monkeypatch):
    """A host tensor bound for a GPU goes through a contiguous pinned buffer with non_blocking=True (a plain `.to`
    synchronises the stream; so does a strided one, through a pageable temporary); elsewhere `.to` as usual. The view
    sent is a column-trimmed one, as `RolloutBatch.select(width=)` makes them."""
    from grpo_lib.core import devices

    sent = []

    class Pinned(torch.Tensor):
        def to(self, device, non_blocking=False):
            sent.append((str(device), non_blocking, self.is_contiguous(), torch.Tensor(self).clone()))
            return "sent"

    def pinned_like(tensor):  # CPU torch cannot pin: a plain contiguous buffer standing in for the pinned one
        return torch.Tensor._make_subclass(Pinned, torch.zeros(tensor.shape, dtype=tensor.dtype))

    monkeypatch.setattr(devices, "_pinned_like", pinned_like)
    view = torch.arange(12.0).reshape(3, 4)[:, :2]  # [3, 2], strides (4, 1): not contiguous
    assert not view.is_contiguous()
    assert to_device(view, torch.device("cuda", 0)) == "sent"
    ((device, non_blocking, contiguous, values),) = sent
    assert (device, non_blocking, contiguous) == ("cuda:0", True, True)
    torch.testing.assert_close(values, view, rtol=0, atol=0)
    host = torch.ones(2)
    assert to_device(host, torch.device("cpu")) is host


def test_micro_batch_sums_are_the_python_loops_bit_for_bit():
    """MicroBatchSums on float32 scalars = the per-micro-batch `.item()` loop it replaces (python floats): the same
    float64 products added in the same order, a dummy (weight 0) adding nothing to the ranges."""
    generator = torch.Generator().manual_seed(3)
    micro = [(1.0, 17), (1.0, 5), (0.0, 0), (1.0, 40)]  # (weight, loss tokens); the third is a dummy
    keys = ["actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss", "actor/kl_loss", "distillation/loss_min",
            "distillation/loss_max", "distillation/kl_mean"]
    sums, summed, weighted, low, high = MicroBatchSums(), {}, {}, {}, {}
    for weight, tokens in micro:
        values = {k: torch.randn((), generator=generator) for k in keys}  # float32 device scalars
        sums.add({**values, "perf/packed": 1.0}, weight=weight, loss_tokens=tokens)
        for k, v in ((k, v.item()) for k, v in values.items()):  # the old loop (actor._add_micro_batch_metrics)
            if k in ("actor/pg_loss", "actor/kl_loss"):
                summed[k] = summed.get(k, 0.0) + weight * v
            elif k == "distillation/loss_min":
                low[k] = min(low.get(k, math.inf), v if weight else math.inf)
            elif k == "distillation/loss_max":
                high[k] = max(high.get(k, -math.inf), v if weight else -math.inf)
            else:
                weighted[k] = weighted.get(k, 0.0) + weight * v * tokens
    got, got_weighted, extra = sums.read(torch.tensor(2.5))
    assert got == {**summed, **low, **high} and list(got) == ["actor/pg_loss", "actor/kl_loss", "distillation/loss_min",
                                                              "distillation/loss_max"]
    assert got_weighted == weighted and extra == [2.5] and sums.perf == {"micro_batches": 3.0, "perf/packed": 3.0}


def test_row_facts_group_prompts_as_shared_prefix_rows():
    """The prefix keys (one torch.unique per batch) group rows exactly as `packing.shared_prefix_rows` (token by token,
    one read per row) does, on rows with equal prompts, equal tokens under other prompt lengths, and no loss token."""
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0], [5, 6, 7, 1, 2], [5, 6, 7, 0, 0], [4, 4, 4, 4, 0], [5, 6, 3, 3, 3]])
    mask = (ids != 0).long()  # [6, 5]; the rows are right-padded
    scores = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0],
                           [0, 0, 1, 1, 1]])  # prompts [5, 6], [5, 6], [5, 6, 7], [5, 6], none, [5, 6]
    facts = RowFacts.of(mask, scores, input_ids=ids)
    assert facts.prefix_lens == prefix_lengths(scores) == [2, 2, 3, 2, 0, 2]
    assert shared_groups(facts) == shared_prefix_rows(ids, mask, facts.prefix_lens) == [(2, [0, 1, 3, 5]), (0, [2]), (0, [4])]
    assert facts.select([2, 0]).lens == [5, 4] and facts.score_tokens == [2, 1, 2, 1, 0, 3]
