"""The per-episode loop against the turn-synchronous loop on a long-tail tool workload, with the real vLLM engine on CPU.

Not a test: `python bench/multi_turn_loop.py` prints a table and writes bench/results_multi_turn_loop_cpu.md (machine,
date, load). Target (issue 30 item 7): the per-episode loop's rollout at least 1.5x faster than the turn-synchronous
loop's on the same episodes.

The workload (all from seeded RNGs, the same for both loops):
- the tiny model of the tests (data_prep/tiny_model.py, random, float32, eager vLLM) with the tiny template listing
  one tool, `slow_lookup` (SlowTool below: an `async def execute` that sleeps 50-500 ms, uniform, drawn per call
  from random.Random(f"{instance id}:{call number}"), so each call waits as long in both loops);
- --prompts x --n episodes; --long-fraction of them make 4-6 assistant turns (a tool call after each but the last),
  the others 1 turn (an answer): the long tail;
- a call turn samples 8-48 tokens (--call-tokens), the answer (each episode's last turn) 16-256 (--answer-tokens: a
  direct answer writes its working out; `--answer-tokens 8,48` makes every turn alike), drawn per episode and turn.
How a random model is made to write such episodes (bench-only, as bench/bench_episodes.py does it): the engine the
loop is given (ScriptedEngine) caps each turn at its drawn length and sets the turn's *text* to a `slow_lookup` call
or to an answer by the episode's plan; the sampled token ids stay the model's. It finds the episode and turn of a
request from its seed (turn t of sample k of prompt i is seeded turn_seed(seeds[i] + k, t) in both loops).

Both loops run through the one public call, `EpisodeRunner.generate` (grpo_lib/rollout/episodes.py), on one engine: the
per-episode loop (VLLMEngine.open_session, the trainer's choice for vLLM at TP 1) and the turn-synchronous one (the
trainer's choice for the hf engine and for TP > 1; chosen here by setting the runner's `per_episode` to False). They
alternate in one process, --rounds times after one warm-up of each, so machine load falls on both alike. Measured:
- rollout seconds: wall time of generate (the generation phase of a step; the rest of a step is the same for both);
- engine idle fraction: time with no request in the engine / rollout time, from the loop's side: the turn loop's
  engine is busy inside its engine.generate calls, the session's from the add that finds it empty to the step that
  empties it;
- mean running requests per engine step (the per-episode loop's session; the turn loop's steps are inside generate);
- the tool-turn cost per turn index: EpisodeRunner._append_tool_turn's wall time (the template delta: three renders and
  three tokenizations of a window of constant size, plus the append), against re-tokenizing the whole context so far
  (decode + encode of prompt + episode), which grows with the turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_lib.tools.base import BaseTool  # noqa: E402  (after the path)

TOOLS = """
tools:
  - class_name: bench.multi_turn_loop.SlowTool
    config: {min_latency_s: %(lo)s, max_latency_s: %(hi)s}
    tool_schema:
      type: function
      function:
        name: slow_lookup
        description: Look something up (takes 50-500 ms)
        parameters: {type: object, properties: {query: {type: string}}, required: [query]}
