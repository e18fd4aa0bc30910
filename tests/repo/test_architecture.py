"""The import drawing of grpo_lib/ stays a stack of layer folders: no import circle, no arrow from a lower folder to a
higher one, and docs/DESIGN.md's module map lists every folder with its layer and every module with its true arrows.

Imports are read with `ast` (every `import grpo_lib...` / `from grpo_lib... import ...`, also inside functions and
under TYPE_CHECKING: a lazy import is still a dependency). A name imported from a package that is one of its
submodules counts as an arrow to that submodule; any other name as an arrow to the package's `__init__`.
The module map is under "## Module map" in docs/DESIGN.md: one folder table, `| layer | folder | owns | may import |`
(layer 0 at the bottom; "may import" the lower folders it uses, `—` for none), then one table per folder,
`| module | owns | talks to |`, module names relative to grpo_lib (`rollout.engines.vllm`, a package's `__init__` by
the package name), "talks to" the project modules it imports, comma-separated (`—` for none). An arrow between two
folders runs to a lower layer and to a folder the row lists; inside a folder, modules import each other freely
(never in a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "grpo_lib"


def lib_modules() -> dict[str, Path]:
    """Module name (relative to grpo_lib) -> file; an empty package __init__ is not a module of its own."""
    out = {}
    for path in sorted(LIB.rglob("*.py")):
        parts = path.relative_to(LIB).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
            if not parts or not path.read_text().strip():
                continue
        out[".".join(parts)] = path
    return out


def _resolve(dotted: str, modules) -> str | None:
    """The longest prefix of `dotted` that is a module (None: grpo_lib itself or an empty package)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imports_of(path: Path, modules) -> set[str]:
    """The grpo_lib modules `path` imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("grpo_lib."):
                    out.add(_resolve(alias.name.removeprefix("grpo_lib."), modules))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative import: resolve against this file's package
                package = path.relative_to(REPO).parent.parts[:len(path.relative_to(REPO).parent.parts) - node.level + 1]
                module = ".".join((*package, *([module] if module else [])))
            if module != "grpo_lib" and not module.startswith("grpo_lib."):
                continue
            base = module.removeprefix("grpo_lib").removeprefix(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                out.add(candidate if candidate in modules else _resolve(base, modules))
    out.discard(None)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = lib_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _rows(section: str, width: int) -> list[list[str]]:
    """The table rows of `section` with `width` cells (header and rule lines left out)."""
    out = []
    for line in section.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == width and not set(cells[0]) <= {"-"} and cells[0] not in ("layer", "module"):
            out.append(cells)
    return out


def _names(cell: str) -> set[str]:
    return {t.strip().strip("`") for t in cell.split(",") if t.strip().strip("`") not in ("", "—", "-")}


def map_section() -> str:
    text = (REPO / "docs/DESIGN.md").read_text()
    return text.split("## Module map", 1)[1].split("\n## ", 1)[0]


def folder_map() -> dict[str, tuple[int, set[str]]]:
    """docs/DESIGN.md's folder table: folder -> (layer, folders it may import)."""
    return {cells[1].strip("`").rstrip("/"): (int(cells[0]), _names(cells[3]))
            for cells in _rows(map_section(), 4) if cells[0].isdigit()}


def module_map() -> dict[str, set[str]]:
    """docs/DESIGN.md's module tables (one per folder): module -> modules it talks to."""
    return {cells[0].strip("`"): _names(cells[2]) for cells in _rows(map_section(), 3)}


def folder_of(module: str) -> str:
    return module.split(".", 1)[0]


def upward_arrows(graph: dict[str, set[str]], folders: dict[str, tuple[int, set[str]]]) -> list[str]:
    """Arrows between folders that do not run down: to a folder of the same or a higher layer, or to one the source
    folder's row does not list under "may import"."""
    bad = []
    for name, deps in sorted(graph.items()):
        src = folder_of(name)
        for dep in sorted(deps):
            dst = folder_of(dep)
            if src == dst:
                continue
            (src_layer, allowed), (dst_layer, _) = folders[src], folders[dst]
            if dst_layer >= src_layer or dst not in allowed:
                bad.append(f"{name} ({src}, layer {src_layer}) -> {dep} ({dst}, layer {dst_layer})")
    return bad


def test_the_reader_sees_every_import():
    """The parser itself: a module known to import others is read as doing so (else every check below is vacuous)."""
    graph = import_graph()
    assert len(graph) > 20, sorted(graph)
    assert sum(len(v) for v in graph.values()) > 30, "almost no arrows read: the ast reader is broken"
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(cyclic) == [["a", "b", "c"]]


def test_the_folder_check_catches_an_arrow_up_or_sideways():
    """The folder rule itself, on a made-up drawing: down is fine, up (or to a folder not listed) is caught."""
    folders = {"core": (0, {"core"}), "model": (2, {"core"}), "rollout": (1, {"core"})}
    assert upward_arrows({"model.a": {"core.b", "model.c"}, "model.c": set(), "core.b": set()}, folders) == []
    assert len(upward_arrows({"core.b": {"model.a"}, "model.a": set()}, folders)) == 1  # up
    assert len(upward_arrows({"model.a": {"rollout.r"}, "rollout.r": set()}, folders)) == 1  # down, but not listed


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles (one concern lives in two files: move the shared piece into a leaf both import): " \
        + "; ".join(" <-> ".join(c) for c in found)


