"""MATH -> verl-schema parquet: train from DigitalLearningGmbH/MATH-lighteval, test from HuggingFaceH4/MATH-500.

Run (hub access):  python data_prep/math.py --out ~/data/math
Offline:           python data_prep/math.py --input-train math_train.parquet --input-test math500.jsonl
Small debug set:   python data_prep/math.py --train-size 512 --test-size 100

Rows match verl's math_dataset.py (data_source "DigitalLearningGmbH/MATH-lighteval" for both splits, as
verl writes; change it with --data-source), plus the original problem/solution/level/type in extra_info:

    {"problem": "What is $1 \\div 2$?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Prealgebra"}
    -> prompt [{"role": "user", "content": "What is $1 \\div 2$? Let's think step by step and output the
       final answer within \\boxed{}."}], reward_model {"style": "rule", "ground_truth": "\\frac{1}{2}"}

The ground truth is the content of the solution's last `\\boxed{}` (MATH-500's `answer` column if the
solution has none), extracted by the reward code's own `last_boxed`, so data and reward agree.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by path: import from the repo root, and never let this file shadow stdlib math
    import os as _os
    import sys as _sys

    _here = _os.path.dirname(_os.path.abspath(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
    _sys.path.insert(0, _os.path.dirname(_here))

from typing import Iterable

__all__ = ["INSTRUCTION", "extract_answer", "make_rows", "main"]

HUB_TRAIN = "DigitalLearningGmbH/MATH-lighteval"
HUB_TEST = "HuggingFaceH4/MATH-500"
DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."  # verl's wording
COLUMNS = ("problem", "solution")


def extract_answer(record: dict) -> str:
    """The clean final answer: last `\\boxed{}` content of the solution, else the record's `answer`.

    Example: extract_answer({"solution": "so $\\boxed{\\frac{1}{2}}$."}) -> "\\frac{1}{2}"
    """
    from grpo_lib.rewards.math import last_boxed  # imports inside functions: see the `__name__ == "math"` note

    boxed = last_boxed(str(record["solution"]))
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if str(record.get("answer") or "").strip():
        return str(record["answer"]).strip()
    raise ValueError(f"solution has no complete \\boxed{{}} and there is no 'answer': {str(record['solution'])[-200:]!r}")


def make_rows(records: Iterable[dict], split: str, data_source: str = DATA_SOURCE) -> list[dict]:
    """MATH records ({"problem", "solution", optional "level", "type"/"subject", "answer"}) -> verl rows.

    Example: make_rows([{"problem": "1+1?", "solution": "$\\boxed{2}$"}], "test")[0]["reward_model"]
             -> {"style": "rule", "ground_truth": "2"}
    """
    from data_prep.common import checked_records  # here, not at the top: see the path note above

    rows = []
    for index, record, ground_truth in checked_records(records, split, COLUMNS, extract_answer):
        problem = str(record["problem"])
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {
                "split": split, "index": index, "question": problem, "answer": str(record["solution"]),
                "level": str(record.get("level") or ""), "type": str(record.get("type") or record.get("subject") or ""),
            },
        })
    return rows


def _load_hub() -> dict[str, tuple[list[dict], str]]:
    import datasets

    splits = {}
    for split, name in (("train", HUB_TRAIN), ("test", HUB_TEST)):
        try:
            records = datasets.load_dataset(name, split=split).to_list()
        except Exception as error:
            raise RuntimeError(f"could not load {name}[{split}] from the hub ({type(error).__name__}: {error}); "
                               "offline, pass --input-train PATH --input-test PATH") from error
        splits[split] = (records, f"{name}[{split}]")
    return splits


def main(argv: list[str] | None = None) -> dict[str, str]:
    from data_prep.common import prepare_with_data_source

    return prepare_with_data_source(argv, description=__doc__.split("\n")[0], default_out="~/data/math",
                                    data_source=DATA_SOURCE, load_hub=_load_hub, required_columns=COLUMNS, make_rows=make_rows)


if __name__ == "__main__":
    from data_prep.common import run_cli

    run_cli(main)
