"""Validation metrics from scored responses: per data source reward, accuracy, mean@n and pass@n; logged samples.

`rounds.validate` generates rollout.val_kwargs.n responses per validation prompt, then calls `val_metrics` and
`generation_rows`. Metric names (every process gets the same values, reduced over processes):

| name | meaning |
|---|---|
| `val/<source>/reward_mean` | weighted reward per response |
| `val/<source>/acc` | fraction of responses whose accuracy reward is > 0 (the total score when no accuracy function is listed) |
| `val/<source>/mean@<n>` | per prompt, the fraction of its n responses that are correct; averaged over prompts (only n > 1) |
| `val/<source>/pass@<n>` | fraction of prompts with at least one correct response among n (only n > 1) |
| `val/<source>/overlong_penalty_mean` | with reward.overlong_buffer.enable: DAPO's overlong penalty per response (included in reward_mean) |
| `val/reward_mean`, `val/reward_errors` | over all sources: reward per response; reward calls that failed or timed out |
| `val/episode/*`, `val/tools/*` | multi-turn: the training step's episode/* and tools/* metrics over the validation episodes (rounds.validate) |

The overlong shaping applies to validation as verl applies it: verl builds its validation reward manager with the same
reward kwargs as the training one, so DAPO's manager adds the penalty to every validation score (its `reward` metric),
while the accuracy (`acc`) is the score before the penalty. Here too: reward_mean includes the penalty, acc does not.

Example, one source, n = 2: prompt A's responses correct [1, 0], prompt B's [0, 0] -> acc 0.25, mean@2 0.25,
pass@2 0.5 (A has one correct). pass@n >= mean@n always: a prompt's best response is at least its average.
"""

from __future__ import annotations

from grpo_lib.core.distributed import Reduction, is_on


def val_metrics(scorer, batch, *, sources: list[str], n: int, overlong_buffer=None,
                max_response_length: int | None = None, rewards=None) -> dict[str, float]:
    """Score `batch` (fills batch.scores, with `overlong_buffer` enabled plus DAPO's overlong penalty) and reduce
    per-source metrics over processes (see the module table). The penalty's max_resp_len is overlong_buffer.max_resp_len
    or `max_response_length` (data.max_response_length), as for training rewards (step.score).

    `sources` must be the same list on every process (the validation set's sources), so the reductions match.
    `rewards`: the batch's RewardOutput when it was scored already (while the engine generated, `rounds.validate`).
    Example: max_response_length 20, len 4, a correct response of 17 tokens -> reward 0.75, acc 1, penalty -0.25.
    """
    import torch

    from grpo_lib.algorithms import overlong_penalty

    out = rewards if rewards is not None else scorer.score(
        responses=batch.response_texts, data_sources=batch.data_sources, ground_truths=batch.ground_truths,
        extra_infos=batch.extra_infos)
    batch.scores = torch.tensor(out.scores, dtype=torch.float32)  # [B]
    penalties = None
    if overlong_buffer is not None and overlong_buffer.enable:
        max_resp_len = overlong_buffer.max_resp_len if overlong_buffer.max_resp_len is not None else max_response_length
        penalties = overlong_penalty(batch.response_lengths, max_resp_len=max_resp_len, buffer_len=overlong_buffer.len,
                                     penalty_factor=overlong_buffer.penalty_factor)  # [B]
        batch.overlong_penalties = penalties
        batch.scores = batch.scores + penalties  # [B]
    scores = batch.scores.tolist()  # [B] what reward_mean averages
    correctness = out.per_function.get("accuracy", out.scores)  # before the penalty (verl's acc)
    correct = [float(value > 0) for value in correctness]  # [B]
    groups: dict[str, list[int]] = {}  # prompt -> its rows (a prompt's n responses share its group id)
    for row, group in enumerate(batch.group_ids):
        groups.setdefault(group, []).append(row)
    counts = Reduction()  # rows and prompts per source, then every metric: two all-reduces
    rows_of = {src: [i for i, d in enumerate(batch.data_sources) if d == src] for src in sources}
    prompts_of = {src: [g for g, members in groups.items() if batch.data_sources[members[0]] == src] for src in sources}
    for src in sources:
        counts.sum(f"rows:{src}", len(rows_of[src]))
    totals = counts.reduce()
    reduction = Reduction()
    for src in sources:
        rows, prompts = rows_of[src], prompts_of[src]
        if not totals[f"rows:{src}"]:
            continue
        reduction.count(f"rows:{src}", len(rows))
        reduction.mean(f"val/{src}/reward_mean", sum(scores[i] for i in rows), over=f"rows:{src}")
        reduction.mean(f"val/{src}/acc", sum(correct[i] for i in rows), over=f"rows:{src}")
        if penalties is not None:
            reduction.mean(f"val/{src}/overlong_penalty_mean", float(sum(penalties[i] for i in rows)), over=f"rows:{src}")
        if n > 1:
            reduction.count(f"prompts:{src}", len(prompts))
            reduction.mean(f"val/{src}/mean@{n}", sum(sum(correct[i] for i in groups[g]) / len(groups[g]) for g in prompts),
                           over=f"prompts:{src}")
            reduction.mean(f"val/{src}/pass@{n}", sum(max(correct[i] for i in groups[g]) for g in prompts), over=f"prompts:{src}")
    reduction.count("rows", len(scores))
    reduction.mean("val/reward_mean", sum(scores), over="rows")
    reduction.sum("val/reward_errors", out.num_errors + out.num_timeouts)
    metrics = reduction.reduce()
    return metrics


def generation_rows(batch, prompt_texts: list[str], *, limit: int) -> list[dict]:
    """The first `limit` (prompt, response, score) rows of the validation, gathered to every process.

    `prompt_texts[i]` is row i's prompt as text. Rows come in process order (process 0's first), so a fixed
    validation set logs the same prompts at every validation and their responses can be compared over steps.
    Example: limit 2 -> [{"data_source": "openai/gsm8k", "prompt": "...", "response": "... #### 7",
    "ground_truth": "7", "score": 1.0}, {...}].
    """
    if limit <= 0:
        return []
    rows = [{"data_source": batch.data_sources[i], "prompt": prompt_texts[i], "response": batch.response_texts[i],
             "ground_truth": str(batch.ground_truths[i]), "score": float(batch.scores[i])}
            for i in range(min(limit, len(batch)))]
    if is_on():
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        rows = [row for part in gathered for row in part]
    return rows[:limit]
