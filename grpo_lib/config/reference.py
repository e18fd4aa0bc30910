"""The config reference (docs/REFERENCE.md), generated from the schema's field docstrings: `python -m grpo_lib.config`
prints it, `--update-docs` rewrites docs/REFERENCE.md's tables (tests/config/test_config.py checks the page holds every line)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from grpo_lib.config.schema import Config
from grpo_lib.config.schema_distillation import DistillationConfig
from grpo_lib.config.schema_reward_model import RewardModelConfig
from grpo_lib.config.schema_rollout import RolloutConfig


def reference_markdown() -> str:
    """The config reference table (docs/REFERENCE.md embeds it): key, default, meaning — read from the field docstrings."""
    import ast
    import inspect

    docs: dict[str, dict[str, str]] = {}
    for module in (Config.__module__, DistillationConfig.__module__, RolloutConfig.__module__, RewardModelConfig.__module__):  # the sections' modules
        tree = ast.parse(inspect.getsource(__import__(module, fromlist=["x"])))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                body, docs[node.name] = node.body, {}
                for a, b in zip(body, body[1:]):
                    if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                        docs[node.name][a.target.id] = " ".join(str(b.value.value).split())

    lines = []

    def walk(cls, prefix: str):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("runtime"):
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{prefix}{f.name}` | `{default!r}` | {docs.get(cls.__name__, {}).get(f.name, '')} |")

    for f in dataclasses.fields(Config):
        if f.metadata.get("runtime"):
            continue
        lines.append(f"\n**{f.name}**\n\n| key | default | meaning |\n|---|---|---|")
        walk(typing.get_type_hints(Config)[f.name], f"{f.name}.")
    return "\n".join(lines).strip() + "\n"


def update_docs(page: str | Path = "docs/REFERENCE.md") -> None:
    """Rewrite the tables between '## Config reference' (after its intro paragraph) and the next '## '."""
    path = Path(page)
    text = path.read_text()
    start = text.index("## Config reference")
    first_table = text.index("**data**", start)
    end = text.index("\n## ", first_table)
    path.write_text(text[:first_table] + reference_markdown() + text[end:])
