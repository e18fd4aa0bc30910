"""LoRA vs full fine-tuning: peak memory of one update step on the mid-size model.

Not a test: `python bench/bench_lora.py` prints a table and writes (or replaces) the section
bench/results_lora_cpu.md. About 2 minutes on 2 idle CPU cores.

What it measures: the random Qwen3-architecture model of bench/bench_update.py (hidden 512, 8 layers, vocab 32k,
~42M parameters, float32), one mini-batch of 16 trajectories (lengths 10-100% of 512 tokens, packed, token budget
1024, KL loss on), two updates with the Actor's own path (`accumulate_gradients`, then the AdamW step) in a FRESH
process per mode (so no high-water mark carries over): full fine-tuning, and LoRA (all-linear, rank 64 by default).
The first update is a warm-up (it allocates the AdamW state, which then lives for the whole run); the second is
measured: the RSS before it (weights + AdamW state), its peak (VmHWM restarted just before it), and the bytes of trainable parameters, their gradients
and the AdamW state (exact, from the tensors). With LoRA the KL reference costs no extra memory (the adapters
are disabled on the actor's own model); with full fine-tuning a second float32 copy of the model would be loaded
for it, which this measurement leaves out (it is the same model size again).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from bench_update import GROUP_SIZE, machine, make_batch, peak_rss_mib, reset_peak_rss, rss_mib, write_model  # noqa: E402
from grpo_lib.config import load_config  # noqa: E402
from grpo_lib.model.actor import Actor  # noqa: E402

MIB = 2**20
SECTION = "# LoRA vs full fine-tuning (CPU)"


def tensor_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def child(args) -> None:
    """One fresh process: load the actor (LoRA rank args.rank, 0 = full), one update; print JSON."""
    torch.set_num_threads(args.threads)
    prompt_len = max(1, args.max_len // 10)  # as bench_update.make_config
    overrides = [f"model.path={args.model_dir}", "model.dtype=float32", "model.use_remove_padding=true",
                 "data.train_files=[unused.parquet]", f"data.max_prompt_length={prompt_len}",
                 f"data.max_response_length={args.max_len - prompt_len}", f"data.train_batch_size={args.rows // GROUP_SIZE}",
                 f"actor.ppo_mini_batch_size={args.rows // GROUP_SIZE}", f"rollout.n={GROUP_SIZE}", "actor.use_dynamic_bsz=true",
                 f"actor.ppo_max_token_len_per_gpu={args.budget}", "actor.use_kl_loss=true", "actor.lr=1e-6",
                 f"model.lora_rank={args.rank}", f"model.lora_alpha={2 * max(args.rank, 1)}"]
    cfg = load_config(None, overrides)
    actor = Actor(cfg, device=torch.device("cpu"))
    actor.model.train()
    batch = make_batch(num_rows=args.rows, max_len=args.max_len, vocab=args.vocab)
    trainable = [p for p in actor.model.parameters() if p.requires_grad]
    actor.accumulate_gradients(batch)  # warm-up update: AdamW allocates its state, as after step 1 of a run
    actor.optimizer.step()
    actor.optimizer.zero_grad(set_to_none=True)
    before = rss_mib()
    reset_peak_rss()  # the peak below is the second (steady-state) update's
    start = time.perf_counter()
    actor.accumulate_gradients(batch)
    grads_mib = tensor_mib(p.grad for p in trainable if p.grad is not None)
    actor.optimizer.step()
    actor.optimizer.zero_grad(set_to_none=True)
    adam_mib = tensor_mib(v for s in actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    print(json.dumps(dict(rank=args.rank, params_mib=tensor_mib(actor.model.parameters()), trainable_params=sum(p.numel() for p in trainable),
                          trainable_mib=tensor_mib(trainable), grads_mib=grads_mib, adam_mib=adam_mib, rss_before_update_mib=before,
                          peak_update_mib=peak_rss_mib(), seconds=time.perf_counter() - start)))


def run_child(args, model_dir: Path, rank: int) -> dict:
    """Run `child` for one mode in a fresh process (no high-water mark carried over); its JSON result."""
    cmd = [sys.executable, __file__, "--child", "--model-dir", str(model_dir), "--rank", str(rank), "--rows", str(args.rows),
           "--max-len", str(args.max_len), "--budget", str(args.budget), "--vocab", str(args.vocab), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child (rank {rank}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_section(path: Path, text: str) -> None:
    """Replace (or append) this benchmark's section of its results file."""
    old = path.read_text() if path.is_file() else ""
    head = old.split(SECTION)[0].rstrip() if SECTION in old else old.rstrip()
    path.write_text((head + "\n\n" if head else "") + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--ranks", default="0,64", help="LoRA ranks to measure (0: full fine-tuning)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench" / "results_lora_cpu.md"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        n_params = write_model(model_dir, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        rows = []
        for rank in (int(r) for r in args.ranks.split(",")):
            row = run_child(args, model_dir, rank)
            rows.append(row)
            print(f"  {'full' if rank == 0 else f'LoRA r={rank}'}: update peak {row['peak_update_mib']:.0f} MiB, before "
                  f"{row['rss_before_update_mib']:.0f} MiB, grads {row['grads_mib']:.1f} MiB, AdamW {row['adam_mib']:.1f} MiB", flush=True)
    full = rows[0]
    lines = [SECTION, "", f"Produced by `python bench/bench_lora.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC:", "", "```", info, "```", "",
             f"Model: the random Qwen3 of bench_update.py ({n_params / 1e6:.1f}M parameters, float32, tied embeddings). One update of "
             f"{args.rows} trajectories (<= {args.max_len} tokens, packed, budget {args.budget} tokens, KL loss on), fresh process per "
             "mode, LoRA on all-linear (alpha = 2 x rank). A warm-up update first (AdamW allocates its state, as after step 1 of "
             "a run), then the measured update: peak = VmHWM restarted just before it (forward/backward and the AdamW step; "
             "the RSS before it holds the weights and the AdamW state).", "",
             "| mode | trainable params | trainable MiB | grads MiB | AdamW state MiB | RSS before update MiB | update peak RSS MiB | "
             "update peak - before MiB | update s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "full fine-tuning" if r["rank"] == 0 else f"LoRA r={r['rank']}"
        lines.append(f"| {name} | {r['trainable_params']:,} | {r['trainable_mib']:.1f} | {r['grads_mib']:.1f} | {r['adam_mib']:.1f} | "
                     f"{r['rss_before_update_mib']:.0f} | {r['peak_update_mib']:.0f} | {r['peak_update_mib'] - r['rss_before_update_mib']:.0f} | "
                     f"{r['seconds']:.1f} |")
    for r in rows[1:]:
        lines.append("")
        lines.append(f"**LoRA r={r['rank']}: update peak {r['peak_update_mib']:.0f} MiB vs {full['peak_update_mib']:.0f} MiB full "
                     f"({r['peak_update_mib'] / full['peak_update_mib']:.2f}x); gradients + AdamW state "
                     f"{r['grads_mib'] + r['adam_mib']:.1f} MiB vs {full['grads_mib'] + full['adam_mib']:.1f} MiB.**")
    lines += ["", "Full fine-tuning with a KL term also loads the reference (another float32 copy of the model, "
              f"{full['params_mib']:.0f} MiB here); LoRA reuses the actor with adapters disabled. The forward/backward "
              "activations are not smaller with LoRA (the frozen layers still keep their inputs for the backward to earlier "
              "adapters, and each adapter adds its own small ones), so the saving is the gradients and the AdamW state of "
              "the base weights (12 bytes per base parameter in float32): it grows with the model, the activations with "
              "the tokens per micro-batch.", ""]
    text = "\n".join(lines)
    write_section(Path(args.out), text)
    print(text)


if __name__ == "__main__":
    main()
