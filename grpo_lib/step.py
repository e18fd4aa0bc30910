"""The phases of one training step that sit between the engine, the rewards and the actor.

`train_grpo.py` calls these by name in docs/DESIGN.md's order. Each is a function over the typed containers
of `grpo_lib.types`; none branches on a loss or estimator name (the math lives in `algorithms`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo_lib import algorithms
from grpo_lib.batching import balance_across_ranks
from grpo_lib.config.checks import engine_logprobs_needed, greedy_baseline_needed
from grpo_lib.distributed import Reduction, all_reduce_min, is_on
from grpo_lib.episodes import episode_sums, reward_extra_info
from grpo_lib.seeds import sample_seed, tp_group_share
from grpo_lib.types import Generation, PromptBatch, RolloutBatch, ScoreRequest


def build_rollout_batch(prompts: PromptBatch, generations: list[list[Generation]], *, pad_id: int = 0) -> RolloutBatch:
    """Prompts x their n generations -> right-padded trajectory rows, groups adjacent.

    response_mask is 1 from the prompt's end to the sequence's end; loss_mask is the generation's own per-token
    `loss_mask` placed there (None: all 1, i.e. equal to response_mask, as for every single-turn generation).
    Example: prompt [5, 6] with responses [7, 2] and [8] (pad 0) ->
    input_ids [[5, 6, 7, 2], [5, 6, 8, 0]], response_mask [[0, 0, 1, 1], [0, 0, 1, 0]], loss_mask the same;
    a response [7, 9, 2] with loss_mask [1, 0, 1] (token 9 a tool's output) -> loss_mask row [0, 0, 1, 0, 1].
    A multi-turn episode's row gets its own extra_info: the prompt's plus the tool rewards (`episodes.reward_extra_info`).
    """
    rows, meta = [], []
    for p, group in enumerate(generations):
        for g in group:
            rows.append((prompts.prompt_ids[p], g))
            meta.append(p)
    width = max((len(pids) + len(g.token_ids) for pids, g in rows), default=0)  # no rows: a process without prompts
    B = len(rows)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((B, width), dtype=torch.long)  # [B, T]
    response_mask = torch.zeros((B, width), dtype=torch.float32)  # [B, T]
    loss_mask = torch.zeros((B, width), dtype=torch.float32)  # [B, T]
    rollout_logprobs = torch.zeros((B, width), dtype=torch.float32)  # [B, T]
    for i, (pids, g) in enumerate(rows):
        P, R = len(pids), len(g.token_ids)
        input_ids[i, :P + R] = torch.tensor(list(pids) + g.token_ids)
        attention_mask[i, :P + R] = 1
        response_mask[i, P:P + R] = 1.0
        if g.loss_mask is None:
            loss_mask[i, P:P + R] = 1.0
        else:
            assert len(g.loss_mask) == R and set(g.loss_mask) <= {0, 1}, (
                f"a generation's loss_mask must hold one 0 or 1 per response token: {R} tokens, loss_mask {g.loss_mask}")
            loss_mask[i, P:P + R] = torch.tensor(g.loss_mask, dtype=torch.float32)
        rollout_logprobs[i, P:P + R] = torch.tensor(g.logprobs, dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs,
        group_ids=[prompts.group_ids[p] for p in meta], response_texts=[g.text for _, g in rows],
        data_sources=[prompts.data_sources[p] for p in meta], ground_truths=[prompts.ground_truths[p] for p in meta],
        extra_infos=[reward_extra_info(prompts.extra_infos[p], g.episode)
                     for p, (_, g) in zip(meta, rows)],
        truncated=torch.tensor([g.finish_reason == "length" for _, g in rows], dtype=torch.bool),
    )


def balance_batch(actor, batch: RolloutBatch) -> RolloutBatch:
    """Even out tokens across processes inside each mini-batch (whole groups move; identity with one process).

    Balancing mini-batch by mini-batch keeps every global mini-batch's set of groups, so the update is the same
    as without balancing; only the work per process changes.
    """
    if not is_on():
        return batch
    return RolloutBatch.concat([balance_across_ranks(batch.select(rows)) for rows in actor.mini_batch_rows(batch)])


def open_reward_stream(scorer):
    """The scorer's stream for one generation (`RewardScorer.stream`: responses scored while the rest generate), or
    None where the scorer cannot stream (reward.num_workers=0: the trainer's own thread would score them; a test's
    scorer with only `score`): then the batch is scored after generation, as before."""
    stream = getattr(scorer, "stream", None)
    return stream() if stream is not None else None


def reward_output(scorer, batch: RolloutBatch, *, rewards=None, timings: dict | None = None):
    """The batch's RewardOutput: the stream's finish (what was not scored during generation) or one scorer.score call;
    the seconds it took are the reward time generation did not hide (`timing_s/reward_exposed`)."""
    start = time.perf_counter()
    lists = dict(responses=batch.response_texts, data_sources=batch.data_sources, ground_truths=batch.ground_truths,
                 extra_infos=batch.extra_infos)
    out = rewards.finish(**lists) if rewards is not None else scorer.score(**lists)
    if timings is not None:
        timings["timing_s/reward_exposed"] = timings.get("timing_s/reward_exposed", 0.0) + time.perf_counter() - start
    return out


def score(scorer, batch: RolloutBatch, *, overlong_buffer=None, max_response_length: int | None = None, rewards=None,
          timings: dict | None = None) -> dict[str, float]:
    """Fill batch.scores with the weighted reward (plus, with `overlong_buffer` enabled, DAPO's overlong penalty, kept in
    batch.overlong_penalties) and batch.accuracies (filter_groups' acc: the accuracy reward > 0, or as verl's DAPO
    manager a custom reward's `acc` field, else its score); return per-function metrics (local sums, reduced by caller).

    The penalty's length is the whole response (`response_lengths`: a multi-turn episode's tool tokens count, as
    verl's DAPO manager counts its response's attention mask); its max_resp_len is overlong_buffer.max_resp_len or
    `max_response_length`. Example: max_response_length 20, len 4, factor 1, a response of 17 tokens scoring 1 -> 0.75.
    `rewards`: the generation's `RewardStream` (`generate_share`), which scored responses as they finished; its finish
    gives what scorer.score gives. `timings["timing_s/reward_exposed"]` gets the seconds spent waiting for rewards here.
    """
    out = reward_output(scorer, batch, rewards=rewards, timings=timings)
    batch.scores = torch.tensor(out.scores, dtype=torch.float32)  # [B]
    sums = {f"reward/{name}/mean": float(sum(v)) for name, v in out.per_function.items()}
    if "accuracy" in out.per_function:
        batch.accuracies = torch.tensor([1.0 if v > 0 else 0.0 for v in out.per_function["accuracy"]])  # [B]
        sums["reward/accuracy"] = float(batch.accuracies.sum())
    elif "custom" in out.per_function:  # verl's DAPO manager: a dict return's `acc` field (math_dapo returns {"score",
        # "acc", "pred"}), else the returned score itself; a response whose call failed gets its score (0)
        acc = out.extra.get("acc", [None] * len(batch))
        batch.accuracies = torch.tensor([float(a) if a is not None else s
                                         for a, s in zip(acc, out.per_function["custom"])], dtype=torch.float32)  # [B]
    if overlong_buffer is not None and overlong_buffer.enable:
        max_resp_len = overlong_buffer.max_resp_len if overlong_buffer.max_resp_len is not None else max_response_length
        batch.overlong_penalties = algorithms.overlong_penalty(
            batch.response_lengths, max_resp_len=max_resp_len, buffer_len=overlong_buffer.len,
            penalty_factor=overlong_buffer.penalty_factor)  # [B]
        batch.scores = batch.scores + batch.overlong_penalties  # [B]
        sums["reward/overlong_penalty_mean"] = float(batch.overlong_penalties.sum())
    sums["reward/errors"] = float(out.num_errors)
    sums["reward/timeouts"] = float(out.num_timeouts)
    sums["reward/error_fraction"] = float(out.num_failed_responses)  # divided by the response count on reduction
    return sums


def mask_truncated(batch: RolloutBatch) -> None:
    """actor.mask_truncated_responses: zero the loss mask of every truncated row (finish reason `length`), in place.

    The row's score stays (it still enters its group's baseline: `compute_advantages` puts it on the last response
    token); a row without loss tokens adds nothing to the loss counts. Example: truncated [False, True] ->
    loss_mask [[0, 1, 1], [0, 1, 1]] becomes [[0, 1, 1], [0, 0, 0]].
    """
    batch.loss_mask[batch.truncated] = 0.0  # [B, T]


class RunAborted(RuntimeError):
    """The run cannot go on with trustworthy results. train_grpo.py catches it, saves the last completed step and
    exits with `exit_code` (3: untrustworthy rewards, too many bad steps)."""

    def __init__(self, message: str, *, exit_code: int = 3):
        super().__init__(message)
        self.exit_code = exit_code


def check_reward_errors(cfg, metrics: dict[str, float], *, step: int, samples: list[str] = ()) -> None:
    """Raise RunAborted when more than reward.max_error_fraction of a step's responses failed to score.

    `metrics` are the step's reduced reward metrics (the same on every process, so every process raises).
    Example: 9 of 16 responses raised with max_error_fraction 0.5 -> RunAborted(exit_code=3).
    """
    fraction = metrics["reward/error_fraction"]
    if fraction > cfg.reward.max_error_fraction:
        first = f"; first: {samples[0]}" if samples else ""
        raise RunAborted(f"step {step}: {fraction:.0%} of responses could not be scored ({metrics['reward/errors']:.0f} reward calls "
                         f"raised or returned no number, {metrics['reward/timeouts']:.0f} timed out after reward.timeout_s="
                         f"{cfg.reward.timeout_s} s){first}. More than reward.max_error_fraction={cfg.reward.max_error_fraction}: "
                         "training on their zero rewards would be noise. Fix the reward function (or raise reward.timeout_s)")


def filter_values(batch: RolloutBatch, metric: str) -> list[float]:
    """The per-response value of algorithm.filter_groups.metric (verl's names): acc the accuracies (1/0), score the
    weighted reward before the overlong penalty, seq_reward / seq_final_reward the score the advantages use (the
    in-reward KL penalty comes after dynamic sampling; checks.py refuses seq_final_reward with it).
    Example: scores [0.75, 1.0], overlong penalties [-0.25, 0] -> score [1.0, 1.0], seq_reward [0.75, 1.0]."""
    if metric == "acc":
        assert batch.accuracies is not None, ("algorithm.filter_groups.metric=acc needs the accuracy reward or a custom "
                                              "reward returning an `acc` field")
        return batch.accuracies.tolist()
    if metric == "score":
        return (batch.scores if batch.overlong_penalties is None else batch.scores - batch.overlong_penalties).tolist()
    assert metric in ("seq_reward", "seq_final_reward"), (
        f"unknown algorithm.filter_groups.metric {metric!r}; supported: acc, score, seq_reward, seq_final_reward")
    return batch.scores.tolist()


def informative_groups(batch: RolloutBatch, metric: str = "seq_reward") -> list[str]:
    """Groups whose `metric` values (`filter_values`) are not all equal (DAPO dynamic sampling keeps only these)."""
    by_group: dict[str, set] = {}
    for g, s in zip(batch.group_ids, filter_values(batch, metric)):
        by_group.setdefault(g, set()).add(round(s, 9))
    return [g for g, values in by_group.items() if len(values) > 1]


def train_sampling(cfg) -> dict:
    """Engine keyword arguments of training rollouts (rollout.*)."""
    r = cfg.rollout
    return dict(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=cfg.data.max_response_length,
                logprobs=engine_logprobs_needed(cfg))


def val_sampling(cfg) -> dict:
    """Engine keyword arguments of validation (rollout.val_kwargs); do_sample false is greedy whatever the temperature."""
    vk = cfg.rollout.val_kwargs
    if not vk.do_sample:
        return dict(n=vk.n, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=cfg.data.max_response_length, logprobs=False)
    return dict(n=vk.n, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k, max_tokens=cfg.data.max_response_length,
                logprobs=False)


def generate_share(cfg, engine, dataset, global_idx: list[int], *, world_size: int, rank: int, purpose: str, step: int,
                   round: int, sampling: dict, episodes=None, timings: dict | None = None,
                   rewards=None, score_request: ScoreRequest | None = None) -> tuple[PromptBatch, list[list[Generation]]]:
    """This process's strided share of `global_idx` (positions rank, rank + W, ...) and its generations: responses, or
    with `episodes` (an `episodes.EpisodeRunner`, rollout.multi_turn.enable) multi-turn episodes, one per sample.

    The ranks of a tensor-parallel group submit one identical request list (the union of their shares, same
    seeds, same sampling) and each keeps its part; seeds depend on the prompt's position in `global_idx`, never on
    the process count or TP size. Example: W=2, TP=2, global_idx [7, 3, 9, 4] -> both ranks submit all four;
    rank 0 keeps dataset rows [7, 9], rank 1 keeps [3, 4] (as with TP=1).
    With `rewards` (a `RewardStream`) each kept response is added to it as the engine finishes it, at its row in
    `build_rollout_batch` (prompt p's sample k is row p * n + k); a multi-turn episode as it ends, with its tool rewards.
    `score_request` (`types.ScoreRequest`, the weight probe's) rides in the engine's first call and comes back filled;
    a process without prompts makes no call and leaves it unfilled.
    """
    submit, keep = tp_group_share(len(global_idx), world_size=world_size, rank=rank, tp_size=cfg.rollout.tensor_model_parallel_size)
    if not submit:  # a validation set smaller than the process count: this TP group has no prompt (all its members agree)
        if episodes is not None:
            episodes.sit_out()  # joins the others' agreement on a tool stall (EpisodeRunner.generate)
        return dataset.batch([]), []
    group = dataset.batch([global_idx[i] for i in submit])
    mine = dataset.batch([global_idx[submit[j]] for j in keep])
    seeds = [sample_seed(cfg.trainer.seed, purpose=purpose, step=step, round=round, prompt_index=i, n=sampling["n"]) for i in submit]
    on_finished = None if rewards is None else stream_to(rewards, mine, local_of=dict(zip(keep, range(len(keep)))),
                                                            n=sampling["n"])
    optional = {} if on_finished is None else {"on_finished": on_finished}  # engines that predate them still work
    if score_request is not None:
        optional["score"] = score_request
    if episodes is None:
        generations = engine.generate(group.prompt_ids, seeds=seeds, **optional, **sampling)
    else:  # the TP group's members run the same episodes (deterministic tools keep their requests identical)
        generations = episodes.generate(engine, group, seeds=seeds, timings=timings, **optional, **sampling)
    return mine, [generations[j] for j in keep]


def stream_to(rewards, prompts: PromptBatch, *, local_of: dict[int, int], n: int):
    """The engine's `on_finished` that adds each response this process keeps to `rewards` at its batch row, and lets
    the reward workers' results in between engine steps. `local_of`: submitted prompt index -> this process's prompt
    index (prompts of other TP-group members are skipped). Example: local_of {1: 0, 3: 1}, n 2: submitted prompt 3's
    sample 1 is row 3."""
    def on_finished(finished: list[tuple[int, int, Generation]]) -> None:
        for j, k, generation in finished:
            p = local_of.get(j)
            if p is not None:  # an episode's extra_info as build_rollout_batch gives it (its tool rewards in)
                extra_info = reward_extra_info(prompts.extra_infos[p], generation.episode)
                rewards.add(p * n + k, response=generation.text, data_source=prompts.data_sources[p],
                            ground_truth=prompts.ground_truths[p], extra_info=extra_info)
        rewards.poll()
    return on_finished


def greedy_sampling(cfg) -> dict:
    """Engine keyword arguments of remax's baseline: one greedy response per prompt (verl's do_sample=False)."""
    return dict(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=cfg.data.max_response_length, logprobs=False)


def attach_greedy_baselines(cfg, engine, scorer, dataset, global_idx: list[int], batch: RolloutBatch, *,
                            rows_per_prompt: list[int], world_size: int, rank: int, step: int, round: int, episodes=None,
                            timings: dict) -> float:
    """remax's baseline: one greedy response (or episode) per prompt of this process's share of `global_idx`, scored as
    the sampled ones are (the overlong penalty included); each prompt's score lands on its `rows_per_prompt` rows in
    batch.reward_baselines [B]. Returns the baselines' sum over the rows (`reward/greedy_baseline_mean` per response).

    Cost: one more generation per prompt (train_batch_size per step, 1/rollout.n of the sampled sequences), run after
    the sampled ones (`timing_s/gen_max`, verl's name), and its reward calls. Example: n 2, prompts scoring 0.5 and 1
    greedily -> reward_baselines [0.5, 0.5, 1, 1]."""
    start = time.perf_counter()
    prompts, generations = generate_share(cfg, engine, dataset, global_idx, world_size=world_size, rank=rank,
                                          purpose="greedy", step=step, round=round, sampling=greedy_sampling(cfg),
                                          episodes=episodes, timings=timings)
    greedy = build_rollout_batch(prompts, generations, pad_id=engine.pad_id)
    score(scorer, greedy, overlong_buffer=cfg.reward.overlong_buffer, max_response_length=cfg.data.max_response_length)
    timings["timing_s/gen_max"] = timings.get("timing_s/gen_max", 0.0) + time.perf_counter() - start
    assert len(rows_per_prompt) == len(greedy) and sum(rows_per_prompt) == len(batch), (
        f"{len(greedy)} greedy responses for {len(rows_per_prompt)} prompts of {len(batch)} rows: the greedy pass must "
        "see the prompts of the batch")
    batch.reward_baselines = torch.repeat_interleave(greedy.scores, torch.tensor(rows_per_prompt))  # [B]
    return float(batch.reward_baselines.sum())


@dataclass
class RoundStats:
    """One rollout round's counts on this process (local sums, not reduced; the step's are every round's, `add`):
    reward/* and response/* sums (response/length_max a max), `count` responses, rollout/preemptions; multi-turn the
    round's `episodes.episode_sums` in `tool_sums`. Example: a round of 4 responses of lengths 3, 5, 2, 6 ->
    sums["count"] 4, sums["response/length_sum"] 16, sums["response/length_max"] 6."""

    sums: dict[str, float] = field(default_factory=dict)
    tool_sums: dict[str, float] = field(default_factory=dict)

    def add(self, other: RoundStats) -> None:
        """Another round's counts into these: a `*_max` key keeps the larger, every other key adds up."""
        for mine, theirs in ((self.sums, other.sums), (self.tool_sums, other.tool_sums)):
            for k, v in theirs.items():
                mine[k] = max(mine.get(k, 0.0), v) if k.endswith("_max") else mine.get(k, 0.0) + v


def rollout_round(cfg, engine, scorer, dataset, global_idx: list[int], *, step: int, round: int, world_size: int,
                  rank: int, timings: dict, episodes=None, stream_rewards: bool = True,
                  score_request: ScoreRequest | None = None) -> tuple[RolloutBatch, RoundStats]:
    """One round of rollouts of the prompts `global_idx` (this process's strided share): generation (the engine ready),
    the rewards streamed as responses finish, remax's greedy baselines -> (this process's scored batch, its counts).

    The batch carries `weight_version`, the engine's when it generated; `score_request` (the weight probe's) rides in
    the round's first generate call and comes back filled. A round after the first renames its groups
    (`{group}#round{round}`): a prompt drawn again (the sampler wrapped into a new epoch) is a new group.
    """
    version = engine.weight_version  # the weights these rollouts come from
    # the t processes of a TP group drive one engine and each sees all of its preemptions: only the first counts them
    tp_leader = rank % cfg.rollout.tensor_model_parallel_size == 0
    stats = RoundStats()
    # Strided share: local prompt j is global prompt rank + j * world_size, so the local mini-batch m of every
    # process together hold exactly the global mini-batch m (process count never changes the update).
    start = time.perf_counter()
    # responses scored as they finish (a stream left by an exception is cancelled: its workers are replaced)
    rewards = open_reward_stream(scorer) if stream_rewards else None
    with rewards if rewards is not None else contextlib.nullcontext():
        prompts, generations = generate_share(cfg, engine, dataset, global_idx, world_size=world_size, rank=rank, purpose="train",
                                              step=step, round=round, sampling=train_sampling(cfg), episodes=episodes,
                                              timings=timings, rewards=rewards, score_request=score_request)
        timings["timing_s/gen"] = timings.get("timing_s/gen", 0.0) + time.perf_counter() - start
        if episodes is not None:
            stats.tool_sums = episode_sums(generations, episodes.tool_names)
        preempted = engine.pop_metrics("rollout/")["rollout/preemptions"]  # during this round's generation
        stats.sums["rollout/preemptions"] = preempted if tp_leader else 0.0
        batch = build_rollout_batch(prompts, generations, pad_id=engine.pad_id)
        batch.weight_version = version
        if cfg.actor.mask_truncated_responses:
            mask_truncated(batch)
        if round > 1:  # a prompt drawn again in a later round (the sampler wrapped into a new epoch) is a new group
            batch.group_ids = [f"{g}#round{round}" for g in batch.group_ids]
        start = time.perf_counter()
        stats.sums.update(score(scorer, batch, overlong_buffer=cfg.reward.overlong_buffer,
                                max_response_length=cfg.data.max_response_length, rewards=rewards, timings=timings))
        stats.sums["count"] = float(len(batch))
        stats.sums["reward/sum"] = float(batch.scores.sum())
        stats.sums["response/length_sum"] = float(batch.response_lengths.sum())
        stats.sums["response/length_max"] = float(batch.response_lengths.max())
        stats.sums["response/clipped"] = float(batch.truncated.sum())
        timings["timing_s/reward"] = timings.get("timing_s/reward", 0.0) + time.perf_counter() - start
    if greedy_baseline_needed(cfg):  # remax: the score of one greedy response per prompt is each row's baseline
        stats.sums["reward/greedy_baseline_mean"] = attach_greedy_baselines(
            cfg, engine, scorer, dataset, global_idx, batch, rows_per_prompt=[len(g) for g in generations],
            world_size=world_size, rank=rank, step=step, round=round, episodes=episodes, timings=timings)
    return batch, stats


class GroupFilter:
    """DAPO dynamic sampling (`algorithm.filter_groups`) over rollout rounds: `add` keeps each round's groups whose
    `metric` values differ (`informative_groups`) until every process holds train_batch_size / world_size of them or
    max_num_gen_batches rounds ran; `finish` returns the step's batch (the surplus of the last round discarded, every
    process the same number of groups) or raises RunAborted when no group differed. Disabled, it keeps the one round.

    Only `add`'s count of kept groups is reduced over processes (a min), so a round's batch may come from anywhere:
    the seam where a rollout producer in another process could hand its batches in.
    Example: per process 2 groups wanted; round 1 keeps 1 of 2 (one all-equal), round 2 keeps 2 -> `add` True,
    `finish` the first 2 kept groups; batch/kept_groups 2, batch/dropped_groups 1, batch/gen_rounds 2.
    """

    def __init__(self, cfg, *, world_size: int):
        self.fg, self.per_rank = cfg.algorithm.filter_groups, cfg.data.train_batch_size // world_size
        self.kept: list[RolloutBatch] = []
        self.num_kept, self.dropped, self.rounds, self.groups = 0, 0, 0, []

    def add(self, batch: RolloutBatch) -> bool:
        """One round's batch; True when the step has enough (or may draw no more rounds)."""
        self.rounds += 1
        if not self.fg.enable:
            self.kept.append(batch)
            return True
        good = set(informative_groups(batch, self.fg.metric))
        self.dropped += len(set(batch.group_ids)) - len(good)
        if good:
            self.kept.append(batch.select([i for i, g in enumerate(batch.group_ids) if g in good]))
            self.num_kept += len(good)
        enough = all_reduce_min(self.num_kept) >= self.per_rank
        return enough or (self.fg.max_num_gen_batches > 0 and self.rounds >= self.fg.max_num_gen_batches)

    def finish(self, cfg, *, step: int, stats: RoundStats, scorer) -> RolloutBatch:
        """The step's batch from the kept rounds. No group kept anywhere: RunAborted (exit 3), for failing rewards
        (`check_reward_errors` over the step's `stats`) if that is why, else for a reward that never differs."""
        batch = RolloutBatch.concat(self.kept) if self.kept else None
        if not self.fg.enable:
            return batch
        keep = min(int(all_reduce_min(self.num_kept)), self.per_rank)  # every process trains on the same number of groups
        self.groups = list(dict.fromkeys(batch.group_ids))[:keep] if batch is not None else []
        batch = batch.select([i for i, g in enumerate(batch.group_ids) if g in set(self.groups)]) if self.groups else None
        if batch is None:  # rewards that all failed score 0 everywhere: say so (exit 3), not "no group differs"
            sums, failed = stats.sums, Reduction()
            failed.count("samples", sums["count"])
            failed.mean("reward/error_fraction", sums["reward/error_fraction"], over="samples")
            for k in ("reward/errors", "reward/timeouts"):
                failed.sum(k, sums[k])
            check_reward_errors(cfg, failed.reduce(), step=step, samples=scorer.last_error_samples)
            raise RunAborted(f"step {step}: dynamic sampling found no group with different scores in {self.rounds} rounds "
                             "(every response of each prompt scored the same); raise algorithm.filter_groups.max_num_gen_batches "
                             "or check the reward")
        return batch


def collect_rollouts(cfg, engine, scorer, dataset, sampler, *, step: int, world_size: int, rank: int, timings: dict,
                     episodes=None, stream_rewards: bool = True, score_request: ScoreRequest | None = None):
    """Rollout rounds (`rollout_round`: prompts -> generation, the engine ready, the caller releases it afterwards ->
    rewards) through the `GroupFilter` until the step has its batch; `score_request` (the weight probe's) rides in
    round 1's first generate call.

    Returns the batch of this process and the step's generation / reward metrics (reduced over processes).
    With `algorithm.filter_groups.enable` (DAPO dynamic sampling) each round draws the next train_batch_size
    prompts and keeps only groups whose scores differ, until every process holds train_batch_size / world_size
    of them (the surplus of the last round is discarded) or max_num_gen_batches rounds have run (then the step
    trains on fewer groups). Logged: batch/gen_rounds, batch/dropped_groups (all-equal groups, all rounds),
    batch/kept_groups (trained on); reward/* and response/* cover every response generated, dropped ones too.
    With `episodes` (multi-turn) each sample is an episode and episode/* and tools/* are logged over all of them
    (`reduce_episode_metrics`).
    """
    groups, stats = GroupFilter(cfg, world_size=world_size), RoundStats(sums={"rollout/preemptions": 0.0})
    engine.pop_metrics("rollout/")  # only the training rollouts count: drop what validation's generation preempted
    while True:
        batch, round_stats = rollout_round(cfg, engine, scorer, dataset, sampler.next_batch(), step=step, round=groups.rounds + 1,
                                           world_size=world_size, rank=rank, timings=timings, episodes=episodes,
                                           stream_rewards=stream_rewards,
                                           score_request=score_request if groups.rounds == 0 else None)
        stats.add(round_stats)
        if groups.add(batch):
            break
    batch = groups.finish(cfg, step=step, stats=stats, scorer=scorer)
    return batch, rollout_metrics(stats, groups, step=step, episodes=episodes)


def rollout_metrics(stats: RoundStats, groups: GroupFilter, *, step: int, episodes=None) -> dict[str, float]:
    """The step's rollout metrics from every round's `stats`, reduced over processes in one all-reduce per kind:
    batch/* (dynamic sampling), reward/*, response/*, rollout/preemptions (a warning when > 0), episode/* and tools/*."""
    metrics, sums = {}, dict(stats.sums)
    if groups.fg.enable:
        metrics["batch/gen_rounds"] = float(groups.rounds)
    reduction = Reduction()  # every metric of the rollouts in one all-reduce per kind
    if groups.fg.enable:
        reduction.sum("batch/kept_groups", len(groups.groups))
        reduction.sum("batch/dropped_groups", groups.dropped)
    reduction.count("samples", sums.pop("count"))
    reduction.max("response/length_max", sums.pop("response/length_max"))
    names = {"reward/sum": "reward/mean", "response/length_sum": "response/length_mean", "response/clipped": "response/clip_ratio"}
    for k, v in sums.items():
        if k in ("reward/errors", "reward/timeouts", "rollout/preemptions"):  # counts
            reduction.sum(k, v)
        else:  # means over the responses
            reduction.mean(names.get(k, k), v, over="samples")
    if episodes is not None:
        add_episode_metrics(reduction, stats.tool_sums, episodes.tool_names)
    metrics.update(reduction.reduce())
    if metrics["rollout/preemptions"] > 0:
        warnings.warn(f"step {step}: the engine preempted {int(metrics['rollout/preemptions'])} sequences for lack of KV cache "
                      "(recomputed later: a slower generation); raise rollout.kv_cache_memory_bytes (CPU) or "
                      "rollout.gpu_memory_utilization (GPU), or leave kv_cache_memory_bytes unset on CPU to size it from the batch",
                      stacklevel=1)
    return metrics


def add_episode_metrics(reduction: Reduction, sums: dict[str, float], tool_names: list[str]) -> None:
    """This process's `episodes.episode_sums` into `reduction`, each as its kind: the step's episode/* and tools/*
    metrics over all processes once it is reduced.

    Example: 8 episodes with 12 assistant turns and 6 tool calls, one stopped by the turn limit ->
    episode/turns_mean 1.5, episode/tool_calls_mean 0.75, episode/stopped_turn_limit 0.125 (a fraction); the error
    counters (tools/errors, ...) and tools/<name>/calls are counts; tools/<name>/reward_mean is the mean over episodes.
    """
    reduction.count("episodes", sums["episode/count"])
    reduction.max("episode/turns_max", sums["episode/turns_max"])
    for key, total in (("episode/turns_mean", "episode/turns_sum"), ("episode/tool_calls_mean", "episode/tool_calls_sum"),
                       ("episode/stopped_turn_limit", "episode/stopped_turn_limit"),
                       ("episode/stopped_length", "episode/stopped_length")):
        reduction.mean(key, sums[total], over="episodes")
    for key in ("tools/errors", "tools/timeouts", "tools/invalid_calls", "tools/truncated_responses", "tools/dropped_calls",
                "tools/abandoned"):
        reduction.sum(key, sums[key])
    reduction.mean("tools/reward_error_fraction", sums["tools/reward_errors"], over="episodes")
    for name in tool_names:
        reduction.sum(f"tools/{name}/calls", sums[f"tools/{name}/calls"])
        reduction.sum(f"tools/{name}/failures", sums[f"tools/{name}/failures"])
        reduction.mean(f"tools/{name}/reward_mean", sums[f"tools/{name}/reward_sum"], over="episodes")


def reduce_episode_metrics(sums: dict[str, float], tool_names: list[str]) -> dict[str, float]:
    """`add_episode_metrics` reduced on its own (one all-reduce per kind)."""
    reduction = Reduction()
    add_episode_metrics(reduction, sums, tool_names)
    return reduction.reduce()


def check_tool_errors(metrics: dict[str, float], tool_names: list[str], *, step: int, max_error_fraction: float = 1.0) -> None:
    """Raise RunAborted (exit 3) when a tool failed (raised or timed out) on every call it got in the step: its
    responses are all error messages, so the episodes would teach the model nothing about the tool; or when more than
    max_error_fraction (reward.max_error_fraction, as for rewards) of the episodes had a calc_reward that failed or
    returned no finite number (NaN, inf, a bool), each scored 0. `metrics` are the step's reduced metrics (the same on
    every process, so every process raises). Example: calculator 12 calls, 12 failures -> RunAborted; 12 calls, 11
    failures -> nothing; tools/reward_error_fraction 0.75 with max_error_fraction 0.5 -> RunAborted."""
    fraction = metrics.get("tools/reward_error_fraction", 0.0)
    if fraction > max_error_fraction:
        raise RunAborted(f"step {step}: {fraction:.0%} of episodes had a tool calc_reward that raised, timed out or "
                         f"returned no finite number (NaN, inf, a bool), each scored 0 (reward.max_error_fraction="
                         f"{max_error_fraction:g}). Make calc_reward return a float")
    for name in tool_names:
        calls, failures = metrics.get(f"tools/{name}/calls", 0.0), metrics.get(f"tools/{name}/failures", 0.0)
        if calls > 0 and failures >= calls:
            raise RunAborted(f"step {step}: tool {name} failed on every one of its {calls:.0f} calls (tools/errors "
                             f"{metrics['tools/errors']:.0f}, tools/timeouts {metrics['tools/timeouts']:.0f} over all tools): "
                             "its answers were all error messages. Fix the tool (run its execute by hand on one call), or "
                             "raise rollout.multi_turn.tool_timeout_s if it is only slow")


def _process_sum(x: Tensor) -> Tensor:
    """Sum of a small tensor over the processes (the batch statistics of `advantages.token_advantages`), in one all-reduce."""
    reduction = Reduction()
    for i, v in enumerate(x.tolist()):
        reduction.sum(str(i), v)
    return torch.tensor(list(reduction.reduce().values()), dtype=x.dtype, device=x.device)


def compute_advantages(cfg, batch: RolloutBatch) -> dict[str, float]:
    """Token rewards (score on the last response token, minus the KL penalty on loss tokens if in reward) ->
    algorithm.adv_estimator's advantages per loss token (`advantages.token_advantages`; remax reads
    batch.reward_baselines, `attach_greedy_baselines`)."""
    alg = cfg.algorithm
    mask = batch.loss_mask  # [B, T]
    # The score belongs to the whole response, so it sits on the response's last token even where that token is out
    # of the loss (a tool's output, a masked truncation): every response's score enters its group's baseline.
    response = batch.response_mask  # [B, T]
    last = (response * torch.arange(response.shape[1])).argmax(-1)  # [B] index of each row's last response token
    token_rewards = torch.zeros_like(mask)  # [B, T]
    token_rewards[torch.arange(len(batch)), last] = batch.scores
    reduction = Reduction()  # the critic/* metrics in one all-reduce
    if alg.use_kl_in_reward:
        kl = algorithms.kl_penalty(batch.old_logprobs, batch.ref_logprobs, alg.kl_penalty) * mask  # [B, T]
        token_rewards = token_rewards - alg.kl_ctrl.kl_coef * kl
        reduction.count("loss_tokens", mask.sum().item())
        reduction.mean("critic/kl_in_reward", kl.sum().item(), over="loss_tokens")
    batch.token_rewards = token_rewards
    batch.advantages = algorithms.token_advantages(token_rewards, mask, batch.group_ids, estimator=alg.adv_estimator,
                                                   norm_by_std=alg.norm_adv_by_std_in_grpo, gamma=alg.gamma,
                                                   reward_baselines=batch.reward_baselines, batch_sum=_process_sum)  # [B, T]
    # per response: mean |A| over its loss tokens (a per-response estimator's |A_i|), over responses with loss tokens
    row_tokens = mask.sum(-1)  # [B]
    row_abs = (batch.advantages.abs() * mask).sum(-1) / row_tokens.clamp(min=1)  # [B]
    reduction.count("responses_with_loss_tokens", float((row_tokens > 0).sum()))
    reduction.mean("critic/advantages_abs_mean", row_abs.sum().item(), over="responses_with_loss_tokens")
    return reduction.reduce()


def validate(cfg, engine, scorer, dataset, *, world_size: int, rank: int, step: int = 0,
             tokenizer=None, episodes=None) -> tuple[dict[str, float], list[dict]]:
    """rollout.val_kwargs generation (greedy unless do_sample) over this process's share of the validation set
    -> (metrics, logged rows). The engine must be ready; seeds are the "val" purpose's, at `step`.

    Metrics per data source (grpo_lib.validation): reward_mean (with reward.overlong_buffer's penalty, as verl's
    validation), acc, and mean@n / pass@n when val_kwargs.n > 1; multi-turn: val/episode/*, val/tools/*.
    Rows: the first trainer.val_generations_to_log (prompt, response, score) rows (prompts decoded with `tokenizer`).
    """
    vk = cfg.rollout.val_kwargs
    from grpo_lib.validation import generation_rows, val_metrics

    rewards = open_reward_stream(scorer)  # scored as they finish (responses or episodes), as in training
    with rewards if rewards is not None else contextlib.nullcontext():
        prompts, generations = generate_share(cfg, engine, dataset, list(range(len(dataset))), world_size=world_size, rank=rank,
                                              purpose="val", step=step, round=0, sampling=val_sampling(cfg), episodes=episodes,
                                              rewards=rewards)
        batch = build_rollout_batch(prompts, generations, pad_id=engine.pad_id)
        out = reward_output(scorer, batch, rewards=rewards)
    metrics = val_metrics(scorer, batch, sources=sorted(set(dataset.data_sources)), n=vk.n, rewards=out,
                          overlong_buffer=cfg.reward.overlong_buffer, max_response_length=cfg.data.max_response_length)
    if episodes is not None:  # the training step's episode/* and tools/* over the validation episodes, as val/...
        names = episodes.tool_names
        metrics.update({f"val/{k}": v for k, v in reduce_episode_metrics(episode_sums(generations, names), names).items()})
    limit = cfg.trainer.val_generations_to_log
    prompt_texts = [tokenizer.decode(batch.input_ids[i][(batch.attention_mask[i] > 0) & (batch.response_mask[i] == 0)].tolist())
                    if tokenizer is not None else "" for i in range(min(limit, len(batch)))]
    return metrics, generation_rows(batch, prompt_texts, limit=limit)


def reduce_timings(timings: dict[str, float]) -> dict[str, float]:
    """Slowest process's time per phase (the step waits for it), in one all-reduce."""
    reduction = Reduction()
    for k, v in timings.items():
        reduction.max(k, v)
    return reduction.reduce()
