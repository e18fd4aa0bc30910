"""Tool calls in an assistant turn, hermes format (`rollout.multi_turn.format: hermes`, what Qwen's chat templates ask for):

    Let me compute it.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * 4"}}
    </tool_call>

Every closed `<tool_call>...</tool_call>` block is one call, in order (verl's HermesToolParser reads the same blocks).
Departures from verl: a block that does not parse is not dropped silently but kept as a call with its `error`, so the
model is told (grpo_lib/tools/calls.py) and the episode goes on; so is a `<tool_call>` left open after the last closed
block (an invalid call, not an answer). Text no parser should choke on is such an error too: JSON nested deeper
than MAX_DEPTH, a number of more than Python's 4300 digits, a recursion the C parser gives up on. `arguments` may
also be a JSON string holding an object (some models write it so).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_DEPTH = 32  # nesting of objects / arrays in a call


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
    calls = [_read(block) for block in _CALL_RE.findall(text)]
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in text else text
    if "<tool_call>" in tail:
        calls.append(ToolCall(None, None, error="a <tool_call> is not closed with </tool_call>"))
    return calls


def _depth(value, limit: int) -> int:
    """Nesting depth of a parsed JSON value, counted up to limit + 1 (without recursing deeper)."""
    depth, level = 0, [value]
    while level and depth <= limit:
        level = [v for x in level if isinstance(x, (dict, list)) for v in (x.values() if isinstance(x, dict) else x)]
        depth += 1
    return depth


def _read(block: str) -> ToolCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as error:
        return ToolCall(None, None, error=f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    except (ValueError, RecursionError) as error:  # a number past 4300 digits; nesting the C parser refuses
        return ToolCall(None, None, error=f"the tool call cannot be read ({type(error).__name__}: {str(error)[:120]})")
    if _depth(call, MAX_DEPTH) > MAX_DEPTH:
        return ToolCall(None, None, error=f"the tool call is nested deeper than {MAX_DEPTH} levels")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, None, error='a tool call is a JSON object {"name": <tool name>, "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(name, None, error=f"the arguments are not valid JSON ({error.msg} at character {error.pos})")
        except (ValueError, RecursionError) as error:
            return ToolCall(name, None, error=f"the arguments cannot be read ({type(error).__name__}: {str(error)[:120]})")
        if _depth(arguments, MAX_DEPTH) > MAX_DEPTH:
            return ToolCall(name, None, error=f"the arguments are nested deeper than {MAX_DEPTH} levels")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, error=f"the arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)
