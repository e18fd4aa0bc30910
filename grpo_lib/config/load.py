"""Loading a config: recipe YAML + dotted `key=value` overrides -> flat keys in our spelling -> typed `Config`.

A recipe is plain YAML whose sections mirror verl's config with the `actor_rollout_ref.` prefix dropped
(`actor.ppo_epochs` for verl's `actor_rollout_ref.actor.ppo_epochs`). Overrides follow on the command line
as `key=value` with dotted keys; values are parsed as YAML scalars (`actor.lr=1e-6`, `trainer.logger=[console]`).
verl's full spelling is accepted as an alias (`grpo_lib/config/verl_keys.py`), so a verl user's override lines work
unchanged.

A mapping key (`data.apply_chat_template_kwargs`, `rollout.engine_kwargs`) takes its entries in this order: the
recipe's, then the overrides'. An override `key={a: 1, b: 2}` is read as its entries `key.a=1 key.b=2` (Hydra's merge,
as verl's overrides do): it adds to the recipe's entries and replaces the ones it names, like a leaf override
`key.a=1`; two overrides giving one entry different values are refused like any key overridden twice (whichever
spelling each uses); `key={}` empties what the recipe set (the one way to drop its entries), while the other overrides'
entries stay, in any order. A key given both a value and entries (`engine_kwargs.compilation_config=3` with
`engine_kwargs.compilation_config.level=3`) is refused naming both.

`load_config` checks everything before anything heavy loads (DESIGN invariant 4) and raises `ConfigError`
listing every problem with its key, its recipe line and the fix; `train_grpo.py` turns that into exit code 2.
The top layer of `grpo_lib.config` (schema <- checks <- load).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo_lib.config.checks import validate
from grpo_lib.config.schema import Config, ConfigError, _all_leaf_keys
from grpo_lib.config.verl_keys import IGNORED, REFUSED, _canonical, _match


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against `hint`, converting harmless cases (int -> float, str -> [str]); raise TypeError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        errors = []
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except TypeError as exc:
                errors.append(str(exc))
        raise TypeError(errors[0])
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise TypeError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise TypeError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_hint,) = typing.get_args(hint) or (Any,)
        return [_coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"{key}: expected true/false, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError(f"{key}: expected a number, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError(f"{key}: expected an integer, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"{key}: expected a string, got {value!r}")
    if hint is dict:
        if isinstance(value, dict):
            return value
        raise TypeError(f"{key}: expected a mapping, got {value!r}")
    return value


def _build(cls: type, values: dict[str, Any], prefix: str = ""):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, f"{prefix}{f.name}.")
        elif f"{prefix}{f.name}" in values:
            kwargs[f.name] = values[f"{prefix}{f.name}"]
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """["actor.lr=1e-6", "trainer.logger=[console]"] -> {"actor.lr": 1e-06, "trainer.logger": ["console"]}.

    One key given twice with different values, in any spelling (`actor.lr=1e-3 actor.lr=1e-2`, or
    `actor_rollout_ref.actor.optim.lr=1e-3 actor.lr=1e-2`), raises ConfigError naming both overrides: a later one never
    silently replaces an earlier one. A repeat with the same value changes nothing and is accepted (verl's own
    examples/tuning/0.5b script sets model.enable_gradient_checkpointing=True twice). A non-empty mapping value is its
    entries: "k={a: 1}" -> {"k.a": 1}, so it meets a leaf override "k.a=2" as that key given twice.
    """
    parsed: dict[str, Any] = {}
    first: dict[str, tuple[int, str, str]] = {}  # canonical key -> (1-based position, override, key as written)
    duplicates = []
    for position, item in enumerate(overrides, start=1):
        if "=" not in item:
            raise ConfigError([f"override {item!r}: expected key=value (for example actor.lr=1e-6)"])
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        try:
            value = yaml.safe_load(raw) if raw.strip() != "" else None
        except yaml.YAMLError as exc:
            raise ConfigError([f"override {item!r}: the value is not valid YAML ({_yaml_problem(exc)}); quote it or fix the "
                               "brackets, for example data.train_files=[a.parquet,b.parquet]"]) from None
        for key, value in _flatten({key: value}).items():  # a mapping's entries, each a key of its own
            canonical = _canonical(key)
            if canonical not in first:
                first[canonical] = (position, item, key)
                parsed[key] = value
            elif parsed[first[canonical][2]] != value:
                where, earlier, _ = first[canonical]
                duplicates.append(f"{canonical} is set by two overrides with different values: #{where} {earlier!r} and "
                                  f"#{position} {item!r}; keep one (a later override does not replace an earlier one here; "
                                  "for a verl script that ends in $@, edit the script's line instead of adding a second one)")
    if duplicates:
        raise ConfigError(duplicates)
    return parsed


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A parser error as one line: what is wrong and where (1-based line and column), no traceback."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{what}" + (f" ({context})" if context else "")


def read_raw(recipe: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The recipe's keys and the overrides, flattened, in our spelling (verl's aliases applied), not yet checked."""
    tree: dict = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError([f"recipe file {str(path)!r} does not exist: pass a YAML file such as recipes/tiny_cpu.yaml"])
        text = path.read_text()
        try:
            duplicates = _repeated_keys(yaml.compose(text, Loader=yaml.SafeLoader), str(path))
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError([f"recipe {str(path)!r} is not valid YAML: {_yaml_problem(exc)}"]) from None
        if duplicates:
            raise ConfigError(duplicates)
        if not isinstance(tree, dict):
            raise ConfigError([f"recipe {str(path)!r}: the top level must be a mapping of sections (data:, actor:, ...)"])
    raw = {_canonical(k): v for k, v in _flatten(tree).items()}
    given = {_canonical(k): v for k, v in parse_overrides(overrides or []).items()}
    for key, value in given.items():  # what the overrides take from the recipe, before any override is applied
        raw.pop(_OTHER_SPELLING.get(key, ""), None)  # an override of one spelling replaces the recipe's other one
        if value == {}:  # `key={}` empties the mapping the recipe set; the overrides' own entries of it stay
            for entry in [k for k in raw if k.startswith(key + ".")]:
                del raw[entry]
    raw.update(given)
    return raw


