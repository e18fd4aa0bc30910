"""GSM8K -> verl-schema parquet (`train.parquet`, `test.parquet`), the same rows verl's gsm8k.py writes.

Run (hub access):  python data_prep/gsm8k.py --out ~/data/gsm8k
Offline:           python data_prep/gsm8k.py --input-train gsm8k_train.jsonl --input-test gsm8k_test.jsonl
Small debug set:   python data_prep/gsm8k.py --train-size 256 --test-size 64 --out ~/data/gsm8k_small

One row (see data_prep/common.py for the full schema):

    {"question": "Tom has 1,000 apples and buys 234 more. How many?", "answer": "1000+234=1234\\n#### 1,234"}
    -> prompt [{"role": "user", "content": "Tom has ... How many? Let's think step by step and output the
       final answer after \\"####\\"."}], reward_model {"style": "rule", "ground_truth": "1234"}

Also used by other code: `make_rows(records, split, data_source)` (the demo's synthetic arithmetic data, in
GSM8K format, calls it with data_source="synthetic/arithmetic") and `write_parquet(rows, path)`.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by path: import from the repo root, and never let data_prep/math.py shadow stdlib math
    import os as _os
    import sys as _sys

    _here = _os.path.dirname(_os.path.abspath(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
    _sys.path.insert(0, _os.path.dirname(_here))

from typing import Iterable

from data_prep.common import checked_records, prepare_with_data_source, run_cli, write_parquet

__all__ = ["INSTRUCTION", "extract_answer", "make_rows", "write_parquet", "main"]

HUB_DATASET = ("openai/gsm8k", "main")
DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's wording
COLUMNS = ("question", "answer")


def extract_answer(solution: str) -> str:
    """The clean final answer of a GSM8K solution: the text after its last `####`, commas removed.

    Example: extract_answer("500+734=1234\\n#### 1,234") -> "1234"
    """
    marker = solution.rfind("####")
    if marker < 0:
        raise ValueError(f"GSM8K answer has no '####': {solution[-200:]!r}")
    answer = solution[marker + 4 :].strip().replace(",", "")
    if not answer:
        raise ValueError(f"GSM8K answer has nothing after '####': {solution[-200:]!r}")
    return answer


def make_rows(records: Iterable[dict], split: str, data_source: str = DATA_SOURCE) -> list[dict]:
    """GSM8K-format records ({"question", "answer" ending in "#### <n>"}) -> verl rows, `index` = position.

    Example: make_rows([{"question": "1+1?", "answer": "1+1=2\\n#### 2"}], "train")[0]["reward_model"]
             -> {"style": "rule", "ground_truth": "2"}
    """
    rows = []
    for index, record, ground_truth in checked_records(records, split, COLUMNS, lambda r: extract_answer(str(r["answer"]))):
        question, answer = str(record["question"]), str(record["answer"])
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
        })
    return rows


def _load_hub() -> dict[str, tuple[list[dict], str]]:
    import datasets

    name, config = HUB_DATASET
    try:
        dataset = datasets.load_dataset(name, config)
    except Exception as error:
        raise RuntimeError(f"could not load {name}/{config} from the hub ({type(error).__name__}: {error}); "
                           "offline, pass --input-train PATH --input-test PATH") from error
    return {split: (dataset[split].to_list(), f"{name}[{split}]") for split in ("train", "test")}


def main(argv: list[str] | None = None) -> dict[str, str]:
    return prepare_with_data_source(argv, description=__doc__.split("\n")[0], default_out="~/data/gsm8k",
                                    data_source=DATA_SOURCE, load_hub=_load_hub, required_columns=COLUMNS, make_rows=make_rows)


if __name__ == "__main__":
    run_cli(main)
