"""Generation benchmark: the hf engine against vLLM on long-tail lengths, and rewards scored while the engine generates.

Not a test: `python bench/bench_generate.py` prints tables and writes bench/results_generate_cpu.md (machine, date,
load). `--what engines` or `--what reward` runs one part; `--rounds` measured rounds after one warm-up round.

Model: bench_step.py's random Qwen3 (hidden 256, 4 layers, vocab 2000, ~3.4M parameters, fp32), built once in
`--work-dir`. Long-tail shape (issue 21): 16 prompts x 8 samples, temperature 1, and each of the 128 responses gets
its own length limit drawn from a log-normal (median 50, sigma 1; this seed: mean 76, p90 181, max 512) that the model,
random, almost never reaches eos before; the limits are forced with one request per response (n=1, the seed a
prompt's sample k would get), so both engines run exactly the same work.

1. engines: `VLLMEngine.generate` and `HFEngine.generate` on the same requests in ONE process, alternated per round
   (vLLM sets the process to one torch thread when it starts: both engines run on it). Reported: seconds per call,
   response tokens, hf / vLLM; with `--hf-compile` also the hf engine with `rollout.hf_use_torch_compile` (its
   warm-up call, the compile, reported apart).
2. reward: whole training steps (generation -> rewards -> advantages -> update -> push, as bench_step.py) of one
   trainer process (train_grpo.GRPOTrainer.setup, vLLM engine, reward.num_workers=1) with three reward set-ups alternated per
   round: a free reward; a CPU-bound reward (a busy loop) costing 30% of the generation time in all, scored while
   the engine generates (the default); the same reward scored after generation (`stream_rewards=False`, today's
   order). The target: the streamed step within 10% of the free one. Each reward scorer has its own worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from bench_step import PROMPTS, GROUP, build_fixtures, machine, median  # noqa: E402

MAX_RESPONSE = 512
BUSY_REWARD = """import time

