"""Field metadata the code reads beyond a key's type (the lowest module of `grpo_lib.config`: the schema's sections
use it). `metadata={"runtime": True}` marks a value load_config sets; `may_change_on_resume` a key a resume may change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def may_change_on_resume(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field whose value may differ between a checkpoint and the run resuming it: it changes speed, memory, logging or
    how long the run goes, never what one step computes (any other difference exits 2: grpo_lib/checkpoints/checkpoint.py). On a
    section (`ref`) or a mapping it covers every key under it.

    Example: `save_freq: int = may_change_on_resume(-1)` is `field(default=-1, metadata={"resume_may_change": True})`.
    """
    return field(default=default, default_factory=default_factory, metadata={"resume_may_change": True})
