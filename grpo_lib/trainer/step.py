"""The phases of one training step between the engine, the rewards and the actor, on one batch: rows built from the
generations, rewards scored, the checks that stop a run whose rewards cannot be trusted, advantages, the step's timings.
Generation rounds (and validation) are grpo_lib/trainer/rounds.py.

`train_grpo.py` calls these by name in docs/DESIGN.md's order. Each is a function over the typed containers
of `grpo_lib.core.types`; none branches on a loss or estimator name (the math lives in `algorithms`).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from grpo_lib import algorithms
from grpo_lib.core.distributed import Reduction, is_on
from grpo_lib.core.types import Generation, PromptBatch, RolloutBatch
from grpo_lib.model.batching import balance_across_ranks
from grpo_lib.rollout.episodes import reward_extra_info




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
    versioned = any(g.versions is not None for _, g in rows)  # carried responses: each token's weight version
    token_versions = torch.zeros((B, width), dtype=torch.long) if versioned else None  # [B, T]
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
        if versioned:
            assert g.versions is not None and len(g.versions) == R, "every generation of a versioned batch has one version per token"
            token_versions[i, P:P + R] = torch.tensor(g.versions, dtype=torch.long)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs,
        group_ids=[prompts.group_ids[p] for p in meta], response_texts=[g.text for _, g in rows],
        data_sources=[prompts.data_sources[p] for p in meta], ground_truths=[prompts.ground_truths[p] for p in meta],
        extra_infos=[reward_extra_info(prompts.extra_infos[p], g.episode)
                     for p, (_, g) in zip(meta, rows)],
        truncated=torch.tensor([g.finish_reason == "length" for _, g in rows], dtype=torch.bool),
        token_versions=token_versions,
        prompt_messages=[prompts.messages[p] for p in meta] if getattr(prompts, "messages", None) is not None else None,
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
    add_model_scores(scorer, batch, out, timings=timings)
    return out


def add_model_scores(scorer, batch: RolloutBatch, out, *, timings: dict | None = None) -> None:
    """The learned scorers attached to `scorer` (`scorer.models`: the reward model, the judge) score `batch` after the rules;
    each one's raw score goes to out.per_function[name] (reward/<name>/mean) and weight x score is added to out.scores
    (docs/TRAINING.md, "Reward models and judges"); their own counters to out.extra["<name>/..."] (one number per batch).
    Every trainer process calls this for each batch it scores (the reward model's forwards are collectives)."""
    for name, model in getattr(scorer, "models", {}).items():
        start = time.perf_counter()
        values = model.score(batch)
        out.per_function[name] = values
        weight = scorer.weights[name]
        out.scores = [total + weight * value for total, value in zip(out.scores, values)]
        out.model_metrics.update(model.metrics)
        if timings is not None:
            timings[f"timing_s/{name}"] = timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


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
    sums.update(out.model_metrics)  # the model scorers' counters (reward_model/truncated, judge/unparsed), summed
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


def reduce_timings(timings: dict[str, float]) -> dict[str, float]:
    """Slowest process's time per phase (the step waits for it), in one all-reduce."""
    reduction = Reduction()
    for k, v in timings.items():
        reduction.max(k, v)
    return reduction.reduce()
