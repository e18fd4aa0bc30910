"""grpo_lib/tools: the tool-config loader (a config that cannot load names its file and entry, and the CLI exits 2
before the engine starts), the hermes parser, the argument check, truncation as verl cuts, and the built-in tools.
What each bad call turns into inside an episode (text and counter) is tested in tests/rollout/test_episodes.py."""

from __future__ import annotations

import textwrap
from fractions import Fraction

import pytest

from grpo_lib.tools.base import ToolSchema
from grpo_lib.tools.builtin import CalculatorTool, Gsm8kTool, evaluate
from grpo_lib.tools.calls import argument_problem, truncate
from grpo_lib.tools.config import ToolConfigError, load_tools
from grpo_lib.tools.hermes import ToolCall, parse_tool_calls

CALCULATOR = """
  - class_name: grpo_lib.tools.builtin.CalculatorTool
    config: {}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression
        parameters:
          type: object
          properties: {expression: {type: string}}
          required: [expression]
"""
GSM8K = """
  - class_name: grpo_lib.tools.builtin.Gsm8kTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calc_gsm8k_reward
        description: A tool for calculating the reward of gsm8k
        parameters:
          type: object
          properties: {answer: {type: string, description: The model's answer}}
          required: [answer]
"""


def write(tmp_path, body: str, name: str = "tools.yaml"):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_verl_tool_config_loads_in_order(tmp_path):
    tools = load_tools(write(tmp_path, "tools:" + CALCULATOR + GSM8K))
    assert list(tools) == ["calculator", "calc_gsm8k_reward"]
    assert isinstance(tools["calculator"], CalculatorTool) and tools["calc_gsm8k_reward"].config == {"type": "native"}
    assert tools["calculator"].tool_schema.function.name == "calculator"  # verl tools read the schema as attributes
    assert tools["calculator"].tool_schema.model_dump()["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize("body, needle", [
    ("tools: []", "expected a non-empty list under `tools:`"),
    ("tools: [1", "is not valid YAML"),
    ("tools:" + CALCULATOR.replace("grpo_lib.tools.builtin.CalculatorTool", "no_such_pkg.tools.Calc"),
     "entry 0 (calculator): cannot import module 'no_such_pkg.tools'"),
    ("tools:" + CALCULATOR.replace("CalculatorTool", "NoSuchTool"),
     "entry 0 (calculator): module 'grpo_lib.tools.builtin' has no 'NoSuchTool'"),
    ("tools:" + CALCULATOR.replace("class_name: grpo_lib.tools.builtin.CalculatorTool", "class_name: Calculator"),
     "entry 0 (calculator): class_name must be an importable 'pkg.module.Class'"),
    ("tools:" + GSM8K + CALCULATOR.replace("name: calculator", "name: ''"),
     "entry 1: tool_schema.function.name must be 1-64 letters"),
    ("tools:" + CALCULATOR.replace("type: function", "type: func"), "tool_schema.type must be 'function'"),
    ("tools:" + CALCULATOR.replace("required: [expression]", "required: [expr]"),
     "required parameter(s) ['expr'] are not in properties ['expression']"),
    ("tools:" + CALCULATOR.replace("{type: string}", "{type: text}"), "parameter 'expression': a JSON schema with a type"),
    ("tools:" + CALCULATOR + CALCULATOR, "entry 1 (calculator): a second tool named 'calculator'"),
    ("tools:" + CALCULATOR.replace("config: {}", "config: 3"), "config must be a mapping"),
])
def test_a_config_that_cannot_load_names_the_file_and_the_entry(tmp_path, body, needle):
    path = write(tmp_path, body)
    with pytest.raises(ToolConfigError) as err:
        load_tools(path)
    assert str(path) in str(err.value) and needle in str(err.value), str(err.value)


