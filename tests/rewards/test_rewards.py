"""Tests for grpo_lib.rewards: answer extraction tables, dispatch, custom files, the scorer's pool and timeouts.

The pool tests start real worker processes (forkserver); one pool is shared per module where possible.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from grpo_lib.rewards import (
    FUNCTION_NAMES,
    MATH_SOURCES,
    RewardScorer,
    compute_score,
    format_score,
    load_custom_reward,
    registered_sources,
)
from grpo_lib.rewards.gsm8k import score as gsm8k_score
from grpo_lib.rewards.math import last_boxed
from grpo_lib.rewards.math import score as math_score

# ------------------------------------------------------------------------------------------ gsm8k strict
GSM8K_STRICT = [  # (response, ground_truth, expected)
    ("Step 1 ... The answer is\n#### 72", "72", 1.0),
    ("#### 1,234", "1234", 1.0),  # thousands comma in the response
    ("#### 1234", "1,234", 1.0),  # thousands comma in the ground truth
    ("#### 1 234", "1234", 1.0),  # space as thousands separator
    ("#### 12 345", "12345", 1.0),
    ("#### 1,000,000", "1000000", 1.0),
    ("#### $1,234.00", "1234", 1.0),  # currency and .00
    ("#### 18 dollars", "18", 1.0),  # units after the number
    ("#### 18.", "18", 1.0),  # trailing period
    ("#### -5", "-5", 1.0),
    ("#### \u22125", "-5", 1.0),  # unicode minus
    ("#### -$5", "-5", 1.0),
    ("#### $-5", "-5", 1.0),
    ("#### 5", "-5", 0.0),  # sign matters
    ("#### 3.50", "3.5", 1.0),  # 3.50 == 3.5
    ("#### 7.0", "7", 1.0),  # 7.0 == 7
    ("#### 7.01", "7", 0.0),
    ("#### 12\nOn second thought:\n#### 13", "13", 1.0),  # several ####: the last wins
    ("#### 12\nOn second thought:\n#### 13", "12", 0.0),
    ("#### 12\nHmm, let me redo it.\n#### ", "12", 0.0),  # the last #### is empty (cut off): no answer
    ("#### ", "72", 0.0),  # cut mid-answer
    ("The answer is 72.", "72", 0.0),  # no marker
    ("", "72", 0.0),  # empty response
    ("####72", "72", 1.0),  # no space after the marker
    ("##### 72", "72", 1.0),  # an extra '#'
    ("####\n72", "72", 1.0),  # number on the next line
    ("#### **72**", "72", 1.0),  # markdown bold
    ("#### \\$1{,}234", "1234", 1.0),  # LaTeX money and grouping
    ("#### 50%", "50", 1.0),
    ("#### The answer is 42 apples.", "42", 1.0),  # first number on the marker's line
    ("#### 3/4", "0.75", 1.0),  # simple fraction
    ("Step: 5-3=2\n#### 2", "2", 1.0),
    ("#### 42\n\nI hope this helps (see step 3).", "42", 1.0),  # text after the answer line is ignored
    ("#### 72", 72, 1.0),  # an int ground truth
    ("#### 0", "0", 1.0),
]


@pytest.mark.parametrize("response, ground_truth, expected", GSM8K_STRICT)
def test_gsm8k_strict(response, ground_truth, expected):
    got = compute_score("openai/gsm8k", response, ground_truth, gsm8k_mode="strict")
    assert got == expected, f"strict {response!r} vs {ground_truth!r}: got {got}, expected {expected}"


# ---------------------------------------------------------------------------------------- gsm8k flexible
GSM8K_FLEXIBLE = [  # (response, ground_truth, expected): the last number anywhere
    ("The answer is 72.", "72", 1.0),
    ("So she has 1,234 apples", "1234", 1.0),
    ("3 + 4 = 7", "7", 1.0),
    ("3 + 4 = 7. Then 2", "7", 0.0),  # the last number is 2
    ("#### 72", "72", 1.0),
    ("", "72", 0.0),
    ("no numbers here", "72", 0.0),
    ("She loses $5.50.", "5.5", 1.0),
    ("the temperature is -3 degrees", "-3", 1.0),
    ("5-3", "3", 1.0),  # a hyphen between digits is not a minus sign
    ("5-3", "-3", 0.0),
    ("x-2", "2", 1.0),
    ("(a+b)-4", "4", 1.0),
    ("It costs 2 000 dollars", "2000", 1.0),
    ("The total is 7.0", "7", 1.0),
    ("x = 3.50", "3.5", 1.0),
    ("answer: 100%", "100", 1.0),
    ("#### 12\n#### 13", "13", 1.0),
    ("The answer is 42 (from step 3)", "42", 0.0),  # flexible takes the last number: 3
    ("1/2 of 10 is 5", "5", 1.0),
    ("total: \\$1{,}200", "1200", 1.0),
    ("the answer is \u22128", "-8", 1.0),
    ("He ran 26.2 miles", "26.2", 1.0),
    ("value .5", "0.5", 1.0),
    ("72 apples", "72", 1.0),
    ("Answer: 1,000,000.", "1000000", 1.0),
    ("12 eggs minus 4 eggs is 8 eggs", "8", 1.0),
    ("I think it's 7 or 8", "7", 0.0),
    ("**Answer: 15**", "15", 1.0),
    ("3*4=12", "12", 1.0),
    ("#### 10\nCheck: 10 - 2 = 8", "10", 0.0),  # flexible ignores the marker
]


@pytest.mark.parametrize("response, ground_truth, expected", GSM8K_FLEXIBLE)
def test_gsm8k_flexible(response, ground_truth, expected):
    got = compute_score("openai/gsm8k", response, ground_truth, gsm8k_mode="flexible")
    assert got == expected, f"flexible {response!r} vs {ground_truth!r}: got {got}, expected {expected}"


def test_synthetic_is_always_strict():
    assert compute_score("synthetic/arithmetic", "#### 12", "12") == 1.0, "synthetic data uses the #### format"
    got = compute_score("synthetic/arithmetic", "it is 12", "12", gsm8k_mode="flexible")
    assert got == 0.0, "synthetic/arithmetic ignores gsm8k_mode: strict always"


# ------------------------------------------------------------------------------------------------- math
MATH = [  # (response, ground_truth, expected)
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("$\\boxed{\\dfrac{1}{2}}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{[-2, 7]}", "[-2,7]", 1.0),  # interval, spacing differs
    ("\\boxed{(-2, 7)}", "[-2,7]", 0.0),  # open vs closed interval
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", 1.0),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),  # text answer
    ("\\boxed{Evelyn}", "\\text{Evelyn}", 1.0),
    ("\\boxed{\\text{Bob}}", "\\text{Evelyn}", 0.0),
    ("\\boxed{C}", "\\text{(C)}", 1.0),  # multiple-choice letter
    ("\\boxed{\\sqrt{50}}", "5\\sqrt{2}", 1.0),
    ("\\boxed{(x+2)(x+5)}", "x^2+7x+10", 1.0),  # symbolic equality
    ("\\boxed{18.90}", "\\$18.90", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{3,2,1}", "1,2,3", 1.0),  # unordered list of solutions
    ("\\boxed{12.}", "12", 1.0),  # trailing period inside the box
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{12", "12", 0.0),  # cut mid-answer: unbalanced
    ("\\boxed{12} ... actually \\boxed{13", "12", 0.0),  # the last box is cut: no answer
    ("first \\boxed{5} then \\boxed{6}", "6", 1.0),  # the last box wins
    ("first \\boxed{5} then \\boxed{6}", "5", 0.0),
    ("\\fbox{7}", "7", 1.0),
    ("The answer is 7.", "7", 0.0),  # no box
    ("", "7", 0.0),
    ("\\boxed{}", "7", 0.0),
    ("$\\boxed 5$", "5", 1.0),  # `\boxed 5` form
    ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{x=2}", "2", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),  # escaped braces inside the box
    ("\\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "so the answer is $\\boxed{0.5}$", 1.0),  # a full solution as ground truth
]


@pytest.mark.parametrize("response, ground_truth, expected", MATH)
def test_math(response, ground_truth, expected):
    got = compute_score("DigitalLearningGmbH/MATH-lighteval", response, ground_truth)
    assert got == expected, f"math {response!r} vs {ground_truth!r}: got {got}, expected {expected}"


@pytest.mark.parametrize("source", MATH_SOURCES)
def test_every_math_source_dispatches(source):
    assert compute_score(source, "\\boxed{\\frac{1}{2}}", "0.5") == 1.0, f"{source} should use the math reward"


def test_last_boxed_balanced():
    assert last_boxed("\\boxed{\\frac{a}{b}} and \\boxed{\\sqrt{\\frac{1}{2}}}") == "\\sqrt{\\frac{1}{2}}", \
        "nested braces belong to the last box"
    assert last_boxed("\\fbox{1} \\boxed{2}") == "2", "the later command wins, whichever it is"
    assert last_boxed("\\boxed{2} \\fbox{3}") == "3", "\\fbox counts as a box"
    assert last_boxed("no box") is None, "no box -> None"


# ----------------------------------------------------------------------------------------------- format
FORMAT = [  # (data_source, response, expected)
    ("openai/gsm8k", "#### 72", 1.0),
    ("openai/gsm8k", "reasoning...\n#### 1,234", 1.0),
    ("openai/gsm8k", "The answer is 72", 0.0),
    ("openai/gsm8k", "#### ", 0.0),
    ("openai/gsm8k", "", 0.0),
    ("openai/gsm8k", "#### 5\n#### ", 0.0),  # the last marker is empty
    ("openai/gsm8k", "#### -3.5", 1.0),
    ("openai/gsm8k", "#### $12", 1.0),
    ("openai/gsm8k", "#### twelve", 0.0),
    ("openai/gsm8k", "\\boxed{72}", 0.0),  # the wrong format for gsm8k
    ("openai/gsm8k", "####72", 1.0),
    ("openai/gsm8k", "## 72", 0.0),
    ("synthetic/arithmetic", "#### 12", 1.0),
    ("synthetic/arithmetic", "12", 0.0),
    ("synthetic/arithmetic", "#### 13", 1.0),  # wrong answer, right format
    ("lighteval/MATH", "\\boxed{1}", 1.0),
    ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", 1.0),
    ("lighteval/MATH", "\\boxed{12", 0.0),
    ("lighteval/MATH", "\\boxed{}", 0.0),
    ("lighteval/MATH", "\\boxed{  }", 0.0),
    ("lighteval/MATH", "#### 12", 0.0),  # the wrong format for math
    ("lighteval/MATH", "", 0.0),
    ("lighteval/MATH", "\\fbox{3}", 1.0),
    ("HuggingFaceH4/MATH-500", "$\\boxed 5$", 1.0),
    ("math", "the answer is 5", 0.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{1} then \\boxed{2", 0.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{\\text{Evelyn}}", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{\\{1,2\\}}", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed", 0.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{x}\n\nDone.", 1.0),
]


@pytest.mark.parametrize("data_source, response, expected", FORMAT)
def test_format(data_source, response, expected):
    got = format_score(data_source, response, "unused")
    assert got == expected, f"format {data_source} {response!r}: got {got}, expected {expected}"


# --------------------------------------------------------------------------------------------- dispatch
def test_unknown_source_lists_registered():
    with pytest.raises(ValueError, match="registered sources") as info:
        compute_score("my/dataset", "#### 1", "1")
    assert "openai/gsm8k" in str(info.value), "the error should list the registered sources"
    with pytest.raises(ValueError, match="my/dataset"):
        format_score("my/dataset", "#### 1", "1")
    assert "synthetic/arithmetic" in registered_sources(), "the demo's source must be registered"


def test_bad_gsm8k_mode():
    with pytest.raises(ValueError, match="gsm8k_mode"):
        compute_score("openai/gsm8k", "#### 1", "1", gsm8k_mode="lenient")


# ------------------------------------------------------------------------------------------ custom file
CUSTOM_REWARD = '''
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom_reward_function signature; behaviour keyed by the response text."""
    if solution_str == "boom":
        raise ZeroDivisionError("boom")
    if solution_str == "sleep":
        time.sleep(30)
    if solution_str == "hang":  # ignores the soft timeout signal: only the parent's kill stops it
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        time.sleep(30)
    if solution_str == "crash":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    return float(solution_str.strip() == str(ground_truth))

