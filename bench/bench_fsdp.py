"""FSDP2 benchmark: peak memory per process with 1 and 2 processes, reference offload on/off, push share of a step;
and (`--collectives`) the bytes of the update's all-gathers and reduce-scatters per mini-batch under each
actor.fsdp_config choice.

`python bench/bench_fsdp.py --collectives` (about 2 minutes on 2 busy cores): 2 gloo processes
(`torch.distributed.run`, this file as the worker) build the Actor of a random Qwen3 shaped like Qwen3-4B scaled down
(hidden 256, 12 layers, vocab 4096: the root unit ~10% of the parameters, a layer ~7%) and accumulate one mini-batch
of the seed recipe's shape scaled down (every sequence at the 128-token cap, a 190-token budget as 3000 is to 2048: one
sequence per micro-batch, 16 micro-batches per process), once per choice; they write the bytes counted by
`fsdp.count_collectives` (the metric perf/collective_mb_per_update), the gradient's largest difference from today's
schedule's, and the time per mini-batch, into the "FSDP2 collectives" section of bench/results_cpu.md.

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


COLLECTIVES_BEGIN, COLLECTIVES_END = "<!-- bench_fsdp collectives begin -->", "<!-- bench_fsdp collectives end -->"
COLLECTIVE_CHOICES = [  # (label, actor.fsdp_config overrides)
    ("today's schedule (per micro-batch)", ["actor.fsdp_config.keep_root_gathered=false"]),
    ("keep_root_gathered (the default)", []),
    ("+ defer_grad_reduce=root", ["actor.fsdp_config.defer_grad_reduce=root"]),
    ("+ defer_grad_reduce=all", ["actor.fsdp_config.defer_grad_reduce=all"]),
    ("+ reshard_after_forward=false", ["actor.fsdp_config.reshard_after_forward=false"]),
    ("+ both (defer all, no reshard after forward)", ["actor.fsdp_config.defer_grad_reduce=all",
                                                      "actor.fsdp_config.reshard_after_forward=false"]),
]
SEQ_PROMPT, SEQ_RESPONSE, TOKEN_BUDGET, TRAJECTORIES_PER_PROCESS = 64, 64, 190, 16


def collectives_config(model_dir: Path, extra: list[str]):
    from grpo_lib.config import load_config

    overrides = [f"model.path={model_dir}", "model.dtype=float32", "data.train_files=[unused.parquet]",
                 f"data.max_prompt_length={SEQ_PROMPT}", f"data.max_response_length={SEQ_RESPONSE}",
                 f"data.train_batch_size={2 * TRAJECTORIES_PER_PROCESS // 4}", f"actor.ppo_mini_batch_size={2 * TRAJECTORIES_PER_PROCESS // 4}",
                 "rollout.n=4", "actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}",
                 "actor.use_kl_loss=false", "actor.entropy_coeff=0", *extra]
    return load_config(None, overrides, world_size=2)


def collectives_batch(vocab: int, rank: int):
    """This process's share of one mini-batch: every trajectory at the length cap, random tokens and advantages."""
    import torch

    from grpo_lib.core.types import RolloutBatch

    g = torch.Generator().manual_seed(rank)
    rows, width = TRAJECTORIES_PER_PROCESS, SEQ_PROMPT + SEQ_RESPONSE
    response = torch.zeros(rows, width)
    response[:, SEQ_PROMPT:] = 1.0
    return RolloutBatch(
        input_ids=torch.randint(2, vocab, (rows, width), generator=g), attention_mask=torch.ones(rows, width, dtype=torch.long),
        response_mask=response, loss_mask=response.clone(), rollout_logprobs=-torch.rand(rows, width, generator=g) * response,
        group_ids=[f"r{rank}g{i // 4}" for i in range(rows)], response_texts=[""] * rows, data_sources=["bench"] * rows,
        ground_truths=[None] * rows, extra_infos=[{} for _ in range(rows)], truncated=torch.zeros(rows, dtype=torch.bool),
        scores=torch.zeros(rows), advantages=torch.randn(rows, 1, generator=g) * response)


