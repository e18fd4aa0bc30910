"""GSM8K -> verl's multi-turn tool format (`train.parquet`, `test.parquet`): the rows verl's
gsm8k_multiturn_w_tool.py writes, for `rollout.multi_turn.enable` with the gsm8k answer-check tool.

Run (hub access):  python data_prep/gsm8k_tool.py --out ~/data/gsm8k_tool
Offline:           python data_prep/gsm8k_tool.py --input-train gsm8k_train.jsonl --input-test gsm8k_test.jsonl
Then:              python train_grpo.py recipes/qwen3_4b_gsm8k_tool.yaml   (tool config: recipes/tool_config/gsm8k_tool_config.yaml)

What differs from data_prep/gsm8k.py's rows (same columns, same ground truths):

- `prompt` opens with a system message that names the tool and says when to call it (our wording; verl's fields);
  the chat template adds the tool's schema itself (the trainer passes the tool config's schemas as `tools=`);
- `extra_info.tools_kwargs.<tool>.create_kwargs.ground_truth`: what the episode loop passes to the tool's
  `create(instance_id, **create_kwargs)` (verl's layout), so the tool can check the submitted answer;
- `extra_info.need_tools_kwargs: true` and `extra_info.interaction_kwargs {query, ground_truth}`, as verl writes them
  (its interaction agents read the latter; here they are carried, not used).

One row:

    {"question": "Ann has 7 cats. Bob has 2 fewer. How many does Bob have?", "answer": "7-2=5\\n#### 5"}
    -> prompt [{"role": "system", "content": "... call the `calc_gsm8k_reward` tool ..."},
               {"role": "user", "content": "Ann has 7 cats. ... Let's think step by step and output the final answer after \\"####\\"."}],
       reward_model {"style": "rule", "ground_truth": "5"},
       extra_info {..., "need_tools_kwargs": true, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}},
                   "interaction_kwargs": {"query": "<the user message>", "ground_truth": "5"}}

Also used by other code: `make_rows(records, split, data_source, tool_name, system_prompt)` (the tiny tool demo's
synthetic data calls it with the calculator tool: data_prep/synthetic.py --tool).
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
from data_prep.common import build_arg_parser, prepare, run_cli

__all__ = ["TOOL_NAME", "SYSTEM_PROMPT", "make_rows", "main"]

DATA_SOURCE = gsm8k.DATA_SOURCE  # scored by the gsm8k rule, as single-turn GSM8K
TOOL_NAME = "calc_gsm8k_reward"  # the tool_schema name of recipes/tool_config/gsm8k_tool_config.yaml
SYSTEM_PROMPT = ("You are good at math. Solve the question step by step first. Then call the `{tool}` tool with your "
                 "answer to check it, at least once before you give the final answer, and correct the answer if the "
                 "tool says it is wrong. Write the final answer as `#### <answer>`.")


def make_rows(records: Iterable[dict], split: str, data_source: str = DATA_SOURCE, *, tool_name: str = TOOL_NAME,
              system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """GSM8K-format records ({"question", "answer" ending in "#### <n>"}) -> verl multi-turn tool rows.

    `system_prompt` may name the tool as `{tool}`. Example: make_rows([{"question": "1+1?", "answer": "1+1=2\\n#### 2"}],
    "train")[0]["extra_info"]["tools_kwargs"] -> {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "2"}}}
    """
    rows = gsm8k.make_rows(records, split, data_source=data_source)  # the same checks, ground truths and user turn
    return with_tool(rows, system_prompt.format(tool=tool_name), tool_name)


def with_tool(rows: list[dict], system_prompt: str, tool_name: str) -> list[dict]:
    """verl's multi-turn fields on single-turn rows (in place): the system turn first, the tool's create_kwargs and the
    interaction kwargs carrying each row's ground truth. Shared by the calculator and the Python tool data preps."""
    system = {"role": "system", "content": system_prompt}
    for row in rows:
        ground_truth = row["reward_model"]["ground_truth"]
        row["prompt"] = [system, *row["prompt"]]
        row["extra_info"].update({
            "need_tools_kwargs": True,
            "tools_kwargs": {tool_name: {"create_kwargs": {"ground_truth": ground_truth}}},
            "interaction_kwargs": {"query": row["prompt"][-1]["content"], "ground_truth": ground_truth},
        })
    return rows


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = build_arg_parser(description=__doc__.split("\n")[0], default_out="~/data/gsm8k_tool")
    parser.add_argument("--data-source", default=DATA_SOURCE, help="data_source written in each row")
    parser.add_argument("--tool-name", default=TOOL_NAME, help="tool whose create_kwargs get the ground truth "
                        "(the tool_schema name in the tool config)")
    args = parser.parse_args(argv)
    return prepare(args=args, load_hub=gsm8k._load_hub, required_columns=gsm8k.COLUMNS,
                   make_rows=lambda records, split: make_rows(records, split, data_source=args.data_source,
                                                              tool_name=args.tool_name))


if __name__ == "__main__":
    run_cli(main)
