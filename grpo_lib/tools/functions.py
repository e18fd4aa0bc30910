"""verl's function tools (`rollout.multi_turn.function_tool_path`): a Python file of typed functions with Google-style
docstrings, each registered with `@function_tool`, becomes tools whose OpenAI schema is inferred from the function, as
verl infers it (transformers' `get_json_schema`: the summary line is the description, every parameter needs a type
hint and an `Args:` line; a parameter without a default is required).

    # my_tools.py                                    (verl's import works unchanged; so does grpo_lib's)
    from verl.tools.function_tool import function_tool

    @function_tool
    def add(a: int, b: int) -> str:
        \"\"\"Add two integers.

        Args:
            a: the first number
            b: the second number
        \"\"\"
        return str(a + b)

    -> tool "add", schema {"type": "function", "function": {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first number"},
       "b": {...}}, "required": ["a", "b"]}}}

`@function_tool("name")` renames the tool; `@function_tool(schema={...})` gives the schema instead of inferring it.
A call is `fn(**arguments)` (stateless: no create / calc_reward; an `async def` runs on the tool loop). What it
returns becomes the text the model reads as verl turns it into a ToolResponse: a str as is, a dict as JSON, a tuple
(response, step reward, metrics) of 1-3 items, anything else str().

`load_all_tools(tool_config_path, function_tool_path)` -> the run's tools, the config's then the file's. Refused with
a ToolConfigError (train_grpo.py: exit 2 before the engine starts), naming the file and the function: a file that does
not exist, does not import, or registers no function; a function whose docstring or type hints cannot give a schema,
or that takes *args / **kwargs; a schema our checks refuse (grpo_lib/tools/config.py); a tool name that both the tool
config and the file define (naming both files) or that two functions define. Where verl itself is installed, the
file's `verl.tools.function_tool` is verl's and its registry is read; otherwise a stand-in module of that name is
put in sys.modules while the file imports (and taken out after).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable

from grpo_lib.tools.base import BaseTool, ToolResponse, ToolSchema
from grpo_lib.tools.config import ToolConfigError, bounded, entry_problems, load_tools

_REGISTERED: list[tuple[str, Callable, dict | None]] = []  # (tool name, function, given schema) in decorator order


def function_tool(name: str | Callable | None = None, *, schema: dict | None = None):
    """Register a function as a tool (verl's decorator: bare, with a name, or with schema=). Returns the function."""
    def register(fn: Callable, tool_name: str | None) -> Callable:
        _REGISTERED.append((tool_name or fn.__name__, fn, schema))
        return fn

    if callable(name) and schema is None:
        return register(name, None)
    return lambda fn: register(fn, name)


def infer_schema(fn: Callable, name: str) -> dict:
    """The OpenAI schema of fn as verl infers it (transformers' get_json_schema, the name set, its "return" left out:
    verl's schema model has none). ValueError saying what the function lacks."""
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"it takes variadic parameter(s) {variadic}, which no OpenAI schema can express; name them")
    try:
        raw = get_json_schema(fn)
    except Exception as error:  # DocstringParsingException, TypeHintParsingException (transformers)
        raise ValueError(f"{type(error).__name__}: {error} (a function tool needs a Google-style docstring with a "
                         "summary line and an `Args:` line per parameter, and a type hint on each)") from None
    raw["function"]["name"] = name
    raw["function"].pop("return", None)
    return raw


def response_of(value: Any) -> tuple[str, float, dict]:
    """A function's return -> (text, step reward, metrics), as verl turns it into a ToolResponse.

    Example: "7" -> ("7", 0.0, {}); {"sum": 7} -> ('{"sum": 7}', 0.0, {}); ("7", 0.5) -> ("7", 0.5, {}); 7 -> ("7", 0.0, {}).
    """
    def text(v) -> str:
        if isinstance(v, ToolResponse) or (hasattr(v, "text") and not isinstance(v, (str, dict))):
            return v.text or ""
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else str(v)

    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise TypeError(f"a function tool returned a tuple of {len(value)}: (response,), (response, reward) or "
                            "(response, reward, metrics)")
        reward = 0.0 if len(value) < 2 or value[1] is None else value[1]
        return text(value[0]), reward, {} if len(value) < 3 or value[2] is None else dict(value[2])
    return text(value), 0.0, {}


class FunctionTool(BaseTool):
    """A registered function as a tool: execute(instance_id, arguments) is fn(**arguments). A plain function runs in
    a killable worker process (grpo_lib/tools/calls.py): the tool pickles as (its file, its tool name), and the worker
    imports the file again to find the function."""

    def __init__(self, fn: Callable, tool_schema: ToolSchema, source: Path | None = None):
        super().__init__({}, tool_schema)
        self.fn, self.source = fn, source  # source: the function tool file it came from (None: pickled by reference)

    def __reduce__(self):
        if self.source is None:
            return super().__reduce__()
        return _rebuild_function_tool, (type(self), str(self.source), self.name, self.tool_schema.model_dump())

    def execute(self, instance_id, parameters, **kwargs):
        return response_of(self.fn(**parameters))