# verl's older global micro-batch keys and their per-process successors (one of each pair may be set).
_OTHER_SPELLING = {}
for _global in ("actor.ppo_micro_batch_size", "rollout.log_prob_micro_batch_size", "ref.log_prob_micro_batch_size"):
    _OTHER_SPELLING[_global], _OTHER_SPELLING[_global + "_per_gpu"] = _global + "_per_gpu", _global


def launch_world_size(raw: dict[str, Any]) -> int | None:
    """trainer.n_gpus_per_node x trainer.nnodes from raw keys (nnodes defaults to 1), or None when not given."""
    per_node, nodes = raw.get("trainer.n_gpus_per_node"), raw.get("trainer.nnodes")
    if isinstance(per_node, int) and not isinstance(per_node, bool) and per_node >= 1:
        return per_node * (nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1 else 1)
    return None


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None, *, world_size: int = 1) -> Config:
    """Read a recipe, apply overrides, check types and batch arithmetic; raise ConfigError with every problem."""
    raw = read_raw(recipe, overrides)
    known = _all_leaf_keys(Config)
    problems, values, ignored = [], {}, {}
    for key, value in raw.items():
        mapping = next((k for k in known if known[k] is dict and key.startswith(k + ".")), None)
        if mapping is not None and _match(key, IGNORED) is None:  # a dict-valued key written leaf by leaf: data.apply_chat_template_kwargs.enable_thinking=false
            values.setdefault(mapping, {})[key[len(mapping) + 1:]] = value
            continue
        if known.get(key) is dict and isinstance(value, dict):  # the mapping itself ({} after read_raw): its entries join
            values.setdefault(key, {}).update(_flatten(value))
            continue
        if key not in known and _match(key, REFUSED) is not None:
            problems.append(f"{key}={value!r} is not supported: {_match(key, REFUSED)}")
            continue
        if key not in known and _match(key, IGNORED) is not None:
            reason, accepted = _match(key, IGNORED)
            if accepted is not None and value not in accepted:
                problems.append(f"{key}={value!r} is not supported ({reason}): only {list(accepted)} is accepted; drop the line")
            else:
                ignored[f"{key}={value!r}"] = reason
            continue
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "; see the config reference in docs/REFERENCE.md"
            problems.append(f"unknown key {key!r}{hint}")
            continue
        try:
            values[key] = _coerce(value, known[key], key)
        except TypeError as exc:
            problems.append(f"wrong type: {exc}")
    for key in [k for k in known if known[k] is dict and isinstance(values.get(k), dict)]:
        clashes = _value_and_entries(key, values[key])
        problems += [problem for problem, _ in clashes]
        for _, entry in clashes:  # reported: the mapping is built without them (vLLM's nested form cannot hold both)
            values[key] = {k: v for k, v in values[key].items() if k != entry and not k.startswith(entry + ".")}
    config = _build(Config, values)  # keys with problems keep their defaults, so every problem is reported at once
    config.ignored = ignored
    problems += validate(config, world_size=world_size)
    if problems:
        lines = _recipe_lines(recipe, overrides)
        raise ConfigError([_with_line(problem, lines, recipe) for problem in problems])
    return config


