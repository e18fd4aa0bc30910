"""Running the tool calls of a turn: every call of every episode at once, each with a timeout, and whatever goes wrong
answered as text the model reads (an observation, never a crash).

    box = ToolBox(load_tools(path), timeout_s=30, max_response_chars=256, truncate_side="middle")
    box.start([("ep0", {"calculator": {"create_kwargs": {}}})])       # create(instance_id, **create_kwargs) per tool
    [out] = box.run([("ep0", ToolCall("calculator", {"expression": "6 * 7"}))])
    out.text == "42"; out.kind == "ok"
    rewards, failures = box.finish(["ep0"])[0]                         # calc_reward, then release, per tool
    box.close()

What the model reads when a call cannot be answered, and its `kind` (the episode loop counts kinds as metrics):

    not valid JSON / not a {"name", "arguments"} object   "Error: the tool call is not valid JSON (...). Call a tool as ..."   invalid
    a tool name the config does not have                  "Error: there is no tool named 'x'; the tools are: ..."            invalid
    arguments the schema does not allow                   "Error: wrong arguments for calculator: missing ..."               invalid
    the tool raises (or returns no text / no number)      "Error: calculator failed: ValueError: ..."                        error
    the tool takes longer than timeout_s                  "Error: calculator did not answer within 30 s."                     timeout

Every response text, an error's too, is cut to `max_response_chars` characters as verl cuts it (left: keep the start +
"...(truncated)"; right: "(truncated)..." + keep the end; middle: half from each end around "...(truncated)...") and
`truncated` says so.

How calls run: one asyncio event loop in a daemon thread, kept for the whole run (an async tool's connections live
across turns). An `async def` method runs on that loop and is cancelled at its timeout. A plain (sync) `execute` runs
where its tool's placement says (`placements`, decided once when the ToolBox is built):

    "process"  in a killable worker process (grpo_lib/tools/workers.py): the tool is pickled once and rebuilt in each
               worker; at its timeout the worker is killed (nothing keeps running) and a fresh one takes the next call.
               The default for a sync tool that keeps no per-episode state (it does not define create / calc_reward /
               release) and pickles: function tools, a config tool with only `execute`.
    "thread"   in a daemon thread of its own, one per call. A thread cannot be killed: a call past its timeout is
               abandoned (its outcome says so, counted as tools/abandoned) and runs on; once MAX_ABANDONED of a tool's
               abandoned calls still run, the next turn raises ToolStallError instead of piling up more. The default
               for a tool with per-episode state (its create / calc_reward / release must see what execute changed on
               `self`, and a worker's copy is another object: the built-in calculator and gsm8k tools) or one that
               does not pickle (a lock, a client, a class defined inside a function).

A tool class chooses with `execute_in = "process" | "thread"` (grpo_lib/tools/base.py): "process" on a tool that does
not pickle is refused when the ToolBox is built; PythonTool says "thread" (it kills its own sandbox child at its wall
limit). create / calc_reward / release of a sync tool always run in a thread (they own the episode state), and
methods a class inherits unchanged from `BaseTool` (no-op defaults) run inline. The worker pool starts workers as
calls need them, up to max_workers (MAX_WORKERS) at once: a turn with more process calls than that runs them in
waves, and the turn's bound below grows by a timeout and a worker start-up (worker_start_timeout_s at most, the
trainer passes reward.import_timeout_s) per wave; a worker that does not start within it is that call's error.

What cannot stall or crash the loop: any BaseException a tool raises (SystemExit, KeyboardInterrupt, GeneratorExit, a
CancelledError of its own; sync or async) is that call's "error" outcome, never raised in the loop's thread. What
aborts the step: a turn whose calls have not all returned `timeout_s + stall_grace_s` after it started (an async tool
that blocks the loop without awaiting), or too many abandoned calls: ToolStallError, which train_grpo.py turns into
a stop that saves the last step and exits 3 (on every process: grpo_lib/rollout/episodes.py agrees on it after generating).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path

from grpo_lib.tools.base import BaseTool
from grpo_lib.tools.config import ToolConfigError
from grpo_lib.tools.hermes import ToolCall
from grpo_lib.tools.workers import WorkerError, WorkerPool

MAX_ABANDONED = 64  # abandoned plain calls of one tool still running before a turn raises ToolStallError
STALL_GRACE_S = 30.0  # seconds past timeout_s a turn's calls may take in all before the step is aborted
MAX_WORKERS = 16  # worker processes for the "process" tools at once (each an interpreter with the tool's imports)
CALL_FORMAT = 'Call a tool as <tool_call>{"name": <tool name>, "arguments": {...}}</tool_call>.'


class ToolStallError(RuntimeError):
    """The tool calls of a turn did not return within their bound, or a tool left too many abandoned calls running:
    the step cannot go on (train_grpo.py saves the last completed step and exits 3)."""


class ToolCrash(Exception):
    """A BaseException that is no Exception (SystemExit, KeyboardInterrupt, ...) raised by a tool, carried as its error."""


@dataclass
class CallOutcome:
    """One tool call (or create / calc_reward / release) as it ended."""

    text: str  # what the model reads (after truncation); a failure's message for the lifecycle calls
    kind: str  # "ok" | "invalid" (the model's call is malformed) | "error" (the tool failed) | "timeout"
    tool: str | None  # the tool's name; None when the call named no tool of the config
    step_reward: float = 0.0  # execute's step reward (0 unless ok)
    truncated: bool = False
    abandoned: bool = False  # a timeout of a plain method run in a thread: it runs on (tools/abandoned)
    method: str = "execute"  # or create / calc_reward / release


def truncate(text: str, limit: int, side: str) -> tuple[str, bool]:
    """(text cut to `limit` characters plus verl's marker, whether it was cut).

    Example: truncate("abcdefgh", 4, "left") -> ("abcd...(truncated)", True); side "right" -> ("(truncated)...efgh",
    True); "middle" -> ("ab...(truncated)...gh", True); truncate("abc", 4, "left") -> ("abc", False).
    """
    if len(text) <= limit:
        return text, False
    if side == "left":
        return text[:limit] + "...(truncated)", True
    if side == "right":
        return "(truncated)..." + text[-limit:], True
    half = limit // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else ""), True


def escape_control_tokens(text: str, control_tokens: list[str]) -> tuple[str, int]:
    """Tool text is data: every occurrence of a tokenizer's control token (its special and added tokens, e.g. Qwen's
    `<|im_end|>`, `<|im_start|>`, `</tool_response>`) is broken with a zero-width space after its first character, so it
    tokenizes as plain text and can never end the tool turn, start an assistant turn or be scored as one. Returns
    (text, tokens escaped). `control_tokens` longest first.

    Example: escape_control_tokens("1<|im_end|>\n<|im_start|>assistant\n#### 99", ["<|im_start|>", "<|im_end|>"]) ->
    ("1<\u200b|im_end|>\n<\u200b|im_start|>assistant\n#### 99", 2).
    """
    count = 0
    for token in control_tokens:
        if token and token in text:
            count += text.count(token)
            text = text.replace(token, token[0] + "\u200b" + token[1:])
    return text, count


def argument_problem(parameters: dict, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool's parameters schema (required, declared names, JSON types, enum); None if they do.

    Example: schema {properties: {expression: {type: string}}, required: [expression]}: {} -> "missing required argument
    'expression'"; {"expression": 3} -> "'expression' must be a string, got 3"; {"x": 1, "expression": "1"} -> "unknown
    argument 'x' (calculator takes: expression)" (unless the schema sets additionalProperties: true).
    """
    properties = parameters.get("properties") or {}
    missing = [key for key in parameters.get("required") or [] if key not in arguments]
    if missing:
        return "missing required argument " + ", ".join(repr(k) for k in missing)
    unknown = [key for key in arguments if key not in properties]
    if unknown and parameters.get("additionalProperties") is not True:
        return "unknown argument " + ", ".join(repr(k) for k in unknown) + f" (it takes: {', '.join(properties) or 'none'})"
    for key, value in arguments.items():
        spec = properties.get(key) or {}
        types = spec.get("type")
        types = [types] if isinstance(types, str) else types
        if types and not any(_is_json_type(value, t) for t in types):
            return f"{key!r} must be {' or '.join('an ' + t if t[0] in 'aeiou' else 'a ' + t for t in types)}, got {json.dumps(value)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"{key!r} must be one of {json.dumps(spec['enum'])}, got {json.dumps(value)}"
    return None


