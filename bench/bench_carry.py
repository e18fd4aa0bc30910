"""Carry-over against the synchronous step on the long-tail work (issue 43): whole trainer steps, A/B alternated.

Not a test: `python bench/bench_carry.py` prints a table and writes bench/results_carry_cpu.md (machine, date, load).

Shape: bench_step.py's random 3.4M-parameter Qwen3, 16 prompts x 8 per step, micro-batches of 32 rows, one update per
step, a 512-token cap, packing on (bench_step's fast_pack: there generation is about half the synchronous step), vLLM
(compiled) in the trainer process. Lengths are forced per sample (ignore_eos; vLLM's
max_tokens): sample s gets `length(s)` tokens, lognormal (median 64, sigma 0.9) cut to [8, 480]: mean ~90, the longest
of a step's 128 near 480 (issue 43's long tail). A sample's length is fixed by its first seed, so a carried response
ends where the synchronous step's copy of it would: each mode generates the same responses' lengths; carry-over only
changes when their tokens are generated (a resumed request asks for what its sample still lacks).

Two trainer processes (train_grpo.GRPOTrainer.setup, then GRPOTrainer.step: rollouts -> reward -> update -> push),
`sync` (rollout.partial_rollout off) and `carry` (on; active_batch_size 32 = twice the batch; max_staleness 1), each
a whole run of --steps steps; the coordinator alternates one step of each, waiting for an idle CPU before each
(bench_step.wait_for_idle) and recording the CPU share other processes took. The first --warmup steps (compiles, the
pool filling) are not reported. Reported per mode: median step, generation (timing_s/gen), update and push seconds,
the tokens generated per step (sum of response lengths trained), carried / resumed / dropped responses, the staleness.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_step import (Worker, build_fixtures, json_rows, machine, median, overrides, reply,  # noqa: E402
                              wait_for_idle, write_report_lines)

CAP = 512
MODES = {"sync": [], "carry": ["rollout.partial_rollout.enable=true", "rollout.partial_rollout.active_batch_size=32",
                               "rollout.partial_rollout.max_staleness=1"]}


def length(seed: int) -> int:
    """A sample's forced response length: lognormal (median 64, sigma 0.9) from its first seed, cut to [8, 480]."""
    u1, u2 = (int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "little") / 2**64 for i in (1, 2))
    normal = math.sqrt(-2 * math.log(max(u1, 1e-12))) * math.cos(2 * math.pi * u2)
    return int(min(480, max(8, round(math.exp(math.log(64) + 0.9 * normal)))))


def force_lengths() -> None:
    """Every request ignores EOS and stops at its sample's remaining length (`length` of the sample's first seed minus
    what it generated already): vLLM's requests are one per sample on both paths (the reward stream's and carry-over's)."""
    import vllm
    from vllm import LLM  # noqa: F401  (vLLM type-annotates with SamplingParams at import: import it first)

    from grpo_lib.rollout import carry
    from grpo_lib.rollout.engines import vllm as engine

    params_class = vllm.SamplingParams
    vllm.SamplingParams = lambda **kwargs: params_class(**{**kwargs, "ignore_eos": True})
    remaining: dict[int, int] = {}  # request seed -> tokens its sample still lacks (carried requests)
    request = carry.Sample.request

    def carried_request(self, prompt_ids, max_response_length):
        ids, max_tokens, seed = request(self, prompt_ids, max_response_length)
        remaining[seed] = length(self.seed) - len(self.token_ids)
        return ids, max_tokens, seed

    carry.Sample.request = carried_request
    add = engine._Session.add

    def forced_add(self, key, prompt_ids, *, max_tokens, seed):
        return add(self, key, prompt_ids, max_tokens=min(max_tokens, remaining.get(seed, length(seed))), seed=seed)

    engine._Session.add = forced_add


