"""Shared pieces of the episode tests: a scripted engine that plays the model, small fake tools, and prompts.

`ScriptedEngine(tokenizer, script)` answers every request with `script(context_text, seed)` as the turn's text: its
tokens are the tokenizer's ids of that text plus the eos `<|im_end|>`, cut at the request's max_tokens (finish reason
"length"), with logprobs that depend on the seed and position only. It records every call (requests, n, seeds,
max_tokens, the ids sampled for each request) and every sampled turn, so a test can check the episode against what the "model" sampled.
"""

from __future__ import annotations

import asyncio
import threading
import time

from grpo_lib.config.schema import MultiTurnConfig
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.rollout.data import render_prompt
from grpo_lib.rollout.episodes import EpisodeRunner
from grpo_lib.tools.base import BaseTool, ToolSchema
from grpo_lib.tools.builtin import CalculatorTool, Gsm8kTool
from grpo_lib.tools.calls import ToolBox


def schema(name: str, **properties: str) -> ToolSchema:
    """A function schema whose parameters are all required strings (or the JSON type given)."""
    return ToolSchema({"type": "function", "function": {
        "name": name, "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in properties.items()},
                       "required": list(properties)}}})


def call(name: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class EchoTool(BaseTool):
    execute_in = "thread"  # the loop tests time their turns: no worker start-up (this module imports torch) in them

    def execute(self, instance_id, parameters, **kwargs):
        return parameters["text"], 0.5, {}


class RaisingTool(BaseTool):
    execute_in = "thread"

    def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("boom")


class HangingTool(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        time.sleep(30)  # a plain function: its worker process is killed at the timeout
        return "late", 0.0, {}


class AsyncHangingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(30)
        return "late", 0.0, {}


class LongTool(BaseTool):
    execute_in = "thread"

    def execute(self, instance_id, parameters, **kwargs):
        return "0123456789" * 100, 0.0, {}


class FailsAfter(BaseTool):
    """Answers the first config["ok_calls"] calls of the run, raises on every later one (a service that went down)."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.calls, self.lock = 0, threading.Lock()

    def execute(self, instance_id, parameters, **kwargs):
        with self.lock:
            self.calls += 1
            calls = self.calls
        if calls > self.config["ok_calls"]:
            raise RuntimeError("the service is down")
        return "ok", 0.0, {}


class StallsAfter(FailsAfter):
    """Answers the first config["ok_calls"] calls, then blocks the tool loop (time.sleep in an async def): no timeout
    can fire, so the turn stalls (grpo_lib/tools/calls.py: ToolStallError)."""

    async def execute(self, instance_id, parameters, **kwargs):
        with self.lock:
            self.calls += 1
            calls = self.calls
        if calls > self.config["ok_calls"]:
            time.sleep(self.config.get("sleep_s", 120))
        return "ok", 0.0, {}


class RecordingTool(BaseTool):
    """Records its lifecycle calls: (method, instance_id, kwargs)."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.log = []

    async def create(self, instance_id=None, **kwargs):
        self.log.append(("create", instance_id, kwargs))
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        self.log.append(("execute", instance_id, parameters))
        return f"seen {parameters['text']}", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.log.append(("calc_reward", instance_id, {}))
        return 0.25

    async def release(self, instance_id, **kwargs):
        self.log.append(("release", instance_id, {}))


def all_tools() -> dict:
    return {"calculator": CalculatorTool({}, schema("calculator", expression="string")),
            "calc_gsm8k_reward": Gsm8kTool({}, schema("calc_gsm8k_reward", answer="string")),
            "echo": EchoTool({}, schema("echo", text="string")),
            "flaky": RaisingTool({}, schema("flaky", text="string")),
            "slow": HangingTool({}, schema("slow", text="string")),
            "slow_async": AsyncHangingTool({}, schema("slow_async", text="string")),
            "long": LongTool({}, schema("long", text="string")),
            "recorder": RecordingTool({}, schema("recorder", text="string"))}


def make_runner(tokenizer, tools: dict | None = None, *, timeout_s: float = 0.3, **multi_turn) -> EpisodeRunner:
    mt = MultiTurnConfig(enable=True, tool_config_path="unused.yaml", tool_timeout_s=timeout_s, **multi_turn)
    box = ToolBox(tools if tools is not None else all_tools(), timeout_s=mt.tool_timeout_s,
                  max_response_chars=mt.max_tool_response_length, truncate_side=mt.tool_response_truncate_side)
    return EpisodeRunner(tokenizer=tokenizer, toolbox=box, multi_turn=mt)


def make_prompts(runner: EpisodeRunner, questions: list[str], *, extra_infos: list[dict] | None = None) -> PromptBatch:
    """Prompts rendered as data.load_prompts renders them for a multi-turn run (the template lists the tools)."""
    messages = [[{"role": "user", "content": q}] for q in questions]
    ids = [render_prompt(m, runner.tokenizer, apply_chat_template=True, system_prompt=None, tools=runner.toolbox.schemas)
           for m in messages]
    return PromptBatch(prompt_ids=ids, group_ids=[f"q{i}" for i in range(len(questions))], data_sources=["synthetic"] * len(questions),
                       ground_truths=["42"] * len(questions), extra_infos=extra_infos or [{} for _ in questions],
                       messages=messages)


class ScriptedEngine:
    """The model, played by `script(context_text, seed) -> turn text` (module docstring)."""

    pad_id = 0
    weight_version = 0  # the engine's weights as built (engines.base.EngineGlue)

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[dict] = []
        self.sampled: list[list[int]] = []  # every turn's sampled ids, in call order

    def generate(self, prompt_ids, *, n, temperature, max_tokens, top_p=1.0, top_k=-1, seeds=None, logprobs=True):
        record = dict(prompts=[list(p) for p in prompt_ids], n=n, max_tokens=max_tokens, seeds=seeds, sampled=[])
        self.calls.append(record)
        out = []
        for i, ids in enumerate(prompt_ids):
            seed = None if seeds is None else seeds[i]
            limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
            group = [self.sample(ids, seed, limit) for _ in range(n)]
            record["sampled"] += [g.token_ids for g in group]
            out.append(group)
        return out

    def sample(self, ids, seed, limit) -> Generation:
        """One request's turn: the script's text + eos, cut at `limit`; logprobs from the seed and position."""
        text = self.script(self.tokenizer.decode(ids), seed)
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
        finish = "stop" if len(tokens) <= limit else "length"
        tokens = tokens[:limit]
        self.sampled.append(tokens)
        lps = [-((0 if seed is None else seed % 89) + j + 1) / 100 for j in range(len(tokens))]
        return Generation(token_ids=tokens, logprobs=lps, finish_reason=finish,
                          text=self.tokenizer.decode(tokens, skip_special_tokens=True))


class SessionEngine(ScriptedEngine):
    """A ScriptedEngine that also offers `open_session` (engines/base.py's GenerationSession): each step finishes the
    newest unfinished request (so episodes finish out of the order they were added) and `log` records every
    ("add", key, prompt ids, max_tokens, seed, unfinished before) and ("finish", key)."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.log: list[tuple] = []
        self.sessions = 0

    def open_session(self, *, temperature, top_p=1.0, top_k=-1, logprobs=True):
        import contextlib

        engine = self

        class Session:
            def __init__(self):
                self.queue = []

            @property
            def unfinished(self):
                return len(self.queue)

            def add(self, key, prompt_ids, *, max_tokens, seed):
                engine.log.append(("add", key, list(prompt_ids), max_tokens, seed, len(self.queue)))
                self.queue.append((key, list(prompt_ids), max_tokens, seed))

            def step(self):
                if not self.queue:
                    return []
                key, ids, limit, seed = self.queue.pop()
                engine.log.append(("finish", key))
                return [(key, engine.sample(ids, seed, limit))]

        @contextlib.contextmanager
        def session():
            engine.sessions += 1
            yield Session()
        return session()


def calls_then_answer(*turns: str, answer: str = "#### 42"):
    """A script: turn t writes turns[t] (each typically a tool call), then `answer` (read from the number of tool
    responses already in the context)."""
    def script(context: str, seed) -> str:
        done = context.count("<tool_response>")
        return turns[done] if done < len(turns) else answer
    return script
