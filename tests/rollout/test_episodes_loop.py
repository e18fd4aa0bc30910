"""The per-episode loop of grpo_lib/rollout/episodes.py on CPU (issue 30 items 1-3), with a scripted engine that offers a
GenerationSession (tests/scripts/episode_case.py's SessionEngine: each step finishes the newest request, so episodes
finish out of order) against the turn-synchronous loop on the same script: the same episodes token for token; a slow
tool holds only its own episode; each episode is reported as it ends with its tool rewards; each tool turn renders and
tokenizes a window of constant size. The real-vLLM comparison of the two loops: tests/rollout/test_episodes_engines.py.
"""

from __future__ import annotations

import time

import pytest

from grpo_lib.core.seeds import turn_seed
from grpo_lib.tools.base import BaseTool
from tests.scripts.episode_case import (ScriptedEngine, SessionEngine, all_tools, call, calls_then_answer, make_prompts,
                                        make_runner, schema)

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, logprobs=True)


class SleepyTool(BaseTool):
    """Answers "zz" after 1 s (a plain function, here in a thread: the test times the overlap, not a worker's start)."""

    execute_in = "thread"

    def execute(self, instance_id, parameters, **kwargs):
        time.sleep(1.0)
        return "zz", 0.0, {}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def runner(tokenizer):
    r = make_runner(tokenizer, {**all_tools(), "sleepy": SleepyTool({}, schema("sleepy", text="string"))}, timeout_s=5.0)
    yield r
    r.toolbox.close()


def mixed(context: str, seed) -> str:
    """Prompt "1 + 1" answers at once; "6 * 7" calls echo twice (the first call's text from the seed), then answers."""
    if "What is 1 + 1?" in context:
        return f"#### 2 (seed {seed % 1000})"
    return calls_then_answer(call("echo", text=f"a{seed % 1000}"), call("calculator", expression="6 * 7"))(context, seed)


def as_rows(groups):
    return [(g.token_ids, g.loss_mask, g.logprobs, g.finish_reason, g.text, g.episode) for group in groups for g in group]


def test_the_per_episode_loop_gives_the_turn_loops_episodes_token_for_token(runner):
    prompts = make_prompts(runner, ["What is 6 * 7?", "What is 1 + 1?", "What is 6 * 7?"])
    turn_engine, session_engine = ScriptedEngine(runner.tokenizer, mixed), SessionEngine(runner.tokenizer, mixed)
    by_turn = runner.generate(turn_engine, prompts, n=2, max_tokens=300, seeds=[100, 200, 300], **SAMPLING)
    by_episode = runner.generate(session_engine, prompts, n=2, max_tokens=300, seeds=[100, 200, 300], **SAMPLING)
    assert session_engine.sessions == 1 and not session_engine.calls, "one session, no turn-by-turn generate call"
    assert as_rows(by_episode) == as_rows(by_turn)  # tokens, masks, logprobs, stats (tool rewards, counts) alike
    # the same requests: the turn loop's (context, budget left, seed) of every episode turn, in another order
    turn_requests = sorted((tuple(p), m, s) for c in turn_engine.calls for p, m, s in zip(c["prompts"], c["max_tokens"], c["seeds"]))
    session_requests = sorted((tuple(p), m, s) for kind, *rest in session_engine.log if kind == "add" for _, p, m, s, _ in [rest])
    assert session_requests == turn_requests and len(turn_requests) == 2 * (3 + 1 + 3)
    # turn 2 of sample 1 of prompt 0 (episode 1) is seeded by its sample and turn only
    assert any(key == 1 and seed == turn_seed(101, 2) for kind, key, *rest in session_engine.log if kind == "add"
               for _, _, seed, _ in [rest])


