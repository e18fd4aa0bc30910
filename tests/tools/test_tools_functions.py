"""verl's function tools (rollout.multi_turn.function_tool_path, grpo_lib/tools/functions.py) and verl 0.9's create
returning (instance_id, ToolResponse): a file written as for verl (its import line) loads unchanged, the schema is
verl's inference, calls reach the function, and every file a user can get wrong is refused at start naming the file and
the function; a name in both the tool config and the file is refused naming both files (the CLI exits 2)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from grpo_lib.tools.base import BaseTool, ToolResponse, ToolSchema
from grpo_lib.tools.calls import ToolBox
from grpo_lib.tools.config import ToolConfigError
from grpo_lib.tools.functions import load_all_tools, load_function_tools, response_of
from grpo_lib.tools.hermes import ToolCall

FUNCTIONS = '''
from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


@function_tool("lookup")
async def find_capital(country: str, upper: bool = False) -> dict:
    """Look up the capital of a country.

    Args:
        country: the country's English name
        upper: whether to answer in capitals
    """
    capital = {"France": "Paris"}.get(country, "unknown")
    return {"capital": capital.upper() if upper else capital}


def helper(x):  # not a tool: no decorator
    return x
'''
CALCULATOR_CONFIG = """tools:
  - class_name: grpo_lib.tools.builtin.CalculatorTool
    tool_schema:
      type: function
      function:
        name: {name}
        description: Evaluate an arithmetic expression
        parameters: {{type: object, properties: {{expression: {{type: string}}}}, required: [expression]}}
"""


def write(tmp_path, body: str, name: str = "my_tools.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_a_verl_function_file_loads_with_verls_inferred_schema(tmp_path):
    tools = load_function_tools(write(tmp_path, FUNCTIONS))
    assert list(tools) == ["add", "lookup"], "the decorated functions, in order, renamed where the decorator says"
    assert dict(tools["add"].tool_schema) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first number"},
                                                         "b": {"type": "integer", "description": "the second number"}},
                       "required": ["a", "b"]}}}
    lookup = tools["lookup"].tool_schema["function"]
    assert lookup["name"] == "lookup" and lookup["parameters"]["required"] == ["country"], "a default: not required"
    assert lookup["parameters"]["properties"]["upper"]["type"] == "boolean"
    assert "verl" not in sys.modules, "the stand-in verl modules are gone after the import"


def test_function_tools_answer_calls_through_the_toolbox(tmp_path):
    tools = load_function_tools(write(tmp_path, FUNCTIONS))
    box = ToolBox(tools, timeout_s=5, max_response_chars=256, truncate_side="left")
    try:
        assert box.start([("e", {})]) == [[]]
        add, lookup, wrong = box.run([("e", ToolCall("add", {"a": 2, "b": 40})),
                                      ("e", ToolCall("lookup", {"country": "France", "upper": True})),
                                      ("e", ToolCall("add", {"a": "two", "b": 1}))])
        assert (add.kind, add.text) == ("ok", "42")
        assert (lookup.kind, lookup.text) == ("ok", '{"capital": "PARIS"}'), "an async function; a dict as JSON (verl)"
        assert wrong.kind == "invalid" and "'a' must be an integer" in wrong.text, "the inferred schema is checked"
        [(rewards, failures)] = box.finish(["e"])
        assert rewards == {"add": 0.0, "lookup": 0.0} and failures == [], "stateless: no tool reward"
    finally:
        box.close()


def test_the_return_value_becomes_text_as_verl_makes_it():
    assert response_of("7") == ("7", 0.0, {})
    assert response_of({"a": 1}) == ('{"a": 1}', 0.0, {})
    assert response_of(("7", 0.5, {"m": 1})) == ("7", 0.5, {"m": 1})
    assert response_of(("7", None)) == ("7", 0.0, {})
    assert response_of(ToolResponse(text="t")) == ("t", 0.0, {})
    assert response_of(7) == ("7", 0.0, {})
    with pytest.raises(TypeError, match="tuple of 4"):
        response_of((1, 2, 3, 4))


@pytest.mark.parametrize("body, needle", [
    ('from verl.tools.function_tool import function_tool\n@function_tool\ndef f(a: int) -> str:\n    """Only a summary."""\n',
     r"function 'f'.*DocstringParsingException.*no description for the argument 'a'"),
    ('from verl.tools.function_tool import function_tool\n@function_tool\ndef f(a) -> str:\n    """S.\n\n    Args:\n        a: x\n    """\n',
     r"function 'f'.*TypeHintParsingException.*missing a type hint"),
    ('from verl.tools.function_tool import function_tool\n@function_tool\ndef f(*a: int) -> str:\n    """S."""\n',
     r"function 'f'.*variadic parameter"),
    ("def f(a: int):\n    return a\n", r"registers no function: decorate each tool with @function_tool"),
    ("raise RuntimeError('no key')\n", r"importing it raised RuntimeError: no key"),
    ('from verl.tools.function_tool import function_tool\n@function_tool("bad name")\ndef f() -> str:\n    """S."""\n',
     r"function 'f'.*function.name must be 1-64 letters"),
    ('from verl.tools.function_tool import function_tool\n@function_tool("x")\ndef f() -> str:\n    """S."""\n'
     '@function_tool("x")\ndef g() -> str:\n    """S."""\n', r"function 'g': a second tool named 'x' in the file"),
], ids=["no_args_block", "no_type_hint", "variadic", "no_decorator", "import_raises", "bad_name", "two_of_a_name"])
def test_a_file_that_cannot_give_tools_is_refused_naming_the_file_and_function(tmp_path, body, needle):
    path = write(tmp_path, body)
    with pytest.raises(ToolConfigError, match=f"function tool file '{path}' \\(rollout.multi_turn.function_tool_path\\).*{needle}"):
        load_function_tools(path)


def test_a_name_in_the_tool_config_and_the_function_file_is_refused_naming_both(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(CALCULATOR_CONFIG.format(name="add"))
    functions = write(tmp_path, FUNCTIONS)
    with pytest.raises(ToolConfigError, match=f"tool name\\(s\\) \\['add'\\] are defined twice: in the tool config '{config}'.*"
                                              f"and in the function tool file '{functions}'"):
        load_all_tools(str(config), str(functions))
    config.write_text(CALCULATOR_CONFIG.format(name="calculator"))
    assert list(load_all_tools(str(config), str(functions))) == ["calculator", "add", "lookup"]


def test_cli_exits_2_on_a_collision_before_the_engine_starts(tmp_path, monkeypatch, tiny_model_dir, arith_data):
    from tests.helpers.cli import run_main

    config = tmp_path / "tools.yaml"
    config.write_text(CALCULATOR_CONFIG.format(name="add"))
    functions = write(tmp_path, FUNCTIONS)
    proc = run_main(monkeypatch, "recipes/tiny_cpu.yaml", f"model.path={tiny_model_dir}", f"data.train_files=[{arith_data['train']}]",
                    f"data.val_files=[{arith_data['test']}]", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[console]",
                    "actor_rollout_ref.rollout.multi_turn.enable=True", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={config}",
                    f"actor_rollout_ref.rollout.multi_turn.function_tool_path={functions}", setup=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tool name(s) ['add'] are defined twice" in proc.stderr and str(functions) in proc.stderr


class Board(BaseTool):
    """verl 0.9's create: (instance_id, ToolResponse) with what the model should see before its first turn."""

    async def create(self, instance_id=None, **kwargs):
        return f"board-{instance_id}", ToolResponse(text=f"The board for {kwargs.get('size', 3)}: empty")

    def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=f"moved on {instance_id}"), 0.0, {}

    def calc_reward(self, instance_id, **kwargs):
        return 1.0 if instance_id.startswith("board-") else 0.0


