"""`rollout.name: hf`: generation with transformers, for machines without vLLM (a Mac, a GPU image without vLLM).

Same interface as `VLLMEngine` (`grpo_lib.rollout.engines.base.RolloutEngine`) and the same lifecycle state machine. The
sampling loop is written here rather than calling `model.generate`, because every sample needs its own seeded
generator: sample k of prompt i draws from `torch.Generator().manual_seed(seeds[i] + k)` (vLLM's rule for the n
children of a request), so a sample does not depend on which process, batch or row runs it.

Semantics follow vLLM's sampler: temperature < 1e-5 is greedy (argmax, logprob reported as 0.0, as the vLLM
engine does without logprobs); otherwise logits / temperature, then top-k, then top-p (the smallest set of
tokens whose probability reaches top_p, at least one), and the reported logprob is the sampled token's
log-softmax of those processed logits (vLLM's `processed_logprobs`). A response stops at the tokenizer's or the
generation config's eos ids (the eos token is kept in `token_ids`, finish reason "stop") or after max_tokens
("length"). Text is decoded without special tokens.

Rows (prompt x sample) run in batches of rollout.max_num_seqs, left padded, with a KV cache (transformers'
DynamicCache), the forward compiled with `rollout.hf_use_torch_compile`. Each decode step is one forward and one
sampling call for the whole batch (`sample`: inverse transform sampling, one uniform draw per row); a row's draws come from its own seeded generator, drawn up front, draw t for its
token t, so a sample does not depend on the batch (the rows beside it, their number, when they finish). A row that
finishes (eos or its own max tokens) leaves the batch at once, its KV cache rows with it
(`DynamicCache.batch_select_indices`), so a long-tail batch costs its tokens, not rows x the longest response; it is
reported to generate's `on_finished` after the step that finished it. Memory: with free_cache_engine on a
GPU, release moves the weights to CPU memory and restore_weights brings them back; the KV cache lives only inside
a generate call, so restore_cache moves nothing. `rollout.sleep_level: 2` (vLLM's "discard the weights") keeps the
weights in CPU memory too (transformers cannot drop and re-create parameter storage cheaply), but the lifecycle
holds this engine to the same order (`discards_weights`: a push before restore_cache). There is no prefix cache
and no tensor parallelism (its settings, engines/hf_settings.py, refuse rollout.tensor_model_parallel_size > 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from grpo_lib.core.dtypes import torch_dtype
from grpo_lib.core.types import Generation, ScoreRequest
from grpo_lib.rollout.engines.base import EngineGlue, Lifecycle, OnFinished

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


def process_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as vLLM's sampler: removed tokens get -inf. [b, V] -> [b, V].

    Example: logits [[2, 1, 0]], temperature 1, top_k 2, top_p 1 -> [[2, 1, -inf]]; with top_p 0.5 instead of
    top_k -> [[2, -inf, -inf]] (the top token alone has probability 0.67 >= 0.5).
    """
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if 0 < top_k < logits.shape[-1]:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))  # keeps at least the top token
    return warpers(None, logits.float())