"""


class SlowTool(BaseTool):
    """A deterministic tool whose calls take min..max_latency_s (uniform), drawn from the episode and call number."""

    def create(self, instance_id=None, **kwargs):
        self.calls = getattr(self, "calls", {})
        self.calls[instance_id] = 0
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        number = self.calls.get(instance_id, 0)
        self.calls[instance_id] = number + 1
        latency_s = random.Random(f"{instance_id}:{number}").uniform(self.config["min_latency_s"], self.config["max_latency_s"])
        await asyncio.sleep(latency_s)
        return f"result {number}", 0.0, {}


def plan_episodes(seeds: list[int], n: int, *, long_fraction: float, call_tokens: tuple[int, int],
                  answer_tokens: tuple[int, int], seed: int) -> dict[int, tuple[int, int, int]]:
    """turn seed -> (episode index, turns of that episode, tokens of that turn) for every turn of every episode: a
    call turn samples call_tokens[0]..[1] tokens, the answer (every episode's last turn) answer_tokens[0]..[1].

    Example: 2 prompts, n 1, long_fraction 0.5 might give episode 0 one answer turn of 200 tokens and episode 1 four
    call turns of 8-48 tokens and an answer."""
    from grpo_lib.core.seeds import turn_seed

    rng = random.Random(seed)
    plan = {}
    for i, base in enumerate(seeds):
        for k in range(n):
            turns = rng.randint(4, 6) if rng.random() < long_fraction else 1
            for t in range(turns):
                low, high = answer_tokens if t == turns - 1 else call_tokens
                plan[turn_seed(base + k, t)] = (i * n + k, turns, rng.randint(low, high))
    return plan


def call_text(episode: int) -> str:
    """The scripted call turn's text. Example: 3 -> '<tool_call>{"name": "slow_lookup", "arguments": {"query": "q3"}}</tool_call>'."""
    return '<tool_call>{"name": "slow_lookup", "arguments": {"query": "q%d"}}</tool_call>' % episode


class ScriptedEngine:
    """The engine as the loops see it: each turn capped at its planned length and its text set by the plan (a call,
    or an answer on the episode's last turn); records when a request is in the engine."""

    def __init__(self, engine, plan: dict, last_turn_seeds: set[int]):
        self.engine, self.plan, self.last_turn_seeds = engine, plan, last_turn_seeds
        self.busy_s = 0.0
        self.step_requests: list[int] = []  # requests in the engine at each session step

    def _script(self, seed: int, generation) -> None:
        generation.text = "The answer is 42." if seed in self.last_turn_seeds else call_text(self.plan[seed][0])
        if generation.finish_reason == "length":
            generation.finish_reason = "stop"  # the plan's turn length, not the episode's budget

    def generate(self, prompt_ids, *, n, max_tokens, seeds, **kwargs):
        assert n == 1 and seeds is not None, "the episode loop sends n=1 seeded requests"
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
        capped = [min(b, self.plan[s][2]) for b, s in zip(budgets, seeds)]
        start = time.perf_counter()
        out = self.engine.generate(prompt_ids, n=1, max_tokens=capped, seeds=seeds, **kwargs)
        self.busy_s += time.perf_counter() - start
        for (g,), s in zip(out, seeds):
            self._script(s, g)
        return out

    @contextlib.contextmanager
    def open_session(self, **sampling):
        with self.engine.open_session(**sampling) as inner:
            session = _ScriptedSession(self, inner)
            try:
                yield session
            finally:
                session.close()


class _ScriptedSession:
    """ScriptedEngine's GenerationSession: the plan's turn caps and texts; the engine counts as busy from the add that
    finds it empty to the step that empties it."""

    def __init__(self, owner: ScriptedEngine, inner):
        self.owner, self.inner = owner, inner
        self.seed_of: dict = {}
        self.busy_since: float | None = None

    @property
    def unfinished(self) -> int:
        return self.inner.unfinished

    def add(self, key, prompt_ids, *, max_tokens, seed):
        if self.busy_since is None:
            self.busy_since = time.perf_counter()
        self.seed_of[key] = seed
        self.inner.add(key, prompt_ids, max_tokens=min(max_tokens, self.owner.plan[seed][2]), seed=seed)

    def step(self):
        self.owner.step_requests.append(self.inner.unfinished)
        finished = self.inner.step()
        for key, g in finished:
            self.owner._script(self.seed_of.pop(key), g)
        if not self.inner.unfinished:
            self.close()
        return finished

    def close(self) -> None:
        if self.busy_since is not None:
            self.owner.busy_s += time.perf_counter() - self.busy_since
            self.busy_since = None


def count_steps(llm_engine) -> dict:
    """Count the engine's steps and their seconds (this LLMEngine object only: both loops step it)."""
    counted = {"n": 0, "s": 0.0}
    original = llm_engine.step

    def step():
        start = time.perf_counter()
        out = original()
        counted["n"] += 1
        counted["s"] += time.perf_counter() - start
        return out

    llm_engine.step = step
    return counted


def time_tool_turns(runner, records: list[tuple[int, float, int]]):
    """Wrap runner._append_tool_turn (this runner only): records (turn index, seconds, context tokens) per tool turn."""
    original = runner._append_tool_turn

    def timed(ep, text, sampled, answered, *, budget):
        start = time.perf_counter()
        original(ep, text, sampled, answered, budget=budget)
        records.append((ep.stats.assistant_turns, time.perf_counter() - start, len(ep.prompt_ids) + len(ep.tokens)))

    runner._append_tool_turn = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--long-fraction", type=float, default=0.25, help="episodes of 4-6 turns; the rest make 1")
    parser.add_argument("--call-tokens", default="8,48", help="low,high sampled tokens of a turn that calls the tool")
    parser.add_argument("--answer-tokens", default="16,256", help="low,high sampled tokens of an episode's answer turn")
    parser.add_argument("--min-latency-s", type=float, default=0.05)
    parser.add_argument("--max-latency-s", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds of each loop after one warm-up of each")
    parser.add_argument("--out", default=str(REPO / "bench" / "results_multi_turn_loop_cpu.md"))
    args = parser.parse_args()

    import torch
    from bench_episodes import tool_episode_setup  # bench/ is this script's own folder (sys.path[0])

    from data_prep.tiny_model import make_tiny_model
    from grpo_lib.core.seeds import turn_seed

    call_tokens, answer_tokens = (tuple(int(x) for x in v.split(",")) for v in (args.call_tokens, args.answer_tokens))
    budget = answer_tokens[1] + 5 * (call_tokens[1] + 40)  # 5 calls, each with a tool turn of ~35 tokens
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", warmup_steps=0, seed=0)
        (Path(tmp) / "tools.yaml").write_text(TOOLS % {"lo": args.min_latency_s, "hi": args.max_latency_s})
        tokenizer, runner, engine, prompts, seeds = tool_episode_setup(
            model_dir, Path(tmp) / "tools.yaml", prompts=args.prompts, n=args.n, budget=budget, eager=True,
            max_assistant_turns=8)
        prompt_ids = prompts.prompt_ids
        plan = plan_episodes(seeds, args.n, long_fraction=args.long_fraction, call_tokens=call_tokens,
                             answer_tokens=answer_tokens, seed=0)
        steps = count_steps(engine.llm.llm_engine)
        turns_of = {e: turns for e, turns, _ in plan.values()}
        last = {turn_seed(seeds[e // args.n] + e % args.n, turns_of[e] - 1) for e in turns_of}
        tool_turns: list[tuple[int, float, int]] = []
        time_tool_turns(runner, tool_turns)
        rows = {"per_episode": [], "turn_sync": []}
        for round_ in range(args.rounds + 1):
            for loop in ("per_episode", "turn_sync") if round_ % 2 == 0 else ("turn_sync", "per_episode"):
                runner.per_episode = loop == "per_episode"
                scripted = ScriptedEngine(engine, plan, last)
                engine.reset_prefix_cache()
                tool_turns.clear()
                steps.update(n=0, s=0.0)
                timings: dict[str, float] = {}
                start = time.perf_counter()
                groups = runner.generate(scripted, prompts, n=args.n, temperature=1.0, max_tokens=budget, seeds=seeds,
                                         logprobs=True, timings=timings)
                rollout_s = time.perf_counter() - start
                made = [g.episode.assistant_turns for group in groups for g in group]
                assert made == [turns_of[e] for e in range(len(made))], "an episode did not make its planned turns"
                errors = sum(g.episode.errors + g.episode.timeouts for group in groups for g in group)
                assert errors == 0, f"{errors} tool errors / timeouts"
                row = dict(rollout_s=rollout_s, idle=1 - scripted.busy_s / rollout_s, busy_s=scripted.busy_s,
                           steps=steps["n"], step_ms=1000 * steps["s"] / max(1, steps["n"]),
                           per_step=statistics.mean(scripted.step_requests) if scripted.step_requests else float("nan"),
                           tokens=sum(len(g.token_ids) for group in groups for g in group),
                           sampled=sum(sum(g.loss_mask) for group in groups for g in group),
                           tool_turns=list(tool_turns),
                           tokens_by_episode=[g.token_ids for group in groups for g in group])
                print(f"round {round_}{' (warm-up)' if round_ == 0 else ''} {loop}: rollout {rollout_s:.2f} s, engine idle "
                      f"{row['idle']:.0%}, tokens {row['tokens']}", flush=True)
                if round_ > 0:
                    rows[loop].append(row)
        same = rows["per_episode"][0]["tokens_by_episode"] == rows["turn_sync"][0]["tokens_by_episode"]
        whole = whole_context_cost(tokenizer, prompt_ids, args.n, rows["per_episode"][0]["tokens_by_episode"], turns_of)
        runner.toolbox.close()
    write_report(Path(args.out), args, rows, turns_of, same, whole, load_before, os.getloadavg(), torch.__version__)


def whole_context_cost(tokenizer, prompt_ids, n: int, episodes_tokens: list[list[int]], turns_of: dict) -> dict[int, list[float]]:
    """Seconds of decode + encode of the whole context (prompt + episode so far) at each tool turn, by turn index, for
    the long episodes: what re-tokenizing the conversation each turn would cost (the context cut at the turn's share)."""
    out: dict[int, list[float]] = {}
    for e, tokens in enumerate(episodes_tokens):
        turns = turns_of[e]
        for t in range(1, turns):
            context = prompt_ids[e // n] + tokens[:len(tokens) * t // turns]
            start = time.perf_counter()
            tokenizer(tokenizer.decode(context), add_special_tokens=False)
            out.setdefault(t, []).append(time.perf_counter() - start)
    return out


def tool_wait_floors(turns_of: dict[int, int], n: int, min_latency_s: float, max_latency_s: float) -> tuple[float, float]:
    """The tool waits of the workload, from SlowTool's own seeded latencies (not measured): (the turn loop's, which waits
    for the slowest call of each turn: sum over turns of the max over episodes; the floor of any per-episode loop, the
    longest chain of one episode's own calls: max over episodes of their sum). Instance ids are episodes.py's
    f"{prompt}:{sample}:{group id}", the group ids this bench's f"p{prompt}"."""
    latency = {e: [random.Random(f"{e // n}:{e % n}:p{e // n}:{c}").uniform(min_latency_s, max_latency_s)
                   for c in range(turns - 1)] for e, turns in turns_of.items()}
    longest = max(turns_of.values())
    turn_loop = sum(max((calls[c] for calls in latency.values() if len(calls) > c), default=0.0) for c in range(longest - 1))
    return turn_loop, max(sum(calls) for calls in latency.values())


def machine() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        lines = []
    keep = {k: v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
    return (f"{keep.get('Model name', platform.processor() or platform.machine())}, {keep.get('CPU(s)', os.cpu_count())} CPUs "
            f"({keep.get('Core(s) per socket', '?')} cores per socket, {keep.get('Thread(s) per core', '?')} thread per core)")


def write_report(path: Path, args, rows: dict, turns_of: dict, same: bool, whole: dict, load_before, load_after,
                 torch_version: str) -> None:
    def stat(loop: str, key: str, fn) -> float:
        return fn(r[key] for r in rows[loop])

    med = {loop: stat(loop, "rollout_s", statistics.median) for loop in rows}
    best = {loop: stat(loop, "rollout_s", min) for loop in rows}
    ratio, ratio_min = med["turn_sync"] / med["per_episode"], best["turn_sync"] / best["per_episode"]
    # each round ran both loops back to back: the ratio within a round sees the same machine load on both sides
    paired = [t["rollout_s"] / p["rollout_s"] for t, p in zip(rows["turn_sync"], rows["per_episode"])]
    long = sum(1 for t in turns_of.values() if t > 1)
    by_turn: dict[int, list[tuple[float, int]]] = {}
    for loop in rows:
        for r in rows[loop]:
            for turn, seconds, context in r["tool_turns"]:
                by_turn.setdefault(turn, []).append((seconds, context))
    r0 = rows["per_episode"][0]
    floors = tool_wait_floors(turns_of, args.n, args.min_latency_s, args.max_latency_s)
    lines = [
        "# Per-episode loop vs turn-synchronous loop on a long-tail tool workload (CPU)",
        "",
        f"`python bench/multi_turn_loop.py` ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}; torch {torch_version}; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after: "
        f"{'the machine was shared with other jobs' if max(load_before[0], load_after[0]) > 1.5 else 'idle'}). "
        f"{args.prompts} prompts x n {args.n} = {len(turns_of)} episodes: {len(turns_of) - long} of 1 turn, {long} of 4-6 turns "
        f"({sum(turns_of.values())} turns in all); sampled tokens per call turn {args.call_tokens.replace(',', '-')}, per answer "
        f"{args.answer_tokens.replace(',', '-')}; "
        f"tool calls {args.min_latency_s * 1000:.0f}-{args.max_latency_s * 1000:.0f} ms (asyncio.sleep, seeded per call); the "
        "tests' tiny random Qwen3 (hidden 64, 2 layers), float32, eager vLLM; both loops through EpisodeRunner.generate on one "
        f"engine, alternated in one process, {len(rows['per_episode'])} measured rounds each after a warm-up of each "
        "(bench/multi_turn_loop.py's docstring). Both loops made the same tokens: "
        f"{'yes' if same else 'NO'} ({r0['tokens']} tokens, {r0['sampled']} sampled).",
        "",
        "| loop | rollout s (median) | min | all rounds | engine idle (median) | engine busy s | engine steps | ms per step | requests per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for loop, name in (("turn_sync", "turn-synchronous (hf engine, TP > 1)"), ("per_episode", "per episode (vLLM, TP 1)")):
        per_step = stat(loop, "per_step", statistics.median)
        lines.append(f"| {name} | {med[loop]:.2f} | {best[loop]:.2f} | {', '.join(format(r['rollout_s'], '.2f') for r in rows[loop])} | "
                     f"{stat(loop, 'idle', statistics.median):.0%} | {stat(loop, 'busy_s', statistics.median):.2f} | {stat(loop, 'steps', statistics.median):.0f} | "
                     f"{stat(loop, 'step_ms', statistics.median):.1f} | {'-' if per_step != per_step else f'{per_step:.1f}'} |")
    lines += [
        "",
        f"**Speed-up of the per-episode loop: {ratio:.2f}x on the medians, {ratio_min:.2f}x on the minima; within each round "
        f"(both loops back to back) {', '.join(f'{x:.2f}' for x in paired)}x, median {statistics.median(paired):.2f}x** "
        f"(target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'} on the medians). Two things make it: the tool waits "
        f"hidden (the turn-synchronous engine sat idle "
        f"{stat('turn_sync', 'idle', statistics.median):.0%} of its rollout, which alone is worth up to "
        f"{med['turn_sync'] / stat('turn_sync', 'busy_s', statistics.median):.2f}x: its rollout over its engine-busy time), and "
        f"fewer, fuller engine steps (episodes that start their next turns while others decode share steps: "
        f"{stat('per_episode', 'steps', statistics.median):.0f} steps against {stat('turn_sync', 'steps', statistics.median):.0f}, "
        f"engine busy {stat('per_episode', 'busy_s', statistics.median):.2f} s against "
        f"{stat('turn_sync', 'busy_s', statistics.median):.2f} s), which pays where a step's cost is mostly fixed (the "
        "tiny model, a loaded CPU) and less where it grows with the requests in it.",
        "",
        "The tools alone, from SlowTool's seeded latencies (computed, not measured: `tool_wait_floors`): the turn loop waits "
        f"{floors[0]:.2f} s for tools (each turn's slowest call), while no loop can end before the longest chain of one "
        f"episode's own calls, {floors[1]:.2f} s: on the tool waits the per-episode loop can gain at most "
        f"{floors[0] / floors[1]:.2f}x; the rest of any gain is generation overlapping (the long episodes' turns with the "
        "others' answers).",
        "",
        "Tool-turn cost by turn index (both loops' tool turns, all measured rounds): `_append_tool_turn` (the template "
        "delta: three renders, three tokenizations of a window of constant size, plus the append) against decoding and "
        "re-encoding the whole context so far (what re-tokenizing the conversation each turn would cost):",
        "",
        "| turn | tool turns | context tokens (mean) | tool turn ms (median) | whole-context re-tokenize ms (median) |",
        "|---|---|---|---|---|",
    ]
    for turn in sorted(by_turn):
        seconds = [s for s, _ in by_turn[turn]]
        contexts = [c for _, c in by_turn[turn]]
        redo = statistics.median(whole[turn]) * 1000 if turn in whole else float("nan")
        lines.append(f"| {turn} | {len(seconds)} | {statistics.mean(contexts):.0f} | {statistics.median(seconds) * 1000:.2f} | "
                     f"{redo:.2f} |")
    lines.append("")
    text = "\n".join(lines)
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
