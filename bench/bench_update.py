"""Update-phase benchmark: tokens/s with padding-free packing on vs off, and peak memory vs batch size (issue 21's two
works against a minimal padded loop: bench/bench_works.py).

Not a test: `python bench/bench_update.py` prints a table and writes bench/results_cpu.md (machine from lscpu /
nproc, torch version, settings, numbers). About 2.5 minutes on 2 idle CPU cores with the defaults.

What it measures, on a random Qwen3-architecture model (hidden 512, 8 layers, vocab 32k, ~42M parameters, float32,
sdpa attention), with the Actor's own update path (`Actor.accumulate_gradients`: token-budgeted micro-batches,
chunked logprobs + entropy, PPO loss with the KL term, backward per micro-batch):

1. Throughput: real tokens (prompt + response, no pads) / second of forward + backward over one mini-batch whose
   lengths spread uniformly from 10% to 100% of the maximum, with `actor.use_dynamic_bsz` and a token budget of
   `--budget` (1024) tokens, in three modes: padded (`model.use_remove_padding` off: every micro-batch padded to
   its longest row), packed in one row (`token_logprobs(packed_row_tokens=None)`: a block-diagonal causal mask,
   dense T x T for sdpa), packed in rows of >= `--packed-row-tokens` (512, the library default) tokens. Timed
   alternately, best of `--repeats` after one warm-up each.
2. Peak memory: peak resident set (VmHWM of /proc/self/status, restarted just before the update through
   /proc/self/clear_refs) of a FRESH subprocess per configuration that loads the model, builds the batch and runs
   one update (micro-batches, then the AdamW step; the peak is read after each), with `data.train_batch_size` 1x
   and 4x at the same token budget. Why RSS in a fresh process: torch's CPU allocator keeps no peak statistics,
   tracemalloc does not see torch's allocations, and a process that already ran another configuration would carry
   that one's high-water mark. Why not `getrusage().ru_maxrss`: Linux carries the PARENT's high-water mark into a
   child's ru_maxrss across fork + exec (this script's first version reported the parent's 2.4 GiB for both sizes).
   RSS includes the Python runtime, weights and gradients (the same for both sizes), so the forward/backward
   increment over the RSS just before the update is reported too: it is what the token budget bounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import grpo_lib.model.actor as actor_module  # noqa: E402
from grpo_lib.config import load_config  # noqa: E402
from grpo_lib.core.types import RolloutBatch  # noqa: E402
from grpo_lib.model.actor import Actor  # noqa: E402
from grpo_lib.model.logprobs import num_packed_rows, token_logprobs  # noqa: E402
from grpo_lib.model.packing import pack_sequences  # noqa: E402
from grpo_lib.model.passes import micro_batches  # noqa: E402

GROUP_SIZE = 4  # rollout.n


def write_model(path: Path, *, hidden: int, layers: int, vocab: int, intermediate: int | None = None,
                max_positions: int = 4096) -> int:
    """Random Qwen3 (head_dim 64, GQA 2:1, MLP `intermediate` (default 3x hidden), tied embeddings) saved to `path`;
    returns its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0)
    model = Qwen3ForCausalLM(config).float()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_config(model_dir: Path, *, max_len: int, prompts: int, budget: int, remove_padding: bool):
    prompt_len = max(1, max_len // 10)
    return load_config(None, [
        f"model.path={model_dir}", "model.dtype=float32", f"model.use_remove_padding={str(remove_padding).lower()}",
        "data.train_files=[unused.parquet]", f"data.max_prompt_length={prompt_len}", f"data.max_response_length={max_len - prompt_len}",
        f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}", f"rollout.n={GROUP_SIZE}",
        "actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={budget}", "actor.use_kl_loss=true", "actor.lr=1e-6",
    ])


