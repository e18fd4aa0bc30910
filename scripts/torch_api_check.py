"""Every torch API the project's code names, resolved against the installed torch: `python scripts/torch_api_check.py`.

Reads grpo_lib/ and train_grpo.py with `ast` (nothing of ours is imported): each `from torch.x import a` and each
attribute chain that starts at a torch module (`torch.cuda.reset_peak_memory_stats`, `dist.all_reduce`,
`dcp.load`) is resolved with importlib/getattr. Then every CALL of such a name is bound to the installed function's
real signature (`inspect.signature(f).bind(...)` with the call's number of positional arguments and its keyword
names; a call with `*args` / `**kwargs` binds what it spells out), so a keyword the installed torch does not take
(`varlen_attn(enable_gqa=...)` on an older torch) is found too; builtins without a signature are counted as unchecked.
Prints one line per missing name or unbound call with the files that use it and exits 1 when any is found, so a
torch version the code was not written for (the lent GPU machine's torch 2.11, CI's 2.13) fails here in seconds
instead of minutes into a run. `--list` prints every name checked.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def used_names(paths: list[Path]) -> dict[str, set[str]]:
    """{"torch.cuda.mem_get_info": {"grpo_lib/rollout/engines/base.py"}, ...}: torch names each file uses."""
    found: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(REPO))
        aliases: dict[str, str] = {}  # local name -> dotted torch module or object
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch" or a.name.startswith("torch."):
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                        found.setdefault(a.name, set()).add(rel)
            elif isinstance(node, ast.ImportFrom) and node.module and (node.module == "torch" or node.module.startswith("torch.")):
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    found.setdefault(f"{node.module}.{a.name}", set()).add(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, inner = [], node
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id in aliases:
                    found.setdefault(".".join([aliases[inner.id], *reversed(chain)]), set()).add(rel)
    return found


def used_calls(paths: list[Path]) -> dict[tuple[str, int, tuple[str, ...], bool], set[str]]:
    """{("torch.nn.functional.pad", 2, ("value",), False), ...: files}: each call of a torch name with its number of
    positional arguments, its keyword names, and whether it also passes `*args` / `**kwargs` (what those hold is unknown
    here: such a call is bound partially, its spelled-out arguments only)."""
    found: dict[tuple[str, int, tuple[str, ...], bool], set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(REPO))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch" or a.name.startswith("torch."):
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and (node.module == "torch" or node.module.startswith("torch.")):
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            chain, inner = [], node.func
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if not (isinstance(inner, ast.Name) and inner.id in aliases):
                continue
            name = ".".join([aliases[inner.id], *reversed(chain)])
            positional = sum(1 for a in node.args if not isinstance(a, ast.Starred))
            keywords = tuple(sorted(k.arg for k in node.keywords if k.arg is not None))
            starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
            found.setdefault((name, positional, keywords, starred), set()).add(rel)
    return found


def _object(dotted: str):
    """The object `dotted` names, or None (`lookup`)."""
    return lookup(dotted)[1]


def bind_problem(name: str, positional: int, keywords: tuple[str, ...], starred: bool = False) -> str | None:
    """None when a call of `name` with `positional` arguments and these keywords binds the installed signature (or the
    object has no signature to bind: a builtin, a class whose __init__ is C), else the TypeError's text."""
    obj = _object(name)
    if obj is None or not callable(obj):
        return None  # missing names are reported by `resolve`
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    try:
        (signature.bind_partial if starred else signature.bind)(*([None] * positional), **{k: None for k in keywords})
    except TypeError as exc:
        return str(exc)
    return None


