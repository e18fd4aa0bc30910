"""Packing a right-padded micro-batch into rows without padding, and the check that packed sequences stay apart.

Like micro-batching (`grpo_lib.model.batching`), packing is a memory and speed knob only (docs/DESIGN.md invariant 1): the
values are the padded path's up to float rounding.

- `pack_sequences`: right-padded rows -> k rows of whole sequences (balanced token counts), position_ids
  restarting at 0 per sequence, each row right-padded by a dummy segment whose position_ids also restart. In
  transformers 5.19, eager / sdpa / flex_attention build a block-diagonal causal mask from such position_ids,
  but ONLY when the model is called with `attention_mask=None` AND `use_cache=False` (a KV cache, or any
  2D mask, silently disables the detection and sequences attend to each other); the mask is built per row, so
  several rows work alike (measured). A varlen implementation (`grpo_lib.model.attention`: flash_attention_2, grpo_varlen)
  gets one row and the segment boundaries as kwargs instead (`packed_forward_kwargs`), and computes no dense mask.
  `check_packing_isolated` verifies this once at start-up for the model actually in use, with the kwargs
  token_logprobs sends it (one and two packed rows for a dense implementation, one row for a varlen one).
- `pack_shared_prefixes`: rows that begin with the same prompt go into one row as [prompt | continuation 1 |
  continuation 2 | ...], each continuation attending to its prompt (grpo_varlen's `attention.CONTINUES_KWARG`), so
  GRPO's n responses run their prompt through the decoder once; `shared_prefix_rows` / `shared_prefix_tokens` say
  which rows share and what the row costs.
- Both layouts are first built on the host from python ints (`pack_rows`, `shared_prefix_layout`: the row lengths,
  the groups), then moved to the device without waiting (`.to`) and their tokens gathered there by index
  (`with_tokens`): the update's forward reads nothing back from the device (`grpo_lib.model.score_plan`).

Example: pack_sequences(ids [[5, 6, 0], [7, 0, 0]], mask [[1, 1, 0], [1, 0, 0]]) -> one row [[5, 6, 7]], position_ids
[[0, 1, 0]].
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from grpo_lib.model.attention import (CONTINUES_KWARG, HOST_CU_KWARG, SHARED_CU_K_KWARG, SHARED_CU_Q_KWARG, SHARED_KV_INDEX_KWARG,
                                SHARED_MAX_K_KWARG, is_varlen, shared_prefix_kv_plan, shares_prefixes, torch_varlen_attn)
from grpo_lib.core.devices import to_device
from grpo_lib.model.batching import partition_balanced


@dataclass
class PackedBatch:
    """b right-padded rows packed into k rows of whole sequences (`total` real tokens), each right-padded to `width`.

    The padding of a packed row is one dummy segment whose position_ids restart at 0: it is a sequence of its own,
    attends only to itself, and its outputs are ignored (`real` is False there).
    """

    input_ids: Tensor | None  # [k, width], pad segments hold token 0 (None: not gathered yet, `pack_rows`)
    position_ids: Tensor  # [k, width], restarts at 0 for every sequence and every pad segment
    real: Tensor  # [k, width] bool, True on the tokens of the b sequences
    cu_seqlens: Tensor  # [segments + 1] int32, segment (pad segments too) boundaries in the flattened [k * width] rows
    max_seqlen: int  # longest segment, tokens
    flat_index: Tensor  # [total] long, index in the flattened [b * T] padded layout of each real packed token
    batch_size: int  # b
    seq_len: int  # T, padded length
    cu_seqlens_host: Tensor | None = None  # cu_seqlens on the host (grpo_varlen's per-sequence loop reads it)
    token_index: Tensor | None = None  # [k, width] long, flat index in the padded [b * T] of each token (0 on pads)

    def to(self, device: torch.device) -> PackedBatch:
        """Its tensors on `device` (`devices.to_device`: no wait for the device), cu_seqlens_host left on the host."""
        fields = ("input_ids", "position_ids", "real", "cu_seqlens", "flat_index", "token_index")
        return replace(self, **{f: to_device(getattr(self, f), device) for f in fields if getattr(self, f) is not None})

    def with_tokens(self, input_ids: Tensor) -> PackedBatch:
        """Its input_ids gathered from the padded [b, T] `input_ids` by `token_index` (token 0 on pad segments): an
        index gather, no boolean mask, so nothing on the device is read back."""
        tokens = input_ids.reshape(-1).index_select(0, self.token_index.reshape(-1)).view(self.token_index.shape)
        return replace(self, input_ids=tokens.masked_fill(~self.real, 0))  # [k, width]

    def unpack(self, values: Tensor) -> Tensor:
        """[k, width, ...] or [total, ...] per-token values -> [b, T, ...] with zeros at pads (differentiable).

        Values whose two leading dimensions are [k, width] are read as the packed rows (pad segments dropped).
        """
        total = self.flat_index.shape[0]
        if values.dim() >= 2 and tuple(values.shape[:2]) == tuple(self.real.shape):
            values = values[self.real]  # [total, ...]
        assert values.shape[0] == total, f"unpack expects {total} packed tokens, got shape {tuple(values.shape)}"
        padded = values.new_zeros((self.batch_size * self.seq_len, *values.shape[1:]))  # [b * T, ...]
        padded = padded.index_copy(0, self.flat_index, values)  # [b * T, ...]
        return padded.view(self.batch_size, self.seq_len, *values.shape[1:])  # [b, T, ...]


def pack_sequences(input_ids: Tensor, attention_mask: Tensor, *, num_rows: int = 1) -> PackedBatch:
    """Pack RIGHT-padded rows (mask 1...1 0...0, asserted) into num_rows rows with restarting position_ids.

    Sequences go to rows by `partition_balanced` of their lengths (each row's sequences in ascending index order);
    rows are right-padded to the longest with a pad segment (token 0, position_ids 0, 1, ...). num_rows is capped at
    the number of sequences (at least 1). Call the model with attention_mask=None, position_ids=packed.position_ids,
    use_cache=False. The layout is `pack_rows` of the row lengths (on the host), the tokens gathered on the device.
    Example: ids [[5, 6, 0], [7, 0, 0]], mask [[1, 1, 0], [1, 0, 0]] -> input_ids [[5, 6, 7]],
    position_ids [[0, 1, 0]], cu_seqlens [0, 2, 3], max_seqlen 2; with num_rows=2 -> input_ids [[5, 6], [7, 0]],
    position_ids [[0, 1], [0, 0]], real [[1, 1], [1, 0]], cu_seqlens [0, 2, 3, 4].
    """
    assert input_ids.shape == attention_mask.shape and input_ids.dim() == 2, (
        f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [b, T]"
    )
    mask = attention_mask.to(torch.long)  # [b, T]
    assert bool(((mask == 0) | (mask == 1)).all()), "attention_mask must hold only 0 and 1"
    assert bool((mask[:, 1:] <= mask[:, :-1]).all()), (
        "pack_sequences assumes right padding (each mask row is 1s then 0s); left-padded rows must be shifted first"
    )
    packed = pack_rows(mask.sum(dim=1).tolist(), mask.shape[1], num_rows=num_rows).to(input_ids.device)
    return packed.with_tokens(input_ids)


def pack_rows(lens: list[int], seq_len: int, *, num_rows: int = 1) -> PackedBatch:
    """`pack_sequences`' layout from the row lengths alone (right-padded rows of `seq_len` columns), host tensors, its
    input_ids not gathered yet (`PackedBatch.with_tokens`): built from python ints, it reads no tensor.
    Example: lens [2, 1], seq_len 3 -> token_index [[0, 1, 3]], position_ids [[0, 1, 0]], cu_seqlens [0, 2, 3]."""
    assert num_rows >= 1, f"num_rows must be >= 1, got {num_rows}"
    batch_size = len(lens)
    rows = [row for row in partition_balanced(lens, min(num_rows, max(batch_size, 1))) if row] or [[]]
    width = max(sum(lens[i] for i in row) for row in rows)
    # Per packed row, the segments as (source row or -1 for the pad segment, length).
    segments = [[(i, lens[i]) for i in row if lens[i] > 0] for row in rows]
    for row in segments:
        used = sum(n for _, n in row)
        if used < width:
            row.append((-1, width - used))
    seg_lens = torch.tensor([n for row in segments for _, n in row], dtype=torch.long)  # [segments]
    cu_seqlens = torch.nn.functional.pad(seg_lens.cumsum(dim=0), (1, 0))  # [segments + 1]
    seg_source = torch.tensor([i for row in segments for i, _ in row], dtype=torch.long)  # [segments], -1: pad segment
    source_row = seg_source.repeat_interleave(seg_lens)  # [k * width]
    position_ids = torch.arange(len(rows) * width) - cu_seqlens[:-1].repeat_interleave(seg_lens)  # [k * width]
    real = source_row >= 0  # [k * width]
    token_index = torch.where(real, source_row * seq_len + position_ids, 0)  # [k * width], 0 on pad segments
    return PackedBatch(
        input_ids=None,
        position_ids=position_ids.view(len(rows), width),  # [k, width]
        real=real.view(len(rows), width),  # [k, width]
        cu_seqlens=cu_seqlens.to(dtype=torch.int32),
        max_seqlen=max((n for row in segments for _, n in row), default=0),
        flat_index=token_index[real],  # [total]
        batch_size=batch_size,
        seq_len=seq_len,
        cu_seqlens_host=cu_seqlens.to(dtype=torch.int32),
        token_index=token_index.view(len(rows), width),  # [k, width]
    )


def packed_forward_kwargs(packed: PackedBatch, *, varlen: bool) -> dict:
    """Model kwargs for packed rows: restarting position_ids, no attention mask, no cache (transformers then isolates the
    sequences), and with a varlen implementation (`attention.is_varlen`) the segment boundaries as transformers'
    FlashAttentionKwargs (`cu_seq_lens_q/k`, `max_length_q/k`), which its varlen kernels read instead of a mask.
    Example: one row [5, 6 | 7] -> position_ids [[0, 1, 0]], cu_seq_lens_q [0, 2, 3], max_length_q 2."""
    kwargs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False)
    if varlen:
        kwargs.update(cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens,
                      max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen)
        if packed.cu_seqlens_host is not None:  # grpo_varlen's loop reads the boundaries here, not from the device
            kwargs[HOST_CU_KWARG] = packed.cu_seqlens_host
    return kwargs


@dataclass
class SharedPrefixPack:
    """b right-padded rows packed into ONE row in which rows that begin with the same prefix (their prompt) share one
    copy of it: [prefix | continuation of row i | continuation of row j | ... | next prefix | ...].

    Every position of the padded [b, T] layout maps to one packed token (`padded_to_packed`); the prefix's tokens
    stand for the same positions of every row that shares them, so their hidden states (and gradients, summed)
    serve all those rows. Position ids run on from the prefix (the continuation of a p-token prefix starts at p).
    """

    input_ids: Tensor | None  # [1, N] (None: not gathered yet, `shared_prefix_layout`)
    position_ids: Tensor  # [1, N]
    cu_seqlens: Tensor  # [segments + 1] int32 on the HOST (read by grpo_varlen's loop: no device sync per layer)
    continues: tuple[int, ...]  # per segment, the index of the prefix segment it continues, -1 for a prefix / whole row
    max_seqlen: int  # longest segment, tokens
    padded_to_packed: Tensor  # [b, T] long, packed index of each real padded position, -1 at pads
    flat_index: Tensor | None = None  # [1, N] long, index in the padded [b * T] of each packed token

    def to(self, device: torch.device) -> SharedPrefixPack:
        """Its tensors on `device` (`devices.to_device`: no wait for the device), cu_seqlens left on the host."""
        fields = ("input_ids", "position_ids", "padded_to_packed", "flat_index")
        return replace(self, **{f: to_device(getattr(self, f), device) for f in fields if getattr(self, f) is not None})

    def with_tokens(self, input_ids: Tensor) -> SharedPrefixPack:
        """Its input_ids gathered from the padded [b, T] `input_ids` by `flat_index` (an index gather: nothing read back)."""
        return replace(self, input_ids=input_ids.reshape(-1).index_select(0, self.flat_index.reshape(-1)).view(1, -1))


def group_shared_prefixes(lens: list[int], prefix_lens: list[int], prefix_keys: list) -> list[tuple[int, list[int]]]:
    """`shared_prefix_rows` from python values: per row its real tokens, its prefix length and a key equal for two rows
    exactly when their first min(prefix length, real tokens) tokens are (for rows of the same prefix length)."""
    keys: dict[tuple, list[int]] = {}
    for r, (p, n, k) in enumerate(zip(prefix_lens, lens, prefix_keys)):
        p = min(int(p), n)
        keys.setdefault((p, k) if p > 0 else ("alone", r), []).append(r)
    return [(key[0], rows) if len(rows) > 1 else (0, rows) for key, rows in keys.items()]


def shared_prefix_rows(input_ids: Tensor, attention_mask: Tensor, prefix_lens: list[int]) -> list[tuple[int, list[int]]]:
    """Rows grouped by an identical prefix: [(prefix length, rows)] in order of first row, groups of one row with
    prefix length 0 (nothing shared). A row's prefix is its first prefix_lens[r] tokens (its prompt: the tokens before
    its first scored token); rows share when those lengths and tokens are equal.
    Example: prompts [5, 6], [5, 6], [7] (prefix lengths 2, 2, 1) -> [(2, [0, 1]), (0, [2])]."""
    lens = attention_mask.sum(dim=1).tolist()  # [b]
    ids = input_ids.cpu()  # one device-to-host copy, not one per row
    keys = [tuple(ids[r, :min(int(p), n)].tolist()) if p > 0 else None for r, (p, n) in enumerate(zip(prefix_lens, lens))]
    return group_shared_prefixes(lens, prefix_lens, keys)


def shared_prefix_tokens(input_ids: Tensor, attention_mask: Tensor, prefix_lens: list[int]) -> int:
    """Tokens of the `pack_shared_prefixes` row: the real tokens less every shared prefix's extra copies.
    Example: two 10-token rows sharing a 4-token prompt -> 20 - 4 = 16."""
    saved = sum(p * (len(rows) - 1) for p, rows in shared_prefix_rows(input_ids, attention_mask, prefix_lens))
    return int(attention_mask.sum()) - saved


def pack_shared_prefixes(input_ids: Tensor, attention_mask: Tensor, prefix_lens: list[int]) -> SharedPrefixPack:
    """Pack RIGHT-padded rows into one row, each group of `shared_prefix_rows` as its prefix once followed by every
    row's continuation (rows sharing nothing go whole). Call the model with `shared_prefix_forward_kwargs`.
    Example: ids [[5, 6, 8], [5, 6, 9]], mask all 1, prefix_lens [2, 2] -> input_ids [[5, 6, 8, 9]],
    position_ids [[0, 1, 2, 2]], cu_seqlens [0, 2, 3, 4], continues (-1, 0, 0), padded_to_packed [[0, 1, 2], [0, 1, 3]].
    """
    assert input_ids.shape == attention_mask.shape and input_ids.dim() == 2, (
        f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [b, T]")
    mask = attention_mask.to(torch.long)  # [b, T]
    assert bool((mask[:, 1:] <= mask[:, :-1]).all()), "pack_shared_prefixes assumes right padding (1s then 0s per row)"
    groups = shared_prefix_rows(input_ids, attention_mask, prefix_lens)
    packed = shared_prefix_layout(mask.sum(dim=1).tolist(), mask.shape[1], groups).to(input_ids.device)
    return packed.with_tokens(input_ids)


def shared_prefix_layout(lens: list[int], seq_len: int, groups: list[tuple[int, list[int]]]) -> SharedPrefixPack:
    """`pack_shared_prefixes`' row from python values alone (the rows' real tokens, `seq_len` padded columns, the groups
    of `shared_prefix_rows`), host tensors, its input_ids not gathered yet (`SharedPrefixPack.with_tokens`)."""
    batch_size = len(lens)
    sources: list[tuple[int, int, int]] = []  # per segment: (row, start, end) of the padded tokens it holds
    continues: list[int] = []
    to_packed = torch.full((batch_size, seq_len), -1, dtype=torch.long)  # [b, T]
    offset = 0
    for p, rows in groups:
        prefix_segment = -1
        if p > 0:
            prefix_segment = len(sources)
            sources.append((rows[0], 0, p))
            continues.append(-1)
            to_packed[rows, :p] = torch.arange(offset, offset + p)
            offset += p
        for r in rows:
            if lens[r] > p:
                sources.append((r, p, lens[r]))
                continues.append(prefix_segment)
                to_packed[r, p : lens[r]] = torch.arange(offset, offset + lens[r] - p)
                offset += lens[r] - p
    seg_lens = [end - start for _, start, end in sources]
    flat = torch.cat([torch.arange(r * seq_len + start, r * seq_len + end) for r, start, end in sources]) if sources \
        else torch.zeros(0, dtype=torch.long)  # [N] index into the flattened padded layout
    positions = torch.cat([torch.arange(start, end) for _, start, end in sources]) if sources \
        else torch.zeros(0, dtype=torch.long)  # [N]
    return SharedPrefixPack(
        input_ids=None,
        position_ids=positions.view(1, -1),  # [1, N]
        cu_seqlens=torch.tensor([0, *itertools.accumulate(seg_lens)], dtype=torch.int32),
        continues=tuple(continues),
        max_seqlen=max(seg_lens, default=0),
        padded_to_packed=to_packed,
        flat_index=flat.view(1, -1),  # [1, N]
    )


def shared_prefix_forward_kwargs(packed: SharedPrefixPack, *, one_call: bool | None = None) -> dict:
    """Model kwargs for a shared-prefix row: position ids running on from each prefix, no mask, no cache, the segment
    boundaries, and per segment the prefix it continues (read by grpo_varlen, `attention.CONTINUES_KWARG`).
    `one_call` (default: the row's device and dtype run torch's varlen kernel, `attention.fast_kernel`) adds the one-call
    kernel plan (`attention.shared_prefix_kv_plan`), built here once per micro-batch and moved to the device once, not
    per layer; elsewhere the plan would be built and never read."""
    kwargs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False,
                  cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens, max_length_q=packed.max_seqlen,
                  max_length_k=packed.max_seqlen,
                  # a tensor, not a tuple: compiled decoder layers (actor.use_torch_compile) guard on a tuple's values
                  **{CONTINUES_KWARG: torch.tensor(packed.continues, dtype=torch.int32)})
    if one_call if one_call is not None else packed.input_ids.is_cuda and torch_varlen_attn()[0] is not None:
        device = packed.input_ids.device
        kv_index, cu_k, max_k = shared_prefix_kv_plan(packed.cu_seqlens.diff().tolist(), list(packed.continues))  # host
        kwargs.update({SHARED_KV_INDEX_KWARG: to_device(kv_index, device), SHARED_CU_K_KWARG: to_device(cu_k, device),
                       SHARED_CU_Q_KWARG: to_device(packed.cu_seqlens, device), SHARED_MAX_K_KWARG: max_k})
    return kwargs


def isolation_tolerance(dtype: torch.dtype) -> float:
    """Largest |packed - alone| log-probability of `check_packing_isolated` in compute dtype `dtype`: 16 roundings of the
    dtype's epsilon (each of a few layers adds a few roundings of values of size O(1) in both forwards, which run their
    matmuls and attention over different shapes), at least 1e-4 (float32 kernels over other shapes differ by ~1e-6).
    A leak moves log-probabilities by O(0.1-1) nats. Example: bfloat16 16 x 2**-7 = 0.125, float16 0.0156,
    float32 1e-4."""
    return max(1e-4, 16 * torch.finfo(dtype).eps)


@torch.no_grad()
def check_packing_isolated(model: torch.nn.Module, *, dtype: torch.dtype | None = None, atol: float | None = None,
                           seed: int = 0) -> None:
    """Start-up check that packed sequences do not attend to each other with the model's attention backend.

    Packs three random sequences (3, 9 and 4 tokens) as `pack_sequences` does (restarting position_ids,
    attention_mask=None, use_cache=False) into one row, and into two rows ([3 + 4 + a 2-token pad segment] and
    [9]: two sequences in a row, a pad segment, a row without one), with grpo_varlen also two rows sharing a 4-token
    prompt in one `pack_shared_prefixes` row, and runs each sequence alone; raises
    RuntimeError if the log-probabilities differ by more than atol (default `isolation_tolerance(dtype)`, `dtype` the
    compute dtype, default the parameters'). The actor calls it on its sharded model, on its device, in its compute
    dtype (`Actor.check_packing`), so the kernels checked are the ones the run uses; under FSDP2 every process calls it.
    """
    param = next(model.parameters())
    if atol is None:
        atol = isolation_tolerance(dtype or param.dtype)
    generator = torch.Generator().manual_seed(seed)
    lens = torch.tensor([3, 9, 4])  # [3]
    mask = (torch.arange(int(lens.max()))[None, :] < lens[:, None]).long().to(param.device)  # [3, 9]
    input_ids = torch.randint(0, model.config.vocab_size, tuple(mask.shape), generator=generator)  # [3, 9]
    input_ids = input_ids.to(param.device) * mask  # [3, 9], pads 0
    was_training = model.training
    model.eval()
    try:
        alone = [
            model(input_ids=input_ids[i : i + 1, :n], position_ids=torch.arange(n, device=param.device)[None],
                  use_cache=False).logits.float().log_softmax(-1)[0]
            for i, n in enumerate(lens.tolist())
        ]  # each [n, V]
        diffs = {}
        # A varlen implementation gets one packed row with its boundaries (what token_logprobs sends it); dense ones
        # get one and two rows, boundaries from position_ids only.
        for num_rows in ((1,) if is_varlen(model) else (1, 2)):
            packed = pack_sequences(input_ids, mask, num_rows=num_rows)
            logits = model(**packed_forward_kwargs(packed, varlen=is_varlen(model))).logits  # [k, width, V]
            unpacked = packed.unpack(logits.float().log_softmax(-1))  # [3, 9, V]
            diffs[num_rows] = max((unpacked[i, :n] - alone[i]).abs().max().item() for i, n in enumerate(lens.tolist()))
        if shares_prefixes(model):  # and rows sharing a prompt: the 9-token row's first 4 tokens + 3 of the 4-token row
            ids = torch.stack([input_ids[1], torch.cat([input_ids[1, :4], input_ids[2, :3], input_ids[2, :2]])])  # [2, 9]
            ids_mask = torch.tensor([[1] * 9, [1] * 7 + [0] * 2], device=param.device)  # [2, 9]
            shared = pack_shared_prefixes(ids, ids_mask, [4, 4])
            logits = model(**shared_prefix_forward_kwargs(shared)).logits[0].float().log_softmax(-1)  # [N, V]
            own = [alone[1], model(input_ids=ids[1:, :7], position_ids=torch.arange(7, device=param.device)[None],
                                   use_cache=False).logits.float().log_softmax(-1)[0]]  # [9, V], [7, V]
            diffs["shared-prompt"] = max((logits[shared.padded_to_packed[i, :n]] - own[i]).abs().max().item()
                                         for i, n in enumerate((9, 7)))
    finally:
        model.train(was_training)
    if not all(diff <= atol for diff in diffs.values()):
        impl = getattr(model.config, "_attn_implementation", "unknown")
        raise RuntimeError(
            f"Packed sequences are not isolated with attn_implementation={impl!r}: log-probs differ by "
            f"{', '.join(f'{d:.3g} ({k} packed rows)' for k, d in diffs.items())} (> {atol:g}) between packed and "
            f"separate forwards. Set `model.use_remove_padding: false`, or use attn_implementation sdpa / eager / "
            f"flash_attention_2."
        )