def test_a_slow_tool_holds_only_its_own_episode(runner):
    """Episode 0 calls the 1 s tool once; episode 1 (prompt 1) calls echo three times: all of episode 1's turns are
    generated while episode 0's call runs, and episode 0's second turn is added after them."""
    def script(context, seed):
        if "slow one" in context:
            return calls_then_answer(call("sleepy", text="x"))(context, seed)
        return calls_then_answer(*[call("echo", text=str(t)) for t in range(3)])(context, seed)

    engine = SessionEngine(runner.tokenizer, script)
    prompts = make_prompts(runner, ["the slow one", "the fast one"])
    started = time.perf_counter()
    groups = runner.generate(engine, prompts, n=1, max_tokens=400, seeds=[1, 2], **SAMPLING)
    assert time.perf_counter() - started < 1.0 * 2, "the sleepy call overlapped the fast episode's turns"
    finishes = [key for kind, key, *_ in engine.log if kind == "finish"]
    assert sorted(finishes[:-1]) == [0, 1, 1, 1, 1] and finishes[-1] == 0, (
        f"episode 1's 4 turns while episode 0's call sleeps, then episode 0's answer: {finishes}")
    assert [g.episode.assistant_turns for [g] in groups] == [2, 4]


def test_each_episode_is_reported_as_it_ends_with_its_tool_rewards(runner):
    heard = []
    prompts = make_prompts(runner, ["What is 6 * 7?", "What is 1 + 1?"])
    engine = SessionEngine(runner.tokenizer, mixed)
    groups = runner.generate(engine, prompts, n=2, max_tokens=300, seeds=[100, 200], **SAMPLING,
                             on_finished=lambda finished: heard.extend((i, k, g.episode.tool_rewards is not None, g)
                                                                       for i, k, g in finished))
    assert sorted((i, k) for i, k, _, _ in heard) == [(0, 0), (0, 1), (1, 0), (1, 1)], "each episode once"
    assert all(has_rewards for _, _, has_rewards, _ in heard), "tool rewards set before the episode is reported"
    assert all(g is groups[i][k] for i, k, _, g in heard), "the Generation returned"
    assert {(i, k) for i, k, _, _ in heard[:2]} == {(1, 1), (1, 0)}, "the episodes that answer at once are heard first"
    # the turn loop reports too, after the turn in which each ended
    heard_by_turn = []
    runner.generate(ScriptedEngine(runner.tokenizer, mixed), prompts, n=2, max_tokens=300, seeds=[100, 200], **SAMPLING,
                    on_finished=lambda finished: heard_by_turn.extend((i, k) for i, k, _ in finished))
    assert heard_by_turn == [(1, 0), (1, 1), (0, 0), (0, 1)]


def test_without_per_episode_the_loop_stays_turn_synchronous_on_an_engine_with_sessions(tokenizer):
    """Under tensor parallelism (per_episode False: from_config sets it when tensor_model_parallel_size > 1) the loop
    calls generate once per turn even where the engine offers sessions."""
    runner = make_runner(tokenizer)
    runner.per_episode = False
    try:
        engine = SessionEngine(tokenizer, mixed)
        runner.generate(engine, make_prompts(runner, ["What is 6 * 7?"]), n=1, max_tokens=300, seeds=[100], **SAMPLING)
        assert engine.sessions == 0 and len(engine.calls) == 3
    finally:
        runner.toolbox.close()