def sample(processed: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by inverse transform sampling, and its logprob: [b, V] processed logits, [b] draws in [0, 1)
    -> ([b] token ids, [b] log-softmax of the processed logits at them).

    Row r takes the first token whose cumulative probability exceeds uniforms[r] x the row's total (the total, not 1,
    absorbs the cumsum's round-off), so a removed token (probability 0) is never taken and every kept token is taken
    with its probability. Example: probabilities [[0.5, 0.0, 0.5]], draw 0.25 -> token 0; draw 0.75 -> token 2.
    """
    logprobs = processed.log_softmax(-1)  # [b, V]
    cdf = logprobs.exp().cumsum(-1)  # [b, V]
    total = cdf[:, -1:].contiguous()  # [b, 1]
    ids = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype) * total, right=True)  # [b, 1]
    # a draw that rounds up to the total would fall past the end: the last token with probability > 0 is the first
    # whose cumulative probability reaches the total
    ids = torch.minimum(ids, torch.searchsorted(cdf, total))[:, 0]  # [b]
    return ids, logprobs.gather(-1, ids[:, None])[:, 0]


def _draws(seed: int | None, count: int) -> torch.Tensor:
    """`count` uniform draws in [0, 1) of one row: from torch.Generator().manual_seed(seed), or unseeded. [count]"""
    generator = torch.Generator()
    generator.manual_seed(seed) if seed is not None else generator.seed()
    return torch.rand(count, generator=generator)


class HFEngine(EngineGlue):
    """A transformers causal LM owned by this process, behind the RolloutEngine interface."""

    def __init__(self, *, model_path: str, cfg, on_cpu: bool, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.cfg = cfg
        self.device = torch.device("cpu") if on_cpu else torch.device(f"cuda:{torch.cuda.current_device()}")
        dtype = torch_dtype(cfg.dtype, self.device)  # auto: float32 on CPU, bfloat16 on GPU
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.model.to(self.device).eval()
        # The decode step's forward, compiled once for dynamic shapes with rollout.hf_use_torch_compile (weights are
        # read at call time, so pushes need no recompile).
        self.forward = torch.compile(self.model, dynamic=True) if cfg.hf_use_torch_compile else self.model
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (self.tokenizer.eos_token_id or 0)
        eos = set()
        for source in (self.tokenizer.eos_token_id, _generation_eos(GenerationConfig, model_path)):
            eos.update([source] if isinstance(source, int) else (source or []))
        self.eos_ids = eos
        self.lifecycle = Lifecycle(frees_memory=cfg.free_cache_engine and not on_cpu, discards_weights=cfg.sleep_level == 2)

    @classmethod
    def from_config(cls, cfg, *, on_cpu: bool, world_size: int) -> HFEngine:
        """The engine of a run's config (`grpo_lib.rollout.engines.build_engine`). `world_size` is not used: each process
        generates alone (no tensor parallelism)."""
        return cls(model_path=cfg.model.path, cfg=cfg.rollout, on_cpu=on_cpu, trust_remote_code=cfg.model.trust_remote_code)

    # -- lifecycle (grpo_lib/rollout/engines/base.py) -----------------------------------------------------------

    def release(self) -> None:
        """ready -> released, after the generation phase and before the update: the weights move to CPU memory."""
        with self.lifecycle.transition("release"):
            if self.lifecycle.frees_memory:
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def restore_weights(self) -> None:
        """released -> weights_only: the weights move back to the device."""
        self._weights_back("restore_weights")

    def _weights_back(self, transition: str) -> None:
        with self.lifecycle.transition(transition):
            if self.lifecycle.frees_memory:
                self.model.to(self.device)

    def restore_cache(self) -> None:
        """weights_only -> ready: nothing to move (the KV cache exists only inside generate)."""
        with self.lifecycle.transition("restore_cache"):
            pass

    def restore_all(self) -> None:
        """released -> ready in one call: the weights move back to the device."""
        self._weights_back("restore_all")

    def reset_prefix_cache(self) -> None:
        with self.lifecycle.transition("reset_prefix_cache"):
            pass  # no prefix cache

    # -- weights ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the actor's full weights into this engine's own copy of the model, in place."""
        with self.lifecycle.transition("push"):
            own = self.model.state_dict(keep_vars=True)  # tied lm_head.weight included, aliasing the embedding
            for name, tensor in named_tensors:
                if name not in own:
                    raise KeyError(f"HF engine: pushed weight {name!r} is not a parameter of the engine's model "
                                   f"(it has e.g. {sorted(own)[:3]}); actor and engine must load the same model.path")
                own[name].copy_(tensor.to(own[name].device, own[name].dtype))

    # -- generation ------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, max_tokens: int | list[int],
                 top_p: float = 1.0, top_k: int = -1, seeds: list[int] | None = None,
                 logprobs: bool = True, on_finished: OnFinished | None = None,
                 score: ScoreRequest | None = None, stop: Callable[[], bool] | None = None) -> list[list[Generation]]:
        """`n` responses for each prompt; returns [num_prompts][n] Generations. Sample k of prompt i uses seeds[i] + k.
        `max_tokens`: one limit for all, or one per prompt (an episode's remaining response budget).
        The sampled tokens' logprobs come out of the sampling step itself, so `logprobs` (the vLLM engine's switch) costs
        nothing here. `on_finished` (`grpo_lib.rollout.engines.base.OnFinished`) hears after every decode step of the rows
        that finished in it. `score` (the weight probe) is scored by `score_logprobs` after the responses, in the same
        call (no batching to share here). `stop` (carry-over): asked after every decode step; True ends the call, each
        unfinished row returned as far as it got (finish reason "abort"; rows of batches not started yet: no tokens)."""
        with self.lifecycle.transition("generate"):
            limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
            rows = [(list(ids), None if seeds is None else seeds[i] + k, limits[i])
                    for i, ids in enumerate(prompt_ids) for k in range(n)]
            done: list[Generation] = []
            for start in range(0, len(rows), self.cfg.max_num_seqs):
                chunk = rows[start:start + self.cfg.max_num_seqs]
                if stop is not None and start > 0 and stop():  # stopped in an earlier batch: these never started
                    done += [Generation(token_ids=[], logprobs=[], text="", finish_reason="abort") for _ in chunk]
                    continue
                report = None if on_finished is None else (
                    lambda finished, start=start: on_finished([divmod(start + r, n) + (g,) for r, g in finished]))
                done += self._generate_rows(chunk, temperature=temperature, top_p=top_p, top_k=top_k, on_finished=report,
                                            should_stop=stop)
        if score is not None:
            score.fill(self.score_logprobs(score.sequences), weight_version=self.weight_version)
        return [done[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

    def _generate_rows(self, rows: list[tuple[list[int], int | None, int]], *, temperature: float, top_p: float,
                       top_k: int, on_finished=None, should_stop: Callable[[], bool] | None = None) -> list[Generation]:
        """Rows of (prompt ids, seed, max tokens) in one left-padded batch; a row leaves the batch (its KV cache rows
        too) at eos or its own max tokens. `on_finished([(row, Generation), ...])` after every decode step; `should_stop()`
        after it: True returns the unfinished rows as far as they got (finish reason "abort")."""
        b, width = len(rows), max(len(ids) for ids, _, _ in rows)
        limits = torch.tensor([limit for _, _, limit in rows])  # [b]
        steps = int(limits.max())
        if steps <= 0:  # nothing to generate (as before: empty responses)
            return [self._generation([], []) for _ in rows]
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)  # [b, P] left padded
        mask = torch.zeros((b, width), dtype=torch.long)  # [b, P]
        for r, (ids, _, _) in enumerate(rows):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            mask[r, width - len(ids):] = 1
        greedy = temperature < GREEDY_EPS
        # Each row's uniform draws, one per response position, from its own seeded generator: token t of a row uses
        # draw t whatever else is in the batch, so one batched sampling call serves every row at every step.
        uniforms = None if greedy else torch.stack([_draws(seed, steps) for _, seed, _ in rows]).to(self.device)  # [b, steps]
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
        tokens = torch.full((b, steps), self.pad_id, dtype=torch.long)  # [b, steps] on the host: what each row sampled
        token_lps = torch.zeros((b, steps))  # [b, steps]
        done: list[Generation | None] = [None] * b  # each row's Generation, from the step it finished
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=self.device)  # [E]
        active = torch.arange(b)  # [a] rows still decoding (indices into rows)
        active_limits = limits.to(self.device)  # [a]
        cache, step_ids = None, input_ids
        for t in range(steps):
            out = self.forward(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                               use_cache=True, logits_to_keep=1)  # only the last position is sampled: no [a, P, V] logits
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # [a, V]
            if greedy:
                next_ids = logits.argmax(-1)  # [a]
                next_lp = torch.zeros(len(active), device=self.device)  # [a] (vLLM reports no logprobs when greedy)
            else:
                processed = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # [a, V]
                next_ids, next_lp = sample(processed, uniforms[active, t])  # [a], [a]
            tokens[active, t], token_lps[active, t] = next_ids.cpu(), next_lp.float().cpu()
            stop = torch.isin(next_ids, eos) | (active_limits <= t + 1)  # [a]
            if bool(stop.any()):
                finished = []
                for r in active[stop.cpu()].tolist():
                    done[r] = self._generation(tokens[r, :t + 1].tolist(), token_lps[r, :t + 1].tolist())
                    finished.append((r, done[r]))
                keep = (~stop).nonzero()[:, 0]  # [a'] positions (in the batch) of the rows that go on
                if on_finished is not None:
                    on_finished(finished)
                if len(keep) == 0:
                    break
                cache.batch_select_indices(keep)  # the finished rows' KV cache goes with them
                active, active_limits = active[keep.cpu()], active_limits[keep]
                next_ids, mask, positions = next_ids[keep], mask[keep], positions[keep]
            elif on_finished is not None:
                on_finished([])
            if should_stop is not None and should_stop():
                for r in active.tolist():
                    done[r] = self._generation(tokens[r, :t + 1].tolist(), token_lps[r, :t + 1].tolist())
                    done[r].finish_reason = "abort"
                break
            step_ids = next_ids[:, None]  # [a, 1]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)  # [a, P + t + 1]
            positions = positions[:, -1:] + 1  # [a, 1]
        return done  # every row finished: its own limit is at most `steps`

    def _generation(self, token_ids: list[int], logprobs: list[float]) -> Generation:
        return Generation(token_ids=token_ids, logprobs=logprobs, text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                          finish_reason="stop" if token_ids and token_ids[-1] in self.eos_ids else "length")

    @torch.no_grad()
    def score_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token of each sequence given its prefix (entry 0 is 0), temperature 1."""
        with self.lifecycle.transition("generate"):
            result = []
            for seq in sequences:
                ids = torch.tensor([seq], device=self.device)  # [1, L]
                logits = self.model(input_ids=ids).logits[0, :-1].float()  # [L-1, V]
                lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]  # [L-1]
                result.append([0.0] + lp.tolist())
        return result


def _generation_eos(generation_config_cls, model_path: str):
    """eos_token_id of the model's generation_config.json (int, list or None); vLLM stops on these too."""
    try:
        return generation_config_cls.from_pretrained(model_path).eos_token_id
    except OSError:
        return None