def test_grpo_lib_is_a_handful_of_layer_folders():
    """Issue 42: every module sits in a folder of one layer (no flat module at grpo_lib's top), at most ~10 entries,
    each folder's __init__ says what the layer owns and what it may import."""
    entries = sorted(p.name for p in LIB.iterdir() if p.name not in ("__init__.py", "__pycache__"))
    assert len(entries) <= 10, entries
    assert all((LIB / e).is_dir() for e in entries), f"flat modules at grpo_lib's top: {[e for e in entries if not (LIB / e).is_dir()]}"
    for folder in entries:
        doc = ast.get_docstring(ast.parse((LIB / folder / "__init__.py").read_text())) or ""
        assert doc and "import" in doc.lower(), f"grpo_lib/{folder}/__init__.py: a docstring saying what it owns and may import"


def test_design_folder_map_lists_every_folder():
    folders, present = folder_map(), {folder_of(m) for m in import_graph()}
    assert set(folders) == present, f"docs/DESIGN.md's folder table: {sorted(folders)}; grpo_lib's folders: {sorted(present)}"


def test_design_module_map_lists_every_module_with_its_true_arrows():
    graph, rows = import_graph(), module_map()
    missing, extra = sorted(set(graph) - set(rows)), sorted(set(rows) - set(graph))
    assert not missing, f"docs/DESIGN.md's module map lacks {missing}"
    assert not extra, f"docs/DESIGN.md's module map lists modules that do not exist: {extra}"
    wrong = {name: (sorted(rows[name]), sorted(deps)) for name, deps in graph.items() if rows[name] != deps}
    assert not wrong, "docs/DESIGN.md 'talks to' differs from the imports (map, code): " + \
        "; ".join(f"{n}: {m} vs {c}" for n, (m, c) in sorted(wrong.items()))


def test_no_arrow_runs_up_a_folder():
    up = upward_arrows(import_graph(), folder_map())
    assert not up, "imports from a lower folder to a higher one (or to a folder its row does not list): " + "; ".join(up)


def test_no_module_or_test_file_outgrows_its_concern():
    """Issue 42: no grpo_lib module over ~500 lines (STYLE: split by concern), no test file over ~700."""
    big = [f"{p.relative_to(REPO)}: {n}" for p in sorted(LIB.rglob("*.py")) if (n := len(p.read_text().splitlines())) > 520]
    big += [f"{p.relative_to(REPO)}: {n}" for p in sorted((REPO / "tests").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 720]
    assert not big, big


def test_the_trainers_run_parts_are_typed():
    """Issue 29 item 7: `RunParts` and `GRPOTrainer`'s constructor are typed, not `Any`: every annotation resolves
    through train_grpo.py's TYPE_CHECKING imports (executed here, so a renamed or moved class fails the test, not only
    a type checker) to a class of the project (or torch / transformers)."""
    import dataclasses
    import typing

    import train_grpo

    tree = ast.parse((REPO / "train_grpo.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
    namespace: dict = {}
    exec(compile(ast.Module(body=block.body, type_ignores=[]), "train_grpo.py", "exec"), namespace)
    globalns = {**vars(train_grpo), **namespace}
    hints = typing.get_type_hints(train_grpo.RunParts, globalns=globalns)
    assert set(hints) == {f.name for f in dataclasses.fields(train_grpo.RunParts)}
    assert typing.Any not in hints.values(), hints
    assert hints["actor"] is namespace["Actor"] and hints["engine"] is namespace["RolloutEngine"]
    assert set(typing.get_args(hints["reference"])) == {namespace["Reference"], namespace["AdapterDisabledReference"], type(None)}
    init = typing.get_type_hints(train_grpo.GRPOTrainer.__init__, globalns=globalns)
    assert init["cfg"] is namespace["Config"] and init["resume"] is namespace["ResumePlan"], init


def test_the_trainers_step_reads_as_the_design_step_order():
    """Issue 29 item 2: `GRPOTrainer.step` calls the phases in docs/DESIGN.md's order (rollouts with their checks ->
    balance -> the step plan -> reference / teacher / old logprobs -> advantages -> update -> push), each a named call,
    and stays short enough to read as that list (it was 74 lines before the weight-sync unit and the helpers)."""
    tree = ast.parse((REPO / "train_grpo.py").read_text())
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer"]
    (step,) = [n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
    calls = sorted((n.lineno, n.col_offset, n.func.attr) for n in ast.walk(step)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute))
    order = ["rollouts", "balance_batch", "plan_step", "score_logprobs", "compute_advantages", "update", "push_weights"]
    seen = list(dict.fromkeys(name for _, _, name in calls if name in order))  # each phase's first call
    assert seen == order, seen
    assert step.end_lineno - step.lineno + 1 <= 30, f"GRPOTrainer.step is {step.end_lineno - step.lineno + 1} lines"
    # the named phases exist on the trainer (the step's own calls, not another object's methods of the same name)
    methods = {n.name for n in trainer.body if isinstance(n, ast.FunctionDef)}
    assert {"rollouts", "score_logprobs", "push_weights"} <= methods
