"""No file of the repository points outside it: a user who clones the project has only the project.

Scans code, docs, README, recipes, tests, data_prep and bench for paths into a developer's machine
(a sibling `shared` folder, the build machine's work folder, absolute home folders). The design and the
formulas live in docs/; comments cite `docs/DESIGN.md` and `docs/ALGORITHMS.md`.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "artifacts", "outputs", "__pycache__", ".pytest_cache", ".hypothesis", "node_modules", ".ruff_cache"}
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".txt", ".sh", ".toml", ".cfg", ".json", ""}
# Patterns are assembled from pieces so this file does not match itself.
FORBIDDEN = [
    re.compile(r"\.\./" + "shared"),          # the sibling design folder of the build machine
    re.compile(r"(?<![\w.])/" + r"work/"),    # the build machine's work tree
    re.compile(r"(?<![\w.~])/" + r"home/\w"), # somebody's home folder
    re.compile(r"(?<![\w.~])/" + r"root/"),   # root's home folder
    re.compile(r"(?<![\w.~])/" + r"Users/\w"),  # macOS home folders
    re.compile(r"(?<![\w/.])" + r"(DESIGN|ALGORITHMS)\.md"),  # the design docs live in docs/: cite docs/DESIGN.md
]


def repo_files() -> list[Path]:
    out = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or path.name in ("Makefile",)):
            out.append(path)
    return out


def test_no_path_outside_the_repository():
    assert len(repo_files()) > 20, "the scan found almost no files: is REPO right?"
    hits = []
    for path in repo_files():
        if path == Path(__file__).resolve():
            continue  # names the patterns it looks for
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(p.search(line) for p in FORBIDDEN):
                hits.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:120]}")
    assert not hits, "paths outside the repository (cite docs/DESIGN.md, docs/ALGORITHMS.md instead):\n" + "\n".join(hits)


def test_the_scan_would_catch_each_pattern():
    """The patterns match what they are for (so an empty hit list means something)."""
    # assembled from parts, so this file holds none of the paths it checks for
    samples = ["/".join(parts) for parts in (("see ..", "shared", "DESIGN.md"), ("", "work", "shared", "ALGORITHMS.md"),
                                             ("", "home", "alice", "data"), ("", "root", ".cache", "x"), ("", "Users", "bob", "x"))]
    samples += [" ".join(("see", "DESIGN.md")), "".join(("(", "ALGORITHMS.md)"))]
    for s in samples:
        assert any(p.search(s) for p in FORBIDDEN), s
    for fine in ("~/data/gsm8k/train.parquet", "docs/DESIGN.md", "outputs/run", "artifacts/tiny_qwen3"):
        assert not any(p.search(fine) for p in FORBIDDEN), fine


def test_docs_exist_and_are_cited():
    for name in ("DESIGN.md", "ALGORITHMS.md"):
        assert (REPO / "docs" / name).is_file(), f"docs/{name} is missing"
    code = "\n".join(p.read_text() for p in (REPO / "grpo_lib").rglob("*.py"))
    assert "docs/DESIGN.md" in code and "docs/ALGORITHMS.md" in code
