"""Multi-turn episodes vs single-turn generation of the same tokens, with the real vLLM engine on CPU.

Not a test: `python bench/bench_episodes.py` prints a table and writes bench/results_episodes_cpu.md (machine, date,
load). Target (issue 18): the 3-turn episode batch within 1.5x of the single-turn time on the same tokens.

Shape: a random Qwen3-architecture model (data_prep/tiny_model.py's builder at hidden 256, 4 layers, head_dim 32:
~3.4M parameters, vocab 384, float32) with the tiny model's Qwen-style template listing the calculator; 32 prompts x
n 4 = 128 episodes; each episode is exactly 3 assistant turns of at most --turn-tokens sampled tokens (temperature 1),
the first two each followed by a calculator call and its tool turn (the template's delta, ~20 tokens, loss_mask 0).
How a random model is made to write such episodes (bench-only, as tests/scripts/train_with_tool_calls.py does it): the
hermes parser reads every turn as one calculator call, rollout.multi_turn.max_assistant_turns=3 ends the episode, and
the engine handed to the episode loop caps each turn at --turn-tokens (a cut turn reads as ended, not as the budget).

Three ways to make the same 128 sequences, alternated within one process (one engine), --rounds times after a warm-up:
1. episodes: `EpisodeRunner.generate` (grpo_lib/rollout/episodes.py): 3 engine calls, each for every running episode, with the
   tools and the template deltas between them;
2. single (same total tokens): one engine call, each sample's response exactly as long as its episode's whole
   response (sampled + tool tokens; ignore_eos), same prompts and seeds;
3. single (same sampled tokens): the same, as long as the episode's sampled tokens only (the decode work alone).
The episode time is split into engine time per turn (wall time of each engine.generate), the tools (timing_s/tools)
and the rest (template deltas, tokenizing, bookkeeping); vLLM's prompt / prefix-cache-hit token counters say how much
of each turn's context was prefilled again rather than read from the prefix cache.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOOLS = """
tools:
  - class_name: grpo_lib.tools.builtin.CalculatorTool
    config: {}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


class TurnCappedEngine:
    """The engine as the episode loop sees it: every turn cut at `turn_tokens` and read as ended there (finish "stop"),
    each call's wall time and request count recorded."""

    def __init__(self, engine, turn_tokens: int):
        self.engine, self.turn_tokens = engine, turn_tokens
        self.calls: list[dict] = []

    def generate(self, prompt_ids, *, max_tokens, **kwargs):
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
        capped = [min(b, self.turn_tokens) for b in budgets]
        start = time.perf_counter()
        out = self.engine.generate(prompt_ids, max_tokens=capped, **kwargs)
        self.calls.append(dict(seconds=time.perf_counter() - start, requests=len(prompt_ids),
                               context_tokens=sum(len(p) for p in prompt_ids)))
        for group, budget, cap in zip(out, budgets, capped):
            for g in group:
                if g.finish_reason == "length" and cap < budget:
                    g.finish_reason = "stop"  # the bench's turn length, not the episode's budget
        return out


def counters(llm) -> dict[str, float]:
    """vLLM's token counters now (prompt tokens, prefix-cache queries and hits, generated tokens)."""
    names = {"vllm:prompt_tokens": "prompt", "vllm:prefix_cache_queries": "cache_queries",
             "vllm:prefix_cache_hits": "cache_hits", "vllm:generation_tokens": "generated"}
    out = {v: 0.0 for v in names.values()}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += float(getattr(metric, "value", 0) or 0)
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def single_turn(engine, prompt_ids: list[list[int]], lengths: list[list[int]], seeds: list[int]) -> float:
    """One engine call: sample k of prompt i gets exactly lengths[i][k] tokens (ignore_eos); returns its wall time."""
    from vllm import SamplingParams

    requests, params = [], []
    for i, ids in enumerate(prompt_ids):
        for k, length in enumerate(lengths[i]):
            requests.append({"prompt_token_ids": list(ids)})
            params.append(SamplingParams(n=1, temperature=1.0, max_tokens=length, min_tokens=length, ignore_eos=True,
                                         seed=seeds[i] + k))
    engine.llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = engine.llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    made = [len(o.outputs[0].token_ids) for o in outputs]
    assert made == [x for row in lengths for x in row], "the single-turn responses are not the episodes' lengths"
    return seconds


