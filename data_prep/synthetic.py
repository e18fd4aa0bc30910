"""Synthetic arithmetic problems in GSM8K's own format, converted by the same code path as real GSM8K.

Each record is `{"question": "What is 3 + 4?", "answer": "3 + 4 = 7\\n#### 7"}`, exactly the two columns of
`openai/gsm8k`; `data_prep.gsm8k.make_rows` turns them into verl-schema rows with
`data_source = "synthetic/arithmetic"` (scored by the gsm8k rule: the number after `####`). The prompt's
instruction is `data_prep.gsm8k.INSTRUCTION` (re-exported here as `GSM8K_INSTRUCTION` for tiny_model.py).

Run:  python data_prep/synthetic.py --out artifacts/data/arith --train-size 2000 --test-size 200

With `--tool` the rows are in verl's multi-turn tool format instead (data_prep/gsm8k_tool.py's `make_rows`, for the
calculator of recipes/tool_config/calculator_tool_config.yaml: a system prompt naming it, the ground truth in
extra_info.tools_kwargs.calculator.create_kwargs), the tiny tool demo's data (`make demo-tool`):

      python data_prep/synthetic.py --tool --out artifacts/data/arith_tool --train-size 2000 --test-size 100

`--tool python` writes the same rows for the sandboxed Python tool of recipes/tool_config/tiny_python_tool_config.yaml
(named `python`; its system prompt asks for code that prints the sum), the tiny Python tool demo's data
(`make demo-python-tool`):

      python data_prep/synthetic.py --tool python --out artifacts/data/arith_python_tool --train-size 2000 --test-size 100
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
TOOL_NAME = "calculator"  # the tool_schema name of recipes/tool_config/calculator_tool_config.yaml
TOOL_SYSTEM_PROMPT = "Call `{tool}` with the sum, then answer after ####."  # short: the tiny model's context is small
PYTHON_TOOL_NAME = "python"  # the tool_schema name of recipes/tool_config/tiny_python_tool_config.yaml
PYTHON_TOOL_SYSTEM_PROMPT = "Call `{tool}` to print the sum, then answer after ####."
# --tool's choices -> (the tool's schema name, its system prompt)
TOOLS = {"calculator": (TOOL_NAME, TOOL_SYSTEM_PROMPT), "python": (PYTHON_TOOL_NAME, PYTHON_TOOL_SYSTEM_PROMPT)}


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


def write_dataset(out: str | Path, *, train_size: int, test_size: int, seed: int = 0, max_operand: int = 9,
                  tool: bool | str = False) -> dict[str, Path]:
    """Write `train.parquet` / `test.parquet` in verl's schema (`tool`: its multi-turn tool format for that tool of
    TOOLS, True meaning the calculator); returns {split: path}."""
    tool = "calculator" if tool is True else tool
    if tool and tool not in TOOLS:
        raise ValueError(f"unknown tool {tool!r} for the synthetic tool data: one of {sorted(TOOLS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, size, split_seed in (("train", train_size, seed), ("test", test_size, seed + 1000)):
        records = [{"question": p["question"], "answer": p["answer"]} for p in make_problems(num=size, seed=split_seed, max_operand=max_operand)]
        paths[split] = out / f"{split}.parquet"
        if tool:
            from data_prep import gsm8k_tool

            tool_name, system_prompt = TOOLS[tool]
            rows = gsm8k_tool.make_rows(records, split, data_source=DATA_SOURCE, tool_name=tool_name,
                                        system_prompt=system_prompt)
        else:
            rows = make_rows(records, split=split, data_source=DATA_SOURCE)
        write_parquet(rows, paths[split])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool", nargs="?", const="calculator", default=None, choices=sorted(TOOLS),
                        help="verl's multi-turn tool format for this tool (--tool alone: the calculator)")
    args = parser.parse_args()
    paths = write_dataset(args.out, train_size=args.train_size, test_size=args.test_size, seed=args.seed, max_operand=args.max_operand,
                          tool=args.tool or False)
    for split, path in paths.items():
        print(f"wrote {split}: {path}")


if __name__ == "__main__":
    main()