def test_a_constructor_that_raises_names_the_entry(tmp_path, monkeypatch):
    module = tmp_path / "broken_tools.py"
    module.write_text("class Broken:\n    def __init__(self, config, tool_schema):\n        raise KeyError('api_key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "tools:" + CALCULATOR.replace("grpo_lib.tools.builtin.CalculatorTool", "broken_tools.Broken"))
    with pytest.raises(ToolConfigError, match=r"entry 0 \(calculator\): broken_tools.Broken\(config, tool_schema\) raised KeyError"):
        load_tools(path)
    assert not (tmp_path / "nope.yaml").exists()
    with pytest.raises(ToolConfigError, match="does not exist"):
        load_tools(tmp_path / "nope.yaml")


def test_cli_exits_2_on_a_bad_tool_config_before_the_engine_starts(tmp_path, monkeypatch, tiny_model_dir, arith_data):
    """setup=True lets setup run but refuses the engine (tests/helpers/cli.py): the tool config is read before it."""
    from tests.helpers.cli import run_main

    path = write(tmp_path, "tools:" + CALCULATOR.replace("CalculatorTool", "Missing"))
    proc = run_main(monkeypatch, "recipes/tiny_cpu.yaml", f"model.path={tiny_model_dir}", f"data.train_files=[{arith_data['train']}]",
                    f"data.val_files=[{arith_data['test']}]", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[console]",
                    "actor_rollout_ref.rollout.multi_turn.enable=True",
                    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}", setup=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"tool config '{path}' entry 0 (calculator): module 'grpo_lib.tools.builtin' has no 'Missing'" in proc.stderr


def test_multi_turn_config_is_checked(tiny_model_dir, arith_data):
    from grpo_lib.config import ConfigError, load_config
    from tests.conftest import REPO

    base = [f"model.path={tiny_model_dir}", f"data.train_files=[{arith_data['train']}]"]
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "recipes/tiny_cpu.yaml", base + [
            "rollout.multi_turn.enable=true", "data.apply_chat_template=false", "rollout.multi_turn.max_assistant_turns=0",
            "rollout.multi_turn.tool_timeout_s=0", "rollout.multi_turn.max_tool_response_length=0",
            "rollout.multi_turn.tool_response_truncate_side=top"])
    text = str(err.value)
    for needle in ("rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path",
                   "with data.apply_chat_template=false", "rollout.multi_turn.max_assistant_turns=0: must be >= 1",
                   "rollout.multi_turn.tool_timeout_s=0.0: seconds, must be > 0",
                   "rollout.multi_turn.max_tool_response_length=0: must be >= 1",
                   "'top' is not one of ['left', 'right', 'middle']"):
        assert needle in text, text
    cfg = load_config(REPO / "recipes/tiny_cpu.yaml", base + ["actor_rollout_ref.rollout.multi_turn.enable=True",
                                                              "actor_rollout_ref.rollout.multi_turn.tool_config_path=t.yaml",
                                                              "actor_rollout_ref.rollout.multi_turn.format=hermes"])
    mt = cfg.rollout.multi_turn
    # verl's defaults (verl/workers/config/rollout.py MultiTurnConfig)
    assert (mt.enable, mt.format, mt.max_assistant_turns, mt.max_user_turns, mt.max_parallel_calls, mt.max_tool_response_length,
            mt.tool_response_truncate_side) == (True, "hermes", None, None, 1, 256, "middle")


def test_hermes_calls_are_read_in_order_and_malformed_ones_kept():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>\n'
            '<tool_call>{"name": "calc_gsm8k_reward", "arguments": "{\\"answer\\": \\"42\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "x", "arguments": 5}</tool_call><tool_call>{"name": "never closed"')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "6 * 7"}), ToolCall("calc_gsm8k_reward", {"answer": "42"})]
    assert calls[2].name is None and calls[2].error.startswith("the tool call is not valid JSON")
    assert calls[3].error.startswith("a tool call is a JSON object")
    assert (calls[4].name, calls[4].error) == ("x", "the arguments must be a JSON object, got int")
    assert len(calls) == 6 and calls[5] == ToolCall(None, None, error="a <tool_call> is not closed with </tool_call>"), \
        "an unclosed block is an invalid call (issue 30: counted, not taken for the answer)"
    assert parse_tool_calls("The answer is 42.") == []


def test_argument_check_follows_the_schema():
    params = {"type": "object", "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"},
                                               "mode": {"type": "string", "enum": ["exact", "float"]}},
              "required": ["expression"]}
    assert argument_problem(params, {"expression": "1+2", "digits": 3, "mode": "exact"}) is None
    assert argument_problem(params, {}) == "missing required argument 'expression'"
    assert argument_problem(params, {"expression": 3}) == "'expression' must be a string, got 3"
    assert argument_problem(params, {"expression": "1", "digits": 2.5}) == "'digits' must be an integer, got 2.5"
    assert argument_problem(params, {"expression": "1", "digits": True}) == "'digits' must be an integer, got true"
    assert argument_problem(params, {"expression": "1", "mode": "fast"}) == "'mode' must be one of [\"exact\", \"float\"], got \"fast\""
    assert argument_problem(params, {"expression": "1", "x": 1}) == "unknown argument 'x' (it takes: expression, digits, mode)"
    assert argument_problem({**params, "additionalProperties": True}, {"expression": "1", "x": 1}) is None