class CountingEngine:
    """The engine of a memory-bound device, counted: one token per running request per step (a step costs the same
    whatever the batch, up to max_num_seqs), lengths as `force_lengths` forces them; counts steps and re-prefilled
    tokens (a resumed request's prompt + what it carried)."""

    pad_id, weight_version = 0, 0

    def __init__(self, max_num_seqs: int = 256):
        self.max_num_seqs, self.steps, self.prefill, self.remaining = max_num_seqs, 0, 0, {}

    def generate(self, prompt_ids, *, max_tokens, seeds, on_finished, stop, **_):
        from grpo_lib.core.types import Generation

        want = [min(limit, self.remaining.pop(seed, length(seed))) for seed, limit in zip(seeds, max_tokens)]
        self.prefill += sum(len(p) for p in prompt_ids)
        done, out = [0] * len(want), [None] * len(want)
        while any(o is None for o in out):
            running = [i for i, o in enumerate(out) if o is None][: self.max_num_seqs]
            self.steps += 1
            finished = []
            for i in running:
                done[i] += 1
                if done[i] >= want[i]:
                    out[i] = Generation([1] * want[i], [0.0] * want[i], "", "length")
                    finished.append((i, 0, out[i]))
            on_finished(finished)
            if any(o is None for o in out) and stop():
                for i, o in enumerate(out):
                    if o is None:
                        out[i] = Generation([1] * done[i], [0.0] * done[i], "", "abort")
        return [[o] for o in out]


def simulate(steps: int = 40, warmup: int = 8) -> dict[str, dict[str, float]]:
    """Engine steps and re-prefilled tokens per training step of the pool (grpo_lib/rollout/carry.py) on
    `CountingEngine`: sync (active = the batch) and carry (twice it), the bench's lengths and shape."""
    from types import SimpleNamespace

    from grpo_lib.config import Config
    from grpo_lib.rollout import carry
    from grpo_lib.rollout.data import PromptSampler

    out = {}
    for mode, active in (("sync", 16), ("carry", 32)):
        cfg = Config()
        cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_response_length = 16, 8, CAP
        cfg.rollout.partial_rollout.enable, cfg.rollout.partial_rollout.active_batch_size = True, active
        pool, engine = carry.CarryPool(cfg, world_size=1, rank=0), CountingEngine()
        request = carry.Sample.request
        data = SimpleNamespace(prompt_ids=[[2] * 20] * 4096, uids=[f"u{i}" for i in range(4096)],
                               batch=lambda idx: SimpleNamespace(prompt_ids=[], group_ids=[]))

        def counted_request(sample, prompt_ids, max_response_length, engine=engine):
            ids, max_tokens, seed = request(sample, prompt_ids, max_response_length)
            engine.remaining[seed] = length(sample.seed) - len(sample.token_ids)
            return ids, max_tokens, seed

        carry.Sample.request = counted_request
        sampler, per_step = PromptSampler(4096, batch_size=16, seed=0), []
        for step in range(1, steps + 1):
            engine.weight_version = step - 1
            before = (engine.steps, engine.prefill)
            pool.fill(sampler, data, step=step)
            pool.run_round(engine, data, sampling={"n": 1, "temperature": 1.0})
            pool.take(data)
            if step > warmup:
                per_step.append((engine.steps - before[0], engine.prefill - before[1]))
        carry.Sample.request = request
        out[mode] = {"engine_steps": sum(s for s, _ in per_step) / len(per_step),
                     "prefill_tokens": sum(p for _, p in per_step) / len(per_step)}
    return out


def trainer_worker(work: Path, mode: str) -> None:
    import train_grpo
    from grpo_lib.checkpoints.checkpoint import ResumePlan
    from grpo_lib.config import load_config
    from grpo_lib.core.perf import capture_torch_threads, tune_allocator

    args = [a for a in overrides(work, "fast_pack", "long_tail") if not a.startswith(("trainer.default_local_dir", "reward.num_workers"))]
    cfg = load_config(None, [*args, f"trainer.default_local_dir={work / ('out_' + mode)}", "reward.num_workers=1",
                             "trainer.weight_probe=false", *MODES[mode]])
    force_lengths()
    tune_allocator()
    capture_torch_threads()
    trainer = train_grpo.GRPOTrainer(cfg, world_size=1, rank=0, resume=ResumePlan())
    trainer.setup()
    step = 0
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        step += 1
        c0 = time.process_time()
        metrics = trainer.step(step)
        reply({**{k: v for k, v in metrics.items() if k.startswith(("timing_s/", "rollout/", "response/"))},
               "cpu_s": time.process_time() - c0})
    trainer.close()