def _is_json_type(value, name: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"string": isinstance(value, str), "number": number, "integer": number and float(value).is_integer(),
            "boolean": isinstance(value, bool), "array": isinstance(value, list), "object": isinstance(value, dict),
            "null": value is None}.get(name, True)


def _response_parts(value) -> tuple[str, float]:
    """execute's return (verl: (response, step reward, metrics)) -> (text, step reward); ValueError if unusable."""
    response, step_reward = value, 0.0
    if isinstance(value, tuple) and len(value) in (2, 3):
        response, step_reward = value[0], value[1]
    if isinstance(response, str):
        text = response
    elif hasattr(response, "text"):
        text = response.text or ""
        if not isinstance(text, str):
            raise ValueError(f"execute returned a response whose text is {type(text).__name__}, not a string")
    else:
        raise ValueError(f"execute returned {type(response).__name__}, expected the response text, an object with .text, "
                         "or (response, step_reward, metrics)")
    if isinstance(step_reward, bool) or not isinstance(step_reward, (int, float)) or not math.isfinite(step_reward):
        raise ValueError(f"execute returned the step reward {step_reward!r}, expected a finite number")
    return text, float(step_reward)


class ToolBox:
    """The run's tools, their per-episode instances and the thread-side event loop that runs them."""

    def __init__(self, tools: dict, *, timeout_s: float, max_response_chars: int, truncate_side: str,
                 stall_grace_s: float | None = None, max_abandoned: int = MAX_ABANDONED,
                 max_workers: int = MAX_WORKERS, worker_start_timeout_s: float = 120.0):
        self.tools = dict(tools)  # name -> tool object, in the config's order
        self._schemas = {name: _schema_of(tool) for name, tool in self.tools.items()}  # name -> plain-dict schema
        blobs: dict[str, bytes] = {}  # name -> the pickled tool, for the "process" tools
        self.placements = {name: _placement(name, tool, blobs) for name, tool in self.tools.items()}  # loop|process|thread
        # a worker's start-up imports the tool's module: bounded like the tool's own import (reward.import_timeout_s)
        self._pool = WorkerPool(blobs, max_workers=max_workers, start_timeout_s=worker_start_timeout_s)
        self.timeout_s, self.max_response_chars, self.truncate_side = timeout_s, max_response_chars, truncate_side
        self.failed_create: dict[tuple[str, str], str] = {}  # (episode, tool) -> why its create failed
        self._instances: dict[tuple[str, str], str] = {}  # (episode, tool) -> the instance id its create returned
        self.created: dict[str, list[CallOutcome]] = {}  # episode -> its creation responses with text (verl 0.9)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tool-loop", daemon=True)
        self._thread.start()
        # None: the module's STALL_GRACE_S, read when the box is built
        self.stall_grace_s = STALL_GRACE_S if stall_grace_s is None else stall_grace_s
        self.max_abandoned = max_abandoned
        self.abandoned_running: dict[str, int] = {name: 0 for name in self.tools}  # changed on the loop's thread only

    @property
    def schemas(self) -> list[dict]:
        """The tools' OpenAI schemas, in order: what the chat template's `tools=` shows the model."""
        return [dict(schema) for schema in self._schemas.values()]

    # -- episode lifecycle --------------------------------------------------------------------------------------

    def start(self, episodes: list[tuple[str, dict]]) -> list[list[CallOutcome]]:
        """create(instance_id, **create_kwargs) of every tool for every (instance id, extra_info.tools_kwargs) episode;
        returns each episode's failed creates (that tool then answers every call of the episode with the failure).

        create may return None, the instance id, or verl 0.9's (instance_id, ToolResponse): a returned id is the one
        the episode's later calls use; a creation response with text is kept in `created[episode]` (cut like any
        response), which the episode loop shows the model as a tool turn before its first turn, as verl does."""
        jobs, where = [], []
        for episode, tools_kwargs in episodes:
            for name in self.tools:
                kwargs = (tools_kwargs or {}).get(name) or {}
                create_kwargs = kwargs.get("create_kwargs") or {} if isinstance(kwargs, dict) else {}
                jobs.append(self._lifecycle(name, "create", episode, **create_kwargs))
                where.append((episode, name))
        failures: dict[str, list[CallOutcome]] = {episode: [] for episode, _ in episodes}
        for (episode, name), (outcome, instance) in zip(where, self._run_all(jobs)):
            if outcome.kind != "ok":
                self.failed_create[(episode, name)] = outcome.text
                failures[episode].append(outcome)
                continue
            if instance is not None and instance != episode:
                self._instances[(episode, name)] = instance
            if outcome.text:
                self.created.setdefault(episode, []).append(outcome)
        return [failures[episode] for episode, _ in episodes]

    def run(self, calls: list[tuple[str, ToolCall]]) -> list[CallOutcome]:
        """Every (instance id, call) at once; one outcome per call, in order."""
        in_workers = sum(self.placements.get(call.name) == "process" for _, call in calls)
        # more process calls than workers wait for one: this batch's, behind those already taken (the per-episode loop
        # runs one batch per episode, all on one pool)
        waves = -(-(in_workers + (self._pool.outstanding if in_workers else 0)) // self._pool.max_workers)
        # each wave may start workers (bounded by the pool's start_timeout_s) before its calls' clocks start
        bound_s = max(1, waves) * self.timeout_s + waves * self._pool.start_timeout_s + self.stall_grace_s
        return self._run_all([self._call(episode, call) for episode, call in calls], bound_s=bound_s)

    def finish(self, episodes: list[str]) -> list[tuple[dict[str, float], list[CallOutcome]]]:
        """calc_reward then release of every tool for every episode -> per episode ({tool: reward}, failed calls).
        A tool whose create failed is neither scored nor released; a failed calc_reward scores 0."""
        pairs = [(e, name) for e in episodes for name in self.tools if (e, name) not in self.failed_create]
        rewards = self._run_all([self._lifecycle(name, "calc_reward", self._instance(e, name)) for e, name in pairs])
        releases = self._run_all([self._lifecycle(name, "release", self._instance(e, name)) for e, name in pairs])
        out = {e: ({}, []) for e in episodes}
        for (e, name), reward, release in zip(pairs, rewards, releases):
            value = 0.0
            if reward.kind == "ok":
                try:
                    value = float(reward.text)
                    if not math.isfinite(value):
                        raise ValueError
                except (TypeError, ValueError):
                    reward = CallOutcome(f"{name}.calc_reward returned {reward.text!r}, not a finite number", "error", name,
                                         method="calc_reward")
                    value = 0.0
            out[e][0][name] = value
            out[e][1].extend(o for o in (reward, release) if o.kind != "ok")
        for e in episodes:
            for name in self.tools:
                self.failed_create.pop((e, name), None)
                self._instances.pop((e, name), None)
            self.created.pop(e, None)
        return [out[e] for e in episodes]

    def record_isolation(self, run_dir) -> Path | None:
        """Write the sandbox layers of the tools that have them (PythonTool.layers) to run_dir/tool_sandbox.json, the
        record of what contained the model's code in this run; None when no tool has a sandbox."""
        layers = {name: tool.layers for name, tool in self.tools.items() if isinstance(getattr(tool, "layers", None), dict)}
        if not layers:
            return None
        path = Path(run_dir) / "tool_sandbox.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(layers, indent=1, sort_keys=True) + "\n")
        return path

    def close(self) -> None:
        """Kill the worker processes and stop the event loop (abandoned calls' threads are daemons: they never hold
        the process)."""
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._pool.close(), self._loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - a worker that cannot be reaped in 5 s is in its own session: killed anyway
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # -- one call -------------------------------------------------------------------------------------------------

    async def _call(self, episode: str, call: ToolCall) -> CallOutcome:
        if call.error is not None:
            return self._outcome(f"Error: {call.error}. {CALL_FORMAT}", "invalid", None)
        tool = self.tools.get(call.name)
        if tool is None:
            return self._outcome(f"Error: there is no tool named {call.name!r}; the tools are: {', '.join(self.tools)}.",
                                 "invalid", None)
        problem = argument_problem(self._schemas[call.name]["function"].get("parameters") or {}, call.arguments)
        if problem is not None:
            return self._outcome(f"Error: wrong arguments for {call.name}: {problem}.", "invalid", call.name)
        if (episode, call.name) in self.failed_create:
            return self._outcome(f"Error: {call.name} could not start for this episode: {self.failed_create[episode, call.name]}",
                                 "error", call.name)
        if self.placements[call.name] == "process":
            kind, value = await self._pool.call(call.name, "execute", (self._instance(episode, call.name), call.arguments),
                                                {}, timeout_s=self.timeout_s)
        else:
            kind, value = await self._timed(call.name, tool.execute, self._instance(episode, call.name), call.arguments)
        if kind == "ok":
            try:
                text, step_reward = _response_parts(value)
            except ValueError as error:
                return self._outcome(f"Error: {call.name} failed: {error}", "error", call.name)
            return self._outcome(text, "ok", call.name, step_reward)
        if kind == "timeout":
            out = self._outcome(f"Error: {call.name} did not answer within {self.timeout_s:g} s.", "timeout", call.name)
            out.abandoned = bool(value)
            return out
        return self._outcome(f"Error: {call.name} failed: {_describe(value)}", "error", call.name)

    def _instance(self, episode: str, name: str) -> str:
        """The instance id tool `name` knows episode `episode` by (the episode's id unless its create returned another)."""
        return self._instances.get((episode, name), episode)

    async def _lifecycle(self, name: str, method: str, episode: str, **kwargs):
        """create / calc_reward / release of tool `name`; an ok outcome's text is str(return value) for calc_reward
        (its number). create returns (outcome, the instance id it gave or None), its text the creation response's."""
        fn = getattr(self.tools[name], method, None)
        if fn is None:  # a class that does not subclass BaseTool may leave these out: verl's defaults
            out = CallOutcome("0.0" if method == "calc_reward" else "", "ok", name, method=method)
            return (out, None) if method == "create" else out
        kind, value = await self._timed(name, fn, episode, **kwargs)
        if kind == "ok" and method == "create":
            try:
                instance, text = _created(value)
            except ValueError as error:
                return CallOutcome(f"{name}.create {error}", "error", name, method=method), None
            text, cut = truncate(text, self.max_response_chars, self.truncate_side) if text else ("", False)
            return CallOutcome(text, "ok", name, truncated=cut, method=method), instance
        if kind == "ok" and method == "calc_reward" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            out = CallOutcome(f"{name}.calc_reward returned {value!r}, not a number", "error", name, method=method)
        elif kind == "ok":
            out = CallOutcome(str(value) if method == "calc_reward" else "", "ok", name, method=method)
        elif kind == "timeout":
            out = CallOutcome(f"{name}.{method} did not answer within {self.timeout_s:g} s", "timeout", name,
                              abandoned=bool(value), method=method)
        else:
            out = CallOutcome(f"{name}.{method} raised {_describe(value)}", "error", name, method=method)
        return (out, None) if method == "create" else out

    def _outcome(self, text: str, kind: str, tool: str | None, step_reward: float = 0.0) -> CallOutcome:
        text, cut = truncate(text, self.max_response_chars, self.truncate_side)
        return CallOutcome(text, kind, tool, step_reward, cut)

    async def _timed(self, name: str, fn, *args, **kwargs) -> tuple[str, object]:
        """("ok", value) | ("timeout", abandoned: a thread runs on) | ("error", exception) of fn(*args, **kwargs) under
        timeout_s; whatever fn raises, a BaseException included, ends here."""
        in_thread: list[bool] = []  # _invoke appends when the call runs in a thread
        try:
            return "ok", await asyncio.wait_for(self._invoke(name, fn, *args, in_thread=in_thread, **kwargs), self.timeout_s)
        except asyncio.TimeoutError:
            return "timeout", bool(in_thread)
        except asyncio.CancelledError:
            if getattr(asyncio.current_task(), "cancelling", lambda: 1)():  # this call is cancelled (the loop stops)
                raise
            return "error", ToolCrash("CancelledError raised by the tool")
        except Exception as error:  # the tool's own failure, whatever it is (a BaseException came as ToolCrash)
            return "error", error

    async def _invoke(self, name: str, fn, *args, in_thread: list, **kwargs):
        """fn's result; a BaseException that is no Exception is raised as ToolCrash, so no task of the loop ever
        raises one (asyncio re-raises SystemExit / KeyboardInterrupt out of the loop, which would stop it)."""
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            if getattr(type(getattr(fn, "__self__", None)), fn.__name__, None) is getattr(BaseTool, fn.__name__, object()):
                return fn(*args, **kwargs)  # BaseTool's no-op default: nothing to wait for
            in_thread.append(True)
            result = await self._in_thread(name, fn, *args, **kwargs)
            return await result if inspect.isawaitable(result) else result
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as error:
            raise ToolCrash(f"{type(error).__name__}: {error}") from None

    def _in_thread(self, name: str, fn, *args, **kwargs) -> asyncio.Future:
        loop, future = self._loop, self._loop.create_future()
        state = {"done": False, "counted": False}  # read and written on the loop's thread only

        def abandoned(f):  # the call timed out (its awaiting task was cancelled) while the thread runs
            if f.cancelled() and not state["done"]:
                self.abandoned_running[name] += 1
                state["counted"] = True

        def settle(value, error):
            state["done"] = True
            if state["counted"]:  # abandoned at its timeout: now it is done
                self.abandoned_running[name] -= 1
            elif not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)

        def work():
            try:
                value, error = fn(*args, **kwargs), None
            except Exception as exc:  # handed to the awaiting coroutine, never raised in this thread
                value, error = None, exc
            except BaseException as exc:  # SystemExit in a thread would end the thread silently; KeyboardInterrupt too
                value, error = None, ToolCrash(f"{type(exc).__name__}: {exc}")
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop was closed (the run ended): nobody waits for this call any more
                pass

        future.add_done_callback(abandoned)
        threading.Thread(target=work, name=f"tool-call-{name}", daemon=True).start()
        return future

    def _run_all(self, jobs: list, bound_s: float | None = None) -> list:
        """Every job at once on the loop, their results in order. ToolStallError when a tool has max_abandoned calls
        still running (before starting more), or when the jobs have not all returned timeout_s + stall_grace_s on."""
        import concurrent.futures

        if not jobs:
            return []
        piled = {name: n for name, n in self.abandoned_running.items() if n >= self.max_abandoned}
        if piled:
            for job in jobs:
                job.close()  # never started: no "coroutine was never awaited" warning
            raise ToolStallError(f"tool(s) {piled} have that many calls abandoned at rollout.multi_turn.tool_timeout_s="
                                 f"{self.timeout_s:g} still running in their threads (a thread cannot be killed): the tool "
                                 "hangs. Fix it, or make it stop its own work at a deadline (PythonTool kills its child)")

        async def gather():
            return await asyncio.gather(*jobs)

        future = asyncio.run_coroutine_threadsafe(gather(), self._loop)
        bound = bound_s if bound_s is not None else self.timeout_s + self.stall_grace_s
        try:
            return future.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolStallError(f"the tool calls of a turn did not return within {bound:g} s (rollout.multi_turn."
                                 f"tool_timeout_s={self.timeout_s:g} + {self.stall_grace_s:g} s, + worker start-ups and "
                                 "waves where calls wait for a worker process): an async tool blocks the "
                                 "event loop without awaiting (time.sleep or CPU work in an `async def`), so no timeout can "
                                 "fire. Make the blocking part a plain method (it then runs in a thread) or await it") from None


