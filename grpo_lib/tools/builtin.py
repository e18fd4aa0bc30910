"""Built-in tools, named in a tool config like any other class (grpo_lib/tools/config.py):

    grpo_lib.tools.builtin.CalculatorTool  exact arithmetic on one expression: + - * / // % ** and parentheses; given
                                           the row's ground truth (create_kwargs), its tool reward says whether a call
                                           computed it (the tiny tool demo's "correct tool call")
    grpo_lib.tools.builtin.Gsm8kTool       verl's gsm8k answer check (`calc_gsm8k_reward`): the episode's tool reward
                                           is 1.0 when the submitted answer equals the row's ground truth

Example: CalculatorTool.execute(id, {"expression": "(3 + 4) * 2 / 4"}) -> ("3.5", 0.0, {}); an expression it cannot
evaluate ("2 +", "1 / 0", "x") is answered with "error: ..." (an answer, not a failure of the tool).
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from grpo_lib.rewards import gsm8k
from grpo_lib.tools.base import BaseTool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # keeps 9 ** 9 ** 9 from taking the trainer's memory
MAX_DIGITS = 100


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError / ZeroDivisionError for anything else.

    Example: evaluate("0.1 + 0.2") -> Fraction(3, 10); evaluate("2 ** 10") -> 1024; evaluate("__import__('os')") raises.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression ({error.msg})") from None
    return _eval(tree.body)


def _eval(node) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if abs(value.numerator) > 10 ** MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return Fraction(value)
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def format_number(value: Fraction) -> str:
    """Fraction(7, 2) -> "3.5"; Fraction(1, 3) -> "0.3333333333"; Fraction(12) -> "12"."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.10f}".rstrip("0").rstrip(".")
    return text if text not in ("-0", "") else "0"


class CalculatorTool(BaseTool):
    """`{"expression": "..."}` -> its exact value as text, step reward 0.

    Its tool reward (calc_reward) is 1.0 when a call of the episode evaluated to the ground truth that `create` got
    (the row's extra_info.tools_kwargs.calculator.create_kwargs.ground_truth, as data_prep/synthetic.py --tool writes),
    else 0.0 (also without a ground truth): the fraction of episodes with a correct calculator call is then
    `tools/calculator/reward_mean`. The answer text never depends on the ground truth.
    Example: create("e", ground_truth="12"); execute("e", {"expression": "5 + 7"}) -> ("12", 0.0, {}); calc_reward("e") -> 1.0.
    """

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.episodes: dict[str, dict] = {}  # instance id -> {"ground_truth": Fraction | None, "hit": bool}

    def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = super().create(instance_id)
        try:
            target = evaluate(str(ground_truth).replace(",", "")) if ground_truth is not None else None
        except (ValueError, ZeroDivisionError):
            target = None  # a ground truth that is no number: no call can hit it
        self.episodes[instance_id] = {"ground_truth": target, "hit": False}
        return instance_id

    def execute(self, instance_id, parameters, **kwargs):
        expression = parameters.get("expression", "")
        if not isinstance(expression, str):
            expression = str(expression)
        try:
            value = evaluate(expression)
        except ZeroDivisionError:
            return "error: division by zero", 0.0, {}
        except ValueError as error:
            return f"error: {error}", 0.0, {}
        state = self.episodes.get(instance_id)
        if state is not None and state["ground_truth"] is not None and value == state["ground_truth"]:
            state["hit"] = True
        return format_number(value), 0.0, {}

    def calc_reward(self, instance_id, **kwargs) -> float:
        state = self.episodes.get(instance_id)
        return 1.0 if state is not None and state["hit"] else 0.0

    def release(self, instance_id, **kwargs):
        self.episodes.pop(instance_id, None)


class Gsm8kTool(BaseTool):
    """verl's gsm8k tool: `{"answer": "..."}` is scored against the ground truth of `create` (the row's
    extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth), flexible extraction (the last number).

    Each call answers "Current parsed answer='72' reward=1.0" (verl's text) with step reward 0.0 when the answer
    improved on the episode's best so far, -0.05 otherwise (verl's penalty for resubmitting); calc_reward is the score
    of the last submitted answer (0.0 before any).
    """

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.episodes: dict[str, dict] = {}

    def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = super().create(instance_id)
        if ground_truth is None:  # verl's newer agent loop passes the row's kwargs as create_kwargs={...}
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self.episodes[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    def execute(self, instance_id, parameters, **kwargs):
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self.episodes[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return f"Current parsed {answer=} {reward=}", step_reward, {}

    def calc_reward(self, instance_id, **kwargs) -> float:
        state = self.episodes[instance_id]
        return gsm8k.score(state["response"], state["ground_truth"], mode="flexible")

    def release(self, instance_id, **kwargs):
        self.episodes.pop(instance_id, None)