def tool_episode_setup(model_dir: Path, tools_path: Path, *, prompts: int, n: int, budget: int, eager: bool,
                       max_assistant_turns: int):
    """The multi-turn benches' common set-up: a config for the tiny model with episodes on (the tool config at
    `tools_path`), its tokenizer, the EpisodeRunner, a vLLM engine on CPU, `prompts` addition questions rendered with
    the tools' schemas, and their seeds -> (tokenizer, runner, engine, PromptBatch, seeds)."""
    from transformers import AutoTokenizer

    from data_prep.synthetic import GSM8K_INSTRUCTION
    from grpo_lib.config import load_config
    from grpo_lib.core.types import PromptBatch
    from grpo_lib.rollout.data import render_prompt
    from grpo_lib.rollout.engines import build_engine
    from grpo_lib.rollout.episodes import EpisodeRunner

    cfg = load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "data.max_prompt_length=512",
                             "actor.ppo_micro_batch_size_per_gpu=8", f"data.max_response_length={budget}",
                             f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}", f"rollout.n={n}",
                             f"rollout.kv_cache_memory_bytes={256 * 2**20}", f"rollout.enforce_eager={str(eager).lower()}",
                             "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools_path}",
                             f"rollout.multi_turn.max_assistant_turns={max_assistant_turns}"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = EpisodeRunner.from_config(cfg, tokenizer=tokenizer)
    engine = build_engine(cfg, on_cpu=True, world_size=1)
    messages = [[{"role": "user", "content": f"What is {i % 10} + {i // 10}? {GSM8K_INSTRUCTION}"}] for i in range(prompts)]
    prompt_ids = [render_prompt(m, tokenizer, apply_chat_template=True, system_prompt=None, tools=runner.toolbox.schemas)
                  for m in messages]
    batch = PromptBatch(prompt_ids=prompt_ids, group_ids=[f"p{i}" for i in range(prompts)],
                        data_sources=["synthetic"] * prompts, ground_truths=["0"] * prompts,
                        extra_infos=[{} for _ in messages], messages=messages)
    return tokenizer, runner, engine, batch, [1000 * (i + 1) for i in range(prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=48, help="sampled tokens per assistant turn (at most)")
    parser.add_argument("--budget", type=int, default=320, help="data.max_response_length of an episode")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up round")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--eager", action="store_true", help="rollout.enforce_eager (default: compiled, the trainer's default)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results_episodes_cpu.md"))
    args = parser.parse_args()

    import torch

    import grpo_lib.rollout.episodes as episodes
    from data_prep.tiny_model import make_tiny_model
    from grpo_lib.tools.hermes import ToolCall

    episodes.parse_tool_calls = lambda text: [ToolCall("calculator", {"expression": "6 * 7"})]  # module docstring
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, seed=0)
        (Path(tmp) / "tools.yaml").write_text(TOOLS)
        tokenizer, runner, engine, prompts, seeds = tool_episode_setup(
            model_dir, Path(tmp) / "tools.yaml", prompts=args.prompts, n=args.n, budget=args.budget, eager=args.eager,
            max_assistant_turns=3)
        prompt_ids = prompts.prompt_ids
        rows = []
        for round_ in range(args.rounds + 1):
            capped = TurnCappedEngine(engine, args.turn_tokens)
            engine.llm.reset_prefix_cache()
            timings: dict[str, float] = {}
            before = counters(engine.llm)
            start = time.perf_counter()
            groups = runner.generate(capped, prompts, n=args.n, temperature=1.0, max_tokens=args.budget, seeds=seeds,
                                     logprobs=False, timings=timings)
            episode_s = time.perf_counter() - start
            tokens = delta(counters(engine.llm), before)
            turns = [g.episode.assistant_turns for group in groups for g in group]
            assert set(turns) == {3}, f"every episode must make 3 turns (raise --budget): {sorted(set(turns))}"
            whole = [[len(g.token_ids) for g in group] for group in groups]
            sampled = [[sum(g.loss_mask) for g in group] for group in groups]
            single_whole_s = single_turn(engine, prompt_ids, whole, seeds)
            single_sampled_s = single_turn(engine, prompt_ids, sampled, seeds)
            engine_s = sum(c["seconds"] for c in capped.calls)
            row = dict(episode_s=episode_s, single_whole_s=single_whole_s, single_sampled_s=single_sampled_s,
                       engine_s=engine_s, turn_s=[c["seconds"] for c in capped.calls], tools_s=timings.get("timing_s/tools", 0.0),
                       whole_tokens=sum(map(sum, whole)), sampled_tokens=sum(map(sum, sampled)),
                       turn_context_tokens=[c["context_tokens"] for c in capped.calls], **tokens)
            row["rest_s"] = episode_s - engine_s - row["tools_s"]
            print(f"round {round_}{' (warm-up)' if round_ == 0 else ''}: episodes {episode_s:.2f} s (engine {engine_s:.2f}, "
                  f"tools {row['tools_s']:.2f}, rest {row['rest_s']:.2f}); single, same total tokens {single_whole_s:.2f} s; "
                  f"single, same sampled tokens {single_sampled_s:.2f} s", flush=True)
            if round_ > 0:
                rows.append(row)
        runner.toolbox.close()
    write_report(Path(args.out), args, rows, load_before, os.getloadavg(), torch.__version__)


