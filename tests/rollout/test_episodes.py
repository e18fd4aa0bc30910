"""The multi-turn episode loop (grpo_lib/rollout/episodes.py) on CPU with a scripted engine and small fake tools
(tests/scripts/episode_case.py) over the tiny model's tokenizer and its Qwen-style template with tools.

What is held: an episode is the chat template's rendering of the conversation with the model's sampled ids at the
model's positions; the loss mask is 1 exactly there; one engine call per turn with a seed per (sample, turn);
the response budget, the turn limits, and every bad input as text the model reads plus its counter; the metrics;
tool rewards reaching the reward function; templates that would drift are refused naming the model.
"""

from __future__ import annotations

import pytest

from grpo_lib.core.seeds import turn_seed
from grpo_lib.rollout.episodes import TemplateError, episode_sums
from grpo_lib.trainer.rounds import reduce_episode_metrics
from grpo_lib.trainer.step import RunAborted, build_rollout_batch, check_tool_errors
from tests.scripts.episode_case import ScriptedEngine, all_tools, call, calls_then_answer, make_prompts, make_runner

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, logprobs=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def runner(tokenizer):
    r = make_runner(tokenizer)
    yield r
    r.toolbox.close()


def episode(runner, script, *, question="What is 6 * 7?", max_tokens=400, n=1, seeds=(1000,), extra_infos=None):
    """One prompt's n episodes, the engine, and the prompt."""
    engine = ScriptedEngine(runner.tokenizer, script)
    prompts = make_prompts(runner, [question], extra_infos=extra_infos)
    [group] = runner.generate(engine, prompts, n=n, max_tokens=max_tokens, seeds=list(seeds), **SAMPLING)
    return group, engine, prompts


def tool_texts(tokenizer, generation) -> list[str]:
    """The tool responses the model read, out of the episode's own tokens."""
    text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
    return [chunk.split("\n</tool_response>", 1)[0] for chunk in text.split("<tool_response>\n")[1:]]