def schema(name: str) -> ToolSchema:
    return ToolSchema({"type": "function", "function": {"name": name, "description": "d", "parameters": {
        "type": "object", "properties": {"move": {"type": "string"}}}}})


def test_verl_09_create_gives_the_instance_id_and_a_creation_response():
    box = ToolBox({"board": Board({}, schema("board"))}, timeout_s=5, max_response_chars=256, truncate_side="left")
    try:
        assert box.start([("e", {"board": {"create_kwargs": {"size": 4}}})]) == [[]]
        [created] = box.created["e"]
        assert created.text == "The board for 4: empty"
        [out] = box.run([("e", ToolCall("board", {"move": "a1"}))])
        assert out.text == "moved on board-e", "later calls use the instance id create returned"
        [(rewards, _)] = box.finish(["e"])
        assert rewards == {"board": 1.0} and "e" not in box.created
    finally:
        box.close()


@pytest.mark.parametrize("value", [42, ("e", 5), ("a", "b", "c")])
def test_a_create_return_of_another_shape_is_a_failed_create(value):
    class Odd(BaseTool):
        def create(self, instance_id=None, **kwargs):
            return value

        def execute(self, instance_id, parameters, **kwargs):
            return "x"

    box = ToolBox({"odd": Odd({}, schema("odd"))}, timeout_s=5, max_response_chars=256, truncate_side="left")
    try:
        [[failed]] = box.start([("e", {})])
        assert failed.kind == "error" and failed.text.startswith("odd.create returned "), failed
    finally:
        box.close()


def test_the_creation_response_is_a_tool_turn_before_the_first_turn(tiny_model_dir):
    from transformers import AutoTokenizer

    from tests.scripts.episode_case import ScriptedEngine, call, make_prompts, make_runner

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = make_runner(tokenizer, {"board": Board({}, schema("board"))})
    try:
        # the model: a move first, the answer once the move's response is in its context
        engine = ScriptedEngine(tokenizer, lambda context, seed: "#### 42" if "moved on" in context else call("board", move="a1"))
        [[g]] = runner.generate(engine, make_prompts(runner, ["q"]), n=1, max_tokens=400, seeds=[1], temperature=1.0)
        first_context = tokenizer.decode(engine.calls[0]["prompts"][0])
        assert first_context.count("<tool_response>") == 1 and "The board for 3: empty" in first_context, \
            "the model reads the creation response before it writes its first turn"
        assert first_context.endswith("<|im_start|>assistant\n")
        text = tokenizer.decode(g.token_ids)
        assert text.index("The board for 3: empty") < text.index("moved on board-")
        creation_part = g.loss_mask[:next(i for i, m in enumerate(g.loss_mask) if m == 1)]
        assert creation_part and set(creation_part) == {0}, "the creation turn is out of the loss"
        assert g.episode.user_turns == 1 and g.episode.assistant_turns == 2, "verl counts no turn for it"
    finally:
        runner.toolbox.close()
