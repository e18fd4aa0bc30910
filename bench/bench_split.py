"""One-step-off on split cores against the synchronous step on both cores, all-at-cap work (issue 43).

Not a test: `python bench/bench_split.py` prints a table and writes bench/results_split_cpu.md (machine, date, load).

Shape: bench_step.py's random 3.4M-parameter Qwen3, 16 prompts x 8 per step, every response at the 128-token cap
(ignore_eos: the work is the same every step), micro-batches of 32 rows, packing on, one update per step, vLLM
(compiled), a varied custom reward. Two layouts of the 2 cores, each a whole `train_grpo.py` run of --steps steps:

    sync   one process, the engine colocated (generation -> update -> push in turn), 2 threads, vLLM bound to cores 0-1
    split  `torch.distributed.run` of 2 processes with rollout.n_gpus_per_node=1: the trainer on core 0 (1 thread),
           the engine on core 1 (1 thread, vLLM bound to it); the engine generates step k+1 while the trainer updates
           on step k

Runs alternate (sync, split, sync, split, ... --repeats each), each after the CPU is idle (bench_step.wait_for_idle).
Per run: the median over its steps after the first --warmup of the trainer's step time (timing_s/step: what a step
costs the run, waits for the engine included) and its phases; the report takes the median over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_step import (build_fixtures, json_rows, machine, median, overrides, wait_for_idle,  # noqa: E402
                              write_report_lines)

LAYOUTS = ("sync", "split")
PHASES = ("timing_s/step", "timing_s/gen", "timing_s/update", "timing_s/push", "timing_s/old_logprob", "timing_s/wait_engine",
          "timing_s/engine_gen", "timing_s/weight_probe")


def worker(argv: list[str]) -> int:
    """One process of a run: every response to the cap (ignore_eos), this process pinned to its core, then train_grpo."""
    layout = os.environ["BENCH_LAYOUT"]
    if layout == "split":  # launch rank 0 trains on core 0, rank 1 generates on core 1
        core = int(os.environ["RANK"])
        os.sched_setaffinity(0, {core})
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    import train_grpo  # sets the environment defaults before vLLM loads
    import vllm
    from vllm import LLM  # noqa: F401  (vLLM type-annotates with SamplingParams at import)

    params_class = vllm.SamplingParams
    vllm.SamplingParams = lambda **kwargs: params_class(**{**kwargs, "ignore_eos": True})
    code = train_grpo.main(argv)
    from grpo_lib.core.distributed import close_distributed

    close_distributed()
    return code


def run(work: Path, layout: str, index: int, steps: int) -> list[dict]:
    out = work / f"out_{layout}_{index}"
    args = [a for a in overrides(work, "fast_pack", "no_spread") if not a.startswith(("trainer.default_local_dir",
                                                                                        "trainer.total_training_steps"))]
    args += [f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}", "trainer.save_freq=-1",
             "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]", "data.val_files=[]"]
    env = {**os.environ, "BENCH_LAYOUT": layout, "PYTHONUNBUFFERED": "1"}
    if layout == "sync":
        env.update(OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
        cmd = [sys.executable, __file__, "--worker", "--", "recipes/tiny_cpu.yaml", *args]
    else:
        env.update(OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(29700 + index),
               __file__, "--worker", "--", "recipes/tiny_cpu.yaml", *args, "rollout.n_gpus_per_node=1"]
    with open(work / f"{layout}_{index}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} run {index} exited {proc.returncode}: see {work / f'{layout}_{index}.log'}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing_s/step" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not reported (compiles, the pipeline filling)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--idle", type=float, default=0.85)
    parser.add_argument("--max-wait-s", type=float, default=30.0)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=str(REPO / "bench" / "results_split_cpu.md"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        sys.exit(worker(rest[1:] if rest and rest[0] == "--" else rest))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_split_"))
    work.mkdir(parents=True, exist_ok=True)
    build_fixtures(work)
    info = machine()
    print(info, flush=True)
    runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for index in range(args.repeats):
        for layout in LAYOUTS:
            idle = wait_for_idle(args.idle, args.max_wait_s)
            start = time.perf_counter()
            rows = run(work, layout, index, args.steps)
            measured = rows[args.warmup:]
            summary = {k: median([r[k] for r in measured]) for k in PHASES if all(k in r for r in measured)}
            summary.update(idle_before=idle, wall_s=time.perf_counter() - start,
                           reward_first=rows[0]["reward/mean"], reward_last=rows[-1]["reward/mean"],
                           steps=[round(r["timing_s/step"], 3) for r in rows])
            runs[layout].append(summary)
            print(f"{layout} run {index}: step {summary['timing_s/step']:.2f}s "
                  + " ".join(f"{k.split('/')[1]} {v:.2f}" for k, v in summary.items() if k.startswith("timing_s/")), flush=True)
    report(Path(args.out), info, args, runs)


def report(path: Path, info: str, args, runs: dict[str, list[dict]]) -> None:
    lines = ["# One-step-off on split cores vs the synchronous step, all-at-cap work (CPU)", "",
             f"Produced by `python bench/bench_split.py --steps {args.steps} --warmup {args.warmup} --repeats {args.repeats}` "
             "(shape and method: its docstring).", "", "## Machine", "", "```", info, f"load average at end: {os.getloadavg()}",
             "```", "", "## Results (median over the runs of each run's median step; seconds)", "",
             "| layout | " + " | ".join(p.split("/")[1] for p in PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for layout, summaries in runs.items():
        cells = [f"{median([s[p] for s in summaries]):.2f}" if all(p in s for s in summaries) else "-" for p in PHASES]
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    ratio = median([s["timing_s/step"] for s in runs["split"]]) / median([s["timing_s/step"] for s in runs["sync"]])
    lines += ["", f"split / sync step time: {ratio:.2f}x; target <= 0.8x: **{'met' if ratio <= 0.8 else 'not met'}**.", "",
              "Per run:", "", "```"]
    lines += [*json_rows("layout", runs), "```", ""]
    write_report_lines(path, lines)


if __name__ == "__main__":
    main()
