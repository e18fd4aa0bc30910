"""Built-in rewards, dispatched by a row's `data_source` (verl's `default_compute_score` names).

    compute_score("openai/gsm8k", "... #### 1,234", "1234")            -> 1.0
    compute_score("lighteval/MATH", "... \\boxed{0.5}", "\\frac{1}{2}") -> 1.0
    format_score("openai/gsm8k", "... the answer is 7", "7")           -> 0.0   (no `#### <number>`)

| data_source | accuracy | format asked by the prompt |
|---|---|---|
| `openai/gsm8k` | gsm8k, `gsm8k_mode` strict or flexible | `#### <number>` |
| `synthetic/arithmetic` (the demo's data) | gsm8k strict, always | `#### <number>` |
| MATH sources (`MATH_SOURCES`) | last `\\boxed{}` + math-verify | `\\boxed{...}` |

An unknown data_source raises ValueError listing these. New sources: use a custom reward file
(`load_custom_reward`), which replaces `accuracy` for every row, as verl's custom_reward_function does.
"""

from __future__ import annotations

from typing import Callable

from grpo_lib.rewards import gsm8k, math

GSM8K_SOURCES = ("openai/gsm8k",)
SYNTHETIC_SOURCES = ("synthetic/arithmetic",)
MATH_SOURCES = (
    "DigitalLearningGmbH/MATH-lighteval",
    "lighteval/MATH",
    "HuggingFaceH4/MATH-500",
    "EleutherAI/hendrycks_math",
    "hendrycks/competition_math",
    "math",
    "MATH",
)


def _gsm8k_accuracy(response: str, ground_truth, gsm8k_mode: str) -> float:
    return gsm8k.score(response, ground_truth, mode=gsm8k_mode)


def _synthetic_accuracy(response: str, ground_truth, gsm8k_mode: str) -> float:
    return gsm8k.score(response, ground_truth, mode="strict")  # the demo teaches the `####` format


def _math_accuracy(response: str, ground_truth, gsm8k_mode: str) -> float:
    return math.score(response, ground_truth)


# data_source -> (accuracy(response, ground_truth, gsm8k_mode) -> float, format_ok(response) -> bool)
_REGISTRY: dict[str, tuple[Callable[[str, object, str], float], Callable[[str], bool]]] = {
    **{source: (_gsm8k_accuracy, gsm8k.has_answer_marker) for source in GSM8K_SOURCES},
    **{source: (_synthetic_accuracy, gsm8k.has_answer_marker) for source in SYNTHETIC_SOURCES},
    **{source: (_math_accuracy, math.has_boxed_answer) for source in MATH_SOURCES},
}


def registered_sources() -> list[str]:
    """The data_source names the built-in rewards know."""
    return sorted(_REGISTRY)


def _lookup(data_source: str):
    entry = _REGISTRY.get(data_source)
    if entry is None:
        raise ValueError(
            f"no built-in reward for data_source {data_source!r}; registered sources: {registered_sources()}. "
            "For other data, set a custom reward file (reward.custom.path, verl: custom_reward_function.path)."
        )
    return entry


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None, *,
                  gsm8k_mode: str = "strict") -> float:
    """Accuracy of one response: 1.0 or 0.0 (built-ins return floats; custom functions may return dicts).

    `gsm8k_mode` ("strict" | "flexible") applies to `openai/gsm8k` only; `extra_info` is unused here and
    kept for verl's signature.
    """
    if gsm8k_mode not in gsm8k.GSM8K_MODES:
        raise ValueError(f"gsm8k_mode must be one of {gsm8k.GSM8K_MODES}, got {gsm8k_mode!r}")
    accuracy, _ = _lookup(data_source)
    if ground_truth is None or isinstance(ground_truth, float) and ground_truth != ground_truth \
            or isinstance(ground_truth, str) and not ground_truth.strip():
        raise ValueError(f"ground truth is {ground_truth!r}: nothing to score against (the data loader drops such rows, "
                         "see data.invalid_rows)")
    return accuracy(solution_str or "", ground_truth, gsm8k_mode)


def format_score(data_source: str, solution_str: str, ground_truth=None, extra_info: dict | None = None) -> float:
    """1.0 if the response gives its final answer in the format its source's prompt asks for, else 0.0.

    Example: format_score("openai/gsm8k", "#### 12", "13") -> 1.0 (format only; correctness is accuracy's job).
    """
    _, format_ok = _lookup(data_source)
    return float(format_ok(solution_str or ""))