def test_episode_is_the_templates_rendering_with_the_sampled_ids_at_the_models_positions(runner, tokenizer):
    turns = [call("calculator", expression="6 * 7"), "Check: " + call("calculator", expression="42 / 6")]
    [g], engine, prompts = episode(runner, calls_then_answer(*turns, answer="#### 42"))
    assert len(engine.calls) == 3 and all(c["n"] == 1 for c in engine.calls), "one engine call per turn, n=1"
    # The whole conversation rendered by the template (no generation prompt) is the prompt + episode + the "\n" the
    # template writes after the last <|im_end|> (the episode ends at the model's eos).
    conversation = prompts.messages[0] + [
        {"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "42"},
        {"role": "assistant", "content": turns[1]}, {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "#### 42"}]
    rendered = tokenizer(tokenizer.apply_chat_template(conversation, tools=runner.toolbox.schemas, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert prompts.prompt_ids[0] + g.token_ids == rendered[:-1] and tokenizer.decode(rendered[-1:]) == "\n"
    # the model's positions hold exactly what it sampled, in order; everything else is the template's (loss 0)
    sampled = [t for t, m in zip(g.token_ids, g.loss_mask) if m == 1]
    assert sampled == [t for turn in engine.sampled for t in turn]
    starts = [i for i in range(len(g.loss_mask)) if g.loss_mask[i] == 1 and (i == 0 or g.loss_mask[i - 1] == 0)]
    assert len(starts) == 3, "three assistant turns, separated by two tool turns"
    for start, turn in zip(starts, engine.sampled):
        assert g.token_ids[start:start + len(turn)] == turn and all(g.loss_mask[start:start + len(turn)])
    engine_lps = [lp for c_turn, out in zip(engine.sampled, range(3)) for lp in [-((1000 % 89 if out == 0 else
                  turn_seed(1000, out) % 89) + j + 1) / 100 for j in range(len(c_turn))]]
    assert [lp for lp, m in zip(g.logprobs, g.loss_mask) if m] == engine_lps
    assert all(lp == 0.0 for lp, m in zip(g.logprobs, g.loss_mask) if not m), "no logprob off the model's tokens"
    holes = tokenizer.decode([t for t, m in zip(g.token_ids, g.loss_mask) if not m])
    assert holes.startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert g.text == tokenizer.decode(g.token_ids, skip_special_tokens=True) and g.finish_reason == "stop"
    e = g.episode
    assert (e.assistant_turns, e.user_turns, e.stop, e.calls, e.step_rewards) == (3, 2, "answer", {"calculator": 2}, [0.0, 0.0])


def test_one_engine_call_per_turn_batches_every_running_episode_with_its_own_seed(runner):
    """Prompt 0 answers at once, prompt 1 calls a tool twice: turn 0 carries all 4 samples (n=2 each as n=1 requests),
    later turns only prompt 1's; turn t of a sample uses turn_seed(sample seed, t); max_tokens is each episode's rest
    of the budget. A sample's episode is the same when its prompt runs alone (nothing depends on the batch)."""
    def script(context, seed):
        if "What is 1 + 1?" in context:
            return f"#### 2 (seed {seed % 1000})"
        return calls_then_answer(call("echo", text=f"a{seed % 1000}"), call("echo", text="b"))(context, seed)

    engine = ScriptedEngine(runner.tokenizer, script)
    prompts = make_prompts(runner, ["What is 1 + 1?", "What is 6 * 7?"])
    groups = runner.generate(engine, prompts, n=2, max_tokens=300, seeds=[100, 200], **SAMPLING)
    assert [len(c["prompts"]) for c in engine.calls] == [4, 2, 2]
    assert engine.calls[0]["seeds"] == [100, 101, 200, 201]
    assert engine.calls[1]["seeds"] == [turn_seed(200, 1), turn_seed(201, 1)]
    assert engine.calls[2]["seeds"] == [turn_seed(200, 2), turn_seed(201, 2)]
    assert engine.calls[0]["max_tokens"] == [300] * 4
    assert engine.calls[1]["max_tokens"] == [300 - len(c) + len(p) for c, p in zip(engine.calls[1]["prompts"], prompts.prompt_ids[1:] * 2)]
    assert [g.episode.assistant_turns for grp in groups for g in grp] == [1, 1, 3, 3]
    alone = ScriptedEngine(runner.tokenizer, script)
    [group] = runner.generate(alone, make_prompts(runner, ["What is 6 * 7?"]), n=2, max_tokens=300, seeds=[200], **SAMPLING)
    assert [g.token_ids for g in group] == [g.token_ids for g in groups[1]]


def test_the_budget_cuts_the_last_tool_response_and_the_episode_says_length(runner, tokenizer):
    first = call("long", text="x")
    [free], _, _ = episode(runner, calls_then_answer(first))
    budget = free.loss_mask.index(0) + 20  # the first turn, then 20 tokens of the tool turn
    [g], engine, _ = episode(runner, calls_then_answer(first), max_tokens=budget)
    assert len(engine.calls) == 1, "no room left for a second turn"
    assert len(g.token_ids) == budget and g.token_ids == free.token_ids[:budget] and g.loss_mask[-20:] == [0] * 20
    assert (g.finish_reason, g.episode.stop, g.episode.user_turns) == ("length", "length", 1)


def test_a_turn_cut_by_the_budget_ends_the_episode(runner):
    script = calls_then_answer(call("echo", text="hi"), answer="7 " * 50)
    [free], _, _ = episode(runner, script)
    second = free.loss_mask.index(1, free.loss_mask.index(0))  # where the second turn starts
    [g], engine, _ = episode(runner, script, max_tokens=second + 10)
    assert engine.calls[-1]["max_tokens"] == [10] and g.token_ids == free.token_ids[:second + 10]
    assert g.loss_mask[-10:] == [1] * 10 and (g.finish_reason, g.episode.stop) == ("length", "length")


@pytest.mark.parametrize("limit", ["max_assistant_turns=2", "max_user_turns=1"])
def test_turn_limits_stop_the_episode_with_a_call_unanswered(tokenizer, limit):
    key, value = limit.split("=")
    runner = make_runner(tokenizer, **{key: int(value)})
    try:
        always = lambda context, seed: call("echo", text="again")  # noqa: E731
        [g], engine, _ = episode(runner, always)
    finally:
        runner.toolbox.close()
    e = g.episode
    assert (len(engine.calls), e.assistant_turns, e.user_turns, e.stop, e.calls) == (2, 2, 1, "turn_limit", {"echo": 1})
    assert g.finish_reason == "stop" and g.loss_mask[-1] == 1, "the episode ends on the model's unanswered call"
    metrics = reduce_episode_metrics(episode_sums([[g]], runner.tool_names), runner.tool_names)
    assert metrics["episode/stopped_turn_limit"] == 1.0 and metrics["episode/stopped_length"] == 0.0


# -- bad input is an observation: the text the model reads and the counter, one case each ------------------------

@pytest.mark.parametrize("turn, counter, text", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "invalid_calls",
     'Error: the tool call is not valid JSON (Expecting value at character 51). Call a tool as '
     '<tool_call>{"name": <tool name>, "arguments": {...}}</tool_call>.'),
    (call("calculater", expression="1"), "invalid_calls",
     "Error: there is no tool named 'calculater'; the tools are: calculator, calc_gsm8k_reward, echo, flaky, slow, "
     "slow_async, long, recorder."),
    (call("calculator", expr="1"), "invalid_calls", "Error: wrong arguments for calculator: missing required argument 'expression'."),
    (call("calculator", expression=6), "invalid_calls", "Error: wrong arguments for calculator: 'expression' must be a string, got 6."),
    (call("flaky", text="x"), "errors", "Error: flaky failed: RuntimeError: boom"),
    (call("slow", text="x"), "timeouts", "Error: slow did not answer within 0.3 s."),
    (call("slow_async", text="x"), "timeouts", "Error: slow_async did not answer within 0.3 s."),
], ids=["malformed_json", "unknown_tool", "missing_argument", "wrong_type", "raises", "hangs", "hangs_async"])
def test_bad_input_becomes_the_text_the_model_reads_and_a_counter(runner, tokenizer, turn, counter, text):
    [g], engine, _ = episode(runner, calls_then_answer(turn, answer="sorry"))
    assert tool_texts(tokenizer, g) == [text]
    assert g.episode.stop == "answer" and g.episode.assistant_turns == 2, "the episode goes on after the error"
    metrics = reduce_episode_metrics(episode_sums([[g]], runner.tool_names), runner.tool_names)
    for key in ("invalid_calls", "errors", "timeouts", "truncated_responses"):
        assert metrics[f"tools/{key}"] == (1.0 if key == counter else 0.0), (key, metrics)


@pytest.mark.parametrize("side, expected", [
    ("left", "0123456789" * 3 + "...(truncated)"),
    ("right", "(truncated)..." + "0123456789" * 3),
    ("middle", "012345678901234...(truncated)...567890123456789"),
])
def test_an_over_long_response_is_cut_on_its_side_and_counted(tokenizer, side, expected):
    runner = make_runner(tokenizer, max_tool_response_length=30, tool_response_truncate_side=side)
    try:
        [g], _, _ = episode(runner, calls_then_answer(call("long", text="x")))
    finally:
        runner.toolbox.close()
    assert tool_texts(tokenizer, g) == [expected]
    assert g.episode.truncated_responses == 1 and g.episode.errors == 0


def test_calls_past_max_parallel_calls_are_dropped_and_counted(runner, tokenizer):
    [g], _, _ = episode(runner, calls_then_answer(call("echo", text="one") + call("echo", text="two")))
    assert tool_texts(tokenizer, g) == ["one"] and g.episode.dropped_calls == 1 and g.episode.calls == {"echo": 1}


def test_tools_kwargs_reach_create_and_tool_rewards_reach_the_reward_function(tokenizer):
    tools = all_tools()
    runner = make_runner(tokenizer, tools)
    kwargs = {"recorder": {"create_kwargs": {"ground_truth": "42", "seen": True}},
              "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "42"}}}
    try:
        group, _, prompts = episode(runner, calls_then_answer(call("recorder", text="hi"), call("calc_gsm8k_reward", answer="42")),
                                    extra_infos=[{"index": 7, "tools_kwargs": kwargs}])
    finally:
        runner.toolbox.close()
    [g] = group
    log = tools["recorder"].log
    instance = log[0][1]
    assert log == [("create", instance, {"ground_truth": "42", "seen": True}), ("execute", instance, {"text": "hi"}),
                   ("calc_reward", instance, {}), ("release", instance, {})]
    assert g.episode.tool_rewards["calc_gsm8k_reward"] == 1.0 and g.episode.tool_rewards["recorder"] == 0.25
    batch = build_rollout_batch(prompts, [group], pad_id=0)
    info = batch.extra_infos[0]
    assert info["rollout_reward_scores"]["calc_gsm8k_reward"] == 1.0 and info["num_turns"] == 6 and info["index"] == 7
    assert prompts.extra_infos[0].keys() == {"index", "tools_kwargs"}, "the data row's own extra_info is not changed"
    assert batch.loss_mask[0, len(prompts.prompt_ids[0]):].tolist() == [float(m) for m in g.loss_mask]


def test_a_tool_failing_on_every_call_of_a_step_stops_the_run(runner):
    always = lambda context, seed: call("flaky", text="x") if "<tool_response>" not in context else "ok"  # noqa: E731
    group, _, _ = episode(runner, always, n=3, seeds=(5,))
    metrics = reduce_episode_metrics(episode_sums([group], runner.tool_names), runner.tool_names)
    assert (metrics["tools/flaky/calls"], metrics["tools/flaky/failures"], metrics["tools/errors"]) == (3.0, 3.0, 3.0)
    with pytest.raises(RunAborted, match="tool flaky failed on every one of its 3 calls") as err:
        check_tool_errors(metrics, runner.tool_names, step=4)
    assert err.value.exit_code == 3
    check_tool_errors({**metrics, "tools/flaky/failures": 2.0}, runner.tool_names, step=4)  # one answered: no stop


def test_episode_metrics_over_a_batch(runner):
    def script(context, seed):
        if "What is 1 + 1?" in context:
            return "#### 2"
        return calls_then_answer(call("echo", text="a"), call("nope", text="b"))(context, seed)

    engine = ScriptedEngine(runner.tokenizer, script)
    groups = runner.generate(engine, make_prompts(runner, ["What is 1 + 1?", "What is 6 * 7?"]), n=2, max_tokens=600,
                             seeds=[1, 2], timings=(timings := {}), **SAMPLING)
    m = reduce_episode_metrics(episode_sums(groups, runner.tool_names), runner.tool_names)
    # 4 episodes: two of 1 turn, two of 3 turns (echo, then an unknown tool, then the answer)
    assert (m["episode/turns_mean"], m["episode/turns_max"], m["episode/tool_calls_mean"]) == (2.0, 3.0, 1.0)
    assert (m["tools/echo/calls"], m["tools/invalid_calls"], m["tools/echo/reward_mean"]) == (2.0, 2.0, 0.0)
    assert timings["timing_s/tools"] > 0


def test_a_template_that_breaks_the_prefix_property_is_refused_naming_the_model(tokenizer):
    """A template that counts the messages at the top renders the earlier turns differently once a tool message
    follows: appending a delta would drift, so the runner refuses at start-up."""
    import copy

    drifting = copy.deepcopy(tokenizer)
    drifting.chat_template = "{{ messages | length }} messages\n" + tokenizer.chat_template
    with pytest.raises(TemplateError, match=f"the chat template of {tokenizer.name_or_path} breaks the prefix property"):
        make_runner(drifting)
    silent = copy.deepcopy(tokenizer)  # the tiny model's old template: no tools in the prompt
    silent.chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="does not show the tools to the model"):
        make_runner(silent)


def test_qwen3_style_last_turn_think_block_is_not_a_drift(tokenizer):
    """Qwen3's template writes an empty think block into the LAST assistant turn only: the newest turn's own rendering
    changes when tool messages follow it, but nothing the episode appends does, so it is accepted."""
    import copy

    qwen3ish = copy.deepcopy(tokenizer)
    qwen3ish.chat_template = tokenizer.chat_template.replace(
        "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n",
        "{% elif message['role'] == 'assistant' and loop.last %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "{{ message['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n")
    runner = make_runner(qwen3ish)
    try:
        delta = runner.template_delta([{"role": "user", "content": "q"}], "a", [{"role": "tool", "content": "t"}])
    finally:
        runner.toolbox.close()
    assert qwen3ish.decode(delta) == "<|im_end|>\n<|im_start|>user\n<tool_response>\nt\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_the_tiny_template_renders_chats_without_tools_as_it_always_has(tokenizer):
    """data_prep/tiny_model.py's template learned tools=; without them it must render as the old one did (single-turn
    runs, the warm-up and every earlier test see the same tokens)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    old = _compile_jinja_template("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chats = [[{"role": "user", "content": "What is 3 + 4?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "#### 7"}],
             [{"role": "user", "content": "x"}, {"role": "system", "content": "a late system message"}]]
    for chat in chats:
        for generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False) == \
                old.render(messages=chat, add_generation_prompt=generation_prompt)


def test_dapo_rounds_draw_new_episodes_and_count_them_all(runner):
    """algorithm.filter_groups with episodes: every round runs its own episodes (seeds of that round), the step's
    episode metrics cover every round, and the kept groups carry their loss-mask holes into the batch."""
    from grpo_lib.config import load_config
    from grpo_lib.rewards import RewardOutput
    from grpo_lib.trainer import rounds

    class Data:
        def batch(self, idx):
            prompts = make_prompts(runner, [f"What is {i} + 1?" for i in idx], extra_infos=[{"index": i} for i in idx])
            prompts.group_ids = [f"p{i}" for i in idx]
            return prompts

    class Sampler:
        position = 0

        def next_batch(self):
            self.position += 2
            return [(self.position - 2) % 4, (self.position - 1) % 4]

    class Scorer:  # prompts 0 and 1 all-equal; 2 and 3 score by the answer the seed chose
        last_error_samples = []

        def score(self, *, responses, data_sources, ground_truths, extra_infos):
            scores = [0.0 if e["index"] < 2 else float(r.endswith("#### 1")) for r, e in zip(responses, extra_infos)]
            return RewardOutput(scores=scores, per_function={"accuracy": scores}, extra={}, num_errors=0, num_timeouts=0)

    engine = ScriptedEngine(runner.tokenizer, lambda context, seed: calls_then_answer(call("echo", text="x"),
                                                                                       answer=f"#### {seed % 2}")(context, seed))
    engine.pop_metrics = lambda prefix="": {"rollout/preemptions": 0.0}
    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused.parquet]", "data.train_batch_size=2",
                             "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "rollout.n=4",
                             "data.max_response_length=400", "algorithm.filter_groups.enable=true",
                             "algorithm.filter_groups.max_num_gen_batches=3"])
    batch, metrics = rounds.collect_rollouts(cfg, engine, Scorer(), Data(), Sampler(), step=1, world_size=1, rank=0, timings={},
                                           episodes=runner)
    assert metrics["batch/gen_rounds"] == 2.0 and metrics["batch/kept_groups"] == 2.0, metrics
    assert metrics["tools/echo/calls"] == 16.0 and metrics["episode/turns_mean"] == 2.0, "both rounds' 16 episodes counted"
    assert [len(c["prompts"]) for c in engine.calls] == [8, 8, 8, 8], "two rounds of two turns, 8 episodes each"
    assert set(engine.calls[0]["seeds"]).isdisjoint(engine.calls[2]["seeds"]), "each round, new seeds"
    assert sorted(set(batch.group_ids)) == ["p2#round2", "p3#round2"]
    assert ((batch.response_mask - batch.loss_mask).sum(-1) > 0).all(), "every kept episode keeps its tool-turn hole"


@pytest.mark.multiprocess
def test_tools_under_tensor_parallelism_run_on_the_leader_and_every_member_gets_the_same_context(tiny_model_dir, tmp_path):
    """Issue 28 item 7: a TP group's members must send their engines identical requests. A tool that times out on
    process 1 only gave that process another tool response (a collective mismatch in the engine: a hang or garbage).
    Now the group's first process runs the tools and hands the outcomes to its members: identical episodes on both, the
    tool run on process 0 only (4 episodes x 2 calls), no timeout. The same loop without the leader shows the failure."""
    from tests.conftest import torchrun_records

    zero, one = torchrun_records("tp_tools_worker.py", str(tiny_model_dir), str(tmp_path), out_dir=tmp_path)
    assert zero["led"] == one["led"], "the TP members' episodes differ: their engines would get different requests"
    assert all(failures == {} for *_, failures in zero["led"]), zero["led"]
    assert zero["ran_led"] == [0] * 8 and one["ran_led"] == [], (zero["ran_led"], one["ran_led"])
    assert zero["alone"] != one["alone"], "without the leader, process 1's timeouts give it other contexts"


@pytest.mark.multiprocess
def test_a_tool_stall_on_one_process_stops_the_step_on_every_process(tiny_model_dir, tmp_path):
    """Issue 30 item 6: a ToolStallError on one data-parallel process only left the others waiting in the step's next
    collective for a process that had stopped. Now every process raises it from EpisodeRunner.generate (the failing
    process's own, the other's naming it), and both still meet in the collective after it (no hang)."""
    from tests.conftest import torchrun_records

    zero, one = torchrun_records("stall_agreement_worker.py", str(tiny_model_dir), str(tmp_path), out_dir=tmp_path,
                                 timeout=120)
    assert one["raised"] is not None and "did not return within 0.5 s" in one["raised"], one
    assert zero["raised"] is not None and zero["raised"].startswith("process 1: the tool calls of a turn"), zero
    assert zero["after"] == one["after"] == 2.0


def test_a_process_with_no_share_joins_the_stall_agreement(monkeypatch):
    """A process with no prompt this round (a validation set smaller than the process count) does not call generate:
    generate_share has it sit out, taking part in the same agreement, so a stall elsewhere is raised there too."""
    from grpo_lib.rollout import episodes as E
    from grpo_lib.trainer.rounds import generate_share

    calls = []
    monkeypatch.setattr(E, "raise_agreed", lambda error: calls.append(error))
    runner = E.EpisodeRunner.__new__(E.EpisodeRunner)  # sit_out reads no state

    class Empty:
        def batch(self, rows):
            assert rows == []
            return "empty"

    cfg = type("Cfg", (), {"rollout": type("R", (), {"tensor_model_parallel_size": 1})()})()
    prompts, generations = generate_share(cfg, None, Empty(), [5], world_size=2, rank=1, purpose="val", step=0, round=0,
                                          sampling={"n": 1}, episodes=runner)
    assert (prompts, generations) == ("empty", []) and calls == [None]
