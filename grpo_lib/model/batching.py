"""Micro-batches under a token budget and work balancing (packing a micro-batch into rows: `grpo_lib.model.packing`).

Everything here is a memory knob only (docs/DESIGN.md invariant 1): how a mini-batch is cut into micro-batches,
and whether a micro-batch is packed, never changes the gradient, because the loss of every micro-batch is
divided by the mini-batch's global counts elsewhere (`algorithms`). Every token count here is compute, a row's
real tokens (`RolloutBatch.seq_lens`: prompt + the whole response, the loss mask's holes included, since they cost
a forward like any token); nothing here reads `response_mask` or `loss_mask`.

- `partition_balanced`: split item indices into k parts with nearly equal weight sums, by the
  Karmarkar-Karp largest differencing method (as verl's `seqlen_balancing.py`). Guarantee used by the tests:
  the spread max(sum) - min(sum) never exceeds the largest weight.
- `micro_batch_indices`: dynamic batch size (every micro-batch holds <= max_tokens tokens, the fewest
  balanced micro-batches that fit) or a fixed number of sequences per micro-batch. `min_num_micro_batches`
  is how processes agree on one count (FSDP needs every process to run the same number of forwards):
  each process computes its own count, `agree_num_micro_batches` takes the MAX, and each process calls again
  with that number.
- `restore_order` / `restore_order_list`: put per-micro-batch results back into the original row order.
- `dummy_micro_batch`: the zero-weighted two-token row an empty micro-batch runs (every process makes the same calls).
- `StepPlan` (`make_step_plan`, from `split_mini_batches`): a step's mini-batches of every epoch and each one's
  micro-batches, decided once after balancing and handed to the old-logprob pass and the update (one decision, not
  one per pass kept in step by a seed).
- `balance_across_ranks` (`trainer.balance_batch`): trajectories are generated on the process that owns the
  prompt; this moves whole groups between processes so that every process holds the same number of
  trajectories and nearly the same number of tokens (`plan_rank_balance` is the pure planning step).

Example: micro_batch_indices([5, 3, 4, 4], max_tokens=8) -> [[0, 1], [2, 3]]  (8 and 8 tokens).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_lib.core.types import RolloutBatch


def partition_balanced(weights: list[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split indices 0..n-1 into exactly k parts whose weight sums are as even as possible (Karmarkar-Karp).

    Each part's indices are sorted ascending; non-empty parts are ordered by their smallest index, empty
    parts (only when k > n and not equal_size) come last. With equal_size=True every part holds n / k items.
    Deterministic. Example: partition_balanced([5, 1, 4, 2], 2) -> [[0, 1], [2, 3]] (sums 6 and 6).
    """
    if k < 1:
        raise ValueError(f"partition_balanced: k must be >= 1, got k={k}")
    if any(w < 0 for w in weights):
        raise ValueError(f"partition_balanced: weights must be >= 0, got min weight {min(weights)}")
    n = len(weights)
    if equal_size and n % k != 0:
        raise ValueError(f"partition_balanced: equal_size needs len(weights) % k == 0, got {n} items into k={k} parts")
    # Heaviest first: for equal_size each initial state holds k consecutive items of this order (one per part).
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    if equal_size:
        groups = [order[start : start + k] for start in range(0, n, k)]
    else:
        groups = [[i] for i in order]
    # A state is k parts [(sum, indices)], sorted by sum descending; the heap pops the largest spread first.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for counter, group in enumerate(groups):
        parts = [(weights[i], [i]) for i in group] + [(0, []) for _ in range(k - len(group))]
        parts.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), counter, parts))
    counter = len(groups)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # Largest part of one state joins the smallest of the other: spread <= max(both spreads).
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    parts = [sorted(indices) for _, indices in heap[0][2]] if heap else [[] for _ in range(k)]
    return sorted(parts, key=lambda part: (not part, part[0] if part else 0))


