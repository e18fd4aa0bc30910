"""The no-grad logprob pass over token-budgeted micro-batches, shared by the actor's old-logprob pass, the reference and
the teacher: micro-batches cut under a token budget (the count agreed by every process), the loss tokens scored in the
update's own chunks (so the first update's ratio is bitwise 1), the rows back on the host in one copy.

    lp = logprobs_over_batch(policy, batch, temperature=1.0, remove_padding=True, max_tokens=16384,
                             micro_batch_size=None, device=device)        # [B, T], the batch's row order
"""

from __future__ import annotations

import contextlib

import torch

from grpo_lib.core.devices import to_device
from grpo_lib.core.types import RolloutBatch
from grpo_lib.model import attention
from grpo_lib.model.batching import agree_num_micro_batches, micro_batch_indices, restore_order
from grpo_lib.model.logprobs import layout_kwargs
from grpo_lib.model.score_plan import batch_facts, micro_batch_rows, plan_forward


def micro_batches(seq_lens: list[int], *, max_tokens: int | None, micro_batch_size: int | None,
                  groups: list | None = None) -> list[list[int]]:
    """Row indices per micro-batch (token budget if `max_tokens`, else fixed size); the count is agreed by all processes.
    `groups` (shared-prompt packing): under a token budget a group's rows stay together where they fit."""
    budget = {"max_tokens": max_tokens, "groups": groups} if max_tokens is not None else {"micro_batch_size": micro_batch_size}
    local = micro_batch_indices(seq_lens, **budget)
    agreed = agree_num_micro_batches(len(local))
    return local if agreed == len(local) else micro_batch_indices(seq_lens, **budget, min_num_micro_batches=agreed)


# Recompute the output head in the backward only when a micro-batch's float32 logits exceed this: below it the
# recompute costs time and saves little memory (bench/results_cpu.md); under it the head also runs as one chunk. A 152k
# vocabulary is above it from ~220 loss tokens per micro-batch on.
HEAD_CHECKPOINT_MIN_BYTES = 128 * 2**20


def response_scores(mb: RolloutBatch) -> torch.Tensor | None:
    """The positions the loss reads (`loss_mask`) as token_logprobs' score_mask; None for a micro-batch without any
    (the zero-weighted dummy, or rows whose loss mask is all 0), which then scores every token so the output head
    stays in its graph.

    The rule: the scored group (with grad in the update) is exactly the loss tokens. Every other position, the
    prompt and the response's holes (tool output), is scored after it in chunks of its own, without grad
    (score_unmasked=True): it has a value that nothing reads. The old-logprob pass and the update call this on the
    same micro-batch, so both score the same positions in the same chunks (first update's ratio bitwise 1).
    """
    return mb.loss_mask if bool(mb.loss_mask.any()) else None


@torch.no_grad()
def logprobs_over_batch(policy, batch: RolloutBatch, *, temperature: float, remove_padding: bool, max_tokens: int | None,
                        micro_batch_size: int | None, device: torch.device, autocast=None,
                        planned: list[list[int]] | None = None) -> torch.Tensor:
    """No-grad logprobs of every row of `batch` ([B, T], original order) over micro-batches; `policy` is a LogprobModel.
    Inside `autocast()` when given (the actor's compute dtype on CPU). Loss tokens are scored in the same chunks as the
    update scores them (so the first update's ratio is bitwise 1), the other tokens (prompt, response holes) after them
    in chunks of their own (`response_scores`).

    `planned`: the micro-batches already cut (the old-logprob pass's, from the step's `StepPlan`); else cut here under
    `max_tokens` / `micro_batch_size`. An empty micro-batch (this process has fewer rows than the agreed count) runs a
    dummy forward, discarded. Nothing is read back from the device until the last micro-batch: the rows then come to
    the host in one copy.
    """
    width = batch.input_ids.shape[1]
    share = attention.shares_prefixes(policy.model)
    facts = batch_facts(batch, share_prefixes=remove_padding and share)  # read once; no micro-batch reads a tensor
    index_lists = planned if planned is not None else micro_batches(
        facts.lens, max_tokens=max_tokens, micro_batch_size=micro_batch_size,
        groups=batch.group_ids if remove_padding and share else None)
    chunks, dummy = [], []
    for idx in index_lists:
        mb, mb_facts = micro_batch_rows(batch, facts, idx, dummy)
        score_mask, layout, _, plan = plan_forward(mb, mb_facts, remove_padding=remove_padding, share_prefixes=share,
                                                   varlen=attention.is_varlen(policy.model), score_unmasked=True)
        with autocast() if autocast is not None else contextlib.nullcontext():
            lp, _ = policy(to_device(mb.input_ids, device), to_device(mb.attention_mask, device), temperature=temperature,
                           **layout_kwargs(layout), score_mask=None if score_mask is None else to_device(score_mask, device),
                           score_unmasked=True, checkpoint_min_bytes=HEAD_CHECKPOINT_MIN_BYTES,
                           plan=plan.to(device))  # [b, t]: the update's chunks
        chunks.append(torch.nn.functional.pad(lp.float(), (0, width - lp.shape[1]))[:len(idx)])  # [b, T], on the device
    rows = torch.cat(chunks).cpu()  # [B, T] in micro-batch order: one device-to-host copy for the whole pass
    return restore_order(list(rows.split([len(idx) for idx in index_lists])), index_lists)  # [B, T]