def _value_and_entries(mapping: str, entries: dict[str, Any]) -> list[tuple[str, str]]:
    """(problem, entry) for each entry given both a value and entries of its own, which vLLM's nested mapping cannot
    hold at once.

    Example: ("rollout.engine_kwargs", {"compilation_config": 3, "compilation_config.level": 3}) -> [("rollout.engine_kwargs.
    compilation_config is given both a value (3) and entries (compilation_config.level): keep one", "compilation_config")].
    """
    return [(f"{mapping}.{entry} is given both a value ({value!r}) and entries "
             f"({', '.join(k for k in entries if k.startswith(entry + '.'))}): keep one", entry)
            for entry, value in entries.items() if any(k.startswith(entry + ".") for k in entries)]


def _repeated_keys(node, recipe: str) -> list[str]:
    """Keys a recipe sets twice, one problem each naming both places (recipe:line). PyYAML keeps the last of two equal
    keys without a word, so a second `trainer:` section would silently replace the first; and two spellings of one key
    (verl's `actor_rollout_ref.actor.optim.lr` and `actor.lr`) would leave one of them unused.

    Example: "trainer:\\n  save_freq: 1\\ntrainer:\\n  save_freq: 2\\n" -> ["trainer is set twice in recipe r.yaml: at
    r.yaml:1 and r.yaml:3 (...)"].
    """
    problems: list[str] = []
    leaves: dict[str, list[tuple[str, int]]] = {}  # canonical key -> [(spelling, line)] of every leaf that sets it

    def walk(mapping, prefix: str, *, in_list: bool = False) -> None:
        seen: dict[str, int] = {}
        for key_node, value_node in mapping.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: explicit keys may override merged ones
                continue
            dotted, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
            if dotted in seen:
                fix = "merge the two blocks into one" if isinstance(value_node, yaml.MappingNode) else "keep one"
                problems.append(f"{dotted} is set twice in recipe {recipe}: at {recipe}:{seen[dotted]} and {recipe}:{line} "
                                f"(YAML would keep only the second, silently); {fix}")
                continue
            seen[dotted] = line
            if isinstance(value_node, yaml.MappingNode) and value_node.value:
                walk(value_node, dotted + ".", in_list=in_list)
            elif not in_list:
                leaves.setdefault(_canonical(dotted), []).append((dotted, line))
            if isinstance(value_node, yaml.SequenceNode):  # mappings in a list: reward.functions: [{name: .., weight: ..}]
                for i, item in enumerate(value_node.value):
                    if isinstance(item, yaml.MappingNode):
                        walk(item, f"{dotted}[{i}].", in_list=True)

    if isinstance(node, yaml.MappingNode):
        walk(node, "")
    if problems:
        return problems  # a repeated section repeats its leaves too: report the section alone
    for canonical, where in leaves.items():
        if len(where) > 1:
            (first, first_line), (second, second_line) = where[:2]
            problems.append(f"{canonical} is set twice in recipe {recipe}: as {first} at {recipe}:{first_line} and as {second} "
                            f"at {recipe}:{second_line} (verl's spelling and ours name one key); keep one")
    return problems


def _key_lines(node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line of its value in a composed YAML mapping (same leaves as `_flatten`)."""
    found: dict[str, int] = {}
    if not isinstance(node, yaml.MappingNode):
        return found
    for key_node, value_node in node.value:
        dotted = f"{prefix}{key_node.value}"
        if isinstance(value_node, yaml.MappingNode) and value_node.value:
            found.update(_key_lines(value_node, dotted + "."))
        else:
            found[dotted] = key_node.start_mark.line + 1
    return found


def _recipe_lines(recipe, overrides: list[str] | None) -> dict[str, int]:
    """Canonical key -> its line in the recipe, for keys the overrides do not replace ({} without a recipe)."""
    if recipe is None:
        return {}
    overridden = {_canonical(k) for k in parse_overrides(overrides or [])}
    lines = _key_lines(yaml.compose(Path(recipe).read_text()))
    return {_canonical(k): line for k, line in lines.items() if _canonical(k) not in overridden}


def _with_line(problem: str, lines: dict[str, int], recipe) -> str:
    """Append where the recipe sets the key a problem names: "actor.lr=-1.0: ..." -> "... (recipe.yaml line 18)"."""
    for key in sorted(lines, key=len, reverse=True):
        if problem.startswith((f"{key}=", f"{key}:", f"wrong type: {key}:", f"unknown key {key!r}")):
            return f"{problem} ({recipe} line {lines[key]})"
    return problem
