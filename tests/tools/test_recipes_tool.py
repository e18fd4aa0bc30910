"""The multi-turn tool recipes (recipes/*tool*.yaml; tests/config/test_config.py and tests/planning/test_plan.py load and plan every
recipe): episodes on with verl's multi-turn keys, a tool config that loads and holds the tool the recipe's data-prep
script writes ground truths for, and verl's spelling of the same keys landing on the same config."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep import gsm8k_tool, python_tool, synthetic
from grpo_lib.config import load_config
from grpo_lib.tools.config import load_tools

REPO = Path(__file__).resolve().parents[2]
# recipe -> (processes, the tool whose create_kwargs its data carries)
TOOL_RECIPES = {"qwen3_4b_gsm8k_tool.yaml": (4, gsm8k_tool.TOOL_NAME), "tiny_cpu_tool.yaml": (1, synthetic.TOOL_NAME),
                "qwen3_4b_gsm8k_python_tool.yaml": (4, python_tool.TOOL_NAME),
                "tiny_cpu_python_tool.yaml": (1, synthetic.PYTHON_TOOL_NAME)}


def test_every_tool_recipe_is_listed():
    assert sorted(p.name for p in (REPO / "recipes").glob("*tool*.yaml")) == sorted(TOOL_RECIPES)


@pytest.mark.parametrize("name", sorted(TOOL_RECIPES))
def test_tool_recipe_runs_episodes_with_a_tool_config_that_loads(name, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes' paths are relative to the repository root, as their launch lines are
    processes, tool = TOOL_RECIPES[name]
    cfg = load_config(REPO / "recipes" / name, world_size=processes)
    mt = cfg.rollout.multi_turn
    assert mt.enable and mt.format == "hermes" and mt.max_assistant_turns >= 2, f"{name}: {mt}"
    assert mt.max_user_turns is not None, f"{name}: verl's scripts bound the tool turns too"
    tools = load_tools(mt.tool_config_path)
    assert tool in tools, f"{name}: {mt.tool_config_path} lacks {tool!r}, which the recipe's data gives its ground truth"
    verl = load_config(REPO / "recipes" / name, [f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={mt.max_assistant_turns + 1}"],
                       world_size=processes)
    assert verl.rollout.multi_turn.max_assistant_turns == mt.max_assistant_turns + 1, "verl's spelling lands on the field"


@pytest.mark.parametrize("name", ["tiny_cpu_tool.yaml", "tiny_cpu_python_tool.yaml"])
def test_tiny_tool_recipe_budgets_hold_a_whole_tool_episode(name):
    """The tiny recipes' (calculator and Python tool) data.max_prompt_length and data.max_response_length hold its warm-up's longest episode
    (data_prep/tiny_model.py; even with two-digit operands: prompt, then call + tool turn + answer), tokenized by the tool
    model's own tokenizer (built as make_tiny_model builds it, no model needed)."""
    from data_prep.synthetic import GSM8K_INSTRUCTION, make_problems
    from data_prep.tiny_model import build_tool_tokenizer, load_tool_schemas, tool_episode_texts

    cfg = load_config(REPO / "recipes" / name)
    schemas = load_tool_schemas(REPO / cfg.rollout.multi_turn.tool_config_path)
    problems = make_problems(num=2000, seed=1, max_operand=99)  # make_tiny_model's corpus problems (seed 0)
    tokenizer = build_tool_tokenizer([p["question"] + " " + GSM8K_INSTRUCTION + "\n" + p["answer"] for p in problems], problems, schemas)
    row = {"question": "What is 99 + 99?", "a": 99, "op": "+", "b": 99, "result": 198}
    prompt, *response = [len(tokenizer(t, add_special_tokens=False)["input_ids"])
                         for t, _ in tool_episode_texts(tokenizer, schemas, row, use_tool=True, answer=198)]
    assert prompt <= cfg.data.max_prompt_length and sum(response) <= cfg.data.max_response_length, (prompt, response)


def test_tiny_tool_model_build_line_is_the_same_in_makefile_recipe_and_docstring():
    """make demo-tool builds the tool model with the flags the recipe's header and tiny_model.py's docstring show (the
    README's measured table was made with them): the three copies of the line must not drift apart."""
    import re

    def flags(text: str) -> list[str]:  # the words from --out up to --warmup-steps N (the line's last flag)
        line = re.search(r"tiny_model\.py (--out artifacts/tiny_qwen3_tool .*?--warmup-steps \d+)", text, re.S)
        assert line, "no tiny_qwen3_tool build line ending in --warmup-steps N found"
        return [w for w in line.group(1).replace("\\", " ").split() if w != "#"]

    makefile = flags((REPO / "Makefile").read_text())
    recipe = flags((REPO / "recipes" / "tiny_cpu_tool.yaml").read_text())
    docstring = flags((REPO / "data_prep" / "tiny_model.py").read_text().split('"""', 2)[1])
    assert makefile == recipe == docstring, (makefile, recipe, docstring)