def test_truncation_cuts_as_verl_does():
    # verl's ToolAgentLoop._call_tool: left keeps the start, right the end, middle half of the limit from each end
    assert truncate("abcdefgh", 4, "left") == ("abcd...(truncated)", True)
    assert truncate("abcdefgh", 4, "right") == ("(truncated)...efgh", True)
    assert truncate("abcdefgh", 4, "middle") == ("ab...(truncated)...gh", True)
    assert truncate("abcd", 4, "middle") == ("abcd", False)


def test_calculator_is_exact_and_answers_bad_expressions_as_text():
    calc = CalculatorTool({}, ToolSchema({"type": "function", "function": {"name": "calculator"}}))
    assert evaluate("0.1 + 0.2") == Fraction(3, 10) and evaluate("-(2 ** 10) // 3") == -342
    cases = {"(3 + 4) * 2 / 4": "3.5", "1 / 3": "0.3333333333", "7 // 2": "3", "2 ** 0.5": "error: exponents must be whole",
             "1 / 0": "error: division by zero", "__import__('os').system('x')": "error: only numbers", "2 +": "error: not an"}
    for expression, expected in cases.items():
        text, step_reward, metrics = calc.execute("e", {"expression": expression})
        assert text.startswith(expected) and step_reward == 0.0 and metrics == {}, (expression, text)


def test_calculator_tool_reward_says_whether_a_call_computed_the_ground_truth():
    """Given the row's ground truth (create_kwargs), calc_reward is 1.0 once a call evaluated to it; the text the model
    reads is the same either way; no ground truth (or none created) scores 0."""
    calc = CalculatorTool({}, ToolSchema({"type": "function", "function": {"name": "calculator"}}))
    calc.create("hit", ground_truth="12")
    calc.create("miss", ground_truth="1,200")  # GSM8K-style thousands separator
    calc.create("none")
    assert calc.execute("hit", {"expression": "5 + 6"})[0] == "11" and calc.calc_reward("hit") == 0.0
    assert calc.execute("hit", {"expression": "5 + 7"}) == ("12", 0.0, {}) and calc.calc_reward("hit") == 1.0
    assert calc.execute("hit", {"expression": "1 / 0"})[0] == "error: division by zero" and calc.calc_reward("hit") == 1.0
    assert calc.execute("miss", {"expression": "1200 - 1"})[0] == "1199" and calc.calc_reward("miss") == 0.0
    assert calc.execute("none", {"expression": "12"})[0] == "12" and calc.calc_reward("none") == 0.0
    assert calc.execute("never_created", {"expression": "12"})[0] == "12" and calc.calc_reward("never_created") == 0.0
    calc.release("hit")
    assert "hit" not in calc.episodes


def test_gsm8k_tool_scores_the_submitted_answer_like_verl():
    tool = Gsm8kTool({}, ToolSchema({"type": "function", "function": {"name": "calc_gsm8k_reward"}}))
    tool.create("a", ground_truth="72")
    tool.create("b", create_kwargs={"ground_truth": "5"})  # verl's newer agent loop passes the kwargs nested
    assert tool.calc_reward("a") == 0.0  # nothing submitted yet
    assert tool.execute("a", {"answer": "71"}) == ("Current parsed answer='71' reward=0.0", -0.05, {})
    assert tool.execute("a", {"answer": "#### 72"}) == ("Current parsed answer='#### 72' reward=1.0", 0.0, {})
    assert tool.execute("a", {"answer": "72"})[1] == -0.05, "no improvement: verl's resubmission penalty"
    assert tool.calc_reward("a") == 1.0 and tool.execute("b", {"answer": "5"})[0].endswith("reward=1.0")
    tool.release("a")
    assert "a" not in tool.episodes


def test_tool_config_example_in_readme_loads(tmp_path):
    """docs/TOOLS.md's tool config (the README links it) is the one users copy: it must load."""
    from tests.conftest import REPO

    readme = (REPO / "docs" / "TOOLS.md").read_text()
    block = readme.split("# Multi-turn tool use", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    tools = load_tools(write(tmp_path, textwrap.dedent(block)))
    assert list(tools) == ["calculator", "calc_gsm8k_reward"]
