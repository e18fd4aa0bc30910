"""FSDP2 benchmark: peak memory per process with 1 and 2 processes, reference offload on/off, push share of a step.

Not a test: `python bench/bench_fsdp.py` runs `train_grpo.py` (real vLLM engine, 3 steps, KL loss so the
reference exists) under `accelerate launch` in three settings and writes the "FSDP2" section of
bench/results_cpu.md (machine, date, settings, numbers). About 10 minutes on 2 busy CPU cores.

Settings: a random mid-size Qwen3 with the tiny tokenizer (`data_prep/tiny_model.py --hidden-size 768
--num-layers 8`: ~71M parameters, float32), synthetic additions, 8 prompts x 4 responses per step, one update
per step. Read from each run's metrics.jsonl (the largest process) and its start-up lines:
- `memory/peak_mb`: peak resident set (VmHWM) of the largest process over the run: Python, torch, the vLLM
  engine (its own full weight copy + 64 MiB KV cache), actor shards, gradients, AdamW state, reference;
- `memory/actor_params_mb`: this process's actor parameter shard;
- push share: `timing_s/push` / `timing_s/step`, mean of steps 2-3 (step 1 carries one-off warm-up).
On a CPU machine the reference "offload" keeps its shards where they already are (the host is the device), so
on/off must measure the same; the row is there to show it, and for the GPU run of scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MARK_BEGIN, MARK_END = "<!-- bench_fsdp begin -->", "<!-- bench_fsdp end -->"
RUNS = [  # (label, processes, extra overrides)
    ("1 process, reference offload on", 1, ["ref.fsdp_config.param_offload=true"]),
    ("2 processes (FSDP2), reference offload on", 2, ["ref.fsdp_config.param_offload=true"]),
    ("2 processes (FSDP2), reference offload off", 2, ["ref.fsdp_config.param_offload=false"]),
]


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Architecture", "Model name", "CPU(s)")
    lines = [line.strip() for line in lscpu.splitlines() if line.split(":")[0].strip() in keep]
    import torch

    return "\n".join([*lines, f"torch {torch.__version__}, python {platform.python_version()}",
                      f"load average at start: {tuple(round(x, 2) for x in os.getloadavg())}"])


def run(label: str, procs: int, extra: list[str], *, model: Path, data: dict, root: Path, steps: int) -> dict:
    out = root / f"run{procs}-{len(extra)}-{abs(hash(label)) % 1000}"
    overrides = [
        f"model.path={model}", f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
        f"trainer.default_local_dir={out}", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
        "actor.ppo_micro_batch_size_per_gpu=16", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "reward.num_workers=1", "actor.use_kl_loss=true",
        "actor.lr=1e-6", *extra,
    ]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(procs), "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no"] + (["--multi_gpu"] if procs > 1 else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([*launcher, str(REPO / "train_grpo.py"), "recipes/tiny_cpu.yaml", *overrides], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{label}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    later = rows[1:] or rows
    startup = [line for line in proc.stdout.splitlines() if "] actor:" in line or "] reference:" in line]
    return dict(label=label, procs=procs, peak_mb=max(r["memory/peak_mb"] for r in rows),
                actor_params_mb=rows[-1]["memory/actor_params_mb"],
                step_s=sum(r["timing_s/step"] for r in later) / len(later),
                push_s=sum(r["timing_s/push"] for r in later) / len(later),
                push_share=sum(r["timing_s/push"] / r["timing_s/step"] for r in later) / len(later), startup=startup)


def write_section(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    if MARK_BEGIN in old:
        old = old[:old.index(MARK_BEGIN)].rstrip() + "\n" + old[old.index(MARK_END) + len(MARK_END):].lstrip("\n")
    path.write_text(old.rstrip() + "\n\n" + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results_cpu.md"))
    args = parser.parse_args()
    from data_prep.synthetic import write_dataset
    from data_prep.tiny_model import make_tiny_model

    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model", hidden_size=args.hidden_size, num_layers=args.num_layers, warmup_steps=0, seed=0)
        import torch
        from transformers import AutoModelForCausalLM

        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).parameters())
        data = write_dataset(root / "data", train_size=64, test_size=8, seed=0)
        results = []
        for label, procs, extra in RUNS:
            results.append(run(label, procs, extra, model=model, data=data, root=root, steps=args.steps))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "startup"}), flush=True)
    lines = [
        MARK_BEGIN, "# FSDP2 benchmark (CPU)", "",
        f"Produced by `python bench/bench_fsdp.py` on {datetime.date.today().isoformat()}.", "", "```", info, "```", "",
        f"Random Qwen3 (tiny tokenizer, hidden {args.hidden_size}, {args.num_layers} layers, {n_params / 1e6:.1f}M parameters, "
        "float32 master weights and compute on CPU), `train_grpo.py` with the real vLLM engine, 8 prompts x 4 responses, "
        f"one update per step, KL loss (reference built), {args.steps} steps. Peak = largest process's VmHWM over the run "
        "(includes its vLLM engine: a full weight copy + 64 MiB KV cache). Step and push times: mean of steps 2-3.", "",
        "| run | peak MiB / process | actor params MiB / process | step s | push s | push / step |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['label']} | {r['peak_mb']:.0f} | {r['actor_params_mb']:.1f} | {r['step_s']:.2f} | {r['push_s']:.3f} | "
                     f"{100 * r['push_share']:.1f}% |")
    one, two = results[0], results[1]
    lines += ["", f"Sharding over 2 processes: peak per process {one['peak_mb']:.0f} -> {two['peak_mb']:.0f} MiB "
              f"({two['peak_mb'] - one['peak_mb']:+.0f} MiB), actor parameter shard {one['actor_params_mb']:.1f} -> "
              f"{two['actor_params_mb']:.1f} MiB. Push target <= 5% of the step: "
              f"{'met' if max(r['push_share'] for r in results) <= 0.05 else 'NOT met'} "
              f"(largest {100 * max(r['push_share'] for r in results):.1f}%). Reference offload on a CPU machine moves "
              "nothing (host = device), so on/off differ only by noise here.", "", "Start-up lines of the 2-process run:", "", "```",
              *results[1]["startup"], "```", MARK_END, ""]
    write_section(Path(args.out), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
