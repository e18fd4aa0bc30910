"""Synthetic arithmetic problems in GSM8K's own format, converted by the same code path as real GSM8K.

Each record is `{"question": "What is 3 + 4?", "answer": "3 + 4 = 7\\n#### 7"}`, exactly the two columns of
`openai/gsm8k`; `data_prep.gsm8k.make_rows` turns them into verl-schema rows with
`data_source = "synthetic/arithmetic"` (scored by the gsm8k rule: the number after `####`). The prompt's
instruction is `data_prep.gsm8k.INSTRUCTION` (re-exported here as `GSM8K_INSTRUCTION` for tiny_model.py).

Run:  python data_prep/synthetic.py --out artifacts/data/arith --train-size 2000 --test-size 200
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run by path: the repo root replaces data_prep/ (whose math.py would shadow stdlib math)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import random
from pathlib import Path

from data_prep.gsm8k import INSTRUCTION as GSM8K_INSTRUCTION  # one wording for real and synthetic data
from data_prep.gsm8k import make_rows, write_parquet

DATA_SOURCE = "synthetic/arithmetic"


def render_answer(a: int, op: str, b: int, result: int) -> str:
    """GSM8K-style worked answer. Example: render_answer(3, "+", 4, 7) -> "3 + 4 = 7\\n#### 7"."""
    return f"{a} {op} {b} = {result}\n#### {result}"


def make_problems(*, num: int, seed: int, max_operand: int = 9) -> list[dict]:
    """`num` random additions with operands in [0, max_operand]; each row keeps a, op, b, result too."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"question": f"What is {a} + {b}?", "answer": render_answer(a, "+", b, a + b), "a": a, "op": "+", "b": b, "result": a + b})
    return rows


def write_dataset(out: str | Path, *, train_size: int, test_size: int, seed: int = 0, max_operand: int = 9) -> dict[str, Path]:
    """Write `train.parquet` / `test.parquet` in verl's schema; returns {split: path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, size, split_seed in (("train", train_size, seed), ("test", test_size, seed + 1000)):
        records = [{"question": p["question"], "answer": p["answer"]} for p in make_problems(num=size, seed=split_seed, max_operand=max_operand)]
        paths[split] = out / f"{split}.parquet"
        write_parquet(make_rows(records, split=split, data_source=DATA_SOURCE), paths[split])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_dataset(args.out, train_size=args.train_size, test_size=args.test_size, seed=args.seed, max_operand=args.max_operand)
    for split, path in paths.items():
        print(f"wrote {split}: {path}")


if __name__ == "__main__":
    main()
