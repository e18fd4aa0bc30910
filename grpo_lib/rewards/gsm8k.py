"""GSM8K-style answers: `#### <number>` extraction and numeric comparison.

Two extraction modes (verl's names):

- `strict`: the first number on the line after the LAST `####` in the response. Several `####`: only the
  last one counts, even when nothing usable follows it (`#### 12 ... #### ` scores 0). The model's final
  statement is its answer; an earlier marker it moved past, or a cut-off final marker, is not.
- `flexible`: the last number anywhere in the response (no marker needed).

Numbers are normalised before comparing, so the comparison is exact on rationals:

    "#### $1,234.50 dollars."  -> Fraction(2469, 2)      (currency, thousands commas, units, trailing period)
    "#### 1 234"               -> 1234                    (space / thin-space thousands groups)
    "#### \\$1{,}234"          -> 1234                    (LaTeX money and grouping)
    "#### −7"                  -> -7                      (unicode minus)
    "#### 3/4"                 -> Fraction(3, 4)          (a simple fraction)
    "3.50" == "3.5", "7.0" == "7"

Departure from verl: verl's strict regex skips a `####` that is not followed by a number and takes an
earlier one, and compares strings ("7.0" != "7"); here the last marker wins and values compare numerically.
"""

from __future__ import annotations

import re
from fractions import Fraction

GSM8K_MODES = ("strict", "flexible")

# One number: optional sign (not a hyphen between words/digits), optional `$`, digits with optional
# thousands groups (`,` or a single space-like char), optional decimals, optional `/denominator`.
_NUMBER_RE = re.compile(
    r"(?P<sign>(?<![\w)\]}])-\s?)?"
    r"\$?\s?"
    r"(?P<num>"
    r"\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # 1,234 / 1,234.5
    r"|\d{1,3}(?:[ \u00a0\u2009\u202f]\d{3})+(?![\d,])(?:\.\d+)?"  # 1 234 (space groups)
    r"|\d+(?:\.\d+)?(?:/\d+(?![\d.]))?"  # 1234 / 12.5 / 3/4
    r"|\.\d+"  # .5
    r")"
)


def _clean(text: str) -> str:
    """Undo LaTeX/unicode spellings of numbers: `\\$`, `{,}`, `\\,` groups, unicode minus."""
    text = text.replace("\u2212", "-").replace("\\$", "$").replace("{,}", ",")
    text = re.sub(r"(?<=\d)\\[,!; ](?=\d{3})", "", text)  # 1\,234 -> 1234
    return text.replace("\\!", "").replace("\\left", "").replace("\\right", "")


def _to_fraction(sign: str | None, num: str) -> Fraction | None:
    digits = re.sub(r"[,\s\u00a0\u2009\u202f]", "", num)
    try:
        value = Fraction(digits)
    except (ValueError, ZeroDivisionError):
        return None
    return -value if sign else value


def parse_number(text: str) -> Fraction | None:
    """The first number in `text`, as an exact Fraction; None if there is none.

    Example: parse_number("$1,234.00 dollars.") -> Fraction(1234, 1); parse_number("none") -> None.
    """
    match = _NUMBER_RE.search(_clean(text))
    return None if match is None else _to_fraction(match["sign"], match["num"])


def extract_strict(response: str) -> Fraction | None:
    """The first number on the line after the last `####`; None if no marker or no number there.

    Example: "x = 3\\n#### 1,234 apples." -> 1234; "#### 5\\n#### " -> None (the last marker is empty).
    """
    marker = response.rfind("####")
    if marker < 0:
        return None
    tail = response[marker + 4 :].lstrip()
    first_line = tail.split("\n", 1)[0]
    return parse_number(first_line)


def extract_flexible(response: str) -> Fraction | None:
    """The last number anywhere in the response; None if there is none.

    Example: "She pays 3 x 4 = 12 dollars." -> 12.
    """
    matches = list(_NUMBER_RE.finditer(_clean(response)))
    for match in reversed(matches):
        value = _to_fraction(match["sign"], match["num"])
        if value is not None:
            return value
    return None


def has_answer_marker(response: str) -> bool:
    """Format check: the last `####` is followed by a number on its line."""
    return extract_strict(response) is not None


def score(response: str, ground_truth, *, mode: str = "strict") -> float:
    """1.0 if the extracted answer equals the ground truth numerically, else 0.0.

    Example: score("... #### 3.50", "3.5") -> 1.0; score("... #### 4", "3.5") -> 0.0.
    A non-numeric ground truth falls back to a case-insensitive string match of the text after `####`.
    """
    if mode not in GSM8K_MODES:
        raise ValueError(f"gsm8k_mode must be one of {GSM8K_MODES}, got {mode!r}")
    if ground_truth is None or isinstance(ground_truth, float) and ground_truth != ground_truth:
        return 0.0  # no answer to match: "#### None" must not match str(None)
    gold_text = str(ground_truth).strip()
    if "####" in gold_text:  # a full GSM8K solution was passed as ground truth
        gold_text = gold_text[gold_text.rfind("####") + 4 :].strip()
    gold = parse_number(gold_text)
    if gold is None:
        marker = response.rfind("####")
        predicted_text = response[marker + 4 :].strip().rstrip(".") if marker >= 0 else ""
        return float(bool(gold_text) and predicted_text.lower() == gold_text.lower())
    predicted = extract_strict(response) if mode == "strict" else extract_flexible(response)
    return float(predicted is not None and predicted == gold)