class ModeWorker(Worker):
    def __init__(self, mode: str, work: Path, log: Path):
        import subprocess

        self.name = mode
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", mode, "--work-dir", str(work)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        self.ready = self.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per mode (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="steps per mode not reported (compiles; the pool fills)")
    parser.add_argument("--idle", type=float, default=0.85)
    parser.add_argument("--max-wait-s", type=float, default=30.0)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=str(REPO / "bench" / "results_carry_cpu.md"))
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_carry_"))
    if args.worker:
        trainer_worker(work, args.worker)
        return
    work.mkdir(parents=True, exist_ok=True)
    build_fixtures(work)
    info = machine()
    print(info, flush=True)
    workers = {m: ModeWorker(m, work, work / f"{m}.log") for m in MODES}
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for step in range(1, args.warmup + args.steps + 1):
            for m, w in workers.items():
                idle = wait_for_idle(args.idle, args.max_wait_s)
                out = w.ask({"cmd": "step"})
                out["idle_before"] = idle
                print(f"step {step} {m}: step {out['timing_s/step']:.2f}s gen {out['timing_s/gen']:.2f}s "
                      f"update {out.get('timing_s/update', 0):.2f}s carried {out.get('rollout/carried_responses', 0):.0f} "
                      f"others' CPU {out['others_cpu_share']:.0%}", flush=True)
                if step > args.warmup:
                    rows[m].append(out)
    finally:
        for w in workers.values():
            w.close()
    report(Path(args.out), info, args, rows)


def report(path: Path, info: str, args, rows: dict[str, list[dict]]) -> None:
    def col(m, k, default=0.0):
        return [r.get(k, default) for r in rows[m]]

    lines = ["# Carry-over vs the synchronous step, long-tail work (CPU)", "",
             f"Produced by `python bench/bench_carry.py --steps {args.steps} --warmup {args.warmup}` (shape and method: its docstring).", "",
             "## Machine", "", "```", info, f"load average at end: {os.getloadavg()}", "```", "",
             "## Results (median over the measured steps; best in brackets)", "",
             "| mode | step s | gen s | update s | push s | tokens / step | carried | resumed | dropped stale | staleness_1 | others' CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in MODES:
        step, gen = col(m, "timing_s/step"), col(m, "timing_s/gen")
        tokens = [r["response/length_mean"] * 128 for r in rows[m]]
        lines.append(f"| {m} | {median(step):.2f} ({min(step):.2f}) | {median(gen):.2f} ({min(gen):.2f}) | "
                     f"{median(col(m, 'timing_s/update')):.2f} | {median(col(m, 'timing_s/push')):.2f} | {median(tokens):.0f} | "
                     f"{median(col(m, 'rollout/carried_responses')):.0f} | {median(col(m, 'rollout/resumed_responses')):.0f} | "
                     f"{median(col(m, 'rollout/dropped_stale_responses')):.0f} | {median(col(m, 'rollout/staleness_1')):.2f} | "
                     f"{median(col(m, 'others_cpu_share')):.0%} |")
    ratio = median(col("carry", "timing_s/step")) / median(col("sync", "timing_s/step"))
    gen_ratio = median(col("carry", "timing_s/gen")) / median(col("sync", "timing_s/gen"))
    sim = simulate()
    sim_ratio = sim["carry"]["engine_steps"] / sim["sync"]["engine_steps"]
    lines += ["", f"carry / sync: step {ratio:.2f}x, generation {gen_ratio:.2f}x; target step <= 0.8x: "
              f"**{'met' if ratio <= 0.8 else 'not met'}**.", "",
              "The same pool on a device whose decode step costs the same whatever the batch (`simulate`: a memory-bound "
              "GPU; one token per running request per step, max_num_seqs 256), per training step after 8 warm-up steps:", "",
              "| mode | engine steps | re-prefilled tokens |", "|---|---|---|",
              *(f"| {m} | {v['engine_steps']:.0f} | {v['prefill_tokens']:.0f} |" for m, v in sim.items()), "",
              f"engine steps carry / sync: {sim_ratio:.2f}x.", "", "Raw rows:", "", "```"]
    lines += [*json_rows("mode", {m: rows[m] for m in MODES}), "```", ""]
    write_report_lines(path, lines)


if __name__ == "__main__":
    main()
