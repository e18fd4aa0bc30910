"""The tool interface: verl's `BaseTool` method names and signatures, so a verl tool class runs here unchanged.

A tool class is built once per run as `Class(config, tool_schema)` (the `config` mapping and `tool_schema` entry of
the tool config YAML: grpo_lib/tools/config.py) and serves every episode of the run; per-episode state lives under
the `instance_id` the episode loop passes (one per episode and tool):

    create(instance_id, **create_kwargs)        an episode starts; create_kwargs are the data row's
                                                extra_info.tools_kwargs[<tool name>].create_kwargs (verl's layout)
    execute(instance_id, parameters, **kwargs)  one call with the model's arguments -> (response, step reward, metrics);
                                                response: the text the model sees, or an object with `.text`
    calc_reward(instance_id, **kwargs)          the episode ended -> its tool reward (a number)
    release(instance_id, **kwargs)              free the episode's state

Every method may be a plain function or a coroutine (`async def`), as verl's are. A class need not subclass
`BaseTool`: only `execute` is required; `BaseTool` supplies the no-op defaults and `self.name`.

Where a plain (sync) `execute` runs (grpo_lib/tools/calls.py): by default in a worker process that is killed at the
call's timeout, when the tool keeps no per-episode state (defines no create / calc_reward / release) and pickles;
otherwise in a thread, which runs on past its timeout (counted as tools/abandoned). A class sets
`execute_in = "process"` (its execute then runs on the worker's copy of the tool: what it changes on `self` is not
seen by create / calc_reward / release) or `execute_in = "thread"` to choose.

Example (a tool that counts its calls):

    class Counter(BaseTool):
        def create(self, instance_id=None, **kwargs):
            self.calls[instance_id] = 0
            return instance_id
        def execute(self, instance_id, parameters, **kwargs):
            self.calls[instance_id] += 1
            return f"call {self.calls[instance_id]}", 0.0, {}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import uuid4


@dataclass
class ToolResponse:
    """What `execute` may return instead of a plain string (verl's ToolResponse; only the text is used here)."""

    text: str | None = None


class ToolSchema(dict):
    """The `tool_schema` mapping of the config (OpenAI function format), also readable as attributes, as verl's pydantic
    `OpenAIFunctionToolSchema` is: `schema.function.name`, `schema.model_dump()`.

    Example: ToolSchema({"type": "function", "function": {"name": "calculator"}}).function.name -> "calculator".
    """

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return ToolSchema(value) if isinstance(value, dict) and not isinstance(value, ToolSchema) else value

    def model_dump(self, **_kwargs) -> dict:
        """A plain-dict copy (what the chat template's `tools=` receives)."""
        import copy

        return copy.deepcopy(dict(self))


class BaseTool:
    """Defaults of verl's tool interface: subclass and write `execute` (and `create` / `calc_reward` for state)."""

    execute_in: str | None = None  # "process" | "thread" | None: decided from the class (module docstring)

    def __init__(self, config: dict, tool_schema: ToolSchema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name

    def get_openai_tool_schema(self) -> ToolSchema:
        return self.tool_schema

    def create(self, instance_id: str | None = None, **kwargs) -> str:
        """An episode starts; returns its instance id (a new one when None is given)."""
        return instance_id if instance_id is not None else str(uuid4())

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str | ToolResponse, float, dict]:
        """One call -> (response text, step reward, metrics)."""
        raise NotImplementedError(f"tool {self.name}: execute is not written")

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The episode's tool reward (0 unless the tool keeps one)."""
        return 0.0

    def release(self, instance_id: str, **kwargs) -> None:
        """The episode ended: drop its state."""
