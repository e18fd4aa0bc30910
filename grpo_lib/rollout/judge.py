"""The generative judge (judge.enable): a second model, served by its own vLLM engine in each trainer process, reads every
response through a prompt template and writes a score.

    judge = Judge.from_config(cfg, on_cpu=True)     # its engine built (resident)
    judge.score(batch)                             # -> one float per row; judge.metrics: judge/unparsed, judge/overlong

Its engine is a `VLLMEngine` of judge.model_path with the judge's own memory keys (judge.gpu_memory_utilization,
judge.kv_cache_memory_bytes), the policy engine's dtype and eager mode, none of its engine_kwargs, and room for a whole
judge prompt in one engine step. It stays RESIDENT (weights and KV cache on the device through the whole run: the plan
counts its share in every phase): vLLM's sleep mode is one allocator per process (`CuMemAllocator`), whose sleep and
wake unmap and map every engine's memory at once, so a second engine cannot sleep on its own without putting the
policy's to sleep with it. Both engines live in one process: vLLM keeps one set of process groups per process, so they
share them and must have the same tensor-parallel size (the judge runs at 1, so the policy must too: checked with the
config).

Per row the template (judge.prompt_template, `str.format` fields {response}, {prompt}: the policy's last user message,
{ground_truth}) becomes the judge's user message, rendered with the judge's chat template; it writes up to judge.max_tokens
tokens (judge.temperature, seeded per row: the same text for the same row). The score is read by
judge.score_parser (`last_number_in_tag`: the last number inside the last <score_tag>...</score_tag>; `last_number`;
or FILE.py:FUNCTION) and divided by judge.score_scale. A text without a score, or a judge prompt longer than the engine's
context, scores 0 and is counted; one unparsed text per call is logged as a sample.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import zlib
from collections.abc import Callable
from pathlib import Path

from grpo_lib.core.names import JUDGE_TEMPLATE_TOKENS
from grpo_lib.core.types import RolloutBatch
from grpo_lib.rollout.data import render_text

logger = logging.getLogger(__name__)

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def judge_context(cfg) -> int:
    """The judge engine's context: the policy's prompt + response, the judge's answer, and room for the template."""
    return cfg.data.max_prompt_length + cfg.data.max_response_length + cfg.judge.max_tokens + JUDGE_TEMPLATE_TOKENS


def last_number(text: str) -> float | None:
    """The last number in `text` (None: none). Example: "7 or maybe 8." -> 8.0."""
    found = NUMBER.findall(text)
    return float(found[-1]) if found else None


def last_number_in_tag(text: str, tag: str = "score") -> float | None:
    """The last number inside the last <tag>...</tag> of `text` (None: no such tag, or no number in it).
    Example: "<score>3</score> no, <score>9/10</score>" -> 10.0 (the last number of the last tag)."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return last_number(found[-1]) if found else None


def make_parser(name: str, *, tag: str) -> Callable[[str], float | None]:
    """judge.score_parser -> fn(text) -> float | None."""
    if name == "last_number_in_tag":
        return lambda text: last_number_in_tag(text, tag)
    if name == "last_number":
        return last_number
    from grpo_lib.rewards.custom import load_custom_reward

    file, _, function = name.partition(":")
    return load_custom_reward(file, function)


class Judge:
    """The judge: `score(batch)` -> a float per row; `metrics` holds the last call's counters (local sums)."""

    def __init__(self, engine, tokenizer, *, template: str, parse: Callable[[str], float | None], cfg, max_model_len: int,
                 seed: int = 0):
        self.engine, self.tokenizer, self.template, self.parse = engine, tokenizer, template, parse
        self.cfg, self.max_model_len, self.seed = cfg, max_model_len, seed
        self.metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg, *, on_cpu: bool, llm_factory=None) -> Judge:
        """The run's judge: its engine built from judge.* and the policy engine's settings (module docstring)."""
        from grpo_lib.core.distributed import world_size
        from grpo_lib.rollout.engines.vllm import VLLMEngine

        j = cfg.judge
        max_model_len = judge_context(cfg)
        settings = dataclasses.replace(cfg.rollout, gpu_memory_utilization=j.gpu_memory_utilization,
                                       kv_cache_memory_bytes=j.kv_cache_memory_bytes, tensor_model_parallel_size=1,
                                       free_cache_engine=False, engine_kwargs={},
                                       max_num_batched_tokens=max(cfg.rollout.max_num_batched_tokens, max_model_len))
        engine = VLLMEngine(model_path=j.model_path, cfg=settings, max_model_len=max_model_len, seed=cfg.trainer.seed,
                            on_cpu=on_cpu, world_size=world_size(), llm_factory=llm_factory)
        template = Path(j.prompt_template).expanduser().read_text(encoding="utf-8")
        return cls(engine, engine.llm.get_tokenizer(), template=template, parse=make_parser(j.score_parser, tag=j.score_tag),
                   cfg=j, max_model_len=max_model_len, seed=cfg.trainer.seed)

    def prompt_ids(self, batch: RolloutBatch, i: int) -> list[int]:
        """Row i's judge prompt: the template filled, as the judge's user message, rendered with its chat template."""
        messages = batch.prompt_messages[i] if batch.prompt_messages is not None else []
        users = [m.get("content", "") for m in messages if m.get("role") == "user"]
        text = self.template.format(response=batch.response_texts[i], prompt=users[-1] if users else "",
                                    ground_truth=batch.ground_truths[i])
        rendered = render_text([{"role": "user", "content": text}], self.tokenizer, apply_chat_template=True, system_prompt=None)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def score(self, batch: RolloutBatch) -> list[float]:
        """The judge's score of every row of `batch` (0 for an unparsed text or an overlong prompt, counted). Each row is
        seeded from trainer.seed and its judge prompt: the same response gets the same text, in a resumed run too."""
        prompts = [self.prompt_ids(batch, i) for i in range(len(batch))]
        fits = [len(p) + self.cfg.max_tokens <= self.max_model_len for p in prompts]
        texts: list[str | None] = [None] * len(batch)
        todo = [i for i in range(len(batch)) if fits[i]]
        if todo:
            out = self.engine.generate([prompts[i] for i in todo], n=1, temperature=self.cfg.temperature,
                                       max_tokens=self.cfg.max_tokens, logprobs=False,
                                       seeds=[zlib.crc32(str(prompts[i]).encode(), self.seed) for i in todo])
            for i, group in zip(todo, out):
                texts[i] = group[0].text
        scores, unparsed, sample = [], 0, None
        for i, text in enumerate(texts):
            try:
                value = self.parse(text) if text is not None else None
                value = None if value is None or value != value else float(value)  # NaN: no score
            except Exception as error:  # noqa: BLE001 - a custom parser's failure is an unparsed text, counted and logged
                logger.warning("judge: judge.score_parser raised %s: %s", type(error).__name__, error)
                value = None
            if value is None:
                unparsed += text is not None
                sample = sample if sample is not None or text is None else text
                scores.append(0.0)
            else:
                scores.append(float(value) / self.cfg.score_scale)
        if sample is not None:
            logger.warning("judge: %d of %d texts had no score (scored 0); a sample: %r", unparsed, len(batch), sample[:500])
        self.metrics = {"judge/unparsed": float(unparsed), "judge/overlong": float(len(batch) - len(todo))}
        return scores
