"""Multi-turn episodes (`rollout.multi_turn.enable`): the model answers, calls tools, reads their responses, answers
again, until it answers without a tool call. One `Generation` per episode comes out, as single-turn generation gives
one per response, so everything after generation (rewards, advantages, the loss) is unchanged but for the loss mask.

One episode, as tokens after the prompt (a = sampled by the model, t = written by the chat template):

    a a a a <tool_call>...</tool_call> <|im_end|> | \\n <|im_start|>user\\n<tool_response>\\n42\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n | a a a <|im_end|>
    loss_mask 1 ...                                1 | 0 ...                                                                                 0 | 1 ...          1
    logprobs  the engine's ...                       | 0 ...                                                                                 0 | the engine's ...

How episodes run. Seeds: turn t of sample k of prompt i uses `seeds.turn_seed(seeds[i] + k, t)`, so it depends on
the sample and the turn only (not on the process count, nor on what runs beside it); turn 0 is the single-turn sample
itself. Each turn is its own request (n=1, its context = prompt + episode so far, max_tokens = what is left of
data.max_response_length; vLLM's prefix cache reuses the shared context). Two loops send the same requests:

- per episode (an engine with `open_session`, engines/base.py's GenerationSession: vLLM; and no tensor parallelism):
  every episode's first turn joins the engine, which is stepped here; when a turn ends, its tool calls run in a
  thread of their own (grpo_lib/tools/calls.py, each under rollout.multi_turn.tool_timeout_s) while the engine keeps
  generating the others, and the episode's next turn is added as soon as they answered. The engine drains only when
  every episode has ended; it waits idle only when nothing is left to generate until a tool answers.
- turn by turn (the hf engine; and under tensor_model_parallel_size > 1, where the members of a TP group must send
  identical requests in identical order, which the tools' timing would not keep; there the group's leader runs the
  tools and broadcasts the outcomes): ONE engine call per turn for every episode still running, then the tool calls
  of all those turns at once.

Either way each episode's context grows by the chat template's rendering of its tool responses, and an episode that
ends is finished at once (its tools' calc_reward and release) and handed to `on_finished` (the reward stream scores
it while the others go on).

Creation responses (verl 0.9): a tool whose create returns (instance_id, ToolResponse) with text has it shown to the
model before the episode's first turn, as tool messages (verl's rollout adds them after the prompt's messages); the
prompt's tokens end in the generation prompt, so they join as the delta after an empty assistant turn (loss_mask 0),
counted as no user turn.

Tokens are never re-tokenized: the model's sampled ids stay as they are. The tool responses join as the token delta of
the chat template (`EpisodeRunner.template_delta`): the prompt's messages are rendered without and with the newest
assistant turn (its decoded text) and its tool messages (`add_generation_prompt` on the longer). Only the prompt's
messages come before the turn, not the earlier turns: what a template writes after an assistant turn depends on that
turn and its tool messages, so each tool turn renders and tokenizes a window of constant size (linear work in the
turns, not quadratic; the whole conversation is still the template's rendering, tests/rollout/test_episodes.py). The shorter
must be a token prefix of the longer, and the tokens after the
newest turn's text are appended: the template's end of the turn (`<|im_end|>\\n` for Qwen, less the `<|im_end|>` the
model sampled itself), the tool messages, the next generation prompt. A template that breaks the prefix property
raises TemplateError naming the model: the episode would otherwise drift from what the template renders (the drift
behind TRL's and verl's multi-turn reports). The newest turn's own rendering is exempt (its tokens are the model's):
Qwen3's template writes an empty think block into the last assistant turn only.

An episode stops when a turn holds no tool call (stop "answer"), when it reached rollout.multi_turn.max_assistant_turns
or max_user_turns with a call unanswered ("turn_limit"), or when data.max_response_length, which counts every token
after the prompt (assistant and tool, as verl counts it), is spent ("length": a turn cut at it, or a tool response cut
to the budget; finish_reason "length"). At the end every tool's calc_reward gives the episode's tool rewards; they
reach the reward function as verl passes them, `extra_info["rollout_reward_scores"]` ({tool: reward}), with
`extra_info["num_turns"]` (verl's count: assistant + tool turns + 1).
"""

from __future__ import annotations

