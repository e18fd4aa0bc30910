"""Issue 21's two works, whole updates: our update against a minimal padded loop doing TRL's work (full logits at every
position, entropy with grad, one AdamW step), alternated in one process; written to bench/results_update_works_cpu.md.

Not a test: `python bench/bench_works.py --works no_spread,long_tail --threads 1` (one thread on a shared machine: CPU
seconds then count the work, not the spinning of oversubscribed threads). The shape is bench_step.py's: its random
3.4M-parameter Qwen3 (`write_step_model`), 16 prompts x 8 (a group shares its prompt), micro-batches of 32 rows;
`no_spread` puts every response at 128 tokens, `long_tail` draws lognormal lengths under a 512 cap (`work_lengths`,
which bench_step.py's forced lengths also use). Modes per work: the minimal padded loop (`MinimalLoop`), ours padded,
ours with packing on (auto), and on the long tail ours packed on transformers' dense block mask.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_update import machine, write_model  # noqa: E402
from grpo_lib.config import load_config  # noqa: E402
from grpo_lib.core.types import RolloutBatch  # noqa: E402
from grpo_lib.model.actor import Actor  # noqa: E402

WORK_PROMPTS, WORK_GROUP, WORK_MICRO_BATCH = 16, 8, 32  # bench_step's shape: 16 prompts x 8, micro-batches of 32 rows


def write_step_model(path: Path) -> int:
    """bench_step.py's random Qwen3 (hidden 256, 4 layers, 4 heads of 64, 2 kv heads, MLP 688, vocab 2000, tied): 3.4M."""
    return write_model(path, hidden=256, layers=4, vocab=2000, intermediate=688, max_positions=2048)


def work_lengths(work: str, n: int, *, seed: int = 0) -> list[int]:
    """Response lengths of a work: no_spread: all 128 (every response at the cap); long_tail: lognormal (median 50,
    sigma 1.0), cut to [8, 480] under a 512 cap: mean ~83, p90 ~200, max ~480, as issue 21's measured run."""
    if work == "no_spread":
        return [128] * n
    generator = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.log(torch.tensor(50.0)) + torch.randn(n, generator=generator))  # [n]
    return [int(x) for x in raw.clamp(8, 480).round().tolist()]