def make_batch(*, num_rows: int, max_len: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """num_rows trajectories whose lengths spread uniformly from 10% to 100% of max_len (shuffled), groups of 4
    sharing a prompt of max_len / 10 tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompt_len = max(1, max_len // 10)
    lengths = [round(max_len * (0.1 + 0.9 * i / max(num_rows - 1, 1))) for i in range(num_rows)]
    lengths = [max(prompt_len + 1, lengths[i]) for i in torch.randperm(num_rows, generator=generator).tolist()]
    input_ids = torch.zeros(num_rows, max_len, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(num_rows, max_len, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros(num_rows, max_len)  # [B, T]
    for i, length in enumerate(lengths):
        if i % GROUP_SIZE == 0:
            prompt = torch.randint(2, vocab, (prompt_len,), generator=generator)
        input_ids[i, :prompt_len] = prompt
        input_ids[i, prompt_len:length] = torch.randint(2, vocab, (length - prompt_len,), generator=generator)
        attention_mask[i, :length] = 1
        response_mask[i, prompt_len:length] = 1.0
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, loss_mask=response_mask,
        rollout_logprobs=torch.zeros(num_rows, max_len), group_ids=[f"p{i // GROUP_SIZE}" for i in range(num_rows)],
        response_texts=[""] * num_rows, data_sources=["bench"] * num_rows, ground_truths=[None] * num_rows,
        extra_infos=[{} for _ in range(num_rows)], truncated=torch.zeros(num_rows, dtype=torch.bool),
        advantages=torch.randn(num_rows, 1, generator=generator) * response_mask,
        ref_logprobs=-torch.rand(num_rows, max_len, generator=generator) * response_mask)


def rss_mib() -> float:
    """Current resident set of this process, MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """High-water mark of this process's resident set, MiB: VmHWM of /proc/self/status.

    Not `getrusage(...).ru_maxrss`: Linux carries the parent's high-water mark across fork + exec into the child's
    ru_maxrss, so a child started by a 2 GiB parent reports >= 2 GiB whatever it does (measured here). VmHWM belongs
    to the process's own address space, which exec replaces.
    """
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB


def reset_peak_rss() -> bool:
    """Restart VmHWM at the current resident set (grpo_lib.core.perf.reset_peak_memory on the CPU)."""
    from grpo_lib.core.perf import reset_peak_memory

    return reset_peak_memory(torch.device("cpu"))


def set_packed_row_tokens(packed_row_tokens: int | None) -> None:
    """Make the Actor's `token_logprobs` calls pack into rows of >= packed_row_tokens tokens (None: one row)."""
    actor_module.token_logprobs = functools.partial(token_logprobs, packed_row_tokens=packed_row_tokens)


def throughput(args, model_dir: Path) -> list[dict]:
    """Padded / packed in one row / packed in rows of >= args.packed_row_tokens, timed alternately (so a load
    change on a shared machine hits all three), best of args.repeats."""
    batch = make_batch(num_rows=args.rows, max_len=args.max_len, vocab=args.vocab)
    real_tokens = sum(batch.seq_lens)
    parts = micro_batches(batch.seq_lens, max_tokens=args.budget, micro_batch_size=None)
    cfgs = {rp: make_config(model_dir, max_len=args.max_len, prompts=args.rows // GROUP_SIZE, budget=args.budget, remove_padding=rp)
            for rp in (False, True)}
    modes = [dict(mode="padded", remove_padding=False, packed_row_tokens=None),
             dict(mode="packed, one row", remove_padding=True, packed_row_tokens=None),
             dict(mode=f"packed, rows of >= {args.packed_row_tokens} tokens", remove_padding=True, packed_row_tokens=args.packed_row_tokens)]
    for m in modes:  # what the forwards process: rows x row width, summed over micro-batches
        rows = widths = computed = 0
        for part in parts:
            mb = batch.select(part)
            if not m["remove_padding"]:
                shape = tuple(mb.input_ids[:, : max(mb.seq_lens)].shape)
            else:
                shape = tuple(pack_sequences(mb.input_ids, mb.attention_mask,
                                             num_rows=num_packed_rows(mb.attention_mask, m["packed_row_tokens"])).input_ids.shape)
            rows, widths, computed = rows + shape[0], widths + shape[1], computed + shape[0] * shape[1]
        m.update(forward_rows=rows, mean_row_width=widths / len(parts), computed_tokens=computed)
    actor = Actor(cfgs[True], device=torch.device("cpu"))
    actor.model.train()
    times: list[list[float]] = [[] for _ in modes]
    try:
        for m in modes:  # warm-up: the smallest micro-batch
            actor.cfg = cfgs[m["remove_padding"]]
            set_packed_row_tokens(m["packed_row_tokens"])
            actor.accumulate_gradients(batch.select(parts[-1]))
            actor.model.zero_grad(set_to_none=True)
        for repeat in range(args.repeats):
            for j, m in enumerate(modes):
                actor.cfg = cfgs[m["remove_padding"]]
                set_packed_row_tokens(m["packed_row_tokens"])
                start = time.perf_counter()
                actor.accumulate_gradients(batch)
                times[j].append(time.perf_counter() - start)
                actor.model.zero_grad(set_to_none=True)
                print(f"  repeat {repeat}: {m['mode']}: {times[j][-1]:.1f} s", flush=True)
    finally:
        actor_module.token_logprobs = token_logprobs
    for m, ts in zip(modes, times):
        m.update(micro_batches=len(parts), real_tokens=real_tokens, seconds=min(ts), all_seconds=ts, tokens_per_s=real_tokens / min(ts))
    return modes


def memory_child(args) -> None:
    """Run in a fresh process: load, build the batch, one update (the steps of `Actor.update` for one mini-batch,
    spelled out so the forward/backward peak is read before the AdamW step allocates its states); print JSON."""
    torch.set_num_threads(args.threads)
    set_packed_row_tokens(args.packed_row_tokens)
    cfg = make_config(Path(args.model_dir), max_len=args.max_len, prompts=args.rows // GROUP_SIZE, budget=args.budget, remove_padding=True)
    actor = Actor(cfg, device=torch.device("cpu"))
    actor.model.train()
    batch = make_batch(num_rows=args.rows, max_len=args.max_len, vocab=args.vocab)
    parts = micro_batches(batch.seq_lens, max_tokens=args.budget, micro_batch_size=None)
    largest = max(sum(batch.seq_lens[i] for i in part) for part in parts)
    reset = reset_peak_rss()  # the peak below is the update's, not the model load's
    before = rss_mib()
    start = time.perf_counter()
    actor.accumulate_gradients(batch)
    peak_forward_backward = peak_rss_mib()
    actor.optimizer.step()
    actor.optimizer.zero_grad(set_to_none=True)
    print(json.dumps(dict(rows=args.rows, real_tokens=sum(batch.seq_lens), micro_batches=len(parts), largest_micro_batch=largest,
                          peak_reset=reset, rss_before_update_mib=before,
                          peak_forward_backward_mib=peak_forward_backward, peak_rss_mib=peak_rss_mib(),
                          seconds=time.perf_counter() - start)))


def memory(args, model_dir: Path) -> list[dict]:
    out = []
    for scale in (1, 4):
        cmd = [sys.executable, __file__, "--child-memory", "--model-dir", str(model_dir), "--rows", str(args.mem_rows * scale),
               "--max-len", str(args.max_len), "--budget", str(args.budget), "--vocab", str(args.vocab), "--threads", str(args.threads),
               "--packed-row-tokens", str(args.packed_row_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory child failed:\n{proc.stderr[-4000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["scale"] = scale
        out.append(row)
        print(f"  train_batch_size x{scale} ({row['rows']} trajectories, {row['real_tokens']} tokens): peak RSS "
              f"{row['peak_rss_mib']:.0f} MiB (forward/backward {row['peak_forward_backward_mib']:.0f} MiB), before update "
              f"{row['rss_before_update_mib']:.0f} MiB ({row['seconds']:.0f} s)", flush=True)
    return out


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Architecture", "Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "L3 cache")
    lines = [line.strip() for line in lscpu.splitlines() if line.split(":")[0].strip() in keep]
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return "\n".join([*lines, f"ISA flags (lscpu): {' '.join(isa) or 'none of avx2/avx512f/avx512_bf16/amx'}", f"nproc: {nproc}", f"torch {torch.__version__} (threads {torch.get_num_threads()}), "
                      f"python {platform.python_version()}", f"load average at start: {os.getloadavg()}"])


def write_report(path: Path, args, n_params: int, thr: list[dict], mem: list[dict], info: str) -> str:
    padded, one_row, multi_row = thr
    speedup_one, speedup_multi = (m["tokens_per_s"] / padded["tokens_per_s"] for m in (one_row, multi_row))
    m1, m4 = mem
    inc1 = m1["peak_forward_backward_mib"] - m1["rss_before_update_mib"]
    inc4 = m4["peak_forward_backward_mib"] - m4["rss_before_update_mib"]
    # Matmul FLOPs per token: body 6 x its parameters (forward + backward) on computed tokens; output head 4 passes
    # (forward, checkpoint recompute, two backward) x 2 x vocab x hidden on real tokens only, in every mode.
    body_flops, head_flops = 6 * (n_params - args.vocab * args.hidden), 8 * args.vocab * args.hidden
    bound = ((padded["computed_tokens"] * body_flops + padded["real_tokens"] * head_flops)
             / (padded["real_tokens"] * (body_flops + head_flops)))
    default_note = " (the default of `token_logprobs`)" if args.packed_row_tokens == token_logprobs.__kwdefaults__["packed_row_tokens"] else ""
    table = "\n".join([
        "| mode | micro-batches | forward rows | mean row width | real tokens | computed tokens | seconds (best) | all runs, s | real tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['mode']} | {r['micro_batches']} | {r['forward_rows']} | {r['mean_row_width']:.0f} | {r['real_tokens']} | "
          f"{r['computed_tokens']} | {r['seconds']:.1f} | {', '.join(f'{t:.1f}' for t in r['all_seconds'])} | {r['tokens_per_s']:.0f} |"
          for r in thr],
        "",
        f"**Packing speed-up: {speedup_multi:.2f}x** with rows of >= {args.packed_row_tokens} tokens{default_note}, "
        f"{speedup_one:.2f}x with one packed row per micro-batch (target >= 1.5x). Matmul-FLOP bound on "
        f"any packing speed-up at these settings (attention excluded, tied head {head_flops / (body_flops + head_flops):.0%} "
        f"of a real token's matmul FLOPs): {bound:.2f}x.",
        "",
        "| train_batch_size | trajectories | real tokens | micro-batches | largest micro-batch, tokens | RSS before update MiB | "
        "peak RSS, forward/backward MiB | forward/backward increment MiB | peak RSS, with AdamW step MiB | update s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[f"| x{m['scale']} | {m['rows']} | {m['real_tokens']} | {m['micro_batches']} | {m['largest_micro_batch']} | "
          f"{m['rss_before_update_mib']:.0f} | {m['peak_forward_backward_mib']:.0f} | "
          f"{m['peak_forward_backward_mib'] - m['rss_before_update_mib']:.0f} | {m['peak_rss_mib']:.0f} | {m['seconds']:.0f} |" for m in mem],
        "",
        f"**Peak RSS ratio x4 / x1: {m4['peak_rss_mib'] / m1['peak_rss_mib']:.3f}** (target <= 1.15); forward/backward peak "
        f"ratio {m4['peak_forward_backward_mib'] / m1['peak_forward_backward_mib']:.3f}, increment ratio {inc4 / max(inc1, 1e-9):.2f}.",
    ])
    text = f"""# Update-phase benchmark (CPU)

Produced by `python bench/bench_update.py` ({' '.join(sys.argv[1:]) or 'defaults'}).

## Machine

```
{info}
```

## Settings

Random Qwen3-architecture model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {n_params / 1e6:.1f}M parameters,
float32, sdpa. Lengths (prompt + response) spread uniformly from 10% to 100% of {args.max_len} tokens, prompt
{max(1, args.max_len // 10)} tokens, groups of {GROUP_SIZE}. `actor.use_dynamic_bsz` with
`ppo_max_token_len_per_gpu={args.budget}`; KL loss on, entropy computed. Throughput: {args.rows} trajectories, one
mini-batch, forward + backward (`Actor.accumulate_gradients`) padded, packed in one row and packed in rows of
>= {args.packed_row_tokens} tokens, timed alternately, best of {args.repeats} after a warm-up. Memory: fresh process per row, one
update (`accumulate_gradients`, peak read, then the AdamW step), packed in rows of >= {args.packed_row_tokens} tokens,
{args.mem_rows} vs {4 * args.mem_rows} trajectories; peak RSS = VmHWM (restarted before the update).

## Results

{table}

"Computed tokens" = sum over micro-batches of forward rows x row width: rows x longest row when padded, k packed
rows x the longest packed row when packed (each packed row is right-padded by a pad segment). The machine is shared
with other jobs: timings are indicative (load average at start above, at the end: {os.getloadavg()}).

## Reading the numbers

The speed-up of packing is bounded by computed / real tokens of the padded mode (a token-balanced partition mixes
long and short rows in every micro-batch, so each is padded to a long row; with only 2-4 rows per micro-batch the
longest row of each is below the global maximum, hence ~1.6x, not 1.8x), and further by what does not shrink:

- the output head, log-softmax and entropy run over real tokens only in every mode (the chunked head of
  `grpo_lib.model.logprobs`). With a 32k vocabulary on a 512-wide model the head is ~47% of a real token's matmul
  FLOPs, which caps the speed-up at the "matmul-FLOP bound" above (~1.3x at the defaults) whatever the packing
  layout; a real 7-8B model spends well under 10% there;
- attention: sdpa (CPU, and GPU without a varlen kernel) computes the packed row's block-diagonal causal mask as a
  dense [row, row] problem. One packed row of T tokens costs T^2; k rows of ~T/k cost ~T^2/k (`token_logprobs`
  packs into k = ceil(tokens / max(packed_row_tokens, longest sequence)) rows, balanced by
  `batching.partition_balanced`). At the defaults a micro-batch holds 2-4 sequences (~900 tokens, longest up to
  512), so it becomes 2 rows of ~470: a torch.profiler run of one micro-batch (not part of this script) put sdpa
  at 13% of the one-row step and 8% of the two-row step, a ~5% gain, within the run-to-run noise here. Where
  micro-batches hold many sequences it is large: `--rows 32 --budget 4096` (~14 sequences, ~4k tokens per
  micro-batch, 2 repeats) measured padded 37.9 s, one row 31.9 s (1.19x), rows of >= 512 tokens 22.8 s (1.66x).
  A varlen kernel (flash_attention_2) computes only the per-sequence blocks and is indifferent to k.

Peak memory: the forward/backward peak follows the largest micro-batch (bounded by the token budget; its token
count is listed), not the batch size. A 4x batch fills its micro-batches closer to the budget, which accounts for
most of the difference between the two rows. A large part of the increment is the output head's float32 [chunk, vocab] blocks
(`token_logprobs(chunk_size=1024)`: 128 MiB each at vocab 32k, several alive while the backward recomputes a
chunk). The AdamW states (2 x parameters, allocated at the first step) stay below the forward/backward peak here.
Packing in rows of >= 512 tokens peaked 90-100 MiB above one packed row in this x1 update (fresh processes, 2
repeats; 30-50 MiB with MALLOC_MMAP_THRESHOLD_=1048576, and one micro-batch alone peaks 16 MiB lower): heap
reuse across differently shaped micro-batches plus the pad segments' ~7% extra tokens through the body.
"""
    path.write_text(text)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--max-len", type=int, default=512, help="longest trajectory, tokens")
    parser.add_argument("--rows", type=int, default=16, help="trajectories in the throughput mini-batch")
    parser.add_argument("--mem-rows", type=int, default=16, help="trajectories of the x1 memory run (x4: 4 times as many)")
    parser.add_argument("--budget", type=int, default=1024, help="ppo_max_token_len_per_gpu, tokens")
    parser.add_argument("--packed-row-tokens", type=int, default=512,
                        help="token_logprobs(packed_row_tokens=...) of the multi-row packed mode and the memory runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=str(REPO / "bench" / "results_cpu.md"))
    parser.add_argument("--throughput-only", action="store_true", help="skip the memory runs and the report file")
    parser.add_argument("--child-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        memory_child(args)
        return
    torch.set_num_threads(args.threads)
    info = machine()
    print(info, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        n_params = write_model(model_dir, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        print(f"model: {n_params / 1e6:.1f}M parameters; throughput ({args.rows} trajectories, budget {args.budget}):", flush=True)
        thr = throughput(args, model_dir)
        if args.throughput_only:
            print(f"packing speed-up: one row {thr[1]['tokens_per_s'] / thr[0]['tokens_per_s']:.2f}x, "
                  f"rows of >= {args.packed_row_tokens} tokens {thr[2]['tokens_per_s'] / thr[0]['tokens_per_s']:.2f}x")
            return
        print(f"memory (fresh process each, {args.mem_rows} vs {4 * args.mem_rows} trajectories):", flush=True)
        mem = memory(args, model_dir)
    print(write_report(Path(args.out), args, n_params, thr, mem, info))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