import time
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from grpo_lib.core.distributed import group_leader_call, raise_agreed
from grpo_lib.core.seeds import turn_seed
from grpo_lib.core.types import EpisodeStats, Generation, PromptBatch, ScoreRequest
from grpo_lib.rollout.engines.base import OnFinished
from grpo_lib.tools.calls import CallOutcome, ToolBox, escape_control_tokens
from grpo_lib.tools.functions import load_all_tools
from grpo_lib.tools.hermes import parse_tool_calls

_PROBE = "grpo-probe-7f3a"  # assistant text whose rendering shows what the template writes after an assistant turn


class TemplateError(RuntimeError):
    """The chat template renders a conversation so that appending a message changes tokens before it."""


@dataclass
class _Episode:
    """One episode in progress: its context and what it has done so far."""

    instance_id: str  # the tools' instance id of this episode
    prompt_ids: list[int]
    messages: list[dict]  # the prompt's messages: each tool turn's delta is rendered after them (_append_tool_turn)
    seed: int | None  # the sample's seed; turn t uses turn_seed(seed, t)
    stats: EpisodeStats
    tokens: list[int] = field(default_factory=list)  # [response_len] everything after the prompt
    mask: list[int] = field(default_factory=list)  # [response_len] 1 sampled, 0 template / tool
    logprobs: list[float] = field(default_factory=list)  # [response_len] the engine's on sampled tokens, else 0

    def append(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += ids
        self.mask += [1 if sampled else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


class EpisodeRunner:
    """The episode loop of one run: the tokenizer that renders the chat template, the tools, the turn limits."""

    def __init__(self, *, tokenizer, toolbox: ToolBox, multi_turn, chat_template_kwargs: dict | None = None,
                 leader_call=None, per_episode: bool = True):
        self.tokenizer, self.toolbox, self.cfg = tokenizer, toolbox, multi_turn  # cfg: rollout.multi_turn
        # The per-episode loop adds an episode's next turn when its tools answer, an order set by the tools' timing;
        # the members of a TP group must send their engines identical requests in identical order, so under tensor
        # parallelism the loop stays turn-synchronous (per_episode False), where each turn's order is fixed.
        self.per_episode = per_episode
        # Under tensor parallelism the group's first process runs the tools and its members receive the outcomes
        # (distributed.group_leader_call): a timeout on one member would otherwise give it another context than its
        # group's, and the engine's TP collectives would mismatch. The identity without TP.
        self.leader_call = leader_call or (lambda fn: fn())
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.model = getattr(tokenizer, "name_or_path", "?")
        added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]  # tool text is data: these escaped
        self.control_tokens = sorted({*getattr(tokenizer, "all_special_tokens", []), *added}, key=len, reverse=True)
        self.turn_end = self._turn_end_ids()
        self.check_template()

    @classmethod
    def from_config(cls, cfg, *, tokenizer) -> EpisodeRunner | None:
        """The run's episode loop: the tools of rollout.multi_turn.tool_config_path and function_tool_path, checked
        against the chat template; None unless rollout.multi_turn.enable. Raises ToolConfigError (a config that cannot
        load) or TemplateError (a template that cannot extend an episode), both before the engine starts; the tools
        are closed on a failure."""
        mt = cfg.rollout.multi_turn
        if not mt.enable:
            return None
        tools = load_all_tools(mt.tool_config_path, mt.function_tool_path, import_timeout_s=cfg.reward.import_timeout_s)
        toolbox = ToolBox(tools, timeout_s=mt.tool_timeout_s, worker_start_timeout_s=cfg.reward.import_timeout_s,
                          max_response_chars=mt.max_tool_response_length, truncate_side=mt.tool_response_truncate_side)
        try:
            return cls(tokenizer=tokenizer, toolbox=toolbox, multi_turn=mt, chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
                       leader_call=group_leader_call(cfg.rollout.tensor_model_parallel_size),
                       per_episode=cfg.rollout.tensor_model_parallel_size == 1)
        except TemplateError:
            toolbox.close()
            raise

    @property
    def tool_names(self) -> list[str]:
        return list(self.toolbox.tools)

    # -- the loop ---------------------------------------------------------------------------------------------

    def generate(self, engine, prompts: PromptBatch, *, n: int, temperature: float, max_tokens: int, top_p: float = 1.0,
                 top_k: int = -1, seeds: list[int] | None = None, logprobs: bool = True,
                 timings: dict | None = None, on_finished: OnFinished | None = None,
                 score: ScoreRequest | None = None) -> list[list[Generation]]:
        """`n` episodes per prompt, [num_prompts][n] Generations, as `engine.generate` gives responses; `max_tokens` is
        the response budget of each episode (data.max_response_length). Adds the tools' wall time to
        timings["timing_s/tools"]. `on_finished` (`engines.base.OnFinished`, the reward stream) hears of each episode
        as it ends, its tool rewards in: [(prompt index, sample index, Generation)] (the Generation returned).
        `score` (the weight probe) rides in the first engine call: the session, or the first turn's generate.

        The per-episode loop (module docstring) where the engine offers `open_session` and the episodes need not
        stay in step with other processes (`self.per_episode`: no tensor parallelism); else one engine call per turn.

        An error on any process (a ToolStallError, a TemplateError, ...) is raised on every process when each has
        generated its share (or, with no share, called `sit_out`): the step, or the validation, stops everywhere (exit 3;
        2 for a template) and no process waits in a collective for it."""
        try:
            out = self._generate(engine, prompts, n=n, temperature=temperature, max_tokens=max_tokens, top_p=top_p,
                                 top_k=top_k, seeds=seeds, logprobs=logprobs, timings=timings, on_finished=on_finished,
                                 score=score)
        except Exception as error:  # noqa: BLE001 - a ToolStallError, a TemplateError, an engine's: agreed, then raised
            raise_agreed(error)
            raise  # raise_agreed raised it already; kept for readers
        raise_agreed(None)
        return out

    def sit_out(self) -> None:
        """This process has no episode this round (a validation set smaller than the process count): it takes part
        in the round's agreement on a tool stall as `generate` does, raising the others' ToolStallError."""
        raise_agreed(None)

    def _generate(self, engine, prompts: PromptBatch, *, n: int, temperature: float, max_tokens: int, top_p: float,
                  top_k: int, seeds: list[int] | None, logprobs: bool, timings: dict | None,
                  on_finished: OnFinished | None, score: ScoreRequest | None) -> list[list[Generation]]:
        assert prompts.messages is not None, "multi-turn prompts keep their messages: load_prompts(..., tools=schemas)"
        episodes = [
            _Episode(instance_id=f"{i}:{k}:{prompts.group_ids[i]}", prompt_ids=list(prompts.prompt_ids[i]),
                     messages=list(prompts.messages[i]), seed=None if seeds is None else seeds[i] + k,
                     stats=EpisodeStats(assistant_turns=0, user_turns=0, stop="", calls={}, failures={}))
            for i in range(len(prompts)) for k in range(n)]
        timings = timings if timings is not None else {}
        started = time.perf_counter()
        tools_kwargs = [(prompts.extra_infos[i] or {}).get("tools_kwargs") or {} for i in range(len(prompts)) for _ in range(n)]
        def start_tools():  # the failures and the creation responses: under TP both come from the group's leader
            failures = self.toolbox.start([(ep.instance_id, kw) for ep, kw in zip(episodes, tools_kwargs)])
            return failures, {ep.instance_id: self.toolbox.created.get(ep.instance_id) for ep in episodes}

        started_tools, created_responses = self.leader_call(start_tools)
        for ep, failed in zip(episodes, started_tools):
            self._count_failures(ep.stats, failed)
            if created := created_responses.get(ep.instance_id):  # verl 0.9: creation responses, read before turn 0
                self._append_tool_turn(ep, "", [], created, budget=max_tokens)
                ep.stats.user_turns -= 1  # verl counts no turn for them
        tool_seconds = time.perf_counter() - started
        done: list[Generation | None] = [None] * len(episodes)

        def report(index: int, generation: Generation) -> None:
            done[index] = generation
            if on_finished is not None:
                on_finished([(*divmod(index, n), generation)])

        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs)
        open_session = getattr(engine, "open_session", None)
        if open_session is not None and self.per_episode:
            session = open_session(**sampling, **({} if score is None else {"score": score}))
            tool_seconds += self._per_episode_loop(session, episodes, seeded=seeds is not None,
                                                   max_tokens=max_tokens, report=report,
                                                   tick=None if on_finished is None else lambda: on_finished([]))
        else:
            tool_seconds += self._turn_loop(engine, episodes, sampling, seeded=seeds is not None, max_tokens=max_tokens,
                                            report=report, score=score)
        timings["timing_s/tools"] = timings.get("timing_s/tools", 0.0) + tool_seconds
        return [done[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _turn_loop(self, engine, episodes: list[_Episode], sampling: dict, *, seeded: bool, max_tokens: int, report,
                   score: ScoreRequest | None = None) -> float:
        """One engine call per turn for every running episode, then all their tool calls at once; the episodes that
        ended in a turn are finished (calc_reward, release) and reported after it; `score` rides in turn 0's call.
        Returns the tools' seconds."""
        def finish(ended: list[int]) -> None:  # calc_reward + release of the episodes that ended, then their reports
            if ended:
                finished = self.leader_call(lambda: self.toolbox.finish([episodes[j].instance_id for j in ended]))
                for j, result in zip(ended, finished):
                    report(j, self._final(episodes[j], result))

        active, turn, tool_seconds = list(range(len(episodes))), 0, 0.0
        finish([j for j in active if episodes[j].stats.stop])  # ended before turn 0: a creation response past the budget
        active = [j for j in active if not episodes[j].stats.stop]
        while active:
            outputs = engine.generate([episodes[j].prompt_ids + episodes[j].tokens for j in active], n=1,
                                      max_tokens=[max_tokens - len(episodes[j].tokens) for j in active],
                                      seeds=[turn_seed(episodes[j].seed, turn) for j in active] if seeded else None, **sampling,
                                      **({"score": score} if score is not None and turn == 0 else {}))
            pending = []  # (episode index, its turn's output, the calls to run)
            for j, (out,) in zip(active, outputs):
                calls = self._end_turn(episodes[j], out, max_tokens=max_tokens)
                if calls:
                    pending.append((j, out, calls))
            started = time.perf_counter()
            outcomes = self.leader_call(lambda: self.toolbox.run(
                [(episodes[j].instance_id, call) for j, _, calls in pending for call in calls]))
            for j, out, calls in pending:
                answered, outcomes = outcomes[:len(calls)], outcomes[len(calls):]
                self._answer(episodes[j], out, answered, max_tokens=max_tokens)
            finish([j for j in active if episodes[j].stats.stop])
            tool_seconds += time.perf_counter() - started
            active = [j for j in active if not episodes[j].stats.stop]
            turn += 1
        return tool_seconds

    def _per_episode_loop(self, session_cm, episodes: list[_Episode], *, seeded: bool, max_tokens: int, report,
                          tick=None) -> float:
        """Each episode on its own: when its turn ends its tool calls run in a thread (the engine keeps generating the
        others) and its next turn joins the engine as soon as they answered; an ended episode is finished and reported
        at once. Same requests per episode as `_turn_loop` (context, budget left, turn_seed of its turn), so the same
        tokens from a batch-invariant engine and deterministic tools. Returns the seconds the engine sat idle waiting
        for tools (the tool time generation did not hide). `tick()` after every engine step (the reward stream's poll,
        as `OnFinished` is called with [] by a generate call)."""
        waiting = 0.0
        running: dict = {}  # Future -> (episode index, its turn's output or None for its finish, the calls)
        with session_cm as session:
            def add(j: int) -> None:
                ep = episodes[j]
                session.add(j, ep.prompt_ids + ep.tokens, max_tokens=max_tokens - len(ep.tokens),
                            seed=turn_seed(ep.seed, ep.stats.assistant_turns) if seeded else None)

            def end(j: int) -> None:
                running[_in_thread(self.toolbox.finish, [episodes[j].instance_id])] = (j, None, None)

            for j in range(len(episodes)):
                end(j) if episodes[j].stats.stop else add(j)  # stopped before turn 0: a creation response past the budget
            while session.unfinished or running:
                for j, out in session.step() if session.unfinished else []:
                    calls = self._end_turn(episodes[j], out, max_tokens=max_tokens)
                    if calls:
                        running[_in_thread(self.toolbox.run, [(episodes[j].instance_id, c) for c in calls])] = (j, out, calls)
                    else:
                        end(j)
                if tick is not None:
                    tick()
                if not session.unfinished and running and not any(f.done() for f in running):
                    started = time.perf_counter()
                    wait(list(running), return_when=FIRST_COMPLETED)  # nothing to generate until a tool answers
                    waiting += time.perf_counter() - started
                for future in [f for f in running if f.done()]:
                    j, out, calls = running.pop(future)
                    if out is None:  # its finish
                        [result] = future.result()
                        report(j, self._final(episodes[j], result))
                        continue
                    self._answer(episodes[j], out, future.result(), max_tokens=max_tokens)
                    if episodes[j].stats.stop:
                        end(j)
                    else:
                        add(j)
        return waiting

    def _end_turn(self, ep: _Episode, out: Generation, *, max_tokens: int) -> list | None:
        """A turn's output joins the episode; the calls to run (at most max_parallel_calls), or None when it stops."""
        ep.append(out.token_ids, sampled=True, logprobs=out.logprobs)
        ep.stats.assistant_turns += 1
        calls = parse_tool_calls(out.text)
        if out.finish_reason == "length" or len(ep.tokens) >= max_tokens:
            ep.stats.stop = "length"
        elif not calls:
            ep.stats.stop = "answer"
        elif self._at_turn_limit(ep.stats):
            ep.stats.stop = "turn_limit"
        else:
            ep.stats.dropped_calls += max(0, len(calls) - self.cfg.max_parallel_calls)
            return calls[:self.cfg.max_parallel_calls]
        return None

    def _answer(self, ep: _Episode, out: Generation, answered: list[CallOutcome], *, max_tokens: int) -> None:
        self._count_calls(ep.stats, answered)
        self._append_tool_turn(ep, out.text, out.token_ids, answered, budget=max_tokens)

    def _final(self, ep: _Episode, finished: tuple[dict[str, float], list[CallOutcome]]) -> Generation:
        """The ended episode's Generation, with its tools' rewards (toolbox.finish's result for it)."""
        rewards, failed = finished
        ep.stats.tool_rewards = rewards
        self._count_failures(ep.stats, failed)
        return Generation(token_ids=ep.tokens, logprobs=ep.logprobs, loss_mask=ep.mask, episode=ep.stats,
                          text=self.tokenizer.decode(ep.tokens, skip_special_tokens=True),
                          finish_reason="length" if ep.stats.stop == "length" else "stop")

    def _at_turn_limit(self, stats: EpisodeStats) -> bool:
        """verl's rule, checked after each generation: the turn just made reached a limit, so its calls are not run."""
        c = self.cfg
        return (c.max_assistant_turns is not None and stats.assistant_turns >= c.max_assistant_turns) or \
            (c.max_user_turns is not None and stats.user_turns >= c.max_user_turns)

    def _append_tool_turn(self, ep: _Episode, text: str, sampled: list[int], answered: list[CallOutcome], *,
                          budget: int) -> None:
        """The template's end of the assistant turn and its rendering of the tool messages, cut to the budget."""
        tool_messages = [{"role": "tool", "content": escape_control_tokens(o.text, self.control_tokens)[0]} for o in answered]
        # Rendered after the prompt's messages alone, not the whole conversation so far: what the template writes after
        # an assistant turn depends on that turn and its tool messages (checked: the tokens before them stay a prefix),
        # so each turn renders and tokenizes a window of constant size (linear in the turns, not quadratic).
        delta = self.template_delta(ep.messages, text, tool_messages)
        # the model sampled the first tokens of the turn's end itself (its eos, Qwen's <|im_end|>): not twice
        overlap = max(k for k in range(min(len(sampled), len(self.turn_end), len(delta)) + 1)
                      if k == 0 or sampled[-k:] == delta[:k])
        added = delta[overlap:]
        room = budget - len(ep.tokens)
        ep.append(added[:room], sampled=False)
        ep.stats.user_turns += 1
        if len(added) >= room:
            ep.stats.stop = "length"

    # -- the chat template -------------------------------------------------------------------------------------

    def render_text(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        """`messages` as the chat template renders them with the run's tools (as data.load_prompts renders prompts)."""
        return self.tokenizer.apply_chat_template(messages, tools=self.toolbox.schemas, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **self.chat_template_kwargs)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def template_delta(self, history: list[dict], assistant_text: str, tool_messages: list[dict]) -> list[int]:
        """Tokens the template writes after an assistant turn with `assistant_text` that follows `history`, when
        `tool_messages` follow it: the end of the turn, the tool messages, the next generation prompt.

        Rendered: the history alone (no generation prompt) and the whole conversation (history, the turn, the tool
        messages, generation prompt). The shorter must be a token prefix of the longer (earlier messages render the
        same whatever follows), and so must the longer cut after the turn's text; the delta is the rest. The turn's
        own rendering is exempt, since its tokens are the model's: Qwen3's template writes an empty think block into
        the last assistant turn only, which moves nothing we append. Raises TemplateError naming the model otherwise.

        Example (Qwen's template): history [system, user], text "<tool_call>...</tool_call>", tool "42" -> ids of
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n".
        """
        assistant = {"role": "assistant", "content": assistant_text}
        full_text = self.render_text(history + [assistant] + tool_messages, add_generation_prompt=True)
        probe = self.render_text(history + [{"role": "assistant", "content": _PROBE}] + tool_messages, add_generation_prompt=True)
        tail = probe[probe.rindex(_PROBE) + len(_PROBE):] if _PROBE in probe else None
        if tail is None or not full_text.endswith(tail):
            raise TemplateError(f"the chat template of {self.model} renders what follows an assistant turn differently "
                                "depending on the turn's text (or drops the text): the tool responses cannot be appended "
                                "as a delta; use a template whose tool turns do not depend on the assistant's text")
        full = self._ids(full_text)
        head = self._ids(full_text[:len(full_text) - len(tail)])  # up to the end of the turn's text
        before = self._ids(self.render_text(history, add_generation_prompt=False))
        for shorter, what in ((before, "the conversation before the turn"), (head, "the conversation up to the turn's end")):
            if full[:len(shorter)] != shorter:
                at = next(i for i, (a, b) in enumerate(zip(shorter, full + [None] * len(shorter))) if a != b)
                raise TemplateError(
                    f"the chat template of {self.model} breaks the prefix property: {what} renders to {len(shorter)} tokens, "
                    f"but with the tool message(s) after it token {at} changes "
                    f"({self.tokenizer.decode(shorter[max(0, at - 8):at + 8])!r} becomes "
                    f"{self.tokenizer.decode(full[max(0, at - 8):at + 8])!r}). Appending the difference would drift from what "
                    "the template renders; use a template that renders earlier messages the same whatever follows them")
        return full[len(head):]

    def check_template(self) -> None:
        """At start-up, before the engine: the template shows the tools to the model (each tool's name is in a rendered
        prompt) and renders a tool turn as a delta (`template_delta` on a two-message conversation). TemplateError if not."""
        prompt = self.render_text([{"role": "user", "content": "u"}], add_generation_prompt=True)
        unseen = [name for name in self.tool_names if name not in prompt]
        if unseen:
            raise TemplateError(f"the chat template of {self.model} does not show the tools to the model: {unseen} not in "
                                f"the rendered prompt {prompt[:300]!r}; use a chat template that renders tools= "
                                "(Qwen2.5 / Qwen3 do)")
        self.template_delta([{"role": "user", "content": "u"}], "a", [{"role": "tool", "content": "t"}])

    def _turn_end_ids(self) -> list[int]:
        """Tokens the template writes after an assistant message's content (Qwen: `<|im_end|>\n`): the most of a
        tool turn's delta that the model may have sampled itself (its eos)."""
        text = self.render_text([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}],
                                add_generation_prompt=False)
        if _PROBE not in text:
            raise TemplateError(f"the chat template of {self.model} does not render an assistant message's content; "
                                "multi-turn episodes need one that does")
        return self._ids(text[text.rindex(_PROBE) + len(_PROBE):])

    # -- counting ------------------------------------------------------------------------------------------------

    @staticmethod
    def _count_calls(stats: EpisodeStats, outcomes: list[CallOutcome]) -> None:
        for o in outcomes:
            if o.kind == "invalid":
                stats.invalid_calls += 1
            else:  # the call reached the tool
                stats.calls[o.tool] = stats.calls.get(o.tool, 0) + 1
                if o.kind != "ok":
                    stats.failures[o.tool] = stats.failures.get(o.tool, 0) + 1
            stats.errors += o.kind == "error"
            stats.timeouts += o.kind == "timeout"
            stats.truncated_responses += o.truncated
            stats.abandoned_calls += o.abandoned
            if o.kind == "ok":
                stats.step_rewards = (stats.step_rewards or []) + [o.step_reward]

    @staticmethod
    def _count_failures(stats: EpisodeStats, failed: list[CallOutcome]) -> None:
        """Failed creates (before the first turn; that tool's calls then fail too) or calc_reward / release (after)."""
        for o in failed:
            stats.errors += o.kind == "error"
            stats.timeouts += o.kind == "timeout"
            stats.abandoned_calls += o.abandoned
            stats.reward_errors += o.method == "calc_reward"


def _in_thread(fn, *args) -> Future:
    """fn(*args) in a daemon thread of its own (it only waits for the tool loop: grpo_lib/tools/calls.py bounds the
    calls' time), as a Future; a daemon, so a call still running when the step fails never holds the process."""
    future: Future = Future()

    def work():
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # handed to the loop, which raises it
            future.set_exception(error)

    threading.Thread(target=work, name="episode-tools", daemon=True).start()
    return future


def episode_sums(generations: list[list[Generation]], tool_names: list[str]) -> dict[str, float]:
    """This process's sums of the episode/* and tools/* metrics over its episodes; the keys are the same on every
    process (the tool names come from the config), so they reduce key by key. rounds.reduce_episode_metrics turns them
    into the logged values (docs in grpo_lib/core/metrics.py)."""
    episodes = [g.episode for group in generations for g in group if g.episode is not None]
    sums = {"episode/count": float(len(episodes)),
            "episode/turns_sum": float(sum(e.assistant_turns for e in episodes)),
            "episode/turns_max": float(max((e.assistant_turns for e in episodes), default=0)),
            "episode/tool_calls_sum": float(sum(sum(e.calls.values()) + e.invalid_calls for e in episodes)),
            "episode/stopped_turn_limit": float(sum(e.stop == "turn_limit" for e in episodes)),
            "episode/stopped_length": float(sum(e.stop == "length" for e in episodes)),
            "tools/errors": float(sum(e.errors for e in episodes)),
            "tools/timeouts": float(sum(e.timeouts for e in episodes)),
            "tools/invalid_calls": float(sum(e.invalid_calls for e in episodes)),
            "tools/truncated_responses": float(sum(e.truncated_responses for e in episodes)),
            "tools/dropped_calls": float(sum(e.dropped_calls for e in episodes)),
            "tools/abandoned": float(sum(e.abandoned_calls for e in episodes)),
            "tools/reward_errors": float(sum(e.reward_errors for e in episodes))}
    for name in tool_names:
        sums[f"tools/{name}/calls"] = float(sum(e.calls.get(name, 0) for e in episodes))
        sums[f"tools/{name}/failures"] = float(sum(e.failures.get(name, 0) for e in episodes))
        sums[f"tools/{name}/reward_sum"] = float(sum((e.tool_rewards or {}).get(name, 0.0) for e in episodes))
    return sums


def reward_extra_info(extra_info: dict, episode: EpisodeStats | None) -> dict:
    """The row's extra_info plus what verl's reward manager adds for a multi-turn episode (a new dict per episode); a
    single-turn response (`episode` None) keeps its row's extra_info as it is.

    Example: ({"index": 3}, an episode of 2 assistant turns, 1 tool turn, calc_gsm8k_reward 1.0) ->
    {"index": 3, "rollout_reward_scores": {"calc_gsm8k_reward": 1.0}, "num_turns": 4, "tool_step_rewards": [0.0]}.
    """
    if episode is None:
        return extra_info
    return {**(extra_info or {}), "rollout_reward_scores": dict(episode.tool_rewards or {}),
            "num_turns": episode.assistant_turns + episode.user_turns + 1, "tool_step_rewards": list(episode.step_rewards or [])}