COST_S = {cost_s!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    end = time.process_time() + COST_S  # CPU-bound, as math-verify is: it competes with the engine for the cores
    while time.process_time() < end:
        pass
    return float(len(solution_str) % 3 == 0)
"""


def long_tail_limits(count: int, *, seed: int = 0) -> list[int]:
    """`count` response-length limits: log-normal, median 50 tokens, sigma 1 (mean ~83, p90 ~180), in [4, 512]."""
    import random

    rng = random.Random(seed)
    return [max(4, min(MAX_RESPONSE, round(rng.lognormvariate(3.912, 1.0)))) for _ in range(count)]


def requests(work: Path) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompt ids, max tokens, seeds), one entry per response: 16 chat prompts x 8 samples."""
    import pandas as pd
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    rows = pd.read_parquet(work / "train.parquet").head(PROMPTS)
    texts = [tokenizer.apply_chat_template(list(r), add_generation_prompt=True, tokenize=False) for r in rows["prompt"]]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = [p for p in prompts for _ in range(GROUP)]
    seeds = [1000 * i + k for i in range(PROMPTS) for k in range(GROUP)]
    return ids, long_tail_limits(len(ids)), seeds


def bench_engines(work: Path, rounds: int, *, hf_compile: bool = False, warm_up: dict | None = None) -> list[dict]:
    from grpo_lib.config import RolloutConfig
    from grpo_lib.rollout.engines.hf import HFEngine
    from grpo_lib.rollout.engines.vllm import VLLMEngine

    ids, limits, seeds = requests(work)
    warm_up = {} if warm_up is None else warm_up
    max_len = max(len(p) for p in ids) + MAX_RESPONSE
    cfg = RolloutConfig(kv_cache_memory_bytes=len(ids) * (max_len + 128) * 4096, max_num_seqs=256)
    engines = {"vllm": VLLMEngine(model_path=str(work / "model"), cfg=cfg, max_model_len=max_len, seed=0, on_cpu=True,
                                  world_size=1),
               "hf": HFEngine(model_path=str(work / "model"), cfg=cfg, on_cpu=True)}
    if hf_compile:
        engines["hf_compiled"] = HFEngine(model_path=str(work / "model"), cfg=replace(cfg, hf_use_torch_compile=True),
                                          on_cpu=True)
    rows = []
    for rnd in range(rounds + 1):
        row = {}
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(ids, n=1, temperature=1.0, max_tokens=limits, seeds=seeds, logprobs=False)
            row[name] = time.perf_counter() - start
            row[f"{name}_tokens"] = sum(len(g[0].token_ids) for g in out)
        print(f"round {rnd}: " + ", ".join(f"{name} {row[name]:.2f}s ({row[f'{name}_tokens']} tokens)" for name in engines)
              + f", hf/vllm {row['hf'] / row['vllm']:.2f}x, load {os.getloadavg()[0]:.2f}", flush=True)
        if rnd > 0:
            rows.append(row)
        else:
            warm_up.update({name: row[name] for name in engines})
    return rows


def engine_table(rows: list[dict], limits: list[int], warm: dict | None = None) -> list[str]:
    ordered = sorted(limits)
    lines = [f"Limits: {len(limits)} responses, mean {sum(limits) / len(limits):.0f}, p90 {ordered[int(0.9 * len(ordered))]}, "
             f"max {ordered[-1]} tokens.", "",
             "| engine | s per call, median (best) | response tokens |", "|---|---|---|"]
    names = [n for n in ("vllm", "hf", "hf_compiled") if n in rows[0]]
    for name in names:
        t = [r[name] for r in rows]
        lines.append(f"| {name} | {median(t):.2f} ({min(t):.2f}) | {rows[-1][f'{name}_tokens']} |")
    for name in names[1:]:
        ratio = [r[name] / r["vllm"] for r in rows]
        lines += ["", f"{name} / vLLM: median {median(ratio):.2f}x (best {min(ratio):.2f}x, worst {max(ratio):.2f}x)"]
    if "hf_compiled" in names:
        ratio = [r["hf_compiled"] / r["hf"] for r in rows]
        lines += ["", f"hf_compiled / hf (rollout.hf_use_torch_compile): median {median(ratio):.2f}x; its first call "
                      f"(the compile) {(warm or {}).get('hf_compiled', float('nan')):.1f} s against hf's "
                      f"{(warm or {}).get('hf', float('nan')):.1f} s"]
    return lines


def eos_model(work: Path, *, mean_tokens: float = 83.0) -> Path:
    """bench_step's model with its eos made likely enough that sampled responses end after ~`mean_tokens` tokens (a
    geometric-like tail: p90 ~2.3x the mean): the eos row of the (tied) embedding becomes alpha x the mean direction
    of the model's last hidden states, alpha found by bisection so that the mean p(eos) over sampled positions is
    1 / mean_tokens. Built once in `work`/eos_model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work / "eos_model"
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32).eval()
    ids, _, _ = requests(work)
    gen = torch.Generator().manual_seed(0)
    batch = torch.tensor([p[:8] for p in ids[::GROUP]])  # [16, 8] prompt starts
    with torch.no_grad():
        for _ in range(64):  # sample a continuation to collect hidden states of generated text
            logits = model(input_ids=batch).logits[:, -1].float()  # [16, V]
            batch = torch.cat([batch, torch.multinomial(logits.softmax(-1), 1, generator=gen)], dim=1)
        hidden = model.model(input_ids=batch).last_hidden_state[:, 8:].reshape(-1, model.config.hidden_size)  # [N, H]
        head = model.lm_head.weight  # [V, H]
        eos = tokenizer.eos_token_id
        others = (hidden @ head.T).index_fill(1, torch.tensor([eos]), float("-inf")).logsumexp(-1)  # [N]
        direction = hidden.mean(0) / hidden.mean(0).norm()  # [H]
        lo, hi = 0.0, 1000.0
        for _ in range(60):
            alpha = (lo + hi) / 2
            p_eos = torch.sigmoid(alpha * (hidden @ direction) - others).mean()
            lo, hi = (alpha, hi) if p_eos < 1 / mean_tokens else (lo, alpha)
        model.model.embed_tokens.weight[eos] = alpha * direction
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def bench_reward(work: Path, rounds: int) -> list[dict]:
    """Whole steps with a free reward, a 30% reward streamed, and the same reward scored after generation."""
    import functools

    import train_grpo
    from bench_step import overrides
    from grpo_lib.checkpoints.checkpoint import ResumePlan
    from grpo_lib.config import load_config
    from grpo_lib.core.perf import capture_torch_threads, tune_allocator
    from grpo_lib.rewards import RewardScorer
    from grpo_lib.trainer import rounds

    model = eos_model(work)
    keys = {"model.path", "data.max_response_length", "reward.num_workers", "trainer.default_local_dir"}
    cfg = load_config(None, [o for o in overrides(work, "fast") if o.split("=")[0] not in keys]
                      + [f"model.path={model}", f"data.max_response_length={MAX_RESPONSE}", "reward.num_workers=1",
                         f"trainer.default_local_dir={work / 'out_reward'}"])
    tune_allocator()
    capture_torch_threads()
    trainer = train_grpo.GRPOTrainer(cfg, world_size=1, rank=0, resume=ResumePlan())
    trainer.setup()
    free = trainer.parts.scorer
    real_collect = rounds.collect_rollouts
    number = 0

    def one_step(scorer, *, stream: bool) -> dict:
        nonlocal number
        number += 1
        trainer.parts.scorer = scorer
        rounds.collect_rollouts = real_collect if stream else functools.partial(real_collect, stream_rewards=False)
        try:
            start = time.perf_counter()
            metrics = trainer.step(number)
            metrics["wall_s"] = time.perf_counter() - start
        finally:
            rounds.collect_rollouts = real_collect
        return {k: metrics[k] for k in metrics if k.startswith("timing_s/") or k in ("wall_s", "response/length_mean",
                                                                                    "response/length_max")}

    warm = [one_step(free, stream=True) for _ in range(2)]  # compiles, caches; the second calibrates the reward's cost
    gen_s = warm[-1]["timing_s/gen"]
    responses = PROMPTS * GROUP
    cost_s = 0.3 * gen_s / responses  # one worker: the reward's calls add up to 30% of the generation time
    (work / "busy_reward.py").write_text(BUSY_REWARD.format(cost_s=cost_s))
    busy = RewardScorer(functions=[{"name": "custom", "weight": 1.0}], custom_path=str(work / "busy_reward.py"),
                        num_workers=1, timeout_s=60.0)
    print(f"generation {gen_s:.2f} s -> reward {cost_s * 1000:.1f} ms per response ({responses} responses, 1 worker)",
          flush=True)
    rows = []
    try:
        for rnd in range(rounds + 1):
            row = {"reward_cost_s": cost_s, "calibration_gen_s": gen_s}
            for name, scorer, stream in (("free", free, True), ("streamed", busy, True), ("after", busy, False)):
                row[name] = one_step(scorer, stream=stream)
            print(f"round {rnd}: step free {row['free']['timing_s/step']:.2f}s, streamed {row['streamed']['timing_s/step']:.2f}s "
                  f"(reward exposed {row['streamed']['timing_s/reward_exposed']:.2f}s), after {row['after']['timing_s/step']:.2f}s "
                  f"(exposed {row['after']['timing_s/reward_exposed']:.2f}s), load {os.getloadavg()[0]:.2f}", flush=True)
            if rnd > 0:
                rows.append(row)
    finally:
        busy.close()
        trainer.close()
    return rows


def reward_table(rows: list[dict]) -> list[str]:
    lines = [f"Reward: a busy loop of {rows[0]['reward_cost_s'] * 1000:.1f} ms CPU per response (30% of a "
             f"{rows[0]['calibration_gen_s']:.2f} s generation over {PROMPTS * GROUP} responses, one worker); "
             f"responses end at the model's eos (mean {rows[-1]['free']['response/length_mean']:.0f}, max "
             f"{rows[-1]['free']['response/length_max']:.0f} tokens, cap {MAX_RESPONSE}).", "",
             "| reward | step s, median (best) | gen s | reward exposed s | step / free step |", "|---|---|---|---|---|"]
    for name, label in (("free", "free"), ("streamed", "30%, scored while generating"), ("after", "30%, scored after generation")):
        step_s = [r[name]["timing_s/step"] for r in rows]
        ratio = [r[name]["timing_s/step"] / r["free"]["timing_s/step"] for r in rows]
        lines.append(f"| {label} | {median(step_s):.2f} ({min(step_s):.2f}) | {median([r[name]['timing_s/gen'] for r in rows]):.2f} "
                     f"| {median([r[name]['timing_s/reward_exposed'] for r in rows]):.2f} | {median(ratio):.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", default="engines,reward", help="comma-separated: engines, reward")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--hf-compile", action="store_true", help="engines: also the hf engine with rollout.hf_use_torch_compile")
    parser.add_argument("--work-dir", default=None, help="model/data folder (reused across runs; default: a temp folder)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results_generate_cpu.md"))
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_generate_"))
    work.mkdir(parents=True, exist_ok=True)
    build_fixtures(work)
    info = machine()
    print(info, flush=True)
    lines = ["# Generation benchmark (CPU)", "", f"Produced by `python bench/bench_generate.py --what {args.what} "
             f"--rounds {args.rounds}{' --hf-compile' if args.hf_compile else ''}` (see its docstring for the shape and method).", "", "## Machine", "", "```", info]
    sections = []
    if "engines" in args.what:
        warm: dict = {}
        rows = bench_engines(work, args.rounds, hf_compile=args.hf_compile, warm_up=warm)
        sections += ["## hf engine vs vLLM, long-tail lengths", "", *engine_table(rows, requests(work)[1], warm), "",
                     "Raw rows (seconds):", "", "```", *[json.dumps(r) for r in rows], "```", ""]
    if "reward" in args.what:
        rows = bench_reward(work, args.rounds)
        sections += ["## Rewards scored while the engine generates", "", *reward_table(rows), "",
                     "Raw rows (seconds):", "", "```", *[json.dumps(r) for r in rows], "```", ""]
    lines += [f"load average at end: {os.getloadavg()}", "```", "", *sections]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