def _created(value) -> tuple[str | None, str]:
    """create's return -> (instance id or None, creation response text): None, an id, or verl 0.9's (id, ToolResponse).

    Example: ("ep", ToolResponse(text="The board is empty.")) -> ("ep", "The board is empty."); "ep" -> ("ep", "").
    """
    if value is None or isinstance(value, str):
        return value, ""
    if isinstance(value, tuple) and len(value) == 2 and (value[0] is None or isinstance(value[0], str)):
        response = value[1]
        if response is not None and not isinstance(response, str) and not hasattr(response, "text"):
            raise ValueError(f"returned a creation response of type {type(response).__name__}, expected a ToolResponse")
        text = response if isinstance(response, str) else getattr(response, "text", None)
        if text is not None and not isinstance(text, str):
            raise ValueError(f"returned a creation response whose text is {type(text).__name__}, not a string")
        return value[0], text or ""
    raise ValueError(f"returned {type(value).__name__}, expected None, the instance id, or (instance_id, ToolResponse)")


def _describe(error: BaseException) -> str:
    """"ValueError: bad" for an exception; a ToolCrash shows the BaseException it carries ("SystemExit: 3"), a
    WorkerError what failed in the worker process ("ValueError: bad")."""
    return str(error) if isinstance(error, (ToolCrash, WorkerError)) else f"{type(error).__name__}: {error}"