def lookup(dotted: str) -> tuple[bool, object]:
    """(True, the object) when `dotted` is a module or an attribute reachable from the longest importable module prefix
    (a submodule its package has not imported yet included), else (False, None)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                try:  # a submodule not imported by its package yet
                    obj = importlib.import_module(f"{obj.__name__}.{attr}") if hasattr(obj, "__path__") else None
                except ImportError:
                    obj = None
                if obj is None:
                    return False, None
            else:
                obj = getattr(obj, attr)
        return True, obj
    return False, None


def resolve(dotted: str) -> bool:
    """True when `dotted` resolves (`lookup`)."""
    return lookup(dotted)[0]


# Attribute chains that end on a tensor's / module's own methods, not torch's API (a chain through a call's result is
# cut at the call by `ast`, so these are the few names that are values in torch's namespace).
NOT_API = ("torch.version.cuda.", "torch.version.git_version.")


# Methods called on objects torch returns (an AST cannot follow them): DTensor's, as grpo_lib/model/fsdp.py and actor.py use.
METHODS = {"torch.distributed.tensor.DTensor.full_tensor": {"grpo_lib/model/fsdp.py"},
           "torch.distributed.tensor.DTensor.to_local": {"grpo_lib/model/fsdp.py"},
           "torch.distributed.tensor.DTensor.device_mesh": {"grpo_lib/model/fsdp.py"},
           "torch.distributed.fsdp.FSDPModule": {"grpo_lib/model/fsdp.py (the class fully_shard mixes in)"}}


# Names the code checks itself at run time and falls back from: a mismatch here is a GUARDED line, not a failure.
GUARDED = {
    "torch.nn.attention.varlen.varlen_attn": "grpo_varlen then runs one sdpa call per sequence "
                                             "(grpo_lib/model/attention.py torch_varlen_attn binds the call first)",
    "torch.distributed.ProcessGroupNCCL": "a CPU build has none: the split roles' bridge then sends the weights over "
                                          "gloo too (grpo_lib/core/bridge.py looks it up where CUDA is present)",
}
GUARDED_PREFIXES = {  # --print-plan --measure's private torch names: grpo_lib/planning/measure.py refuses without them
    "torch.testing._internal.": "--measure refuses, naming it (planning.measure.missing_private_api)",
    "torch.distributed._tools.": "--measure refuses, naming it (planning.measure.missing_private_api)",
}


def guarded(name: str) -> str | None:
    """How the code handles `name` missing or not binding, when it checks at run time; else None."""
    return GUARDED.get(name) or next((why for prefix, why in GUARDED_PREFIXES.items() if name.startswith(prefix)), None)


def main(argv: list[str]) -> int:
    import torch

    paths = sorted((REPO / "grpo_lib").rglob("*.py")) + [REPO / "train_grpo.py"]
    names = {n: files for n, files in {**used_names(paths), **METHODS}.items() if not n.startswith(NOT_API)}
    missing = {n: files for n, files in sorted(names.items()) if not resolve(n)}
    calls = used_calls(paths)
    unbound = {key: (problem, files) for key, files in sorted(calls.items())
               if not key[0].startswith(NOT_API) and (problem := bind_problem(*key)) is not None}
    if "--list" in argv:
        print("\n".join(sorted(names)))
    for name in sorted({n for n in missing if guarded(n)} | {key[0] for key in unbound if guarded(key[0])}):
        print(f"torch_api_check: GUARDED {name} is missing or does not bind here; {guarded(name)}")
    missing = {n: files for n, files in missing.items() if not guarded(n)}
    unbound = {key: value for key, value in unbound.items() if not guarded(key[0])}
    for name, files in missing.items():
        print(f"torch_api_check: MISSING {name} (used in {', '.join(sorted(files))})")
    for (name, positional, keywords, _), (problem, files) in unbound.items():
        print(f"torch_api_check: SIGNATURE {name}({positional} positional{''.join(', ' + k + '=' for k in keywords)}) "
              f"does not bind: {problem} (used in {', '.join(sorted(files))})")
    print(f"torch_api_check: torch {torch.__version__}: {len(names) - len(missing)} of {len(names)} torch names used by "
          f"grpo_lib/ and train_grpo.py resolve" + ("" if not missing else f"; {len(missing)} missing")
          + f"; {len(calls) - len(unbound)} of {len(calls)} calls bind their signatures"
          + ("" if not unbound else f"; {len(unbound)} do not"))
    return 1 if missing or unbound else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
