"""Rollout rounds: the prompts of a step generated (responses, or multi-turn episodes) and scored as they finish
(`rollout_round`, `RoundStats`), DAPO's group filter over the rounds (`GroupFilter`, `collect_rollouts`), the rollout
and episode metrics, and validation. The batch-level phases they call are grpo_lib/trainer/step.py's.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch

from grpo_lib.config.checks import engine_logprobs_needed, greedy_baseline_needed
from grpo_lib.core.distributed import Reduction, all_reduce_min
from grpo_lib.core.seeds import sample_seed, tp_group_share
from grpo_lib.core.types import Generation, PromptBatch, RolloutBatch, ScoreRequest
from grpo_lib.rollout.episodes import TemplateError, episode_sums, reward_extra_info
from grpo_lib.tools.calls import ToolStallError
from grpo_lib.trainer.step import (RunAborted, build_rollout_batch, check_reward_errors, informative_groups, mask_truncated,
                                   open_reward_stream, reward_output, score)


@contextlib.contextmanager
def episode_errors_abort(where: str):
    """Inside (a step's rollouts, a validation): a chat template that cannot extend an episode by a delta (the model's
    problem) is RunAborted with exit code 2, tool calls that never returned (agreed by every process) RunAborted with
    exit code 3; each message starts with `where` ("step 7", "validation at step 10")."""
    try:
        yield
    except TemplateError as error:
        raise RunAborted(f"{where}: {error}", exit_code=2) from error
    except ToolStallError as error:
        raise RunAborted(f"{where}: {error}") from error


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
        if getattr(engine, "collective", False):  # the split engine's proxy gathers every trainer process's requests
            engine.generate([], seeds=[], **sampling)
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


def round_batch(cfg, prompts: PromptBatch, generations: list[list[Generation]], *, pad_id: int, version: int) -> RolloutBatch:
    """A round's rows (`step.build_rollout_batch`) for the weights of `version` (the ones being trained: a carried or
    one-step-off token's own version is in its token_versions), truncated rows masked out with
    actor.mask_truncated_responses."""
    batch = build_rollout_batch(prompts, generations, pad_id=pad_id)
    batch.weight_version = version
    if cfg.actor.mask_truncated_responses:
        mask_truncated(batch)
    return batch


def score_round(cfg, scorer, batch: RolloutBatch, stats: RoundStats, *, timings: dict, rewards=None) -> None:
    """A round's batch scored (`step.score`; `rewards`: the generation's stream, if any) and its reward / response sums
    into `stats` (count, reward/sum, response/length_sum, length_max, clipped); the seconds under timing_s/reward."""
    start = time.perf_counter()
    stats.sums.update(score(scorer, batch, overlong_buffer=cfg.reward.overlong_buffer,
                            max_response_length=cfg.data.max_response_length, rewards=rewards, timings=timings))
    stats.sums["count"] = float(len(batch))
    stats.sums["reward/sum"] = float(batch.scores.sum())
    stats.sums["response/length_sum"] = float(batch.response_lengths.sum())
    stats.sums["response/length_max"] = float(batch.response_lengths.max())
    stats.sums["response/clipped"] = float(batch.truncated.sum())
    timings["timing_s/reward"] = timings.get("timing_s/reward", 0.0) + time.perf_counter() - start


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
        batch = round_batch(cfg, prompts, generations, pad_id=engine.pad_id, version=version)
        if round > 1:  # a prompt drawn again in a later round (the sampler wrapped into a new epoch) is a new group
            batch.group_ids = [f"{g}#round{round}" for g in batch.group_ids]
        score_round(cfg, scorer, batch, stats, timings=timings, rewards=rewards)
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


def carry_round(cfg, engine, scorer, dataset, sampler, pool, *, step: int, rank: int, timings: dict,
                score_request: ScoreRequest | None = None) -> tuple[RolloutBatch, RoundStats]:
    """rollout.partial_rollout's round (grpo_lib/rollout/carry.py): the pool refilled from the sampler, its unfinished
    responses resumed until the step's groups are complete (the rest carried), this process's complete groups as the
    scored batch (each token's weight version in batch.token_versions) -> (batch, its counts, as `rollout_round`'s)."""
    tp_leader = rank % cfg.rollout.tensor_model_parallel_size == 0
    stats = RoundStats()
    start = time.perf_counter()
    pool.fill(sampler, dataset, step=step)
    sampling = {k: v for k, v in train_sampling(cfg).items() if k != "max_tokens"} | {"n": 1}
    pool.run_round(engine, dataset, sampling=sampling,
                   generate_kwargs={} if score_request is None else {"score": score_request})
    prompts, generations = pool.take(dataset)
    timings["timing_s/gen"] = timings.get("timing_s/gen", 0.0) + time.perf_counter() - start
    preempted = engine.pop_metrics("rollout/")["rollout/preemptions"]
    stats.sums["rollout/preemptions"] = preempted if tp_leader else 0.0
    batch = round_batch(cfg, prompts, generations, pad_id=engine.pad_id, version=engine.weight_version)
    score_round(cfg, scorer, batch, stats, timings=timings)
    return batch, stats


def carry_metrics(pool, batch: RolloutBatch) -> dict[str, float]:
    """The pool's counters summed over processes (rollout/carried_responses: unfinished at the round's end,
    resumed_responses, dropped_stale_responses / _tokens, pool_groups) and the staleness of the trained loss tokens:
    rollout/staleness_{s} the share s versions old for s = 0 .. max_staleness, rollout/staleness_max; one all-reduce
    per kind. Example: 90 loss tokens of this step's weights and 10 of the previous -> staleness_0 0.9, staleness_1 0.1."""
    reduction = Reduction()
    for k, v in pool.pop_counts().items():
        reduction.sum(k, v)
    mask = batch.loss_mask > 0  # [B, T]
    age = (batch.weight_version - batch.token_versions)[mask]  # [loss tokens]
    reduction.count("trained_tokens", float(age.numel()))
    for s in range(pool.max_staleness + 1):
        reduction.mean(f"rollout/staleness_{s}", float((age == s).sum()), over="trained_tokens")
    reduction.max("rollout/staleness_max", float(age.max()) if age.numel() else 0.0)
    return reduction.reduce()