def _first_fit_decreasing(seq_lens: list[int], max_tokens: int) -> list[list[int]]:
    """Bin packing fallback: longest first, each into the first micro-batch with room."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i)):
        slot = next((b for b, load in enumerate(loads) if load + seq_lens[i] <= max_tokens), None)
        if slot is None:
            bins.append([])
            loads.append(0)
            slot = len(bins) - 1
        bins[slot].append(i)
        loads[slot] += seq_lens[i]
    return bins


def _split_to(parts: list[list[int]], seq_lens: list[int], num_parts: int) -> list[list[int]]:
    """Split the heaviest multi-item part in two until there are num_parts parts (sums only shrink)."""
    parts = [list(part) for part in parts]
    while len(parts) < num_parts:
        splittable = [p for p in range(len(parts)) if len(parts[p]) >= 2]
        if not splittable:
            parts.append([])  # fewer items than parts: trailing empty micro-batches
            continue
        p = max(splittable, key=lambda p: (sum(seq_lens[i] for i in parts[p]), -p))
        part = parts.pop(p)
        halves = partition_balanced([seq_lens[i] for i in part], 2)
        parts += [sorted(part[j] for j in half) for half in halves]
    return parts


def micro_batch_indices(
    seq_lens: list[int],
    *,
    max_tokens: int | None = None,
    micro_batch_size: int | None = None,
    min_num_micro_batches: int = 1,
    groups: list | None = None,
) -> list[list[int]]:
    """Cut sequences (lengths in tokens, prompt + response) into micro-batches; returns row indices per part.

    Exactly one of:
    - max_tokens (dynamic batch size, verl's `use_dynamic_bsz`): every micro-batch holds <= max_tokens tokens.
      The count is the smallest k >= ceil(sum / max_tokens) whose Karmarkar-Karp partition fits (first-fit
      decreasing as the fallback). Micro-batches are ordered by token count descending (the memory peak comes
      first, so an OOM shows at the first micro-batch), ties by smallest index.
    - micro_batch_size (sequences per micro-batch): consecutive slices in the original order, as even as
      possible (10 rows, size 4 -> sizes [4, 3, 3]); no token balancing (use max_tokens for that).

    - groups (with max_tokens: one id per row, e.g. the prompt's; for shared-prompt packing): a group's rows stay
      together where they fit the budget (a larger group is cut into consecutive runs that do), so rows that share a
      prompt share a micro-batch; the same partition as above over those units. Falls back to rows when more parts
      are asked for than there are units.

    The result has exactly max(own need, min_num_micro_batches) parts, each sorted ascending. When that exceeds
    the number of sequences, the trailing parts are EMPTY lists: the caller must still run a forward (a dummy
    row whose loss is multiplied by 0) for an empty part so that every process runs the same number of
    forward/backward passes under FSDP.
    Example: micro_batch_indices([5, 3, 4, 4], max_tokens=8, min_num_micro_batches=3) -> 3 parts, each <= 8.
    """
    if (max_tokens is None) == (micro_batch_size is None):
        raise ValueError(
            f"micro_batch_indices: pass exactly one of max_tokens / micro_batch_size, "
            f"got max_tokens={max_tokens}, micro_batch_size={micro_batch_size}"
        )
    if min_num_micro_batches < 1:
        raise ValueError(f"micro_batch_indices: min_num_micro_batches must be >= 1, got {min_num_micro_batches}")
    n = len(seq_lens)
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_indices: micro_batch_size must be >= 1, got {micro_batch_size}")
        num_parts = max(math.ceil(n / micro_batch_size), min_num_micro_batches)
        base, extra = divmod(n, num_parts)
        bounds = [0]
        for p in range(num_parts):
            bounds.append(bounds[-1] + base + (1 if p < extra else 0))
        return [list(range(bounds[p], bounds[p + 1])) for p in range(num_parts)]

    assert max_tokens is not None, "max_tokens checked above"
    if max_tokens < 1:
        raise ValueError(f"micro_batch_indices: max_tokens must be >= 1, got {max_tokens}")
    for i, length in enumerate(seq_lens):
        if length < 0 or length > max_tokens:
            raise ValueError(
                f"micro_batch_indices: sequence {i} has {length} tokens, over the budget max_tokens={max_tokens} "
                f"(raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu to at least {length})"
            )

    if groups is not None:
        assert len(groups) == n, f"{len(groups)} group ids for {n} sequences"
        units = _group_units(seq_lens, groups, max_tokens)
        if min_num_micro_batches <= len(units):
            unit_parts = micro_batch_indices([sum(seq_lens[i] for i in u) for u in units], max_tokens=max_tokens,
                                             min_num_micro_batches=min_num_micro_batches)
            return [sorted(i for u in part for i in units[u]) for part in unit_parts]

    def fits(parts: list[list[int]]) -> bool:
        return all(sum(seq_lens[i] for i in part) <= max_tokens for part in parts)

    parts = _first_fit_decreasing(seq_lens, max_tokens)  # always fits; len(parts) bounds the search
    for k in range(max(1, math.ceil(sum(seq_lens) / max_tokens)), len(parts) + 1):
        candidate = partition_balanced(seq_lens, k)
        if fits(candidate):
            parts = candidate
            break
    parts = [sorted(part) for part in parts if part]  # own need counts non-empty parts only (n == 0 -> 0)
    num_parts = max(len(parts), min_num_micro_batches)
    if num_parts > len(parts):
        candidate = partition_balanced(seq_lens, num_parts)
        parts = candidate if fits(candidate) else _split_to(parts, seq_lens, num_parts)
    assert len(parts) == num_parts and fits(parts), f"internal: {len(parts)} parts for {num_parts} or over budget"
    return sorted(parts, key=lambda part: (not part, -sum(seq_lens[i] for i in part), part[0] if part else 0))


def _group_units(seq_lens: list[int], groups: list, max_tokens: int) -> list[list[int]]:
    """Rows of each group (in order of first row) in consecutive runs of at most max_tokens tokens.
    Example: lengths [3, 3, 3, 2], groups [a, a, a, b], max_tokens 6 -> [[0, 1], [2], [3]]."""
    rows_of: dict = {}
    for i, g in enumerate(groups):
        rows_of.setdefault(g, []).append(i)
    units = []
    for rows in rows_of.values():
        run, tokens = [], 0
        for i in rows:
            if run and tokens + seq_lens[i] > max_tokens:
                units.append(run)
                run, tokens = [], 0
            run.append(i)
            tokens += seq_lens[i]
        units.append(run)
    return units


def _inverse_order(index_lists: list[list[int]]) -> list[int]:
    """Position in the concatenated micro-batch order of each original row; checks a permutation."""
    flat = [i for part in index_lists for i in part]
    assert sorted(flat) == list(range(len(flat))), f"index lists are not a permutation of 0..{len(flat) - 1}"
    inverse = [0] * len(flat)
    for position, i in enumerate(flat):
        inverse[i] = position
    return inverse


def restore_order(chunks: list[Tensor], index_lists: list[list[int]]) -> Tensor:
    """Concatenate per-micro-batch results (row p of chunk j belongs to row index_lists[j][p]) in original order.

    A chunk for an empty part must have 0 rows (slice a dummy forward's output with [:0]). All chunks must
    share their trailing shape. Differentiable. Example: chunks [[b], [a, c]], index lists [[1], [0, 2]] ->
    [a, b, c].
    """
    assert len(chunks) == len(index_lists), f"{len(chunks)} chunks for {len(index_lists)} index lists"
    for j, (chunk, indices) in enumerate(zip(chunks, index_lists)):
        assert chunk.shape[0] == len(indices), f"chunk {j} has {chunk.shape[0]} rows for {len(indices)} indices"
    inverse = _inverse_order(index_lists)
    stacked = torch.cat(chunks, dim=0)  # [n, ...] in micro-batch order
    return stacked[torch.tensor(inverse, dtype=torch.long, device=stacked.device)]  # [n, ...] original order


def restore_order_list(chunks: list[list], index_lists: list[list[int]]) -> list:
    """`restore_order` for python lists: [[b], [a, c]], [[1], [0, 2]] -> [a, b, c]."""
    assert len(chunks) == len(index_lists), f"{len(chunks)} chunks for {len(index_lists)} index lists"
    for j, (chunk, indices) in enumerate(zip(chunks, index_lists)):
        assert len(chunk) == len(indices), f"chunk {j} has {len(chunk)} items for {len(indices)} indices"
    flat = [item for chunk in chunks for item in chunk]
    return [flat[position] for position in _inverse_order(index_lists)]


def agree_num_micro_batches(n_local: int, *, group: dist.ProcessGroup | None = None) -> int:
    """MAX of n_local over the processes of `group` when torch.distributed is initialised, else n_local."""
    if not (dist.is_available() and dist.is_initialized()):
        return n_local
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    count = torch.tensor([n_local], dtype=torch.long, device=device)  # [1]
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def dummy_micro_batch(template: RolloutBatch) -> RolloutBatch:
    """One two-token row (token id 0, real tokens, EMPTY response and loss masks) shaped like `template`'s fields.

    Run in place of an empty micro-batch so this process makes the same forward/backward calls as the others;
    its loss is multiplied by 0. Two tokens, so one token is scored and the output head is part of the graph.
    """
    out = {}
    for f in fields(template):
        value = getattr(template, f.name)
        if isinstance(value, torch.Tensor):
            shape = (1, 2, *value.shape[2:]) if value.dim() >= 2 else (1, *value.shape[1:])  # per-token: two tokens
            out[f.name] = torch.zeros(shape, dtype=value.dtype)
        elif isinstance(value, list):
            out[f.name] = [value[0] if value else None]
        else:
            out[f.name] = value
    out["attention_mask"] = torch.ones(1, 2, dtype=template.attention_mask.dtype)  # [1, 2]
    return RolloutBatch(**out)


# ------------------------------------------------------------------------------------------------ the step plan


@dataclass(frozen=True)
class MiniBatch:
    """This process's share of one global mini-batch: `rows` of the step's batch, cut into `micro_batches` (positions in
    `rows`, one list per forward; an empty one, where this process holds fewer rows than the agreed count, runs a
    zero-weighted dummy row so every process makes the same forward / backward calls)."""

    rows: list[int]
    micro_batches: list[list[int]]


@dataclass(frozen=True)
class StepPlan:
    """A step's mini-batches and micro-batches, decided once after balancing (`make_step_plan`) and handed to the
    old-logprob pass and the update, so both cut the batch alike: the first update sees every row in the same
    micro-batch at the same padded / packed width as the old-logprob pass did, its ratio bitwise 1 (DESIGN invariant 2).

    `epochs[e]`: the update's e-th pass over the batch (actor.ppo_epochs), one optimizer step per MiniBatch, shuffled
    anew each epoch with actor.shuffle. `old_logprob`: the old-logprob pass, epoch 0's mini-batches cut under its own
    budget (rollout.log_prob_*); the very MiniBatch objects of epoch 0 where that budget is the update's (the default).

    Example (2 groups of 2 rows, 1 epoch, mini-batches of one prompt, 1 row per micro-batch):
    epochs [[MiniBatch([0, 1], [[0], [1]]), MiniBatch([2, 3], [[0], [1]])]], old_logprob = epochs[0].
    """

    epochs: list[list[MiniBatch]]
    old_logprob: list[MiniBatch]


def split_mini_batches(group_ids: list, *, sizes: list[int], generator: torch.Generator | None = None) -> list[list[int]]:
    """Row indices of each mini-batch of one epoch: whole groups (rows of one `group_ids` value), the groups shuffled
    with `generator` when given (one permutation drawn from it per call).

    `sizes`: prompts per global mini-batch (`config.checks.mini_batch_sizes`: actor.ppo_mini_batch_size each, the last
    one fewer when it does not divide data.train_batch_size, verl's split). Without shuffling, local mini-batch m of
    every process holds that process's part of global mini-batch m (prompts are dealt out strided), so the process count
    never changes what an update sees. Shuffling permutes each process's groups locally: the mini-batches then depend on
    the process count.

    Example (4 groups of 2 rows, sizes [2, 2], no shuffle): [[0, 1, 2, 3], [4, 5, 6, 7]].
    """
    groups = list(dict.fromkeys(group_ids))  # group order as generated
    rows_of: dict = {}
    for i, g in enumerate(group_ids):
        rows_of.setdefault(g, []).append(i)
    if generator is not None:
        groups = [groups[j] for j in torch.randperm(len(groups), generator=generator).tolist()]
    # this process's share of each mini-batch, in proportion (every process holds train_batch_size / world groups)
    total, ends, seen = sum(sizes), [], 0
    for size in sizes:
        seen += size
        ends.append(seen * len(groups) // total)
    starts = [0, *ends[:-1]]
    # A mini-batch left empty (DAPO kept fewer groups than there are mini-batches) is dropped: an optimizer step on
    # zero gradients would still move the weights (weight decay, momentum). Every process holds the same number of
    # groups, so all drop the same ones.
    return [[i for g in groups[lo:hi] for i in rows_of[g]] for lo, hi in zip(starts, ends) if hi > lo]


def make_step_plan(group_ids: list, *, sizes: list[int], epochs: int, generator: torch.Generator | None,
                   cut: Callable[[list[int]], list[list[int]]],
                   cut_old_logprob: Callable[[list[int]], list[list[int]]] | None = None) -> StepPlan:
    """The step's `StepPlan`: `epochs` passes of `split_mini_batches` (each drawing its permutation from `generator`, in
    epoch order; None: no shuffle, every epoch the same mini-batches), each mini-batch's rows cut into micro-batches by
    `cut(rows)` (positions in rows; the caller's budget, agreed over processes); the old-logprob pass's by
    `cut_old_logprob` (None: its budget is the update's, epoch 0's MiniBatch objects are its own)."""
    planned: list[list[MiniBatch]] = []
    for _ in range(epochs):
        if generator is None and planned:  # unshuffled: the same mini-batches every epoch, cut once
            planned.append(planned[0])
            continue
        planned.append([MiniBatch(rows, cut(rows)) for rows in split_mini_batches(group_ids, sizes=sizes, generator=generator)])
    first = planned[0] if planned else []
    old = first if cut_old_logprob is None else [MiniBatch(m.rows, cut_old_logprob(m.rows)) for m in first]
    return StepPlan(epochs=planned, old_logprob=old)


def plan_rank_balance(groups_per_rank: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """Assign whole groups to processes: equal trajectory counts, balanced token counts, few moves.

    groups_per_rank[r][j] = (rows, tokens) of group j on process r. Returns, for every destination process, the
    groups it gets as (source process, j), in global order (source, then j). Every group must hold the same
    number of rows and the group count must divide by the process count (each process then gets
    num_groups / world_size groups); the token sums then differ by at most one group's tokens (Karmarkar-Karp).
    A batch already as balanced as the partition stays put; otherwise parts go to processes greedily by how many
    of their tokens are already there.
    Example: [[(2, 90), (2, 80)], [(2, 10), (2, 20)]] -> [[(0, 0), (1, 0)], [(0, 1), (1, 1)]] (100 / 100 tokens).
    """
    world_size = len(groups_per_rank)
    flat = [(r, j, rows, tokens) for r, groups in enumerate(groups_per_rank) for j, (rows, tokens) in enumerate(groups)]
    sizes = sorted({rows for _, _, rows, _ in flat})
    if len(sizes) > 1:
        raise ValueError(f"balance_across_ranks: groups hold different numbers of trajectories {sizes}; equal counts per "
                         "process need equal group sizes (set trainer.balance_batch=false)")
    if len(flat) % world_size:
        raise ValueError(f"balance_across_ranks: {len(flat)} groups do not split evenly across {world_size} processes "
                         "(set trainer.balance_batch=false or make data.train_batch_size a multiple of the process count)")
    parts = partition_balanced([tokens for *_, tokens in flat], world_size, equal_size=True)
    planned = [sum(flat[i][3] for i in part) for part in parts]
    current = [sum(tokens for _, tokens in groups) for groups in groups_per_rank]
    if len({len(groups) for groups in groups_per_rank}) == 1 and max(current) - min(current) <= max(planned) - min(planned):
        return [[(r, j) for j in range(len(groups))] for r, groups in enumerate(groups_per_rank)]  # already as balanced
    # overlap[p][r]: tokens of part p already on process r; assign the largest overlaps first.
    overlap = [[sum(flat[i][3] for i in part if flat[i][0] == r) for r in range(world_size)] for part in parts]
    pairs = sorted(((overlap[p][r], p, r) for p in range(world_size) for r in range(world_size)), key=lambda x: (-x[0], x[1], x[2]))
    owner: dict[int, int] = {}
    taken: set[int] = set()
    for _, p, r in pairs:
        if p not in owner and r not in taken:
            owner[p] = r
            taken.add(r)
    plan: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for p, part in enumerate(parts):
        plan[owner[p]] = sorted((flat[i][0], flat[i][1]) for i in part)
    return plan


def _concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """Rows of several batches in one, [B, T] fields right-padded with zeros to the widest."""
    width = max(b.input_ids.shape[1] for b in batches)
    out = {}
    for f in fields(RolloutBatch):
        values = [getattr(b, f.name) for b in batches]
        if isinstance(values[0], Tensor):
            pad = [torch.nn.functional.pad(v, (0, width - v.shape[1])) if v.dim() == 2 else v for v in values]
            out[f.name] = torch.cat(pad)
        elif isinstance(values[0], list):
            out[f.name] = [x for v in values for x in v]
        else:
            out[f.name] = values[0]  # None (on every process alike) or the batch-level `extra` dict
    return RolloutBatch(**out)


def balance_across_ranks(batch: RolloutBatch, *, group: dist.ProcessGroup | None = None) -> RolloutBatch:
    """This process's rows after moving whole groups so every process holds the same number of trajectories and
    nearly the same number of tokens (prompt + response, real tokens). Identity with one process.

    The (rows, tokens) of every group are all-gathered, every process computes the same `plan_rank_balance`,
    then each source process scatters the groups it gives away (pickled CPU batches, `scatter_object_list`).
    Groups are rows sharing a group_id; a group never straddles processes, so per-group advantages are
    unchanged. Rows arrive grouped, in (source process, position) order. Call it right after generation, before
    any per-row tensor is computed from the process's share (reference / old logprobs, advantages).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return batch
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    group_order = list(dict.fromkeys(batch.group_ids))  # local groups, as generated
    rows_of: dict[str, list[int]] = {g: [] for g in group_order}
    for i, g in enumerate(batch.group_ids):
        rows_of[g].append(i)
    seq_lens = batch.seq_lens
    local = [(len(rows_of[g]), sum(seq_lens[i] for i in rows_of[g])) for g in group_order]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, local, group=group)
    plan = plan_rank_balance(gathered)
    outgoing = []
    for dest in range(world_size):
        mine = [j for src, j in plan[dest] if src == rank]
        outgoing.append(batch.select([i for j in mine for i in rows_of[group_order[j]]]) if mine else None)
    pieces = []
    for src in range(world_size):  # one scatter per source process: data moves once, to its destination
        received: list = [None]
        dist.scatter_object_list(received, outgoing if src == rank else None, group=group, group_src=src)
        if received[0] is not None:
            pieces.append(received[0])
    assert pieces, f"balance_across_ranks: process {rank} received no group"
    return _concat_batches(pieces)