def joined(rows: list[dict], key: str) -> str:
    return ", ".join(f"{r[key]:.2f}" for r in rows)


def write_report(path: Path, args, rows: list[dict], load_before, load_after, torch_version: str) -> None:
    med = {k: statistics.median(r[k] for r in rows) for k in ("episode_s", "single_whole_s", "single_sampled_s", "engine_s",
                                                               "tools_s", "rest_s")}
    r0 = rows[0]
    ratio = med["episode_s"] / med["single_whole_s"]
    turns = [statistics.median(r["turn_s"][t] for r in rows) for t in range(3)]
    cached = r0["cache_hits"] / r0["cache_queries"] if r0["cache_queries"] else float("nan")
    lines = [
        "# Multi-turn episodes vs single-turn generation (CPU)",
        "",
        f"`python bench/bench_episodes.py` ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch_version}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after: "
        f"{'the machine was shared with other jobs' if max(load_before[0], load_after[0]) > 1.5 else 'idle'}). "
        f"{args.prompts} prompts x n {args.n} = {args.prompts * args.n} episodes of 3 assistant turns (at most "
        f"{args.turn_tokens} sampled tokens each) with 2 calculator turns between them; random {args.layers}-layer, hidden "
        f"{args.hidden} Qwen3, float32, {'eager' if args.eager else 'compiled'} vLLM; median of {len(rows)} rounds after a warm-up, "
        "the three ways alternated in one process (bench/bench_episodes.py's docstring).",
        "",
        "| | seconds (median) | all rounds | tokens |",
        "|---|---|---|---|",
        f"| episodes (3 turns, tools between) | {med['episode_s']:.2f} | {joined(rows, 'episode_s')} | "
        f"{r0['whole_tokens']} ({r0['sampled_tokens']} sampled) |",
        f"| single turn, same total tokens | {med['single_whole_s']:.2f} | {joined(rows, 'single_whole_s')} | "
        f"{r0['whole_tokens']} |",
        f"| single turn, same sampled tokens | {med['single_sampled_s']:.2f} | {joined(rows, 'single_sampled_s')} | "
        f"{r0['sampled_tokens']} |",
        "",
        f"**Ratio: episodes / single turn on the same total tokens = {ratio:.2f}x** (target <= 1.5x: "
        f"{'met' if ratio <= 1.5 else 'NOT met'}); against the same sampled tokens "
        f"{med['episode_s'] / med['single_sampled_s']:.2f}x.",
        "",
        "Where the episode time goes (medians):",
        "",
        f"- engine calls: {med['engine_s']:.2f} s ({med['engine_s'] / med['episode_s']:.0%}); per turn "
        f"{', '.join(f'{t:.2f}' for t in turns)} s; the turns' contexts {', '.join(str(c) for c in r0['turn_context_tokens'])} tokens, of which vLLM "
        f"read {cached:.0%} from its prefix cache ({r0['cache_hits']:.0f} of {r0['cache_queries']:.0f} queried prompt tokens; "
        f"{r0['prompt']:.0f} prompt tokens in all, {r0['generated']:.0f} generated);",
        f"- tools: {med['tools_s']:.2f} s ({med['tools_s'] / med['episode_s']:.0%}): create / execute / calc_reward / release of "
        "the calculator for every episode, each plain method in its own worker thread (grpo_lib/tools/calls.py);",
        f"- the rest: {med['rest_s']:.2f} s ({med['rest_s'] / med['episode_s']:.0%}): the chat template's delta after each turn "
        "(two renders and tokenizations per episode and turn), parsing, bookkeeping.",
        "",
        "Engine time over the single turn of the same total tokens: each later turn restarts generation for every "
        "running episode (scheduling, one prefill step per request for the context past the cached blocks: the tool "
        "turn and the partly filled last block), and decodes fewer sequences per step at the end of each turn; the tool "
        "tokens themselves are prefilled, not decoded, which is why the engine part can be cheaper than decoding them.",
        "",
    ]
    text = "\n".join(lines)
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