def collect_rollouts(cfg, engine, scorer, dataset, sampler, *, step: int, world_size: int, rank: int, timings: dict,
                     episodes=None, stream_rewards: bool = True, score_request: ScoreRequest | None = None,
                     carry=None):
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
    With `carry` (a `carry.CarryPool`, rollout.partial_rollout) the step is one `carry_round` and its metrics add
    `carry_metrics`.
    """
    groups, stats = GroupFilter(cfg, world_size=world_size), RoundStats(sums={"rollout/preemptions": 0.0})
    engine.pop_metrics("rollout/")  # only the training rollouts count: drop what validation's generation preempted
    if carry is not None:
        batch, round_stats = carry_round(cfg, engine, scorer, dataset, sampler, carry, step=step, rank=rank, timings=timings,
                                         score_request=score_request)
        stats.add(round_stats)
        groups.add(batch)
        batch = groups.finish(cfg, step=step, stats=stats, scorer=scorer)
        return batch, {**rollout_metrics(stats, groups, step=step), **carry_metrics(carry, batch)}
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
        if k in ("reward/errors", "reward/timeouts", "rollout/preemptions") or k.startswith(("reward_model/", "judge/")):  # counts
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


def validate(cfg, engine, scorer, dataset, *, world_size: int, rank: int, step: int = 0,
             tokenizer=None, episodes=None) -> tuple[dict[str, float], list[dict]]:
    """rollout.val_kwargs generation (greedy unless do_sample) over this process's share of the validation set
    -> (metrics, logged rows). The engine must be ready; seeds are the "val" purpose's, at `step`.

    Metrics per data source (grpo_lib.rollout.validation): reward_mean (with reward.overlong_buffer's penalty, as verl's
    validation), acc, and mean@n / pass@n when val_kwargs.n > 1; multi-turn: val/episode/*, val/tools/*.
    Rows: the first trainer.val_generations_to_log (prompt, response, score) rows (prompts decoded with `tokenizer`).
    """
    vk = cfg.rollout.val_kwargs
    from grpo_lib.rollout.validation import generation_rows, val_metrics

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