class AsyncFunctionTool(FunctionTool):
    """An `async def` function tool: awaited on the tool loop."""

    async def execute(self, instance_id, parameters, **kwargs):
        return response_of(await self.fn(**parameters))


def load_function_tools(path: str | Path, *, import_timeout_s: float = 120.0) -> dict[str, FunctionTool]:
    """Tool name -> tool of every @function_tool of the file at `path`, in their order. Raises ToolConfigError."""
    path = Path(path).expanduser()
    where = f"function tool file {str(path)!r} (rollout.multi_turn.function_tool_path)"
    if not path.is_file():
        raise ToolConfigError(f"{where} does not exist")
    registered = bounded(_import_registering, path, where, timeout_s=import_timeout_s, what="importing it", where=where)
    if not registered:
        raise ToolConfigError(f"{where} registers no function: decorate each tool with @function_tool "
                              "(from verl.tools.function_tool import function_tool)")
    tools: dict[str, FunctionTool] = {}
    for name, fn, given in registered:
        at = f"{where}, function {getattr(fn, '__qualname__', name)!r}"
        if name in tools:
            raise ToolConfigError(f"{at}: a second tool named {name!r} in the file; tool names must be unique")
        try:
            schema = given if given is not None else infer_schema(fn, name)
        except ValueError as error:
            raise ToolConfigError(f"{at}: no schema can be inferred: {error}") from None
        schema = schema.model_dump() if hasattr(schema, "model_dump") else dict(schema)
        problems = entry_problems({"class_name": "function.tool", "tool_schema": schema})
        if problems:
            raise ToolConfigError(f"{at}: " + "; ".join(problems))
        cls = AsyncFunctionTool if inspect.iscoroutinefunction(fn) else FunctionTool
        tools[name] = cls(fn, ToolSchema(schema), path)
    return tools


_FILES: dict[str, dict[str, Callable]] = {}  # in a worker process: a function tool file's functions, imported once


def _rebuild_function_tool(cls: type, path: str, name: str, schema: dict) -> FunctionTool:
    """Tool `name` of the function tool file at `path`, its file imported again (a worker process rebuilding it; the
    schema comes along, so nothing is inferred twice)."""
    if path not in _FILES:
        where = f"function tool file {path!r}"
        _FILES[path] = {n: fn for n, fn, _ in _import_registering(Path(path), where)}
    return cls(_FILES[path][name], ToolSchema(schema), Path(path))


def load_all_tools(tool_config_path: str | None, function_tool_path: str | None, *,
                   import_timeout_s: float = 120.0) -> dict:
    """The tools of the tool config, then those of the function file (either may be None). Raises ToolConfigError,
    naming both files when a tool name is in both."""
    tools = load_tools(tool_config_path, import_timeout_s=import_timeout_s) if tool_config_path else {}
    functions = load_function_tools(function_tool_path, import_timeout_s=import_timeout_s) if function_tool_path else {}
    both = [name for name in functions if name in tools]
    if both:
        raise ToolConfigError(f"tool name(s) {both} are defined twice: in the tool config {str(tool_config_path)!r} "
                              f"(rollout.multi_turn.tool_config_path) and in the function tool file "
                              f"{str(function_tool_path)!r} (rollout.multi_turn.function_tool_path); rename one")
    return {**tools, **functions}


def _import_registering(path: Path, where: str) -> list[tuple[str, Callable, dict | None]]:
    """Run the file as a module; the functions it registered (ours, or verl's registry where verl is installed)."""
    verl_registry = _verl_registry()
    shim = {} if verl_registry is not None else _verl_shim()
    before, verl_before = len(_REGISTERED), set(verl_registry or {})
    added = [name for name in shim if name not in sys.modules]
    sys.modules.update({name: module for name, module in shim.items() if name in added})
    module_name = "_grpo_function_tools_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # the file may import its own names back
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise ToolConfigError(f"{where}: importing it raised {type(error).__name__}: {error}") from error
    finally:
        for name in added:
            sys.modules.pop(name, None)
    found = _REGISTERED[before:]
    del _REGISTERED[before:]
    if verl_registry is not None:  # verl's decorator: its entries carry the function and its (pydantic) schema
        found += [(n, e.fn, e.tool_schema.model_dump(exclude_unset=True, exclude_none=True))
                  for n, e in verl_registry.items() if n not in verl_before]
    return found


def _verl_registry() -> dict | None:
    try:
        from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY  # type: ignore[import-not-found]
    except Exception:
        return None
    return FUNCTION_TOOL_REGISTRY


def _verl_shim() -> dict[str, types.ModuleType]:
    """Modules verl, verl.tools, verl.tools.function_tool whose function_tool is ours (verl not installed)."""
    modules = {name: types.ModuleType(name) for name in ("verl", "verl.tools", "verl.tools.function_tool")}
    modules["verl"].tools = modules["verl.tools"]
    modules["verl.tools"].function_tool = modules["verl.tools.function_tool"]
    modules["verl.tools.function_tool"].function_tool = function_tool
    for module in modules.values():
        module.__path__ = []  # a package, so `from verl.tools.function_tool import ...` resolves
    return modules