def with_extras(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == str(ground_truth)
    return {"score": 2.0 if correct else -1.0, "acc": correct, "length": len(solution_str)}

def _private_helper():
    return 0
'''


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(textwrap.dedent(CUSTOM_REWARD))
    return str(path)


def test_load_custom_reward_float_and_dict(custom_file):
    function = load_custom_reward(custom_file, "compute_score")
    assert function(data_source="x", solution_str="7", ground_truth="7", extra_info=None) == 1.0, "float return"
    extras = load_custom_reward(custom_file, "with_extras")
    assert extras("x", "7", "7", {}) == {"score": 2.0, "acc": True, "length": 1}, "dict return"


def test_load_custom_reward_errors(custom_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_reward.py"):
        load_custom_reward(str(tmp_path / "missing_reward.py"), "compute_score")
    with pytest.raises(AttributeError, match="no function 'nope'") as info:
        load_custom_reward(custom_file, "nope")
    assert "compute_score" in str(info.value) and "with_extras" in str(info.value), "lists the functions found"
    assert "_private_helper" not in str(info.value), "private helpers are not listed"
    broken = tmp_path / "broken_reward.py"
    broken.write_text("raise RuntimeError('bad import')\n")
    with pytest.raises(ImportError, match="broken_reward.py"):
        load_custom_reward(str(broken), "compute_score")


# ------------------------------------------------------------------------------------------------ scorer
def _score(scorer, responses, data_source="openai/gsm8k", ground_truth="7"):
    n = len(responses)
    return scorer.score(responses=responses, data_sources=[data_source] * n, ground_truths=[ground_truth] * n,
                        extra_infos=[None] * n)


def test_scorer_weights_combine_in_process():
    scorer = RewardScorer(functions=[{"name": "accuracy", "weight": 1.0}, {"name": "format", "weight": 0.5}],
                          num_workers=0)
    out = _score(scorer, ["#### 7", "#### 8", "7", ""])
    # accuracy [1, 0, 0, 0] (strict needs ####); format [1, 1, 0, 0]; score = 1*acc + 0.5*format
    assert out.per_function == {"accuracy": [1.0, 0.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0, 0.0]}, out.per_function
    assert out.scores == [1.5, 0.5, 0.0, 0.0], f"weighted sum wrong: {out.scores}"
    assert (out.num_errors, out.num_timeouts) == (0, 0), "no failures expected"
    flexible = RewardScorer(functions=[{"name": "accuracy"}], gsm8k_mode="flexible", num_workers=0)  # weight 1.0
    assert _score(flexible, ["it is 7"]).scores == [1.0], "gsm8k_mode reaches compute_score"


def test_scorer_unknown_source_is_a_counted_error():
    scorer = RewardScorer(functions=[{"name": "accuracy", "weight": 1.0}], num_workers=0)
    out = scorer.score(responses=["#### 7", "#### 7"], data_sources=["openai/gsm8k", "my/dataset"],
                       ground_truths=["7", "7"], extra_infos=[None, None])
    assert out.scores == [1.0, 0.0] and out.num_errors == 1, f"unknown source scores 0, counted: {out}"
    assert "registered sources" in out.error_samples[0], f"the error message is kept: {out.error_samples}"


@pytest.mark.parametrize("functions, custom_path, message", [
    ([{"name": "accuracy", "weight": 1.0}, {"name": "fluency", "weight": 1.0}], None, "valid names"),
    ([{"name": "custom", "weight": 1.0}], None, "needs custom_path"),
    ([{"name": "format", "weight": 1.0}, {"name": "format", "weight": 2.0}], None, "more than once"),
    ([{"name": "format", "wieght": 1.0}], None, "'name': str, 'weight': float"),
    ([{"weight": 1.0}], None, "'name': str, 'weight': float"),
    ([{"name": "format", "weight": float("nan")}], None, "finite number"),
    ([], None, "functions is empty"),
])
def test_scorer_config_errors(functions, custom_path, message):
    with pytest.raises(ValueError, match=message):
        RewardScorer(functions=functions, custom_path=custom_path, num_workers=0)
    assert set(FUNCTION_NAMES) == {"accuracy", "format", "custom", "reward_model", "judge"}, "documented function names"


def test_scorer_custom_replaces_accuracy_and_returns_extras(custom_file):
    scorer = RewardScorer(functions=[{"name": "accuracy", "weight": 1.0}, {"name": "format", "weight": 0.5}],
                          custom_path=custom_file, custom_name="with_extras", num_workers=0)
    out = _score(scorer, ["7", "#### 8"])
    assert out.per_function["accuracy"] == [2.0, -1.0], "accuracy is the custom function when custom_path is set"
    assert out.scores == [2.0, -0.5], f"2.0 + 0.5*0, -1.0 + 0.5*1: {out.scores}"
    assert out.extra == {"acc": [True, False], "length": [1, 6]}, f"extra fields keyed by field: {out.extra}"


def test_scorer_same_field_from_two_functions_is_prefixed(custom_file):
    scorer = RewardScorer(functions=[{"name": "accuracy", "weight": 1.0}, {"name": "custom", "weight": 1.0}],
                          custom_path=custom_file, custom_name="with_extras", num_workers=0)
    out = _score(scorer, ["7"])
    assert set(out.extra) == {"accuracy/acc", "custom/acc", "accuracy/length", "custom/length"}, out.extra


@pytest.fixture(scope="module")
def pool_scorer(custom_file):
    scorer = RewardScorer(functions=[{"name": "custom", "weight": 1.0}, {"name": "format", "weight": 0.5}],
                          custom_path=custom_file, timeout_s=1.0, num_workers=2)
    yield scorer
    scorer.close()


def test_pool_scores_many_responses(pool_scorer):
    responses = ["7", "#### 7", "8"] * 400  # 1,200 responses x 2 functions, sent in chunks
    out = _score(pool_scorer, responses)
    assert out.per_function["custom"] == [1.0, 0.0, 0.0] * 400, "custom: exact text match with '7'"
    assert out.scores == [1.0, 0.5, 0.0] * 400, "custom + 0.5 * format"
    assert (out.num_errors, out.num_timeouts) == (0, 0), "no failures expected"


def test_pool_raising_reward_is_counted_and_run_continues(pool_scorer):
    out = _score(pool_scorer, ["7", "boom", "nan", "7"])
    assert out.per_function["custom"] == [1.0, 0.0, 0.0, 1.0], "raise/NaN score 0, the others are scored"
    assert out.num_errors == 2 and out.num_timeouts == 0, f"two errors expected: {out}"
    assert any("ZeroDivisionError" in sample for sample in out.error_samples), out.error_samples


@pytest.mark.wallclock
def test_pool_sleeping_reward_times_out_quickly(pool_scorer):
    start = time.monotonic()
    out = _score(pool_scorer, ["7", "sleep", "#### 7", "7"])
    elapsed_s = time.monotonic() - start
    assert elapsed_s < 6, f"a sleep(30) reward with timeout 1 s must return within a few seconds, took {elapsed_s:.1f}"
    assert out.num_timeouts == 1 and out.num_errors == 0, f"one timeout expected: {out}"
    assert out.per_function["custom"] == [1.0, 0.0, 0.0, 1.0], "the other responses are still scored"
    assert out.per_function["format"] == [0.0, 0.0, 1.0, 0.0], "format is scored for every response"
    assert _score(pool_scorer, ["7"]).scores == [1.0], "the pool keeps working after a timeout"


@pytest.mark.wallclock
def test_pool_hang_that_ignores_signals_is_killed(pool_scorer):
    start = time.monotonic()
    out = _score(pool_scorer, ["7", "hang"] + ["7"] * 20)
    elapsed_s = time.monotonic() - start
    assert elapsed_s < 10, f"a hung worker must not hang the trainer, took {elapsed_s:.1f} s"
    assert out.num_timeouts == 1, f"the hang is one timeout: {out}"
    assert out.per_function["custom"] == [1.0, 0.0] + [1.0] * 20, "the other responses are re-run and scored"
    assert _score(pool_scorer, ["7"]).scores == [1.0], "a fresh pool serves the next call"


def test_pool_crashing_worker_is_counted(pool_scorer):
    out = _score(pool_scorer, ["7", "crash"] + ["7"] * 10)
    assert out.per_function["custom"][1] == 0.0 and out.num_errors >= 1, f"the crash is an error: {out}"
    # calls in flight in the other worker when the pool broke also count as errors (cannot be told apart)
    assert sum(out.per_function["custom"]) >= 10 - 1, f"most other responses still scored: {out.per_function}"
    assert _score(pool_scorer, ["7"]).scores == [1.0], "a fresh pool serves the next call"


def test_pool_survives_a_stop_signal_to_the_trainers_process_group(custom_file):
    """torch elastic forwards a Ctrl-C / SIGTERM with os.killpg to the trainer's whole process group: the forkserver
    and the reward workers are hit too. They must keep serving the step the trainer is finishing: no error, no
    respawn. (Sent here to each pool process by pid: a killpg would also hit pytest.)"""
    import signal

    import psutil

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with RewardScorer(functions=[{"name": "custom", "weight": 1.0}], custom_path=custom_file, timeout_s=5.0,
                      num_workers=2) as scorer:
        assert _score(scorer, ["7", "8"]).scores == [1.0, 0.0]
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask, "the trainer must still receive stop signals"
        workers = [w.process.pid for w in scorer._pool._workers]
        forkserver = psutil.Process(workers[0]).parent()  # the workers' parent, a child of this process
        assert "forkserver" in " ".join(forkserver.cmdline()) and forkserver.ppid() == os.getpid(), forkserver
        targets = [forkserver, *(psutil.Process(pid) for pid in workers)]
        for sig in (signal.SIGTERM, signal.SIGINT):
            for process in targets:
                process.send_signal(sig)
        time.sleep(1.0)  # a process killed by the signal would be gone by now
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in targets), \
            f"a stop signal killed a pool process: {[(p.pid, p.is_running()) for p in targets]}"
        out = _score(scorer, ["7", "8"] * 20)
        assert (out.num_errors, out.num_timeouts) == (0, 0) and out.scores == [1.0, 0.0] * 20, out
        assert [w.process.pid for w in scorer._pool._workers] == workers, "the workers were replaced"


# ------------------------------------------------------------------------------- untrustworthy rewards (issue 11)
def test_null_ground_truth_never_scores():
    """`#### None` against a None / NaN / empty answer scores 0 (str(None) == "None" used to match: 1.0)."""
    assert gsm8k_score("#### None", None) == 0.0 and gsm8k_score("#### nan", float("nan")) == 0.0
    assert math_score("\\boxed{None}", None) == 0.0
    scorer = RewardScorer(functions=[{"name": "accuracy", "weight": 1.0}], num_workers=0)
    out = scorer.score(responses=["#### None", "#### None", "#### 7"], data_sources=["openai/gsm8k"] * 3,
                       ground_truths=[None, "", "7"], extra_infos=[None] * 3)
    assert out.scores == [0.0, 0.0, 1.0], f"a missing answer never scores: {out.scores}"
    assert out.num_errors == 2 and out.num_failed_responses == 2, f"and is counted as an error: {out}"
    assert "nothing to score against" in out.error_samples[0], out.error_samples


def test_failed_responses_counted_once_per_response(custom_file):
    scorer = RewardScorer(functions=[{"name": "custom", "weight": 1.0}, {"name": "format", "weight": 0.5}],
                          custom_path=custom_file, num_workers=0)
    out = _score(scorer, ["boom", "nan", "7", "7"])
    assert out.num_errors == 2 and out.num_failed_responses == 2, f"2 of 4 responses failed: {out}"


@pytest.mark.wallclock
def test_half_hung_responses_cost_one_timeout_per_batch(custom_file):
    """8 of 16 responses hang (sleep 30 s) with timeout_s=2 and 2 workers: the batch takes about one timeout_s,
    not 8 x 2 s / 2 workers = 8 s as when timeouts queued per worker; the other 8 are scored."""
    from grpo_lib.rewards.pool import HARD_GRACE_S

    timeout_s = 2.0
    with RewardScorer(functions=[{"name": "custom", "weight": 1.0}], custom_path=custom_file, timeout_s=timeout_s,
                      num_workers=2) as scorer:
        _score(scorer, ["7"])  # workers started (their start-up is not the hang's cost)
        start = time.monotonic()
        out = _score(scorer, ["7", "sleep"] * 8)
        elapsed_s = time.monotonic() - start
    assert out.num_timeouts == 8 and out.num_errors == 0, f"the 8 hung responses are timeouts: {out}"
    assert out.per_function["custom"] == [1.0, 0.0] * 8, "the 8 others are scored"
    assert elapsed_s < timeout_s + HARD_GRACE_S + 1.0, f"8 hangs must cost about one timeout_s={timeout_s} s in total, took {elapsed_s:.1f} s"


@pytest.mark.wallclock
def test_many_hangs_stop_at_the_batch_deadline(custom_file):
    """More hung calls than workers + helpers: the batch still ends by about one timeout_s after the first hang."""
    from grpo_lib.rewards.pool import HARD_GRACE_S, MAX_HELPERS

    timeout_s = 1.0
    with RewardScorer(functions=[{"name": "custom", "weight": 1.0}], custom_path=custom_file, timeout_s=timeout_s,
                      num_workers=1) as scorer:
        _score(scorer, ["7"])
        start = time.monotonic()
        out = _score(scorer, ["hang"] * (4 * (1 + MAX_HELPERS)))  # "hang" ignores the soft timeout signal
        elapsed_s = time.monotonic() - start
    assert out.num_timeouts == 4 * (1 + MAX_HELPERS), f"every hung call is a timeout: {out}"
    assert elapsed_s < timeout_s + HARD_GRACE_S + 2.0, f"the batch deadline bounds the cost, took {elapsed_s:.1f} s"


KILL_SCRIPT = '''
import sys, time
sys.path.insert(0, {repo!r})
from grpo_lib.rewards import RewardScorer

if __name__ == "__main__":
    scorer = RewardScorer(functions=[{{"name": "custom", "weight": 1.0}}], custom_path={custom!r}, timeout_s=60, num_workers=2)
    print("scoring", flush=True)
    scorer.score(responses=["hang"] * 4, data_sources=["x"] * 4, ground_truths=["7"] * 4, extra_infos=[None] * 4)
'''


@pytest.mark.slow
def test_no_worker_survives_sigkill_of_the_trainer(custom_file, tmp_path):
    """The process owning the scorer is SIGKILLed while its workers hang in C-like sleeps: none survives."""
    import signal
    import subprocess
    import sys

    import psutil

    script = tmp_path / "trainer.py"
    script.write_text(KILL_SCRIPT.format(repo=str(Path(__file__).resolve().parents[2]), custom=custom_file))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "scoring"
        descendants, deadline = [], time.monotonic() + 30
        while len(descendants) < 3 and time.monotonic() < deadline:  # the forkserver and the 2 workers
            time.sleep(0.2)
            descendants = psutil.Process(proc.pid).children(recursive=True)
        time.sleep(1.0)  # the workers are now inside the hanging calls
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 3, f"the scorer should have started worker processes: {descendants}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        gone_by = time.monotonic() + 5
        alive = descendants
        while alive and time.monotonic() < gone_by:
            alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.1)
        assert not alive, f"processes outlived the SIGKILLed trainer: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------ imports that block (issue 20 item 7)
# reward.timeout_s bounds calls only: a file that waits at import (a download, a lock, input()) hung setup forever
# with no output. Each import -- in the trainer and in every worker -- is now bounded by reward.import_timeout_s.

BLOCKS_AT_IMPORT = '''
import time
try:
    time.sleep(600)  # stands for a download or a lock that never comes
except Exception:  # a broad except in the file cannot swallow the deadline
    pass

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''

BLOCKS_IN_WORKERS = '''
import multiprocessing, signal, time
if multiprocessing.parent_process() is not None:  # a reward worker, not the trainer
    if {ignore_alarm}:  # a hang the soft deadline cannot interrupt: only the parent's kill ends it
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(600)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''


@pytest.mark.wallclock
def test_an_import_that_blocks_times_out_naming_the_file(tmp_path):
    import sys

    from grpo_lib.rewards.custom import ImportTimeoutError

    blocking = tmp_path / "slow_import_reward.py"
    blocking.write_text(BLOCKS_AT_IMPORT)
    start = time.monotonic()
    with pytest.raises(ImportTimeoutError, match=r"slow_import_reward.py did not finish importing within "
                                                 r"reward.import_timeout_s=0.5 s"):
        load_custom_reward(str(blocking), "compute_score", import_timeout_s=0.5)
    assert time.monotonic() - start < 5, "the deadline stops the import"
    assert not [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(blocking)], "no half-imported module"
    with pytest.raises(ImportError, match="slow_import_reward.py"):  # the scorer, in-process (num_workers=0)
        RewardScorer(functions=[{"name": "custom"}], custom_path=str(blocking), num_workers=0, import_timeout_s=0.5)


@pytest.mark.wallclock
@pytest.mark.parametrize("ignore_alarm", [False, True], ids=["worker import times out", "worker killed by the parent"])
def test_an_import_that_blocks_only_in_the_workers_fails_at_construction(tmp_path, monkeypatch, ignore_alarm):
    """The trainer's import succeeds; each worker imports the file again when the pool starts (at construction, so the
    trainer exits 2 at setup, not mid-run). A worker whose import times out reports it; one that ignores the deadline
    is killed import_timeout_s + START_GRACE_S after it started."""
    from grpo_lib.rewards import pool

    monkeypatch.setattr(pool, "START_GRACE_S", 2.0)
    reward = tmp_path / "worker_blocks_reward.py"
    reward.write_text(BLOCKS_IN_WORKERS.format(ignore_alarm=ignore_alarm))
    start = time.monotonic()
    with pytest.raises(ImportError) as info:
        RewardScorer(functions=[{"name": "custom"}], custom_path=str(reward), num_workers=2, import_timeout_s=1.0)
    elapsed_s = time.monotonic() - start
    assert f"custom reward file {reward}" in str(info.value) and "reward.import_timeout_s=1.0 s" in str(info.value)
    if ignore_alarm:
        assert "was not ready 3 s after it started" in str(info.value), str(info.value)
    else:
        assert "did not finish importing within reward.import_timeout_s=1.0 s" in str(info.value), str(info.value)
    assert elapsed_s < 20, f"bounded by the import timeout (+ grace), took {elapsed_s:.1f} s"


def test_pool_workers_are_ready_after_construction(custom_file):
    """The workers start (and import the file) in the constructor: the first score() finds them ready."""
    with RewardScorer(functions=[{"name": "custom"}], custom_path=custom_file, num_workers=2) as scorer:
        assert len(scorer._pool._workers) == 2 and all(w.ready for w in scorer._pool._workers)
        assert _score(scorer, ["7", "8"]).scores == [1.0, 0.0]


def test_with_a_model_scorer_rows_without_a_rule_get_no_rule_call_and_no_error():
    """rule_sources (a reward model or judge on): a row whose data_source has no built-in rule is left to the models: its
    rule functions score 0 and count no error; a row with a rule is scored as before."""
    scorer = RewardScorer(functions=[{"name": "accuracy", "weight": 1.0}, {"name": "reward_model", "weight": 0.5}],
                          num_workers=0, rule_sources={"openai/gsm8k"})
    out = scorer.score(responses=["#### 7", "#### 7"], data_sources=["openai/gsm8k", "my/open_ended"], ground_truths=["7", "x"],
                       extra_infos=[None, None])
    assert out.per_function == {"accuracy": [1.0, 0.0]} and out.scores == [1.0, 0.0]
    assert out.num_errors == 0 and out.num_failed_responses == 0
    assert scorer.rule_names == ["accuracy"], "the reward model is the trainer's to score, not the rule workers'"
