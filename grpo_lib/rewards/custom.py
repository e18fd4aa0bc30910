"""Load a user reward function from a Python file (verl's `custom_reward_function.path` / `.name`).

The function has verl's signature and is called with keywords, exactly as verl calls it, so verl users'
files work unchanged:

    # my_reward.py
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip().endswith(str(ground_truth)) else 0.0   # or {"score": ..., "acc": ...}

    fn = load_custom_reward("my_reward.py", "compute_score")
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Callable


def load_custom_reward(path: str, name: str = "compute_score") -> Callable:
    """Import `path` as a module and return its callable `name`.

    Raises FileNotFoundError (file missing), ImportError (the file raised while importing; the original
    error is chained), AttributeError (no callable `name`; the message lists the functions the file has).
    """
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(resolved):
        raise FileNotFoundError(f"custom reward file not found: {path!r} (resolved to {resolved})")
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:12]
    module_name = f"grpo_custom_reward_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, resolved)
        assert spec is not None and spec.loader is not None, f"cannot build an import spec for {resolved}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses / pickling inside the file need the module registered
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[module_name]
            raise ImportError(
                f"custom reward file {resolved} raised while importing: {type(error).__name__}: {error}"
            ) from error
    function = getattr(module, name, None)
    if function is None or not callable(function) or inspect.isclass(function):
        found = sorted(
            attr for attr, value in vars(module).items()
            if not attr.startswith("_") and (inspect.isfunction(value) or inspect.isbuiltin(value))
        )
        raise AttributeError(
            f"custom reward file {resolved} has no function {name!r}; functions found: {found}"
        )
    return function
