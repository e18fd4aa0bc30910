"""End to end with tools: train_grpo.py for 3 steps on the tiny model (eos made likely: conftest's `eos_model_dir`)
with rollout.multi_turn on, real vLLM, the built-in calculator from a verl-format tool config, and a model that calls
it in every turn (tests/scripts/train_with_tool_calls.py replaces only the hermes parser). Asserts what a user reads
of such a run: finite losses, episode and tool metrics, the engine serving the actor's weights after every push
(invariant 3, over episodes), validation with episodes, and a checkpoint at the end. Then: 2 processes and a
tensor-parallel engine over 2 train like 1 with episodes (invariant 8: per-(sample, turn) seeds), LoRA trains with
episodes, a run SIGKILLed mid-run with tools resumes to the same metrics and weights, and a tool failing on every call
of a step, or blocking the tool loop, stops the run (exit 3) after saving.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.conftest import HF_ENGINE, REPO, read_metrics, run_script, tiny_overrides

pytestmark = pytest.mark.slow  # tiers: conftest.py

TOOLS = """
tools:
  - class_name: grpo_lib.tools.builtin.CalculatorTool
    config: {}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied, deterministic reward so advantages and the policy gradient are non-zero on a random model
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
'''


def run_with_tool_calls(args: list[str], *, tool: str, arguments: dict, timeout: int = 900, procs: int | None = None,
                        faults: list[str] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """train_grpo.py under tests/scripts/train_with_tool_calls.py on one process or `procs` (tests/conftest.py's
    run_script); `faults`: train_with_faults.py's (e.g. a SIGKILL). `env`: added to the environment (STALL_GRACE_S:
    the script's tool-box grace)."""
    return run_script([REPO / "tests" / "scripts" / "train_with_tool_calls.py", tool, json.dumps(arguments), *faults, "--", *args],
                      procs=procs, timeout=timeout, env=env)


def multi_turn_overrides(model_dir, data, out, tools_path, *extra: str) -> list[str]:
    """tiny_overrides with episodes on (the tool config at `tools_path`, 2 assistant turns), then `extra` (a key given
    again replaces the earlier value: the trainer refuses a key given twice)."""
    return tiny_overrides(model_dir, data, out, "data.max_prompt_length=512", "data.max_response_length=160",
                          "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools_path}",
                          "rollout.multi_turn.max_assistant_turns=2", *extra)


@pytest.fixture(scope="module")
def tool_run(eos_model_dir, arith_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_e2e")
    (root / "tools.yaml").write_text(TOOLS)
    out = root / "run"
    args = ["recipes/tiny_cpu.yaml", *multi_turn_overrides(eos_model_dir, arith_data, out, root / "tools.yaml",
                                                           "trainer.check_weight_sync=true", "trainer.test_freq=3", "actor.lr=1e-3")]
    proc = run_with_tool_calls(args, tool="calculator", arguments={"expression": "6 * 7"})
    if proc.returncode != 0:
        pytest.fail(f"the run exited {proc.returncode}\n--- stderr tail ---\n{proc.stderr[-6000:]}")
    return out, proc


def test_a_run_with_tools_trains_and_logs_its_episodes(tool_run):
    out, _ = tool_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean", "episode/turns_mean", "episode/turns_max",
                    "episode/tool_calls_mean", "episode/stopped_turn_limit", "episode/stopped_length", "tools/calculator/calls",
                    "tools/calculator/failures", "tools/errors", "tools/timeouts", "tools/invalid_calls", "timing_s/tools"):
            assert key in r and math.isfinite(r[key]), f"{key} missing or not finite at step {r['step']}: {sorted(r)}"
        assert 1.0 < r["episode/turns_mean"] <= 2.0 and r["episode/turns_max"] == 2.0, r
        assert r["tools/calculator/calls"] > 0 and r["tools/calculator/failures"] == 0 and r["tools/errors"] == 0
        assert r["episode/stopped_turn_limit"] > 0, "the model calls in every turn: episodes end at max_assistant_turns=2"
    assert any(r["actor/grad_norm"] > 0 for r in rows)


def test_the_engine_serves_the_actors_weights_after_every_push(tool_run):
    out, _ = tool_run
    diffs = [r["debug/weight_sync_max_abs_diff"] for r in read_metrics(out)]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs


def test_validation_runs_episodes_and_the_run_saves(tool_run):
    out, _ = tool_run
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val/synthetic/arithmetic/acc" in r for r in lines), lines[-1]
    assert (out / "global_step_3").is_dir()


def compared_args(model_dir, data, root, out, *extra: str) -> list[str]:
    """The arguments of the 1-vs-2-process comparison's runs (varied reward, KL loss, two updates per step, validation
    before step 1), `extra` replacing their keys."""
    (root / "tools.yaml").write_text(TOOLS)
    (root / "reward.py").write_text(REWARD)
    return ["recipes/tiny_cpu.yaml", *multi_turn_overrides(model_dir, data, out, root / "tools.yaml", f"reward.custom.path={root / 'reward.py'}",
                                                           "actor.use_kl_loss=true", "actor.lr=1e-3", "actor.ppo_mini_batch_size=2",
                                                           "trainer.check_weight_sync=true", *extra)]


def compared_run(model_dir, data, root, name: str, procs: int, extra: list[str]) -> list[dict]:
    """One 3-step run of the 1-vs-2-process comparison; its per-step metrics (the run folder is root / name)."""
    out = root / name
    proc = run_with_tool_calls(compared_args(model_dir, data, root, out, *extra), tool="calculator",
                               arguments={"expression": "6 * 7"}, procs=procs)
    assert proc.returncode == 0, f"{name}: exited {proc.returncode}\n{proc.stderr[-6000:]}"
    return read_metrics(out)


@pytest.fixture(scope="module")
def one_process_dir(eos_model_dir, arith_data, tmp_path_factory):
    """The 1-process run of the comparison (its folder): read by the 2-process, TP-2 and kill-and-resume tests."""
    root = tmp_path_factory.mktemp("tools_p1")
    compared_run(eos_model_dir, arith_data, root, "p1", 1, [])
    return root / "p1"


@pytest.fixture(scope="module")
def one_process_run(one_process_dir):
    return read_metrics(one_process_dir)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["2_processes", "tp_2"])
def test_two_processes_train_like_one_with_tools(one_process_run, eos_model_dir, arith_data, tmp_path, layout):
    """Each process (or TP group, whose members submit identical requests) runs the episodes of its share; turn t of a
    sample has its own seed whatever runs beside it, so the step's metrics (episodes' included) equal the 1-process
    run's step by step."""
    extra = ["rollout.tensor_model_parallel_size=2"] if layout == "tp_2" else []
    one, two = one_process_run, compared_run(eos_model_dir, arith_data, tmp_path, layout, 2, extra)
    assert len(one) == len(two) == 3 and any(abs(r["actor/pg_loss"]) > 1e-6 for r in one)
    for a, b in zip(one, two):
        for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                    "episode/turns_mean", "episode/tool_calls_mean", "episode/stopped_length", "tools/calculator/calls"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"{layout} step {a['step']} {key}: 1 process {a[key]} vs {b[key]}"
        assert b["debug/weight_sync_max_abs_diff"] < 1e-4


def test_sigkill_mid_run_with_tools_then_resume_is_exact(one_process_dir, eos_model_dir, arith_data, tmp_path):
    """The 1-process comparison run again, checkpointing every step, SIGKILLed right after step 3's update (steps 1-2
    logged and saved); rerunning the same command resumes from step 2 and logs that run's metrics (episodes' and
    tools' included) and writes its final weights: the per-(sample, turn) seeds and the tools' per-episode state start
    afresh at each step, so a checkpoint is all the state with episodes too (invariant 5)."""
    import torch

    from tests.helpers.checkpoint_runs import assert_same_steps, hf_weights

    out = tmp_path / "run"
    args = compared_args(eos_model_dir, arith_data, tmp_path, out, "trainer.save_freq=1")
    killed = run_with_tool_calls(args, tool="calculator", arguments={"expression": "6 * 7"}, faults=["--signal", "KILL update 3"],
                                 procs=1)  # launched as the compared run
    assert killed.returncode != 0 and "test hook: SIGKILL at update of step 3" in killed.stderr, \
        f"the test hook did not kill the run: exit {killed.returncode}\n{killed.stderr[-3000:]}"
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and sorted(p.name for p in out.glob("global_step_*")) == \
        ["global_step_1", "global_step_2"]
    resumed = run_with_tool_calls(args, tool="calculator", arguments={"expression": "6 * 7"}, procs=1)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    a_rows, b_rows = read_metrics(one_process_dir), read_metrics(out)
    assert [r["step"] for r in b_rows] == [1, 2, 3] and any(r["tools/calculator/calls"] > 0 for r in b_rows)
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in a_rows), "the policy never moved: the test would prove nothing"
    assert_same_steps(a_rows, b_rows, [1, 2, 3])
    val = [[json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "val/episode/turns_mean" in x]
           for run in (one_process_dir, out)]
    assert [r["step"] for r in val[0]] == [r["step"] for r in val[1]] == [0], "validation before step 1, once"
    assert_same_steps(val[0], val[1], [0])
    a_final, b_final = hf_weights(one_process_dir / "global_step_3"), hf_weights(out / "global_step_3")
    assert a_final.keys() == b_final.keys() and all(torch.equal(a_final[k], b_final[k]) for k in a_final), \
        "final exports differ after kill + resume with tools"


def test_lora_trains_with_tools(eos_model_dir, arith_data, tmp_path):
    (tmp_path / "tools.yaml").write_text(TOOLS)
    (tmp_path / "reward.py").write_text(REWARD)  # varied: nonzero advantages, so the adapters get a gradient
    out = tmp_path / "run"
    args = ["recipes/tiny_cpu_lora.yaml", *multi_turn_overrides(eos_model_dir, arith_data, out, tmp_path / "tools.yaml",
                                                                f"reward.custom.path={tmp_path / 'reward.py'}",
                                                                "trainer.check_weight_sync=true", "trainer.save_merged=false")]
    proc = run_with_tool_calls(args, tool="calculator", arguments={"expression": "6 * 7"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(out)
    assert len(rows) == 3 and any(r["actor/grad_norm"] > 0 for r in rows)
    for r in rows:
        assert r["episode/turns_mean"] > 1 and r["tools/calculator/calls"] > 0 and math.isfinite(r["actor/pg_loss"])
        assert r["debug/weight_sync_max_abs_diff"] < 1e-4, "the engine does not serve base + adapters after the push"


def test_a_tool_failing_on_every_call_of_a_step_stops_the_run_after_saving(eos_model_dir, arith_data, tmp_path):
    """The tool answers its first call of the run only: step 1 has one answered call (the run goes on), step 2 none,
    so the run stops there as failing rewards do: exit 3, step 1 saved, step 2's generation metrics logged. On the hf
    engine (the check is the trainer's, after either loop; the per-episode loop on vLLM answers every call above)."""
    (tmp_path / "tools.yaml").write_text(TOOLS.replace("grpo_lib.tools.builtin.CalculatorTool", "tests.scripts.episode_case.FailsAfter")
                                         .replace("config: {}", "config: {ok_calls: 1}"))
    out = tmp_path / "run"
    # no validation before step 1: its episodes would take the one good call
    args = multi_turn_overrides(eos_model_dir, arith_data, out, tmp_path / "tools.yaml", "trainer.val_before_train=false", HF_ENGINE)
    proc = run_with_tool_calls(["recipes/tiny_cpu.yaml", *args], tool="calculator", arguments={"expression": "1"})
    assert proc.returncode == 3, proc.stderr[-4000:]
    assert "step 2: tool calculator failed on every one of its" in proc.stderr
    assert (out / "global_step_1").is_dir() and not (out / "global_step_2").exists()
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1]
    step2 = [r for r in rows if r["step"] == 2]
    assert step2 and step2[0]["tools/calculator/failures"] == step2[0]["tools/calculator/calls"] > 0


def test_a_tool_that_blocks_the_loop_stops_the_run_after_saving(eos_model_dir, arith_data, tmp_path):
    """The tool answers step 1's 16 calls (4 prompts x 4 episodes, one call each before the turn limit), then blocks
    the tool loop for 120 s on the next (time.sleep in an async def): step 2's calls never return, so 1 + 5 s later
    (tool_timeout_s + the stall grace, shortened from the product's 30 s by the script's STALL_GRACE_S) the step is
    aborted: exit 3, step 1 saved."""
    import time

    (tmp_path / "tools.yaml").write_text(TOOLS.replace("grpo_lib.tools.builtin.CalculatorTool", "tests.scripts.episode_case.StallsAfter")
                                         .replace("config: {}", "config: {ok_calls: 16}"))
    out = tmp_path / "run"
    args = multi_turn_overrides(eos_model_dir, arith_data, out, tmp_path / "tools.yaml", "trainer.val_before_train=false",
                                "rollout.multi_turn.tool_timeout_s=1")
    started = time.monotonic()
    proc = run_with_tool_calls(["recipes/tiny_cpu.yaml", *args], tool="calculator", arguments={"expression": "1"},
                               env={"STALL_GRACE_S": "5"})
    assert proc.returncode == 3, proc.stderr[-4000:]
    assert "step 2: the tool calls of a turn did not return within 6 s" in proc.stderr, proc.stderr[-4000:]
    assert (out / "global_step_1").is_dir() and not (out / "global_step_2").exists()
    assert time.monotonic() - started < 600
    assert [r["step"] for r in read_metrics(out) if "actor/pg_loss" in r] == [1]
