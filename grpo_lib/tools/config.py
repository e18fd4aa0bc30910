"""verl's tool-config YAML (`rollout.multi_turn.tool_config_path`) -> the run's tool objects, checked entry by entry.

    tools:
      - class_name: grpo_lib.tools.builtin.CalculatorTool     # importable pkg.module.Class
        config: {}                                            # passed to the class (optional)
        tool_schema:                                          # OpenAI function schema: what the model is shown
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression
            parameters:
              type: object
              properties: {expression: {type: string, description: "e.g. 3 * (4 + 5)"}}
              required: [expression]

`load_tools(path)` imports each class and builds it as `Class(config, tool_schema)` (grpo_lib/tools/base.py). Trust
boundary: the classes run as your code, in the training process. Anything that cannot be loaded (a missing file or
class, a schema without a name or with `required` keys it does not declare, an `enum` that is no list, two tools of
one name, a constructor that raises, or an import + constructor that takes longer than import_timeout_s: the
trainer passes reward.import_timeout_s) is a `ToolConfigError` naming the file and the entry; train_grpo.py exits 2
with it before the engine starts.
"""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path

from grpo_lib.tools.base import ToolSchema

JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function-name rule


class ToolConfigError(ValueError):
    """A tool config that cannot be loaded; the message names the file and the entry."""


def load_tools(path: str | Path, *, import_timeout_s: float = 120.0) -> dict:
    """Tool name -> tool object, in the file's order. Raises ToolConfigError."""
    import yaml

    path = Path(path).expanduser()
    if not path.is_file():
        raise ToolConfigError(f"tool config {str(path)!r} (rollout.multi_turn.tool_config_path) does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ToolConfigError(f"tool config {str(path)!r} is not valid YAML: {error}") from error
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"tool config {str(path)!r}: expected a non-empty list under `tools:` (verl's format), "
                              f"found {type(entries).__name__ if isinstance(raw, dict) else type(raw).__name__}")
    tools: dict = {}
    for i, entry in enumerate(entries):
        where = f"tool config {str(path)!r} entry {i}{_named(entry)}"
        problems = entry_problems(entry)
        if problems:
            raise ToolConfigError(f"{where}: " + "; ".join(problems))
        schema = ToolSchema(entry["tool_schema"])
        name = schema["function"]["name"]
        if name in tools:
            raise ToolConfigError(f"{where}: a second tool named {name!r}; tool names must be unique")
        tools[name] = bounded(_build, entry["class_name"], entry.get("config") or {}, schema, where, timeout_s=import_timeout_s,
                              what=f"importing and building {entry['class_name']}", where=where)
    return tools


def bounded(fn, *args, timeout_s: float, what: str, where: str):
    """fn(*args) in a daemon thread, waited for at most timeout_s: an import or constructor that blocks cannot hang
    set-up (the thread is left behind; the run stops with exit 2). fn's exception is raised here as ToolConfigError
    ("{where}: {what} raised ...")."""
    result: list = []

    def work():
        try:
            result.append(("ok", fn(*args)))
        except BaseException as error:  # SystemExit from a module's import too: reported, not swallowed
            result.append(("error", error))

    thread = threading.Thread(target=work, name="tool-load", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise ToolConfigError(f"{where}: {what} did not finish within {timeout_s:g} s (reward.import_timeout_s): its "
                              "module or constructor blocks (a network call, a lock?)")
    kind, value = result[0]
    if kind == "error":
        if isinstance(value, ToolConfigError):
            raise value
        raise ToolConfigError(f"{where}: {what} raised {type(value).__name__}: {value}") from value
    return value


def entry_problems(entry) -> list[str]:
    """What is wrong with one entry of the `tools:` list ([] when nothing is). No import happens here."""
    if not isinstance(entry, dict):
        return [f"an entry is a mapping with class_name, config and tool_schema, got {entry!r}"]
    p = []
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or "." not in class_name:
        p.append(f"class_name must be an importable 'pkg.module.Class', got {class_name!r}")
    if entry.get("config") is not None and not isinstance(entry.get("config"), dict):
        p.append(f"config must be a mapping (or absent), got {entry.get('config')!r}")
    unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
    if unknown:
        p.append(f"unknown field(s) {unknown}: an entry has class_name, config and tool_schema")
    schema = entry.get("tool_schema")
    if not isinstance(schema, dict):
        return p + [f"tool_schema must be a mapping {{type: function, function: {{name, description, parameters}}}}, got {schema!r}"]
    if schema.get("type") != "function":
        p.append(f"tool_schema.type must be 'function', got {schema.get('type')!r}")
    function = schema.get("function")
    if not isinstance(function, dict):
        return p + [f"tool_schema.function must be a mapping with name, description and parameters, got {function!r}"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        p.append(f"tool_schema.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    if not isinstance(function.get("description", ""), str):
        p.append(f"tool_schema.function.description must be a string, got {function.get('description')!r}")
    params = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        return p + [f"tool_schema.function.parameters must be a JSON schema of type 'object', got {params!r}"]
    properties = params.get("properties", {})
    if not isinstance(properties, dict):
        return p + [f"tool_schema.function.parameters.properties must be a mapping, got {properties!r}"]
    for key, spec in properties.items():
        types = spec.get("type") if isinstance(spec, dict) else None
        types = [types] if isinstance(types, str) else types
        if not isinstance(spec, dict) or (types is not None and not (isinstance(types, list) and set(types) <= set(JSON_TYPES))):
            p.append(f"parameter {key!r}: a JSON schema with a type among {list(JSON_TYPES)}, got {spec!r}")
            continue
        if "enum" in spec and not (isinstance(spec["enum"], list) and spec["enum"]):  # argument checks read it mid-step
            p.append(f"parameter {key!r}: enum must be a non-empty list of allowed values, got {spec['enum']!r}")
        if not isinstance(spec.get("description", ""), str):
            p.append(f"parameter {key!r}: description must be a string, got {spec['description']!r}")
    required = params.get("required", [])
    if params.get("additionalProperties", False) not in (True, False):
        p.append("tool_schema.function.parameters.additionalProperties must be true or false (a schema there is not "
                 f"supported), got {params['additionalProperties']!r}")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        p.append(f"tool_schema.function.parameters.required must be a list of parameter names, got {required!r}")
    elif set(required) - set(properties):
        p.append(f"required parameter(s) {sorted(set(required) - set(properties))} are not in properties {sorted(properties)}")
    return p


def _named(entry) -> str:
    """" (calculator)" for an entry whose schema names its function, else ""."""
    schema = entry.get("tool_schema") if isinstance(entry, dict) else None
    function = schema.get("function") if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return f" ({name})" if isinstance(name, str) and name else ""


def _build(class_name: str, config: dict, schema: ToolSchema, where: str):
    module_name, _, attr = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module's own code raising
        raise ToolConfigError(f"{where}: cannot import module {module_name!r} of class_name {class_name!r} "
                              f"({type(error).__name__}: {error})") from error
    cls = getattr(module, attr, None)
    if cls is None:
        raise ToolConfigError(f"{where}: module {module_name!r} has no {attr!r} (class_name {class_name!r})")
    try:
        tool = cls(config, schema)
    except Exception as error:
        raise ToolConfigError(f"{where}: {class_name}(config, tool_schema) raised {type(error).__name__}: {error}") from error
    if not callable(getattr(tool, "execute", None)):
        raise ToolConfigError(f"{where}: {class_name} has no execute(instance_id, parameters) method (grpo_lib/tools/base.py)")
    return tool
