"""The weight probe's cost (trainer.weight_probe, grpo_lib/rollout/weight_probe.py): its share of the step, on the demo's run.

Not a test: `python bench/bench_weight_probe.py [--steps 12] [--work-dir DIR] [--warmup-steps 300]` builds the demo's
model and data (as `make demo` does: the tiny Qwen3 warmed up --warmup-steps steps, 2000 synthetic additions) unless DIR
has them, runs
`train_grpo.py recipes/tiny_cpu.yaml` (real vLLM on CPU, 32 prompts x 8 responses per step) for --steps steps, and
reads from its metrics.jsonl, per step, `timing_s/weight_probe` (the actor's forward of the probe before the push, and
the comparison after the next generation; inside `timing_s/step`) against `timing_s/step`. The first 2 steps are left
out (one-off warm-up). The engine scores the probe inside its generation call (one more prompt-logprob request in the
batch), which timing_s/weight_probe does not see: that part is measured here in one process, as paired A/B calls of
the step's generate (the demo's 32 prompts x 8 samples, streamed as in training) with and without the carried probe,
alternating, --ab-pairs pairs; its median difference is added to the probe's cost. Both parts are measured inside the
same steps / calls they are compared with, so a machine shared with other jobs slows both alike; the load average is
printed with the result. Writes bench/results_weight_probe_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WARMUP_STEPS = 2


def build(work: Path, warmup_steps: int) -> tuple[Path, Path]:
    model, data = work / "tiny_qwen3", work / "arith"
    py = sys.executable
    if not (model / "config.json").exists():
        subprocess.run([py, "data_prep/tiny_model.py", "--out", str(model), "--warmup-steps", str(warmup_steps)], cwd=REPO, check=True)
    if not (data / "train.parquet").exists():
        subprocess.run([py, "data_prep/synthetic.py", "--out", str(data), "--train-size", "2000", "--test-size", "100"],
                       cwd=REPO, check=True)
    return model, data


def generate_ab(model: Path, data: Path, pairs: int) -> tuple[float, float]:
    """Median over `pairs` of (generate with the carried probe - generate without), and the median plain generate, s."""
    import time

    from transformers import AutoTokenizer

    from grpo_lib.config import load_config
    from grpo_lib.core.types import ScoreRequest
    from grpo_lib.rollout.data import load_prompts
    from grpo_lib.rollout.engines.vllm import VLLMEngine
    from grpo_lib.rollout.weight_probe import PROBE_TOKENS

    cfg = load_config(REPO / "recipes" / "tiny_cpu.yaml", [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]"])
    train = load_prompts(cfg.data.train_files, AutoTokenizer.from_pretrained(str(model)), cfg.data)
    engine = VLLMEngine.from_config(cfg, on_cpu=True, world_size=1)
    prompts, probe = train.prompt_ids[:cfg.data.train_batch_size], train.prompt_ids[0][:PROBE_TOKENS]

    def generate(with_probe: bool, rep: int) -> float:
        carried = {"score": ScoreRequest([probe])} if with_probe else {}
        start = time.perf_counter()
        engine.generate(prompts, n=cfg.rollout.n, temperature=cfg.rollout.temperature, max_tokens=cfg.data.max_response_length,
                        seeds=[1000 * rep + i for i in range(len(prompts))], on_finished=lambda finished: None, **carried)
        return time.perf_counter() - start

    for rep in range(3):  # warm-up
        generate(rep % 2 == 0, rep)
    diffs, plain = [], []
    for rep in range(pairs):  # the same seeds for both calls of a pair; which goes first alternates
        order = (False, True) if rep % 2 == 0 else (True, False)
        t = {w: generate(w, rep) for w in order}
        diffs.append(t[True] - t[False])
        plain.append(t[False])
    return statistics.median(diffs), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--warmup-steps", type=int, default=300, help="the tiny model's warm-up (make demo: 300)")
    parser.add_argument("--ab-pairs", type=int, default=60, help="paired generate calls with / without the carried probe")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_probe_"))
    model, data = build(work, args.warmup_steps)
    out = work / "run"
    cmd = [sys.executable, "train_grpo.py", "recipes/tiny_cpu.yaml", f"model.path={model}",
           f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]",
           f"trainer.default_local_dir={out}", f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.save_hf=false", "trainer.logger=[jsonl]",
           "trainer.resume_mode=disable"]
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/weight_probe" in r and r["step"] > WARMUP_STEPS]
    probe = [r["timing_s/weight_probe"] for r in rows]
    step = [r["timing_s/step"] for r in rows]
    in_gen, gen_plain = generate_ab(model, data, args.ab_pairs)
    share = [(p + in_gen) / s for p, s in zip(probe, step)]
    load = os.getloadavg()
    lines = [
        "# Weight probe: its cost per step (bench/bench_weight_probe.py)", "",
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end: a machine shared with other jobs.",
        f"The demo run (recipes/tiny_cpu.yaml: 32 prompts x 8 responses of <= 16 tokens, real vLLM on CPU, float32; the "
        f"tiny model warmed up {args.warmup_steps} steps), steps {WARMUP_STEPS + 1}-{args.steps}:", "",
        "| | median | max |", "|---|---|---|",
        f"| timing_s/weight_probe (actor forward + comparison) | {statistics.median(probe) * 1e3:.2f} ms | {max(probe) * 1e3:.2f} ms |",
        f"| the probe inside the generate call ({args.ab_pairs} A/B pairs; plain generate {gen_plain:.3f} s) | "
        f"{in_gen * 1e3:.2f} ms | |",
        f"| timing_s/step | {statistics.median(step):.3f} s | {max(step):.3f} s |",
        f"| probe / step (both parts) | {statistics.median(share):.2%} | {max(share):.2%} |",
        f"| rollout/weight_probe_abs_diff | {statistics.median(r['rollout/weight_probe_abs_diff'] for r in rows):.2g} | "
        f"{max(r['rollout/weight_probe_abs_diff'] for r in rows):.2g} |",
        f"| rollout/weight_probe_tolerance | {statistics.median(r['rollout/weight_probe_tolerance'] for r in rows):.2g} | |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (REPO / "bench" / "results_weight_probe_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
