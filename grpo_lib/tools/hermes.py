"""Tool calls in an assistant turn, hermes format (`rollout.multi_turn.format: hermes`, what Qwen's chat templates ask for):

    Let me compute it.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * 4"}}
    </tool_call>

Every closed `<tool_call>...</tool_call>` block is one call, in order (verl's HermesToolParser reads the same blocks);
an unclosed block is no call (the turn is an answer). Departure from verl: a block that does not parse is not
dropped silently but kept as a call with its `error`, so the model is told (grpo_lib/tools/calls.py) and the
episode goes on. `arguments` may also be a JSON string holding an object (some models write it so).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One call read from the text: a tool name and its arguments, or the reason it could not be read."""

    name: str | None
    arguments: dict | None
    error: str | None = None  # set: malformed (the model is told this reason); name / arguments may be None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls of one assistant turn, in order; [] when it holds none (the turn is the answer).

    Example: '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>' ->
    [ToolCall("calculator", {"expression": "1+2"})]; '<tool_call>{"name": </tool_call>' ->
    [ToolCall(None, None, error="not valid JSON (...)")].
    """
    return [_read(block) for block in _CALL_RE.findall(text)]


def _read(block: str) -> ToolCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as error:
        return ToolCall(None, None, error=f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, None, error='a tool call is a JSON object {"name": <tool name>, "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(name, None, error=f"the arguments are not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, error=f"the arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)
