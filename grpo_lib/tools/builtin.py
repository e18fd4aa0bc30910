"""Built-in tools, named in a tool config like any other class (grpo_lib/tools/config.py):

    grpo_lib.tools.builtin.CalculatorTool  exact arithmetic on one expression: + - * / // % ** and parentheses; given
                                           the row's ground truth (create_kwargs), its tool reward says whether a call
                                           computed it (the tiny tool demo's "correct tool call")
    grpo_lib.tools.builtin.Gsm8kTool       verl's gsm8k answer check (`calc_gsm8k_reward`): the episode's tool reward
                                           is 1.0 when the submitted answer equals the row's ground truth
    grpo_lib.tools.builtin.PythonTool      runs the model's Python code in a sandbox (grpo_lib/tools/sandbox.py) and
                                           answers with what it printed, or why it was stopped

Example: CalculatorTool.execute(id, {"expression": "(3 + 4) * 2 / 4"}) -> ("3.5", 0.0, {}); an expression it cannot
evaluate ("2 +", "1 / 0", "x") is answered with "error: ..." (an answer, not a failure of the tool).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import os
import signal
import sys
import threading
from fractions import Fraction

from grpo_lib.rewards import gsm8k
from grpo_lib.tools import sandbox
from grpo_lib.tools.base import BaseTool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # keeps 9 ** 9 ** 9 from taking the trainer's memory
MAX_DIGITS = 100  # of the numerator and of the denominator of every intermediate value
_MAX_BITS = int(MAX_DIGITS * 3.33) + 1  # 10 ** 100 < 2 ** 333


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
            # bound the work before doing it: the power has about bits(base) * exponent bits (numerator and denominator)
            if max(left.numerator.bit_length(), left.denominator.bit_length()) * abs(int(right)) > _MAX_BITS + 64:
                raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        value = Fraction(_BINARY[type(node.op)](left, right))
        if abs(value.numerator) > 10 ** MAX_DIGITS or value.denominator > 10 ** MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
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


class PythonTool(BaseTool):
    """`{"code": "..."}` -> what the code printed (stdout + stderr; a last bare expression's value too, as a REPL
    shows it), step reward 0. Each call is a fresh interpreter in a fresh bubblewrap container under the limits of the
    tool config's `config:` (grpo_lib/tools/sandbox.py says which layer stops which escape):

        cpu_time_s: 10        CPU seconds              wall_time_s: 20    wall-clock seconds (keep < tool_timeout_s)
        memory_mb: 1024       address space, MiB       file_mb: 16        largest file written, MiB
        dir_mb: 64            all it writes, MiB       dir_files: 1024    files + folders it may create
        max_threads: 32       threads of the code      max_output_bytes: 65536  output read back (the model then sees
                                                                          max_tool_response_length characters of it)
        max_concurrent: 8     runs at once (each may take memory_mb); a call waits for a slot within wall_time_s
        isolation: strict     refuse to build (exit 2 at load) unless every layer is up here (bubblewrap's namespaces,
                              uid 65534 without capabilities, the bounded tmpfs, rlimits, Landlock, seccomp);
                              best_effort runs with what there is and logs what it lacks (NOT safe for untrusted code)

    The layers in force are printed once at load and kept in `layers` (train_grpo.py writes them to the run folder's
    tool_sandbox.json). Example: execute(id, {"code": "x = 6 * 7\nprint(x)"}) -> ("42\n", 0.0, {});
    {"code": "while True: pass"} -> ("Error: the code used its 10 s of CPU time and was stopped.", 0.0, {}).
    """

    execute_in = "thread"  # the code already runs in a sandbox killed at wall_time_s; its slots are process-wide
    KEYS = {"cpu_time_s": "cpu_s", "wall_time_s": "wall_s", "memory_mb": "memory_mb", "file_mb": "file_mb",
            "dir_mb": "dir_mb", "dir_files": "dir_inodes", "max_threads": "max_tasks", "max_output_bytes": "output_bytes"}

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        known = {*self.KEYS, "max_concurrent", "isolation"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown PythonTool config key(s) {unknown}; it takes {sorted(known)}")
        isolation = config.get("isolation", "strict")
        if isolation not in ("strict", "best_effort"):
            raise ValueError(f"PythonTool config isolation={isolation!r}: strict or best_effort")
        defaults = sandbox.Limits()
        values = {}
        for key, name in self.KEYS.items():
            kind = type(getattr(defaults, name))
            try:
                values[name] = kind(config.get(key, getattr(defaults, name)))
            except (TypeError, ValueError):
                raise ValueError(f"PythonTool config {key}={config[key]!r}: must be a number") from None
            if values[name] <= 0:
                raise ValueError(f"PythonTool config {key}={values[name]}: must be > 0")
        self.limits = sandbox.Limits(**values, strict=isolation == "strict")
        self.slots = threading.BoundedSemaphore(int(config.get("max_concurrent", min(8, os.cpu_count() or 1))))
        self.layers = sandbox.isolation_layers(self.limits)  # checked once here, so a machine without them fails at load
        missing = {k: v for k, v in self.layers["missing"].items() if k in sandbox.REQUIRED}
        if missing and self.limits.strict:
            raise ValueError("the Python sandbox cannot isolate code on this machine (isolation: strict): " +
                             "; ".join(f"{k}: {v} (to enable: {sandbox.HOW_TO_ENABLE.get(k, 'see docs/TOOLS.md')})"
                                       for k, v in missing.items()) +
                             ". Set config.isolation: best_effort to run with the layers there are (NOT safe for untrusted code)")
        if "bubblewrap" in missing:  # best_effort: the stage on the host, with the layers it can set there
            self.limits = dataclasses.replace(self.limits, container=False)
            self.layers = sandbox.isolation_layers(self.limits)
        if os.environ.get("RANK", "0") == "0":
            lacking = self.layers["missing"]
            print(f"python tool: isolation {isolation}, {self.layers['container']} container, Landlock ABI "
                  f"{self.layers['landlock_abi']}; layers in force: "
                  f"{', '.join(k for k in sandbox.REQUIRED + ('landlock_net', 'landlock_scope') if k not in lacking)}"
                  + (f"; missing: {lacking}" if lacking else ""), file=sys.stderr)

    def execute(self, instance_id, parameters, **kwargs):
        code = parameters.get("code", "")
        if not isinstance(code, str):
            return "Error: code must be a string of Python source", 0.0, {}
        if not self.slots.acquire(timeout=self.limits.wall_s):
            return f"Error: the Python tool was busy for {self.limits.wall_s:g} s; try again", 0.0, {}
        try:
            result = sandbox.run_python(code, limits=self.limits)
        finally:
            self.slots.release()
        return self.observation(result), 0.0, {}

    def observation(self, result: sandbox.RunResult) -> str:
        """What the model reads of one run: its output, then why it stopped if it did not end on its own. Nothing of
        the host: a sandbox failure's detail (paths, uids) goes to the trainer's log only."""
        out, lim = result.output, self.limits
        if result.status == "ok":
            return out if out else "(no output)"
        if result.status == "sandbox_error":
            print(f"python tool: the sandbox did not run a call: {result.detail}", file=sys.stderr)
            return "Error: the Python sandbox could not run this call (the trainer's log says why); no code ran."
        if result.status == "output_limit":
            return out + f"\n...(output cut at {lim.output_bytes} bytes; the code was stopped)"
        why = {"cpu_limit": f"Error: the code used its {lim.cpu_s} s of CPU time and was stopped.",
               "timeout": f"Error: the code ran past its {lim.wall_s:g} s time limit and was stopped."}.get(result.status)
        if why is None and result.status == "killed":
            why = f"Error: the code was killed by signal {signal_name(result.signal)}."
        if why is None:  # error: an exit status other than 0
            why = f"(exit status {result.returncode})" if result.returncode != 1 or not out else ""
            if "MemoryError" in out:
                why += f" (the memory limit is {lim.memory_mb} MiB)"
        return (out + ("\n" if out and not out.endswith("\n") else "") + why.strip()).strip("\n") or "(no output)"


def signal_name(number: int | None) -> str:
    """9 -> "SIGKILL"; 40 (a real-time signal, no name in Python) -> "40"; None -> "unknown"."""
    if number is None:
        return "unknown"
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