class CountingTokenizer:
    """The tokenizer, counting the messages each apply_chat_template renders and the characters each call tokenizes."""

    def __init__(self, tokenizer):
        self.inner, self.rendered, self.tokenized = tokenizer, [], []

    def apply_chat_template(self, messages, **kwargs):
        self.rendered.append(len(messages))
        return self.inner.apply_chat_template(messages, **kwargs)

    def __call__(self, text, **kwargs):
        self.tokenized.append(len(text))
        return self.inner(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("loop", ["per_episode", "turn"])
def test_each_tool_turn_renders_and_tokenizes_a_window_of_constant_size(runner, tokenizer, loop):
    """An episode of 2 and one of 8 identical echo turns: the renders and tokenized characters per tool turn are the
    same (today's three renders of the prompt + the turn + its tool message, and their three tokenizations), not
    growing with the turns as a render of the whole conversation would (turn 8's conversation is ~8x turn 1's)."""
    def cost(turns: int) -> tuple[list[int], list[int], int]:
        script = calls_then_answer(*[call("echo", text="same")] * turns)
        prompts = make_prompts(runner, ["What is 6 * 7?"])
        counting = CountingTokenizer(tokenizer)
        runner.tokenizer = counting
        engine = (SessionEngine if loop == "per_episode" else ScriptedEngine)(tokenizer, script)
        [[g]] = runner.generate(engine, prompts, n=1, max_tokens=2000, seeds=[5], **SAMPLING)
        runner.tokenizer = tokenizer
        assert g.episode.user_turns == turns
        return counting.rendered, counting.tokenized, len(g.token_ids)

    rendered_2, tokenized_2, length_2 = cost(2)
    rendered_8, tokenized_8, length_8 = cost(8)
    assert len(rendered_2) == 3 * 2 and len(rendered_8) == 3 * 8, "three renders per tool turn"
    assert rendered_8 == rendered_2[:3] * 8 and max(rendered_8) == 1 + 1 + 1, "the prompt, the turn, its tool message"
    assert len(tokenized_8) == 3 * 8 and tokenized_8 == tokenized_2[:3] * 8, "the same characters tokenized every turn"
    assert length_8 > 3 * length_2, "while the conversation grew"


def test_the_reward_stream_gets_each_episode_as_it_ends_with_the_tool_rewards_in_its_extra_info(runner):
    """rounds.stream_to (what generate_share hands the runner as on_finished): each episode is added at its batch row
    (prompt p's sample k: p * n + k) while others still generate, its extra_info what build_rollout_batch gives it
    (rollout_reward_scores: the tools' calc_reward; num_turns), so finish() finds the same texts."""
    from grpo_lib.rollout.episodes import reward_extra_info
    from grpo_lib.trainer.rounds import stream_to
    from grpo_lib.trainer.step import build_rollout_batch

    engine = SessionEngine(runner.tokenizer, mixed)

    class Stream:
        added: list = []

        def add(self, index, **fields):
            self.added.append((index, fields, len(engine.log)))

        def poll(self):
            pass

    prompts = make_prompts(runner, ["What is 6 * 7?", "What is 1 + 1?"], extra_infos=[{"index": 0}, {"index": 1}])
    stream = Stream()
    groups = runner.generate(engine, prompts, n=2, max_tokens=300, seeds=[100, 200], **SAMPLING,
                             on_finished=stream_to(stream, prompts, local_of={0: 0, 1: 1}, n=2))
    batch = build_rollout_batch(prompts, groups)
    assert sorted(i for i, _, _ in stream.added) == [0, 1, 2, 3]
    for index, fields, _ in stream.added:
        assert fields["response"] == batch.response_texts[index] and fields["extra_info"] == batch.extra_infos[index]
    g = groups[0][0]
    assert stream.added[0][1]["extra_info"] == reward_extra_info({"index": 1}, groups[1][stream.added[0][0] - 2].episode)
    assert g.episode.tool_rewards["recorder"] == 0.25 and batch.extra_infos[0]["rollout_reward_scores"]["recorder"] == 0.25
    assert batch.extra_infos[0]["num_turns"] == 3 + 2 + 1
    assert stream.added[0][2] < len(engine.log), "the first episode was scored before the engine's last request"


@pytest.mark.parametrize("tp", [1, 2])
def test_from_config_runs_per_episode_only_without_tensor_parallelism(tokenizer, tp):
    from types import SimpleNamespace

    from grpo_lib.config.schema import MultiTurnConfig
    from grpo_lib.rollout.episodes import EpisodeRunner

    mt = MultiTurnConfig(enable=True, tool_config_path="recipes/tool_config/calculator_tool_config.yaml")
    cfg = SimpleNamespace(rollout=SimpleNamespace(multi_turn=mt, tensor_model_parallel_size=tp),
                          data=SimpleNamespace(apply_chat_template_kwargs={}),
                          reward=SimpleNamespace(import_timeout_s=60.0))  # the keys from_config reads
    runner = EpisodeRunner.from_config(cfg, tokenizer=tokenizer)
    try:
        assert runner.per_episode is (tp == 1)
    finally:
        runner.toolbox.close()
