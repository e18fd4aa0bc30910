"""`--print-plan --measure`: the training phase's memory per GPU MEASURED by running our real update at the real model
size on fake tensors, on a CPU, in about a minute for Qwen3-4B (43-59 s on a shared 2-core machine) (`python -m grpo_lib.planning.measure RECIPE ...`).

What runs is this project's own code, not a model of it: the run's `Actor`, built by `Actor.from_model` through the
same `Actor._build` as a run's (`fsdp.shard`: FSDP2 over a fake W-process group, this process = rank 0), `Actor.accumulate_gradients` (the packed logprob path through the FSDP2 root, the chunked
checkpointed output head, the loss, backward) and `Actor._optimizer_step` (norm, clipping, AdamW), on ONE micro-batch
that fills the token budget (`actor.ppo_max_token_len_per_gpu`: sequences of the longest allowed length and a last
one with the rest), in the steady state: AdamW's moments exist and the earlier micro-batches' gradients are in place
(a mini-batch has hundreds of micro-batches; the first one peaks lower). Every tensor is a `FakeTensor` (shape, dtype, no storage): the model is built from its config.json
on fake tensors, so nothing is downloaded or allocated. torch's `FSDPMemTracker` counts every live tensor by kind
(sharded parameters, gradients, optimizer state, unsharded parameters, activations, temporaries) and keeps the peak.

How (the facts each piece rests on, all torch internals, read in torch 2.13's source: `check_torch` refuses a torch
that lacks one of these names, and on a torch other than 2.13 (the lent GPU image has 2.11) prints the numbers under an
"unverified torch version" warning with a self-check of the fake-mode helpers on that torch beside them, never silently):
- Process group: backend "fake" (`torch.testing._internal.distributed.fake_pg`, registered on import) with a
  `FakeStore`; the collectives allocate their outputs and move no data. The device mesh is built outside fake mode.
- Device: the CPU. FSDP2 on a faked "cuda" device fails on a CPU-only torch (`_get_device_from_mesh` asserts), so the
  numbers are bytes of tensors, whatever device holds them; the compute dtype is the GPU's (bf16 for `auto`).
- Real small tensors under fake mode (`_RealSmallTensors`): integer and bool work (masks, packing indices, boolean
  indexing: `aten.nonzero` has no fake output shape) runs on real tensors whenever no input is fake; a boolean index
  into a fake tensor becomes its real `nonzero()` positions; `.item()` of a fake float answers a placeholder (1.0).
- DTensor's sharding propagation gets its own fake mode: it reuses the active one otherwise, and the tracker then counts
  its global-shape scratch tensors (as optimizer state at the step).
- The tracker's module hooks (ModTracker's pre- and post-forward) are skipped under `no_grad` (the prompt tokens scored
  without grad inside the update's forward): the pre-forward hook asserts there, on real tensors too.
- The split between the backward's and the optimizer step's peak resets the tracker's peak fields at the step's
  pre-hook (`_peak_mem`, `_peak_mem_snap`).
A real-tensor run of the same code (`fake=False`, small models only) gives the same tracker numbers
(tests/planning/test_plan_measure.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from copy import deepcopy
from dataclasses import dataclass

import torch

VERIFIED_TORCH = ("2.13",)  # the versions whose private APIs (fake_pg, FSDPMemTracker, DTensor propagation) were read
# The private names this module uses: (module, attribute path); a torch without one is refused with its name.
PRIVATE_API = (("torch.testing._internal.distributed.fake_pg", "FakeStore"),
               ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),
               ("torch.distributed._tools.mem_tracker", "_TOTAL_KEY"),
               ("torch.distributed._tools.mem_tracker", "MemTracker.get_tracker_snapshot"),
               ("torch.distributed._tools.mod_tracker", "ModTracker._fw_pre_hook"),
               ("torch.distributed._tools.mod_tracker", "ModTracker._fw_post_hook"),
               ("torch.distributed.tensor._sharding_prop", "detect_fake_mode"),
               ("torch.distributed.device_mesh", "init_device_mesh"),
               ("torch._subclasses.fake_tensor", "FakeTensor"),
               ("torch._subclasses.fake_tensor", "unset_fake_temporarily"))
# Fields of MemTracker the backward / optimizer-step split resets (`measure_update`): instance attributes.
TRACKER_FIELDS = ("_peak_mem", "_peak_mem_snap")


class MeasureError(RuntimeError):
    """The measurement cannot run here (a torch without the private APIs it uses, no transformers model class, ...)."""


def missing_private_api() -> list[str]:
    """The private names of PRIVATE_API / TRACKER_FIELDS this torch lacks (empty: every one is there)."""
    import importlib

    missing = []
    for module_name, path in PRIVATE_API:
        try:
            obj = importlib.import_module(module_name)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{path}")
    if not missing:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        missing += [f"MemTracker().{field}" for field in TRACKER_FIELDS if not hasattr(tracker, field)]
    return missing


def check_torch(version: str | None = None) -> str | None:
    """None on a torch whose private APIs this module was checked against (VERIFIED_TORCH); on another, the warning to
    print beside the numbers (they are measured all the same). Raises MeasureError when this torch lacks one of the
    private names used (`missing_private_api`): no number rather than a crash half-way."""
    version = version or torch.__version__
    missing = missing_private_api()
    if missing:
        raise MeasureError(f"torch {version} lacks the private APIs --measure uses: {', '.join(missing)}; use the "
                           f"analytic plan (--print-plan without --measure), or torch {VERIFIED_TORCH[-1]}")
    if any(version == v or version.startswith(v + ".") for v in VERIFIED_TORCH):
        return None
    return (f"WARNING: unverified torch version {version}: --measure was checked against torch "
            f"{', '.join(VERIFIED_TORCH)} (its fake process group, FSDPMemTracker and DTensor internals); every name it "
            "uses is present here, but their behaviour was not read in this version's source: compare with the plan")


SELF_CHECK_MODEL = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": True,
                    "max_position_embeddings": 512}


def self_check(cfg) -> str:
    """On an unverified torch: a small model's measurement on fake tensors against the same code on real tensors
    (`measure_update(fake=False)`, the run's config, a 128 + 72-token micro-batch, 4 fake processes); equal byte counts
    mean the fake-mode helpers change no allocation on this torch (what tests/planning/test_plan_measure.py asserts on torch
    2.13). It cannot see a tracker that counts differently in both runs. Returns the line to print."""
    fake, real = (measure_update(cfg, SELF_CHECK_MODEL, world_size=4, fake=f, lengths=[128, 72], verified=True)
                  for f in (True, False))
    if fake.backward == real.backward and fake.optimizer_step == real.optimizer_step:
        return (f"self-check on torch {torch.__version__}: a small model measured on fake tensors equals the same update "
                f"on real tensors byte for byte (peak {fake.peak} bytes)")
    return (f"self-check on torch {torch.__version__} FAILED: a small model's peak on fake tensors {fake.peak} bytes, on "
            f"real tensors {real.peak} bytes: the fake-tensor numbers below are not trustworthy on this torch")


@dataclass
class Measured:
    """Bytes on rank 0 at the peak of the measured update, by the tracker's kinds."""

    backward: dict[str, int]  # at the peak of the forward + backward: tracker kind ("Sharded Param", ...) -> bytes, "Total"
    optimizer_step: dict[str, int]  # the same at the peak of clipping + AdamW's step
    micro_batch_tokens: list[int]  # the sequence lengths of the measured micro-batch
    seconds: float

    @property
    def peak(self) -> int:
        return max(self.backward["Total"], self.optimizer_step["Total"])


# ------------------------------------------------------------------------------------------ fake-mode helpers


class _RealSmallTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Entered INSIDE a FakeTensorMode: keeps integer / bool work on real tensors (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        fake = [t for t in tensors if isinstance(t, FakeTensor)]
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default and fake:
            return 1.0 if fake[0].dtype.is_floating_point else 1  # .item() of a fake value: a placeholder
        if func in (aten.index.Tensor, aten._unsafe_index.Tensor) and fake:
            return func(args[0], [i for index in args[1] for i in self._positions(index)])
        if not fake and (tensors or self._integral_factory(func, args, kwargs)):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _integral_factory(func, args, kwargs) -> bool:
        """Whether a factory (no tensor inputs) makes an integer / bool tensor: asked of the same call on the meta device."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        try:
            with unset_fake_temporarily():
                out = func(*args, **{**kwargs, "device": torch.device("meta")})
        except (TypeError, RuntimeError, NotImplementedError):  # a factory without a device argument: left fake
            return False
        return isinstance(out, torch.Tensor) and not (out.dtype.is_floating_point or out.dtype.is_complex)

    @staticmethod
    def _positions(index):
        """A real boolean index of d dims -> its d real position tensors (long indices the fake kernel can shape)."""
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if index is None or isinstance(index, FakeTensor) or index.dtype not in (torch.bool, torch.uint8):
            return [index]
        with unset_fake_temporarily():
            return list(index.nonzero(as_tuple=True))


@contextlib.contextmanager
def _fake_world(world_size: int):
    """A fake process group of `world_size` ranks, this process rank 0; torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    if dist.is_initialized():
        raise MeasureError("--measure needs a process without a process group (run it outside accelerate launch)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _patched_for_fake(fake_mode):
    """DTensor propagation on its own fake mode; the device mesh built outside fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import device_mesh
    from torch.distributed.tensor import _sharding_prop

    own = torch._subclasses.FakeTensorMode()
    original_mesh = device_mesh.init_device_mesh

    def mesh_outside_fake(*args, **kwargs):
        with unset_fake_temporarily():
            return original_mesh(*args, **kwargs)

    saved = (_sharding_prop.detect_fake_mode, device_mesh.init_device_mesh)
    _sharding_prop.detect_fake_mode = lambda *a, **k: own
    device_mesh.init_device_mesh = mesh_outside_fake
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode, device_mesh.init_device_mesh = saved


@contextlib.contextmanager
def _module_hooks_only_with_grad():
    """The tracker's module hooks (ModTracker) skip forwards under no_grad: its pre-forward hook asserts there (the
    prompt tokens scored without grad inside the update's forward), with real tensors as with fake ones."""
    from torch.distributed._tools.mod_tracker import ModTracker

    saved = (ModTracker._fw_pre_hook, ModTracker._fw_post_hook)

    def only_with_grad(hook):
        def inner(self, *args):
            if torch.is_grad_enabled():
                return hook(self, *args)
            return None

        return inner

    ModTracker._fw_pre_hook, ModTracker._fw_post_hook = (only_with_grad(h) for h in saved)
    try:
        yield
    finally:
        ModTracker._fw_pre_hook, ModTracker._fw_post_hook = saved


# ------------------------------------------------------------------------------------------ the measured update


def budget_lengths(tokens: int, max_seq: int) -> list[int]:
    """Sequence lengths of the fullest micro-batch under a `tokens` budget: full-length sequences, then the rest.

    Example: budget 3000, sequences of at most 2048 -> [2048, 952]; budget 8192 -> [2048, 2048, 2048, 2048].
    """
    lengths = [max_seq] * (tokens // max_seq)
    if tokens % max_seq >= 2:
        lengths.append(tokens % max_seq)
    return lengths or [tokens]


def _batch(lengths: list[int], prompt_share: float, vocab: int, kl: bool):
    """A RolloutBatch of real tensors: rows of `lengths` tokens, the last (1 - prompt_share) of each the response."""
    from grpo_lib.core.types import RolloutBatch

    b, width = len(lengths), max(lengths)
    ids = torch.randint(0, vocab, (b, width), generator=torch.Generator().manual_seed(0))  # [b, T]
    mask = torch.zeros(b, width, dtype=torch.long)  # [b, T]
    loss = torch.zeros(b, width)  # [b, T]
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        loss[i, max(1, round(n * prompt_share)):n] = 1.0
    zeros = torch.zeros(b, width)  # [b, T]
    return RolloutBatch(input_ids=ids * mask, attention_mask=mask, response_mask=loss.clone(), loss_mask=loss,
                        rollout_logprobs=zeros.clone(), group_ids=[str(i) for i in range(b)], response_texts=[""] * b,
                        data_sources=["plan"] * b, ground_truths=[None] * b, extra_infos=[{}] * b,
                        truncated=torch.zeros(b, dtype=torch.bool), advantages=torch.ones(b, width) * loss,
                        old_logprobs=zeros.clone(), ref_logprobs=zeros.clone() if kl else None)


def _actor(cfg, model, device):
    """The run's `Actor` around the model built from its config (`Actor.from_model`: the same `_build` as a run's), with
    the GPU's choices on the CPU: the GPU's compute dtype as FSDP2's gather dtype and no CPU autocast (on a GPU the
    MixedPrecisionPolicy casts), the GPU's AdamW (fused), no broadcast into the shards (fake tensors hold no values),
    and no packing isolation check (it compares values, which fake tensors do not have; the run makes it)."""
    from grpo_lib.core.dtypes import torch_dtype
    from grpo_lib.model.actor import Actor

    return Actor.from_model(cfg, model, device=device,
                            param_dtype=torch_dtype(cfg.actor.fsdp_config.param_dtype, torch.device("cuda")),
                            compute_dtype=torch.float32, optimizer_device_type="cuda",
                            attn=("sdpa", "the measured model (from its config.json)"), export_dtype=torch.float32,
                            fill=False, check_packing=False)


def measure_update(cfg, model_config: dict, *, world_size: int, fake: bool = True,
                   lengths: list[int] | None = None, verified: bool = False) -> Measured:
    """Run one optimizer step of our update (one micro-batch filling the token budget) on rank 0 of a fake
    `world_size`-process group and return the tracker's peak. `fake=False` runs the same on real tensors (small models).
    `verified`: the caller has run `check_torch` already."""
    if not verified:
        check_torch()  # before the private imports below
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model.lora_rank > 0:
        raise MeasureError("--measure covers full fine-tuning; with LoRA (model.lora_rank > 0) read the analytic plan")
    if cfg.actor.use_torch_compile:  # the actor would compile its layers on fake tensors: not what this measures
        raise MeasureError("--measure measures the eager update; set actor.use_torch_compile=false for the measurement")
    start = time.perf_counter()
    d, a = cfg.data, cfg.actor
    max_seq = d.max_prompt_length + d.max_response_length
    budget = a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu * max_seq
    lengths = lengths or budget_lengths(budget, max_seq)
    hf_config = AutoConfig.for_model(**model_config)
    hf_config.use_cache = False
    device = torch.device("cpu")
    kl = a.use_kl_loss
    batch = _batch(lengths, d.max_prompt_length / max_seq, hf_config.vocab_size, kl)
    fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng())  # the caller's random state is left as it was
        stack.enter_context(_fake_world(world_size))
        stack.enter_context(_module_hooks_only_with_grad())
        if fake:
            stack.enter_context(_patched_for_fake(fake_mode))
            stack.enter_context(fake_mode)
            stack.enter_context(_RealSmallTensors())
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
        actor = _actor(cfg, model, device)
        actor.policy.train()
        _steady_state(actor)  # AdamW's moments and the earlier micro-batches' gradients exist before this backward
        tracker = FSDPMemTracker(actor.policy, actor.optimizer)
        tracker.track_inputs((batch.input_ids, batch.attention_mask))
        backward = {}

        def split_at_step(*_):  # the peak so far is the backward's; from here on the tracker's peak is the step's
            backward["peak"] = deepcopy(tracker.get_tracker_snapshot("peak"))
            now = tracker.get_tracker_snapshot()
            tracker._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in now.items()}  # torch 2.13's MemTracker fields
            tracker._peak_mem_snap = deepcopy(now)

        hook = actor.optimizer.register_step_pre_hook(split_at_step)
        with tracker:
            actor._optimizer_step(batch)
        hook.remove()
        step = tracker.get_tracker_snapshot("peak")
    return Measured(backward=_kinds(backward["peak"]), optimizer_step=_kinds(step), micro_batch_tokens=lengths,
                    seconds=time.perf_counter() - start)


def _steady_state(actor) -> None:
    """Outside the tracker: one AdamW step on zero gradients (the moments exist, as in every step after the first),
    then zero gradients left in place: the measured micro-batch is one after the first of its mini-batch (a mini-batch
    has hundreds), whose backward accumulates into the whole sharded gradient."""
    params = [p for p in actor.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    actor.optimizer.step()
    for p in params:
        p.grad = torch.zeros_like(p)


def _kinds(snapshot) -> dict[str, int]:
    """A tracker snapshot of one device -> {kind: bytes, "Total": bytes}."""
    (per_kind,) = snapshot.values()  # one device: the CPU
    return {getattr(k, "value", str(k)): int(v) for k, v in per_kind.items() if v or k == "Total"}


def measure_lines(cfg, model_config: dict, sizes, world_size: int, parts: dict, gpu_bytes: float) -> list[str]:
    """The measured training phase's lines, beside the analytic plan's (`parts`, grpo_lib.planning.plan.memory_plan)."""
    from grpo_lib.planning.memory import GIB, fitting_budget

    warning = check_torch()
    lines = [warning, self_check(cfg)] if warning else []
    m = measure_update(cfg, model_config, world_size=world_size, verified=True)
    analytic = parts["training phase"] - parts["CUDA context + NCCL"]
    lines += [(f"micro-batch {' + '.join(map(str, m.micro_batch_tokens))} tokens, after earlier micro-batches of its mini-batch; "
              f"measured in {m.seconds:.0f} s (torch {torch.__version__})")]
    for name, kinds in (("forward + backward", m.backward), ("clip + AdamW step", m.optimizer_step)):
        shown = ", ".join(f"{k} {v / GIB:.2f}" for k, v in kinds.items() if k != "Total" and v >= 0.005 * GIB)
        lines.append(f"{name:<20} {kinds['Total'] / GIB:7.2f} GiB ({shown})")
    lines.append(f"measured peak        {m.peak / GIB:7.2f} GiB; analytic training phase without the CUDA context "
                 f"{analytic / GIB:.2f} GiB ({(m.peak / analytic - 1) * 100:+.1f}%)")
    tokens = sum(m.micro_batch_tokens)
    slope = m.backward.get("Activation", 0) / tokens
    if slope > 0:
        best = fitting_budget(cfg, sizes, world_size=world_size, gpu_bytes=gpu_bytes, slope=slope)
        lines.append(f"measured activations {slope / 2**20:.3f} MiB per token (at the peak, over {tokens} tokens): largest "
                     f"actor.ppo_max_token_len_per_gpu that fits {gpu_bytes / GIB:g} GiB {best}")
    return lines


def main(argv: list[str]) -> int:
    """`python -m grpo_lib.planning.measure RECIPE [key=value ...] [--num-processes N] [--gpu-memory-gb G] [--model-config F]`:
    the plan of `--print-plan` with the measured training phase (the same as `train_grpo.py RECIPE --print-plan --measure`)."""
    from grpo_lib.planning.plan import print_plan

    try:
        check_torch()  # a torch without the private APIs: exit 2 before the plan (another version: measured, warned)
    except MeasureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_plan([*argv, "--print-plan", "--measure"], measure=measure_lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
