"""What every generation engine is: its interface and its lifecycle, named by what the engine holds on the device.

Each training process owns one engine in the same process (no server, no Ray), picked by `rollout.name` from the
registry of `grpo_lib/rollout/engines/__init__.py`: `VLLMEngine` (`engines/vllm.py`) or `HFEngine` (`engines/hf.py`). Both
satisfy the `RolloutEngine` protocol below, the union of three by concern (`Generator`: generate / score / sessions;
`WeightSink`: push_weights / reset_prefix_cache; `ColocatedMemory`: release / restore_* / prepare_for_generation), and share one lifecycle state machine
(`Lifecycle`), so the memory hand-off between the engine and the update is written down once; each engine maps the
transitions onto its own calls (vLLM's sleep mode: `engines/vllm.py`):

    ready --release()--> released --prepare_for_generation(weights)--> ready
                                    = empty the trainer's device cache -> restore weights -> push -> reset prefix
                                      cache -> the actor's offload (free_trainer_memory) -> empty the trainer's
                                      device cache (the push's blocks) -> restore cache

    states: ready (weights + cache on the device) | released (neither) | weights_only (weights, no cache)
    generate / score_logprobs: ready only.     push / reset_prefix_cache: weights_only or ready.
    restore_cache: weights_only only.          restore_all (weights and cache at once): released only, never after
                                               a partial restore.
    a release that discards the weights (`discards_weights`): restoring the cache before a push is refused.

An illegal order raises `LifecycleError` on CPU too (where the engines move no memory), so a test on CPU catches an
order that would hang or re-map memory on a GPU. Where CUDA is present every transition records the device's free
memory (`memory/*` metrics); these and the engine's own counters (`rollout/preemptions`) come out through one call,
`engine.pop_metrics(prefix)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch

from grpo_lib.core.types import Generation, ScoreRequest


# ------------------------------------------------------------------------------------------------ interface
# generate's optional `on_finished`: called after every engine step (decode step) with the responses that finished in
# it, as (prompt index, sample index, Generation) -- often an empty list, which lets the caller poll its own work (the
# reward stream) between steps. The Generations are the ones generate returns; the caller must not change them.
OnFinished = Callable[[list[tuple[int, int, Generation]]], None]


class GenerationSession(Protocol):
    """Requests added to the running engine one by one, while the others generate (the per-episode loop of
    `grpo_lib/rollout/episodes.py`: an episode's next turn joins as soon as its tools answered). An engine that offers one has
    `open_session(*, temperature, top_p, top_k, logprobs)`, a context manager that yields it (the engine is generating
    inside: lifecycle state ready; on leaving, unfinished requests are aborted); one without (`HFEngine`) has none, and
    its callers keep calling `generate` turn by turn.

        with engine.open_session(temperature=1.0, top_p=1.0, top_k=-1, logprobs=True) as session:
            session.add("ep0", [1, 2, 3], max_tokens=8, seed=7)
            while session.unfinished:
                for key, generation in session.step():  # what finished in this engine step (often nothing)
                    ...                                 # may session.add(...) the next turn

    A request with (prompt ids, max_tokens, seed) samples the same tokens as `generate([prompt ids], n=1, seeds=[seed],
    max_tokens=...)` with the same sampling settings.
    """

    def add(self, key, prompt_ids: list[int], *, max_tokens: int, seed: int | None) -> None: ...

    def step(self) -> list[tuple[object, Generation]]: ...

    @property
    def unfinished(self) -> int: ...


# The engine interface by concern: what the step asks of generation, of the weight push, and of the memory hand-off with
# the colocated update. Code that needs one concern can ask for that protocol alone (a weight sink needs no sampler).
@runtime_checkable
class Generator(Protocol):
    """Token ids in; token ids, per-token logprobs (processed: after temperature / top-k / top-p; 0.0 when greedy),
    finish reasons ("stop" / "length") and text out. `seeds[i]` seeds sample 0 of prompt i, sample k uses
    seeds[i] + k (`grpo_lib/core/seeds.py`). `max_tokens` is one limit, or one per prompt (the multi-turn loop's remaining
    budget per episode). `on_finished` (`OnFinished`, optional) hears of each response as it finishes (the reward
    stream scores it while the rest generate); what generate returns is the same with or without it. `score`
    (`types.ScoreRequest`, optional: the weight probe) is scored inside the call, from the weights it generates with,
    and changes nothing it generates. score_logprobs: every token's logprob given its prefix (entry 0 is 0),
    temperature 1. `stop` (optional, carry-over: grpo_lib/rollout/carry.py) is asked after every engine step, after
    `on_finished`; once it says True the call returns, each unfinished response as far as it got (its tokens and
    logprobs so far, finish reason "abort"). An engine may also offer `open_session` (`GenerationSession`: requests added while it generates;
    vLLM). Legal in the lifecycle state ready only.
    """

    pad_id: int

    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, max_tokens: int | list[int], top_p: float = 1.0,
                 top_k: int = -1, seeds: list[int] | None = None, logprobs: bool = True,
                 on_finished: OnFinished | None = None, score: ScoreRequest | None = None,
                 stop: Callable[[], bool] | None = None) -> list[list[Generation]]: ...

    def score_logprobs(self, sequences: list[list[int]]) -> list[list[float]]: ...


@runtime_checkable
class WeightSink(Protocol):
    """Where the actor's weights go after an update: `push_weights` streams (Hugging Face name, full tensor) pairs into
    the engine in place (nothing reloads from disk); `reset_prefix_cache` drops what was computed with the old ones.
    `weight_version` is the version of the weights the engine serves (0 as built, then the `version` of each push:
    `EngineGlue.prepare_for_generation`). Legal while the engine holds its weights on the device (weights_only or ready)."""

    weight_version: int

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def reset_prefix_cache(self) -> None: ...


@runtime_checkable
class ColocatedMemory(Protocol):
    """The device memory the engine shares with the update in the same process: the transitions of the module
    docstring's state machine (`lifecycle`), and `prepare_for_generation`, the whole released -> ready hand-off with
    the actor's weights (`EngineGlue` supplies it over the others)."""

    lifecycle: Lifecycle

    def release(self) -> None: ...

    def restore_weights(self) -> None: ...

    def restore_cache(self) -> None: ...

    def restore_all(self) -> None: ...

    def prepare_for_generation(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                               free_trainer_memory: Callable[[], None] | None = None, version: int | None = None) -> None: ...


@runtime_checkable
class RolloutEngine(Generator, WeightSink, ColocatedMemory, Protocol):
    """What the trainer needs from a generation engine (vLLM or transformers): the three concerns above, and one
    call for the engine's counters (`pop_metrics`: rollout/preemptions, memory/*; `EngineGlue` supplies it)."""

    def pop_metrics(self, prefix: str = "") -> dict[str, float]: ...


# ------------------------------------------------------------------------------------------------ lifecycle
class LifecycleError(RuntimeError):
    """An engine call out of the legal lifecycle order (it would hang, re-map memory or generate garbage on GPU)."""


def empty_trainer_cache() -> None:
    """Return the trainer's cached CUDA blocks to the device so the engine can map its weights and cache."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_free_mb() -> float | None:
    """Free device memory in MiB (whole device, so it sees an engine's own allocator too); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return free / 2**20


def sleep_residual_mb() -> float | None:
    """Device MiB in use that torch's allocator does not account for as live memory, right after the engine's release:
    (total - free) of the device less (torch's reserved bytes less the engine's unmapped sleep pool). What is left:
    the CUDA context and NCCL's buffers, and what the engine holds outside its sleep pool (its CUDA-graph pool and
    buffers): the residual that fake-tensor plans cannot see (scripts/gpu_check.sh prints it). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from grpo_lib.core.perf import engine_unmapped_bytes

    free, total = torch.cuda.mem_get_info()
    return (total - free - (torch.cuda.memory_reserved() - engine_unmapped_bytes())) / 2**20


class Lifecycle:
    """The engine's memory state, the legal order of its transitions (module docstring) and the engine's counters.

    `frees_memory` is whether a release really frees device memory (a GPU with rollout.free_cache_engine); without
    it the transitions are tracked and checked but move nothing. `discards_weights` is whether a release drops the
    weights instead of moving them off the device, so they must be pushed again before the cache is restored.
    `metrics` holds the counters since the last `pop_metrics`: memory/* of each transition (CUDA only) and what the
    engine adds during one (`add`: rollout/preemptions during generate).
    """

    # transition -> (states it may start from, state it leaves; None: unchanged)
    RULES = {
        "release": ({"ready"}, "released"),
        "restore_weights": ({"released"}, "weights_only"),
        "restore_cache": ({"weights_only"}, "ready"),
        "restore_all": ({"released"}, "ready"),
        "push": ({"weights_only", "ready"}, None),
        "reset_prefix_cache": ({"weights_only", "ready"}, None),
        "generate": ({"ready"}, None),
    }
    # transition -> its memory metric; the names keep vLLM's sleep / wake words they have always been logged under
    METRIC = {"release": "memory/sleep_freed_mb", "restore_weights": "memory/wake_weights_mb",
              "restore_cache": "memory/wake_kv_cache_mb", "restore_all": "memory/wake_regained_mb",
              "empty_cache": "memory/empty_cache_freed_mb", "push_cache": "memory/push_cache_freed_mb"}

    def __init__(self, *, frees_memory: bool, discards_weights: bool):
        self.frees_memory, self.discards_weights = frees_memory, discards_weights
        self.state = "ready"  # a freshly built engine holds its weights and cache
        self.weights_valid = True  # False after a release that discarded the weights, until the next push
        self.metrics: dict[str, float] = {}

    @contextmanager
    def transition(self, name: str):
        allowed, after = self.RULES[name]
        if self.state not in allowed:
            raise LifecycleError(f"engine {name} while {self.state} (legal from {sorted(allowed)}); the order is "
                                 "generate -> release -> update -> prepare_for_generation(weights) -> generate")
        if name in ("restore_cache", "restore_all", "generate") and not self.weights_valid:
            raise LifecycleError(f"engine {name} after a release discarded the weights: push the weights first")
        before = device_free_mb() if name in self.METRIC else None
        yield
        if after is not None:
            self.state = after
        if name == "release" and self.frees_memory and self.discards_weights:
            self.weights_valid = False
        if name == "push":
            self.weights_valid = True
        self.record(name, before)

    def add(self, name: str, value: float) -> None:
        """Add `value` to the counter `name` (summed until the next pop_metrics)."""
        self.metrics[name] = self.metrics.get(name, 0.0) + value

    def record(self, name: str, before: float | None) -> None:
        """Device memory the transition freed (release, empty_cache, push_cache) or took (restores), MiB; nothing
        without CUDA."""
        if before is None:
            return
        now = device_free_mb()
        freed = now - before  # > 0: the device has more free memory than before
        value = freed if name in ("release", "empty_cache", "push_cache") else -freed
        self.add(self.METRIC[name], value)
        if name in ("restore_weights", "restore_cache"):
            self.add("memory/wake_regained_mb", value)
        self.metrics["memory/device_free_mb"] = now
        if name == "release":  # what the engine keeps while it sleeps, beside what torch's allocator holds
            residual = sleep_residual_mb()
            if residual is not None:
                self.metrics["memory/sleep_residual_mb"] = residual

    def empty_trainer_cache(self, metric: str = "empty_cache") -> None:
        """`empty_trainer_cache` with the device memory it freed counted under METRIC[metric]."""
        before = device_free_mb()
        empty_trainer_cache()
        self.record(metric, before)


# ------------------------------------------------------------------------------------------------ shared glue
class EngineGlue:
    """The phase-level calls every engine shares, over its `lifecycle` and its own release / restore methods."""

    weight_version = 0  # the weights the engine was built with (model.path); each push with a version sets it

    def prepare_for_generation(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                               free_trainer_memory: Callable[[], None] | None = None, version: int | None = None) -> None:
        """released -> ready with the actor's weights: empty the trainer's cache, restore weights, push, reset prefix
        cache, `free_trainer_memory()` (the actor's offload: the shards the push gathered leave the device BEFORE the
        cache is restored, which needs that memory free at once), empty the trainer's cache again (what the push left
        cached), restore cache. `weights` None (nothing changed since the last push) is refused after a release that
        discarded the weights. `version` (with `weights`): the weight version the engine reports from then on
        (`weight_version`; grpo_lib/rollout/weight_sync.py numbers them)."""
        self.lifecycle.empty_trainer_cache()
        self.restore_weights()
        if weights is not None:
            self.push_weights(weights)
            self.reset_prefix_cache()
            if version is not None:
                self.weight_version = version
        if free_trainer_memory is not None:
            free_trainer_memory()
        if weights is not None:
            # The push's blocks are free but still reserved by torch's caching allocator: the full tensors FSDP2
            # gathered one at a time (the fp32 embedding, 1.5 GiB for Qwen3-4B), their copies cast to the engine's dtype
            # and the rollout.update_weights_bucket_megabytes bucket. vLLM maps its KV cache with its own allocator,
            # which cannot use torch's reserve: returned to the device here, once, or they stay reserved through
            # generation (Actor.offload empties the cache only with an offload key on; memory/push_cache_freed_mb says
            # how much).
            self.lifecycle.empty_trainer_cache("push_cache")
        self.restore_cache()

    def pop_metrics(self, prefix: str = "") -> dict[str, float]:
        """The engine's counters whose names start with `prefix`, summed since they were last popped; they restart at 0.

        rollout/preemptions: sequences the engine preempted during generate (always present; 0 for an engine that
        never preempts). memory/*: device MiB each transition freed or took, and memory/device_free_mb after the last
        one (CUDA only). Example: after a generate that preempted 3 sequences, pop_metrics("rollout/") ->
        {"rollout/preemptions": 3.0}, then again -> {"rollout/preemptions": 0.0}; on CPU pop_metrics("memory/") -> {}.
        """
        counters = {"rollout/preemptions": 0.0, **self.lifecycle.metrics}
        popped = {k: v for k, v in counters.items() if k.startswith(prefix)}
        self.lifecycle.metrics = {k: v for k, v in self.lifecycle.metrics.items() if k not in popped}
        return popped
