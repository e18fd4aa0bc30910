"""MATH-style answers: last `\\boxed{...}` (or `\\fbox{...}`) extraction, equivalence by math-verify.

The answer is the content of the LAST `\\boxed`/`\\fbox` in the response, braces balanced (escaped `\\{`,
`\\}` do not count). If that last box is cut off (`\\boxed{12`), the response has no answer: an earlier box
is not used, as for GSM8K's last `####`.

    last_boxed("so \\boxed{1} no wait \\boxed{\\frac{1}{2}}.")  -> "\\frac{1}{2}"
    last_boxed("\\boxed 5$")                                   -> "5"      (verl's `\\boxed 5` form)
    last_boxed("\\boxed{12")                                   -> None

Equivalence: gold and prediction are both wrapped in `\\boxed{}` and parsed by `math_verify.parse`, then
compared by `math_verify.verify(gold, pred)` (so `0.5` == `\\frac{1}{2}` == `\\dfrac12`, `(x+2)(x+5)` ==
`x^2+7x+10`, `[-2,7]` != `(-2,7)`). A normalised string match is tried first (cheap, and it covers text
answers math-verify cannot parse). math-verify's own signal-based timeouts are used only in a process's
main thread (they raise elsewhere); the scorer enforces its own timeout around the whole call.
"""

from __future__ import annotations

import re
import threading

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MATH_VERIFY_TIMEOUT_S = 5


def _balanced(text: str, open_at: int) -> str | None:
    """Content of the `{...}` group whose `{` is at `open_at`; None if it never closes."""
    depth = 0
    i = open_at
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped char: `\{` and `\}` are literal braces
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{}`/`\\fbox{}` in `text` (see the module docstring); None if absent or cut off."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest_at = start + len(command)
    rest = text[rest_at:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return _balanced(text, rest_at + len(rest) - len(stripped))
    if rest[:1] == " ":  # `\boxed 5`: one token up to whitespace or `$`
        token = re.match(r"[^\s$]+", stripped)
        return token.group(0) if token else None
    return None


def normalize_answer(answer: str) -> str:
    """A canonical string for cheap equality: spacing, `\\left`/`\\right`, `\\dfrac`, `\\text{}`, units marks.

    Example: normalize_answer("\\left( 3, \\dfrac{1}{2} \\right).") -> "(3,\\frac{1}{2})"
    """
    text = answer.strip()
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "\\$", "\\%", "$", "^\\circ", "^{\\circ}"):
        text = text.replace(token, "")
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def _parse_boxed(content: str, timeout_s: int | None) -> list:
    from math_verify import LatexExtractionConfig, parse  # lazy: sympy import costs ~0.5 s

    return parse(
        "\\boxed{" + content + "}",
        extraction_config=[LatexExtractionConfig()],
        parsing_timeout=timeout_s,
    )


def is_equivalent(gold: str, predicted: str) -> bool:
    """True if `predicted` (a boxed content) equals `gold` (a boxed content) as math.

    Example: is_equivalent("\\frac{1}{2}", "0.5") -> True; is_equivalent("[-2,7]", "(-2,7)") -> False.
    """
    gold_norm, predicted_norm = normalize_answer(gold), normalize_answer(predicted)
    if not predicted_norm:
        return False
    if gold_norm == predicted_norm:
        return True
    from math_verify import verify

    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout_s = _MATH_VERIFY_TIMEOUT_S if in_main_thread else None
    gold_parsed = _parse_boxed(gold.strip(), timeout_s)
    predicted_parsed = _parse_boxed(predicted.strip().rstrip("."), timeout_s)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout_s))


def score(response: str, ground_truth) -> float:
    """1.0 if the last boxed answer of `response` is equivalent to `ground_truth`, else 0.0.

    `ground_truth` is the clean answer (`"\\frac{1}{2}"`); a full solution containing `\\boxed{}` also works.
    Example: score("... so \\boxed{0.5}", "\\frac{1}{2}") -> 1.0; score("... so 0.5", "\\frac{1}{2}") -> 0.0.
    """
    if ground_truth is None or isinstance(ground_truth, float) and ground_truth != ground_truth:
        return 0.0  # no answer to match: "\\boxed{None}" must not match str(None)
    gold = str(ground_truth)
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = last_boxed(gold) or ""
    predicted = last_boxed(response)
    if predicted is None or not gold.strip():
        return 0.0
    return float(is_equivalent(gold, predicted))


def has_boxed_answer(response: str) -> bool:
    """Format check: the last `\\boxed{}`/`\\fbox{}` is complete and not empty."""
    content = last_boxed(response)
    return content is not None and content.strip() != ""