def collectives_worker(model_dir: str, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    from grpo_lib.core.distributed import init_distributed
    from grpo_lib.model import fsdp
    from grpo_lib.model.actor import Actor

    init_distributed()
    rank = dist.get_rank()
    actor = Actor(collectives_config(Path(model_dir), []), device=torch.device("cpu"))
    batch = collectives_batch(actor.model.config.vocab_size, rank)
    results, today = [], None
    for label, extra in COLLECTIVE_CHOICES:
        actor.cfg = collectives_config(Path(model_dir), extra)
        actor.model.zero_grad(set_to_none=True)
        actor.collective_bytes.update(all_gather=0, reduce_scatter=0)
        start = time.perf_counter()
        actor.accumulate_gradients(batch)
        seconds = time.perf_counter() - start
        counted = dict(actor.collective_bytes)
        grads = {n: fsdp.full_tensor(p.grad).clone() for n, p in actor.model.named_parameters()}
        today = today or grads
        diff = max(float(((grads[n] - today[n]).abs().max() / today[n].abs().max().clamp(min=1e-30))) for n in grads)
        results.append(dict(label=label, all_gather=counted["all_gather"], reduce_scatter=counted["reduce_scatter"],
                            seconds=seconds, grad_rel_diff=diff))
    if rank == 0:
        Path(out).write_text(json.dumps(dict(results=results, params=sum(p.numel() for p in actor.model.parameters()))))
    dist.barrier()
    dist.destroy_process_group()


def collectives_main(out_md: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, result = Path(tmp) / "model", Path(tmp) / "result.json"
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True,
                             bos_token_id=None, eos_token_id=1, pad_token_id=0)
        Qwen3ForCausalLM(config).float().save_pretrained(model_dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(Path(__file__).resolve()),
               "--collectives-worker", str(model_dir), str(result)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"collectives worker: exit {proc.returncode}\n{proc.stderr[-4000:]}")
        data = json.loads(result.read_text())
    rows, base = data["results"], data["results"][0]
    base_bytes = base["all_gather"] + base["reduce_scatter"]
    lines = [COLLECTIVES_BEGIN, "# FSDP2 collectives per mini-batch (CPU, 2 gloo processes)", "",
             f"Produced by `python bench/bench_fsdp.py --collectives` on {datetime.date.today().isoformat()} (the machine "
             "was shared with other jobs: times are indicative only; bytes are exact counts).", "", "```", info, "```", "",
             f"Random Qwen3 shaped like Qwen3-4B scaled down ({data['params'] / 1e6:.1f}M parameters: hidden 256, 12 layers, "
             "vocab 4096, tied; the root unit ~10%), float32 (param_dtype = reduce_dtype on CPU). One mini-batch of "
             f"{TRAJECTORIES_PER_PROCESS} trajectories per process, each at the {SEQ_PROMPT + SEQ_RESPONSE}-token cap, budget "
             f"{TOKEN_BUDGET} tokens (the seed's 3000 / 2048, scaled): one trajectory per micro-batch, "
             f"{TRAJECTORIES_PER_PROCESS} micro-batches. Bytes: every all-gather's gathered buffer and every reduce-scatter's "
             "unsharded input on process 0 (`fsdp.count_collectives`, the metric perf/collective_mb_per_update). Gradient: "
             "largest |difference| from today's schedule's, relative to each tensor's largest entry.", "",
             "| actor.fsdp_config | all-gather MiB | reduce-scatter MiB | total MiB | today / this | gradient diff | s / mini-batch |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["all_gather"] + r["reduce_scatter"]
        lines.append(f"| {r['label']} | {r['all_gather'] / 2**20:.1f} | {r['reduce_scatter'] / 2**20:.1f} | {total / 2**20:.1f} | "
                     f"{base_bytes / total:.2f}x | {r['grad_rel_diff']:.1e} | {r['seconds']:.2f} |")
    best = max(rows, key=lambda r: base_bytes / (r["all_gather"] + r["reduce_scatter"]))
    ratio = base_bytes / (best["all_gather"] + best["reduce_scatter"])
    lines += ["", f"Target (issue 21): at least 2x fewer collective bytes per mini-batch at the same result: "
              f"{'met' if ratio >= 2 else 'NOT met'} by {best['label']!r} ({ratio:.2f}x, gradient within "
              f"{best['grad_rel_diff']:.1e} of today's: float32 summation order). On a GPU the gathers move bf16 "
              "(half these all-gather bytes) and the reduce-scatters float32: `--print-plan` shows the real model's numbers.",
              COLLECTIVES_END, ""]
    text = "\n".join(lines)
    old = out_md.read_text() if out_md.exists() else ""
    if COLLECTIVES_BEGIN in old:
        old = old[:old.index(COLLECTIVES_BEGIN)].rstrip() + "\n" + old[old.index(COLLECTIVES_END) + len(COLLECTIVES_END):].lstrip("\n")
    out_md.write_text(old.rstrip() + "\n\n" + text)
    print(text)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--collectives-worker":
        collectives_worker(*sys.argv[2:4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--collectives", action="store_true", help="the collective-bytes table only (2 gloo processes)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results_cpu.md"))
    args = parser.parse_args()
    if args.collectives:
        collectives_main(Path(args.out))
        return
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