def make_work_batch(work: str, *, vocab: int = 2000, seed: int = 0) -> RolloutBatch:
    """16 prompts (12-31 tokens, shared by a group) x 8 responses of `work_lengths`, right-padded, random advantages."""
    n = WORK_PROMPTS * WORK_GROUP
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(12, 32, (WORK_PROMPTS,), generator=generator).tolist()
    lengths = work_lengths(work, n, seed=seed)
    width = max(prompt_lens) + max(lengths)
    input_ids = torch.zeros(n, width, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(n, width, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros(n, width)  # [B, T]
    prompts = [torch.randint(2, vocab, (p,), generator=generator) for p in prompt_lens]  # a group shares its prompt
    for i, length in enumerate(lengths):
        p = prompt_lens[i // WORK_GROUP]
        input_ids[i, :p] = prompts[i // WORK_GROUP]
        input_ids[i, p : p + length] = torch.randint(2, vocab, (length,), generator=generator)
        attention_mask[i, : p + length] = 1
        response_mask[i, p : p + length] = 1.0
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, loss_mask=response_mask,
        rollout_logprobs=torch.zeros(n, width), group_ids=[f"p{i // WORK_GROUP}" for i in range(n)],
        response_texts=[""] * n, data_sources=["bench"] * n, ground_truths=[None] * n, extra_infos=[{} for _ in range(n)],
        truncated=torch.zeros(n, dtype=torch.bool), advantages=torch.randn(n, 1, generator=generator) * response_mask)


def make_work_config(model_dir: Path, *, work: str, remove_padding: bool):
    return load_config(None, [
        f"model.path={model_dir}", "model.dtype=float32", f"model.use_remove_padding={str(remove_padding).lower()}",
        "data.train_files=[unused.parquet]", "data.max_prompt_length=32",
        f"data.max_response_length={128 if work == 'no_spread' else 512}", f"data.train_batch_size={WORK_PROMPTS}",
        f"actor.ppo_mini_batch_size={WORK_PROMPTS}", f"rollout.n={WORK_GROUP}",
        f"actor.ppo_micro_batch_size_per_gpu={WORK_MICRO_BATCH}", "actor.use_kl_loss=false", "actor.lr=1e-5",
    ])


class MinimalLoop:
    """What a trainer that just pads does (TRL's GRPOTrainer update, reduced to its work): per micro-batch of 32 rows
    padded to its longest, an HF forward with the padding mask and FULL logits, float32 log-softmax at every position,
    the entropy of every position with grad on (TRL computes it with the loss), the policy-gradient loss over the
    response tokens, backward; then grad-norm clipping and one AdamW step."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.config.use_cache = False
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def update(self, batch: RolloutBatch) -> float:
        num_tokens = batch.loss_mask.sum()
        entropy_sum = 0.0
        for lo in range(0, len(batch), WORK_MICRO_BATCH):
            mb = batch.select(list(range(lo, min(lo + WORK_MICRO_BATCH, len(batch)))))  # trimmed to its longest row
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # [b, T, V]
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [b, T-1, V]
            lp = logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)  # [b, T-1]
            entropy = -(logp.exp() * logp).sum(-1)  # [b, T-1], with grad
            mask = mb.loss_mask[:, 1:]  # [b, T-1]
            loss = -(lp * mb.advantages[:, 1:] * mask).sum() / num_tokens
            loss.backward()
            entropy_sum += float((entropy.detach() * mask).sum())  # the metric read (the graph was built: TRL's cost)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return entropy_sum / float(num_tokens)


def computed_tokens(batch: RolloutBatch, *, packed: bool) -> int:
    """Tokens the forwards run over with micro-batches of WORK_MICRO_BATCH rows: rows x longest per micro-batch
    (padded) or the real tokens (packed into one row for a varlen implementation)."""
    total = 0
    for lo in range(0, len(batch), WORK_MICRO_BATCH):
        lens = batch.seq_lens[lo : lo + WORK_MICRO_BATCH]
        total += sum(lens) if packed else len(lens) * max(lens)
    return total


def works(args, model_dir: Path) -> list[dict]:
    """Per work: the minimal padded loop, ours padded, ours with packing on (auto: packs where it pays, grpo_varlen),
    and on the long tail ours packed with transformers' dense block mask (sdpa), each a whole update (micro-batches
    + AdamW), alternated in one process, repeated; wall and CPU seconds."""
    rows = []
    minimal = MinimalLoop(model_dir)
    for work in args.works.split(","):
        batch = make_work_batch(work)
        lengths = sorted(batch.response_lengths.tolist())
        cfgs = {rp: make_work_config(model_dir, work=work, remove_padding=rp) for rp in (False, True)}
        actor = Actor(cfgs[True], device=torch.device("cpu"))
        varlen_impl = actor.model.config._attn_implementation
        modes = [("minimal padded loop", None, None), ("ours, padded", False, varlen_impl),
                 ("ours, packing on (auto)", True, varlen_impl)]
        if work != "no_spread":
            modes.append(("ours, packed, dense block mask (sdpa)", True, "sdpa"))
        metrics: dict[str, dict] = {}

        def run(mode, actor=actor):  # this work's actor (deleted at the end of the work)
            name, rp, impl = mode
            if rp is None:
                return minimal.update(batch)
            actor.cfg = cfgs[rp]
            actor.model.set_attn_implementation(impl)
            metrics[name] = actor.update(batch)

        for mode in modes:  # warm-up
            run(mode)
        wall: dict[str, list[float]] = {m[0]: [] for m in modes}
        cpu: dict[str, list[float]] = {m[0]: [] for m in modes}
        for repeat in range(args.repeats):
            for mode in modes:
                c0, t0 = time.process_time(), time.perf_counter()
                run(mode)
                wall[mode[0]].append(time.perf_counter() - t0)
                cpu[mode[0]].append(time.process_time() - c0)
                print(f"  {work} repeat {repeat}: {mode[0]}: {wall[mode[0]][-1]:.2f} s (CPU {cpu[mode[0]][-1]:.2f} s)", flush=True)
        actor.model.set_attn_implementation(varlen_impl)
        for name, rp, impl in modes:
            m = metrics.get(name, {})
            rows.append(dict(work=work, mode=name, wall=wall[name], cpu=cpu[name], real_tokens=sum(batch.seq_lens),
                             computed_tokens=computed_tokens(batch, packed=bool(m.get("perf/packed"))) if rp is not None
                             else computed_tokens(batch, packed=False),
                             packed=m.get("perf/packed"), real_token_fraction=m.get("perf/real_token_fraction"),
                             lengths=dict(mean=sum(lengths) / len(lengths), p90=lengths[int(0.9 * len(lengths))], max=lengths[-1])))
        del actor
    return rows


def write_works_report(path: Path, args, rows: list[dict], info: str, started: str) -> str:
    def med(xs):
        s = sorted(xs)
        return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])

    lines = ["| work | mode | update s, median (best) | CPU s, median | vs minimal (median wall / CPU) | computed / real tokens | perf/packed | all wall s |",
             "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for work in dict.fromkeys(r["work"] for r in rows):
        wrows = [r for r in rows if r["work"] == work]
        base = next(r for r in wrows if r["mode"].startswith("minimal"))
        for r in wrows:
            ratio_wall, ratio_cpu = med(r["wall"]) / med(base["wall"]), med(r["cpu"]) / med(base["cpu"])
            r["ratio_wall"], r["ratio_cpu"] = ratio_wall, ratio_cpu
            packed = "" if r["packed"] is None else f"{r['packed']:.2f}"
            lines.append(f"| {work} | {r['mode']} | {med(r['wall']):.2f} ({min(r['wall']):.2f}) | {med(r['cpu']):.2f} | "
                         f"{ratio_wall:.2f}x / {ratio_cpu:.2f}x | {r['computed_tokens'] / r['real_tokens']:.2f} | {packed} | "
                         f"{', '.join(f'{t:.2f}' for t in r['wall'])} |")
        auto = next(r for r in wrows if r["mode"].startswith("ours, packing on"))
        target = 0.85 if work == "no_spread" else None
        if target is not None:
            verdicts.append(f"- {work}: ours (packing on) / minimal = {auto['ratio_wall']:.2f}x wall, {auto['ratio_cpu']:.2f}x CPU; "
                            f"target <= {target}x: **{'met' if max(auto['ratio_wall'], auto['ratio_cpu']) <= target else 'not met'}**.")
        else:
            verdicts.append(f"- {work}: ours (packing on) / minimal = {auto['ratio_wall']:.2f}x wall, {auto['ratio_cpu']:.2f}x CPU "
                            f"(\"far less\": {'met' if auto['ratio_wall'] < 0.5 else 'not met'} at < 0.5x).")
    lengths = "; ".join(f"{r['work']}: response mean {r['lengths']['mean']:.0f}, p90 {r['lengths']['p90']}, max {r['lengths']['max']}"
                        for r in rows if r["mode"].startswith("minimal"))
    table = "\n".join(lines)
    text = f"""# Update phase of issue 21's two works (CPU)

Produced by `python bench/bench_works.py --works {args.works} --repeats {args.repeats} --threads {args.threads}` on {started} UTC.

## Machine

```
{info}
load average at end: {os.getloadavg()}
```

**The machine was shared** (about six other jobs on its 2 cores while this ran): wall times swing between repeats;
the modes are alternated within each repeat so a load change hits all of them, and CPU seconds are given too.

## Settings

bench_step.py's random Qwen3 (hidden 256, 4 layers, vocab 2000, tied, 3.4M parameters), float32, 16 prompts (12-31
tokens) x 8 responses, one update (one mini-batch: micro-batches of {WORK_MICRO_BATCH} rows, then AdamW), no KL, entropy
coefficient 0. Lengths forced by the bench ({lengths}). Each mode is a whole update; one warm-up each, then
{args.repeats} repeats alternating the modes.

- minimal padded loop: `MinimalLoop` in this script (full logits at every position, log-softmax, entropy with grad, PG
  loss, backward per micro-batch, clip, AdamW): what a trainer that just pads does (TRL's work).
- ours: `Actor.update` (the trainer's update: token_logprobs' chunked head over the loss tokens only, entropy without
  grad as a metric, PPO loss, metrics, grad norm, AdamW), with `model.use_remove_padding` off, on (packs a micro-batch
  only when its real tokens are < 90% of its padded block, on `grpo_varlen`: one causal sdpa call per sequence on
  CPU), and on the long tail also packed on transformers' dense block-diagonal mask (`sdpa`, what packing ran on before).

## Results

{table}

{chr(10).join(verdicts)}
"""
    path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--works", default="no_spread,long_tail", help="comma-separated from no_spread,long_tail")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=str(REPO / "bench" / "results_update_works_cpu.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    print(info, flush=True)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_step_model(model_dir)
        rows = works(args, model_dir)
    print(write_works_report(Path(args.out), args, rows, info, started))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
