"""Carry-over rollouts on the same GPUs (`rollout.partial_rollout`): a round ends when the step has its groups, and
the long tail goes on in the next round under newer weights instead of holding the engine for a handful of sequences.

The pool. Each process keeps `active_batch_size / world_size` prompt groups in flight (a TP group: the union of its
members' shares, every member holding the same pool). A step's round resumes every unfinished response of the pool
(carried ones first, oldest group first) and stops the engine (`generate(stop=...)`) as soon as every member owns
`train_batch_size / world_size` complete groups and every due group is complete (a group is due when, carried once
more, its oldest tokens would be more than `max_staleness` versions old when trained: it finishes now rather than be
dropped, so no generated work is thrown away for staleness); the unfinished responses come back as far as they got (tokens,
behaviour logprobs, the weight version of each token) and stay in the pool. The complete groups a process owns,
oldest first, are its batch; then one sampler batch of fresh prompts refills the pool (the first step draws
active_batch_size / train_batch_size of them). Example: train_batch_size 4, active_batch_size 8, one process: step 1
starts 8 groups, stops when 4 are complete, trains on those 4, keeps the other 4 (some responses half written) and
draws 4 fresh prompts; step 2 resumes the carried responses first.

A carried response is resumed as a new request: its prompt followed by what it generated so far (re-prefilled under the
new weights: every push resets the engine's prefix cache, `EngineGlue.prepare_for_generation`), the remaining token
budget, and a seed of its own (`seeds.carry_seed`). Staleness: due groups finish in their round (above); a response
whose oldest token is still more than `max_staleness` versions behind the engine's weights at a round's start (more
complete groups than a step trains, with active_batch_size above twice the batch) is dropped (counted) and generated
again from its prompt, so no trained token is older than that and no prompt is lost or trained twice. With
max_staleness 0 every group that started is due: the round runs until all are complete and nothing is carried. With active_batch_size ==
train_batch_size nothing is ever carried: the round runs to the last response and the step is today's synchronous one
(the same seeds, responses and batch order).

The pool is part of the checkpoint (`state_dict`: one JSON file per process, grpo_lib/checkpoints/checkpoint.py), so a
resume continues with the same responses in flight; it holds per-process shares, so it resumes on the same process
count and TP size only (`load_state_dict` says so). Not process-count invariant by design: which groups complete
first depends on what each engine runs beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from grpo_lib.core.seeds import carry_seed, sample_seed, tp_group_share
from grpo_lib.core.types import Generation, PromptBatch

STATE_VERSION = 1


@dataclass
class Sample:
    """One response of a group, as far as it got."""

    seed: int  # the seed of its first request (the synchronous step's seed of this sample)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour logprobs, one per token
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    texts: list[str] = field(default_factory=list)  # the engine's text of each request's tokens
    finish_reason: str | None = None  # "stop" / "length" when finished; None while in flight
    requests: int = 0  # requests made for it (its next request's seed depends on it)
    restarts: int = 0  # times it was dropped for staleness and started again

    def request(self, prompt_ids: list[int], max_response_length: int) -> tuple[list[int], int, int]:
        """(prompt ids, max tokens, seed) of its next request: the prompt and what it has so far."""
        seed = self.seed if self.requests == 0 else carry_seed(self.seed, self.requests)
        return list(prompt_ids) + self.token_ids, max_response_length - len(self.token_ids), seed

    def extend(self, generation: Generation, version: int) -> None:
        self.requests += 1
        self.token_ids += generation.token_ids
        self.logprobs += generation.logprobs
        self.versions += [version] * len(generation.token_ids)
        self.texts.append(generation.text)
        self.finish_reason = None if generation.finish_reason == "abort" else generation.finish_reason

    def restart(self) -> None:
        """Dropped for staleness: everything it generated goes; its next request starts from the prompt."""
        self.token_ids, self.logprobs, self.versions, self.texts = [], [], [], []
        self.finish_reason = None
        self.restarts += 1
        self.requests += 1  # a fresh seed: the dropped tokens are not sampled again

    def generation(self, decode: Callable[[list[int]], str] | None) -> Generation:
        """The finished response, each token with its version. Text: the engine's when one request wrote it all,
        else `decode` of all its tokens (a text cut between two requests may split a character)."""
        if len(self.texts) == 1 or decode is None:
            text = "".join(self.texts)
        else:
            text = decode(self.token_ids)
        return Generation(token_ids=list(self.token_ids), logprobs=list(self.logprobs), text=text,
                          finish_reason=self.finish_reason or "length", versions=list(self.versions))


@dataclass
class Group:
    """One prompt's group in flight."""

    row: int  # the dataset row
    group_id: str
    owner: int  # the process that trains it
    born: int  # the step that drew it
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class CarryPool:
    """The groups in flight on this process's TP group, their requests, the stop rule and what a step trains."""

    def __init__(self, cfg, *, world_size: int, rank: int, decode: Callable[[list[int]], str] | None = None):
        self.decode = decode  # the text of a response several requests wrote (the tokenizer's, special tokens skipped)
        pr = cfg.rollout.partial_rollout
        self.n, self.max_staleness = cfg.rollout.n, pr.max_staleness
        self.max_response_length, self.trainer_seed = cfg.data.max_response_length, cfg.trainer.seed
        self.world_size, self.rank, self.tp = world_size, rank, cfg.rollout.tensor_model_parallel_size
        self.batch_size = cfg.data.train_batch_size
        self.per_rank = self.batch_size // world_size
        self.active_batches = pr.active_batch_size // self.batch_size  # resolved at load (config.checks.resolve_defaults)
        first = rank // self.tp * self.tp
        self.members = list(range(first, first + self.tp))  # the processes whose groups this pool holds
        self.groups: list[Group] = []
        self.journal: tuple | None = None  # the step's start (`journal_step`, `undo_step`)
        self.counts: dict[str, float] = {}  # this round's counters (`pop_counts`)

    # -- the pool ---------------------------------------------------------------------------------------

    def fill(self, sampler, dataset, *, step: int) -> int:
        """Fresh groups from the sampler, topping the pool up to active_batch_size: one batch a step (a step trains one
        batch's worth), active_batch_size / train_batch_size of them when the pool is empty (the first step, or a resume
        whose checkpoint held no pool). Returns the batches drawn. Each process draws the same batches (every pool
        loses the same number of groups a step: the samplers stay equal); its TP group keeps its members' strided
        shares, seeded as the synchronous step seeds them (round d of the step: the d-th batch drawn). The step's
        journal starts here (`undo_step`)."""
        self.journal_step()
        per_draw = self.per_rank * len(self.members)  # groups one sampler batch brings this TP group
        draws = max(0, self.active_batches - len(self.groups) // per_draw)  # top up to active_batch_size
        in_pool = {g.group_id for g in self.groups}
        for d in range(1, draws + 1):
            idx = sampler.next_batch()
            submit, _ = tp_group_share(len(idx), world_size=self.world_size, rank=self.rank, tp_size=self.tp)
            for i in submit:
                uid = dataset.uids[idx[i]]
                group_id = uid if d == 1 else f"{uid}#round{d}"  # the synchronous rounds' renaming
                if group_id in in_pool:  # the sampler wrapped while the prompt is still in flight: a new group
                    group_id = f"{uid}#step{step}.{d}"
                in_pool.add(group_id)
                seed = sample_seed(self.trainer_seed, purpose="train", step=step, round=d, prompt_index=i, n=self.n)
                self.groups.append(Group(row=idx[i], group_id=group_id, owner=i % self.world_size, born=step,
                                         samples=[Sample(seed=seed + k) for k in range(self.n)]))
        return draws

    def drop_stale(self, version: int) -> None:
        """Start again every response holding a token more than max_staleness versions older than `version` (the
        engine's weights now): its tokens would be trained with more staleness than allowed."""
        for group in self.groups:
            for sample in group.samples:
                if sample.versions and version - min(sample.versions) > self.max_staleness:
                    if group.owner == self.rank:
                        self._count("rollout/dropped_stale_responses", 1)
                        self._count("rollout/dropped_stale_tokens", len(sample.token_ids))
                    sample.restart()

    @staticmethod
    def oldest(group: Group) -> int | None:
        """The oldest weight version among the group's tokens (None: nothing generated yet)."""
        return min((min(s.versions) for s in group.samples if s.versions), default=None)

    def complete_by_owner(self) -> dict[int, int]:
        counts = dict.fromkeys(self.members, 0)
        for group in self.groups:
            counts[group.owner] += group.complete
        return counts

    def enough(self) -> bool:
        """Every member owns train_batch_size / world_size complete groups (the round's stop rule)."""
        return all(c >= self.per_rank for c in self.complete_by_owner().values())

    # -- a round ------------------------------------------------------------------------------------------

    def run_round(self, engine, dataset, *, sampling: dict, generate_kwargs: dict | None = None) -> None:
        """Resume every unfinished response (oldest group first) on `engine` until `enough()`; what they generated,
        finished or not, goes into the pool with the engine's weight version. `sampling`: generate's n=1 keyword
        arguments but max_tokens (rounds.train_sampling); `generate_kwargs`: the weight probe's `score`, carried by
        this call. The call is made even with nothing to resume (the probe rides in it)."""
        version = engine.weight_version
        self.drop_stale(version)
        pending = [(g, s) for g in self.groups for s in g.samples if s.finish_reason is None]
        requests = [s.request(dataset.prompt_ids[g.row], self.max_response_length) for g, s in pending]
        left = {id(g): sum(s.finish_reason is None for s in g.samples) for g in self.groups}
        complete = self.complete_by_owner()
        # Due groups finish in this round: carried once more, their oldest tokens would be more than K versions old
        # when trained, and dropped (their work lost). The round goes on until they are complete.
        due = {id(g) for g in self.groups if not g.complete and self.oldest(g) is not None
               and version - self.oldest(g) >= self.max_staleness}
        due_left = [len(due)]
        for g, s in pending:
            if g.owner == self.rank and s.token_ids:
                self._count("rollout/resumed_responses", 1)

        def on_finished(finished: list[tuple[int, int, Generation]]) -> None:
            for j, _, _generation in finished:
                group = pending[j][0]
                left[id(group)] -= 1
                if left[id(group)] == 0:
                    complete[group.owner] += 1
                    due_left[0] -= id(group) in due

        def stop() -> bool:
            return due_left[0] == 0 and all(c >= self.per_rank for c in complete.values())

        generations = engine.generate([r[0] for r in requests], max_tokens=[r[1] for r in requests],
                                      seeds=[r[2] for r in requests], on_finished=on_finished, stop=stop,
                                      **sampling, **(generate_kwargs or {}))
        for (_, sample), (generation,) in zip(pending, generations):
            sample.extend(generation, version)
        for group in self.groups:
            if group.owner == self.rank:
                self._count("rollout/carried_responses", sum(s.finish_reason is None for s in group.samples))
        self._count("rollout/pool_groups", sum(g.owner == self.rank for g in self.groups))

    def take(self, dataset) -> tuple[PromptBatch, list[list[Generation]]]:
        """This process's batch: the first train_batch_size / world_size complete groups it owns (oldest first), as
        (prompts, generations); every member's taken groups leave the pool (the members' pools stay equal)."""
        taken: dict[int, list[Group]] = {m: [] for m in self.members}
        for group in self.groups:
            if group.complete and len(taken[group.owner]) < self.per_rank:
                taken[group.owner].append(group)
        assert all(len(t) == self.per_rank for t in taken.values()), (
            f"a round ended with {[len(t) for t in taken.values()]} complete groups per process, not {self.per_rank}")
        gone = {id(g) for t in taken.values() for g in t}
        self.groups = [g for g in self.groups if id(g) not in gone]
        mine = taken[self.rank]
        prompts = dataset.batch([g.row for g in mine])
        prompts.group_ids = [g.group_id for g in mine]
        return prompts, [[s.generation(self.decode) for s in g.samples] for g in mine]

    def journal_step(self) -> None:
        """What `undo_step` restores, noted at the step's start: the groups in flight and, per response, its lists (the
        objects: a staleness drop replaces them) with their lengths and its fields. O(responses), no token copied."""
        self.journal = (list(self.groups), [
            (s, s.token_ids, s.logprobs, s.versions, s.texts, len(s.token_ids), len(s.texts), s.finish_reason, s.requests,
             s.restarts) for g in self.groups for s in g.samples])

    def undo_step(self) -> None:
        """The pool as it was at the step's start (a step aborted before its update: failing rewards, a weight probe
        that failed, so this round's tokens may come from unproven weights): this step's fresh groups gone, every
        response cut back to what it held, the taken groups back. The resume redoes the step with the same seeds."""
        if self.journal is None:
            return
        groups, samples = self.journal
        for s, tokens, logprobs, versions, texts, n, n_texts, reason, requests, restarts in samples:
            del tokens[n:], logprobs[n:], versions[n:], texts[n_texts:]
            s.token_ids, s.logprobs, s.versions, s.texts = tokens, logprobs, versions, texts
            s.finish_reason, s.requests, s.restarts = reason, requests, restarts
        self.groups, self.journal = groups, None

    def step_done(self) -> None:
        """The step's batch is trained: nothing of it can be undone any more."""
        self.journal = None

    # -- counters and state ---------------------------------------------------------------------------------

    def _count(self, name: str, value: float) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value

    def pop_counts(self) -> dict[str, float]:
        """This process's counters since the last call (local sums: rollout/carried_responses, resumed_responses,
        dropped_stale_responses / _tokens, pool_groups)."""
        names = ("rollout/carried_responses", "rollout/resumed_responses", "rollout/dropped_stale_responses",
                 "rollout/dropped_stale_tokens", "rollout/pool_groups")
        out = {k: self.counts.get(k, 0.0) for k in names}
        self.counts = {}
        return out

    def state_dict(self) -> dict:
        """The pool as plain JSON (a copy: later rounds do not change it)."""
        return {"version": STATE_VERSION, "world_size": self.world_size, "tp": self.tp, "n": self.n,
                "groups": [asdict(g) for g in self.groups]}

    def load_state_dict(self, state: dict, *, where: str) -> None:
        """The pool of a checkpoint; a ValueError naming `where` when it was saved on another layout."""
        saved = (state.get("version"), state.get("world_size"), state.get("tp"), state.get("n"))
        if saved != (STATE_VERSION, self.world_size, self.tp, self.n):
            raise ValueError(
                f"{where}: the carried responses were saved by {state.get('world_size')} processes, TP "
                f"{state.get('tp')}, rollout.n {state.get('n')} (format {state.get('version')}); this run has "
                f"{self.world_size}, TP {self.tp}, n {self.n}. Resume on the same layout, or delete the carry/ folder of "
                "that checkpoint to start the pool afresh (its groups' prompts are then skipped)")
        self.groups = [Group(**{**g, "samples": [Sample(**s) for s in g["samples"]]}) for g in state["groups"]]