def _placement(name: str, tool, blobs: dict[str, bytes]) -> str:
    """Where tool `name`'s execute runs: "loop" (async), "process" (its pickle is put in blobs) or "thread" (module
    docstring). ToolConfigError for an execute_in that is neither, or "process" on a tool that does not pickle."""
    chosen = getattr(tool, "execute_in", None)
    if chosen not in (None, "process", "thread"):
        raise ToolConfigError(f"tool {name}: execute_in must be 'process' or 'thread' (or unset), got {chosen!r}")
    if inspect.iscoroutinefunction(tool.execute):
        return "loop"
    if chosen == "thread" or (chosen is None and _keeps_state(tool)):
        return "thread"
    try:
        blobs[name] = pickle.dumps(tool)
    except Exception as error:  # noqa: BLE001 - whatever pickle refuses (a lock, a socket, a local class)
        if chosen == "process":
            raise ToolConfigError(f"tool {name}: execute_in = 'process', but the tool cannot be pickled for its worker process "
                             f"({type(error).__name__}: {error}); make it picklable or set execute_in = 'thread'") from None
        return "thread"
    return "process"


def _keeps_state(tool) -> bool:
    """Whether the tool defines create / calc_reward / release of its own (not BaseTool's no-op defaults)."""
    return any(getattr(type(tool), method, None) not in (None, getattr(BaseTool, method))
               for method in ("create", "calc_reward", "release"))


def _schema_of(tool) -> dict:
    """A tool's schema as a plain dict (its tool_schema, or verl's get_openai_tool_schema())."""
    schema = getattr(tool, "tool_schema", None)
    if schema is None and hasattr(tool, "get_openai_tool_schema"):
        schema = tool.get_openai_tool_schema()
    return schema.model_dump() if hasattr(schema, "model_dump") else dict(schema)
