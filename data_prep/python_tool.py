"""GSM8K or MATH -> verl's multi-turn tool rows for the Python code tool (`train.parquet`, `test.parquet`): the model
may run Python (grpo_lib.tools.builtin.PythonTool, sandboxed) while it solves the problem, as in ToRL / ReTool.

Run (hub access):  python data_prep/python_tool.py --dataset gsm8k --out ~/data/gsm8k_python_tool
                   python data_prep/python_tool.py --dataset math --out ~/data/math_python_tool
Offline:           python data_prep/python_tool.py --dataset gsm8k --input-train train.jsonl --input-test test.jsonl
Then:              python train_grpo.py recipes/qwen3_4b_gsm8k_python_tool.yaml   (tool config:
                   recipes/tool_config/python_tool_config.yaml)

The rows are data_prep/gsm8k.py's or data_prep/math.py's (same data_source, ground truth and user turn, so the final
answer is scored by the same rule) with verl's multi-turn fields added: a system message that names the tool and says
what it is for (our wording), `extra_info.need_tools_kwargs: true`, `extra_info.tools_kwargs.<tool>.create_kwargs`
(the ground truth, as verl's tool datasets carry it; the Python tool itself does not read it, and never shows it to
the model) and `extra_info.interaction_kwargs`.

One row (GSM8K):

    {"question": "What is 17 * 23?", "answer": "17*23=391\\n#### 391"}
    -> prompt [{"role": "system", "content": "... call the `code_interpreter` tool ..."},
               {"role": "user", "content": "What is 17 * 23? Let's think step by step and output the final answer after \\"####\\"."}],
       reward_model {"style": "rule", "ground_truth": "391"},
       extra_info {..., "need_tools_kwargs": true, "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": "391"}}}, ...}
"""

from __future__ import annotations

if __name__ == "__main__":  # run by path: import from the repo root, and never let data_prep/math.py shadow stdlib math
    import os as _os
    import sys as _sys

    _here = _os.path.dirname(_os.path.abspath(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
    _sys.path.insert(0, _os.path.dirname(_here))

from typing import Iterable

from data_prep import gsm8k
from data_prep.gsm8k_tool import with_tool
from data_prep import math as math_prep
from data_prep.common import build_arg_parser, prepare, run_cli

__all__ = ["TOOL_NAME", "SYSTEM_PROMPTS", "make_rows", "main"]

TOOL_NAME = "code_interpreter"  # verl's name for its code tool; the tool_schema name of python_tool_config.yaml
SYSTEM_PROMPTS = {
    "gsm8k": ("You are good at math. Think step by step. You may call the `{tool}` tool to run Python code that "
              "computes what you need; it answers with what the code prints. Write the final answer as `#### <answer>`."),
    "math": ("You are good at math. Think step by step. You may call the `{tool}` tool to run Python code (sympy is "
             "available where installed) that computes or checks what you need; it answers with what the code prints. "
             "Put the final answer within \\boxed{{}}."),
}
DATASETS = {"gsm8k": gsm8k, "math": math_prep}


def make_rows(records: Iterable[dict], split: str, *, dataset: str, data_source: str | None = None,
              tool_name: str = TOOL_NAME) -> list[dict]:
    """GSM8K ({"question", "answer"}) or MATH ({"problem", "solution"}) records -> verl multi-turn rows for the code tool.

    Example: make_rows([{"question": "1+1?", "answer": "1+1=2\\n#### 2"}], "train", dataset="gsm8k")[0]["prompt"][0]
    -> {"role": "system", "content": "You are good at math. ... `code_interpreter` tool ..."}
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset {dataset!r}: one of {sorted(DATASETS)}")
    module = DATASETS[dataset]
    rows = module.make_rows(records, split, data_source=data_source or module.DATA_SOURCE)
    return with_tool(rows, SYSTEM_PROMPTS[dataset].format(tool=tool_name), tool_name)


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = build_arg_parser(description=__doc__.split("\n")[0], default_out="~/data/gsm8k_python_tool")
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="gsm8k", help="which problems (default gsm8k)")
    parser.add_argument("--data-source", default=None, help="data_source written in each row (default: the dataset's)")
    parser.add_argument("--tool-name", default=TOOL_NAME, help="the tool_schema name in the tool config")
    args = parser.parse_args(argv)
    module = DATASETS[args.dataset]
    return prepare(args=args, load_hub=module._load_hub, required_columns=module.COLUMNS,
                   make_rows=lambda records, split: make_rows(records, split, dataset=args.dataset,
                                                              data_source=args.data_source, tool_name=args.tool_name))


if __name__ == "__main__":
    run_cli(main)
