"""The numbers and the verdict table of scripts/gpu_check.sh (no torch import; reads the runs' files).

    python scripts/gpu_report.py run METRICS_JSONL --name NAME --steps 1,2,3 --tol 5e-2 --verdict FILE
        per step: the weight-sync error and every memory/* metric; one verdict row (OK when the steps are there and
        every weight-sync error is within --tol)
    python scripts/gpu_report.py big DIR --plan PLAN_TXT [--measure MEASURE_TXT] --verdict FILE
        the true-size run of scripts/gpu_big_run.py: peak memory per phase against the 1-process plan's phases, step
        time, tokens/s and MFU; verdict rows (on a GPU the measured training-phase peak must not pass the plan's
        training phase by more than PLAN_TOLERANCE; on CPU the numbers are shown, not judged)
    python scripts/gpu_report.py table FILE
        the verdict table; exit 1 when any row FAILED

A verdict file holds one row per check: name <TAB> OK|FAIL|INFO <TAB> detail.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

# The plan is an upper bound of the training phase (docs: grpo_lib/plan_memory.py); measured above it by more than this
# fraction, the plan under-states what a GPU needs and the check fails (issue 19: measured within 10% of the plan).
PLAN_TOLERANCE = 0.10
# Dense bf16 tensor-core peak, FLOP/s, by a name fragment of torch.cuda.get_device_name(); PEAK_TFLOPS overrides.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
                   "L4": 121e12, "A10": 125e12, "B200": 2250e12}
PLAN_LINES = {"generation": r"generation phase\s+([\d.]+)\s*GiB", "training": r"training phase\s+([\d.]+)\s*GiB",
              "peak": r"peak per GPU\s+([\d.]+)\s*GiB"}


def read_rows(metrics: Path) -> list[dict]:
    """The step rows of a metrics.jsonl (those with timing_s/step)."""
    return [r for r in (json.loads(line) for line in metrics.read_text().splitlines() if line.strip()) if "timing_s/step" in r]


def add(verdict: Path, name: str, status: str, detail: str) -> None:
    assert status in ("OK", "FAIL", "INFO"), status
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


def parse_plan(text: str) -> dict[str, float]:
    """GiB of the plan's phases: {"generation": ..., "training": ..., "peak": ...} (those found)."""
    return {key: float(m.group(1)) for key, pattern in PLAN_LINES.items() if (m := re.search(pattern, text))}


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
    if measure_text is not None:
        lines = [line.strip() for line in measure_text.splitlines() if "measur" in line.lower()]
        add(verdict, "big: --measure", "INFO", " / ".join(lines[:4]) or "no 'measured' line in its output")
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


def table(verdict: Path) -> int:
    rows = [line.split("\t", 2) for line in verdict.read_text().splitlines() if line.strip()] if verdict.is_file() else []
    print("\n| check | verdict | detail |\n|---|---|---|")
    for name, status, detail in rows:
        print(f"| {name} | {status} | {detail} |")
    failed = [name for name, status, _ in rows if status == "FAIL"]
    print(f"\ngpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'OK'}" if rows else "\ngpu_check: FAILED: no check ran")
    return 1 if failed or not rows else 0


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
    tab = sub.add_parser("table")
    tab.add_argument("verdict", type=Path)
    args = parser.parse_args(argv)
    if args.command == "layouts":
        return layouts_report(args.metrics, name=args.name, verdict=args.verdict)
    if args.command == "run":
        return run_report(args.metrics, name=args.name, steps=[int(s) for s in args.steps.split(",")], tol=args.tol,
                          verdict=args.verdict)
    if args.command == "big":
        measure = args.measure.read_text() if args.measure and args.measure.is_file() else None
        return big_report(args.out, plan_text=args.plan.read_text(), measure_text=measure, verdict=args.verdict)
    return table(args.verdict)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
