"""Attention for packed rows: a variable-length kernel where one exists, chosen once and named at start-up.

A packed row (`packing.pack_sequences`) holds several whole sequences back to back, position_ids restarting at 0 for
each. Dense attention over it (sdpa with the block-diagonal mask transformers builds from those position_ids) computes
the whole [row, row] problem and throws most of it away; a variable-length ("varlen") kernel computes each sequence's
own causal block only, so one row of every sequence costs the sum of their squared lengths.

Implementations (`attn_implementation` names of transformers' `AttentionInterface`), best first:

- `flash_attention_2`: transformers' flash-attn integration, when the `flash_attn` package is installed and the model
  runs on CUDA; packed rows reach its varlen kernel through the `cu_seq_lens_q/k`, `max_length_q/k` forward kwargs.
- `grpo_varlen` (registered here): torch's own `torch.nn.attention.varlen.varlen_attn` (a flash kernel: CUDA, fp16 /
  bf16) where it runs, else one causal `scaled_dot_product_attention` call per sequence (CPU, or float32): each
  sequence attends alone, with no dense mask. Not packed (a 2D attention mask, or no restarting position_ids) it
  is transformers' sdpa, so the padded path is unchanged.
- `flex_attention`: transformers' integration (a BlockMask from the position_ids). Not chosen automatically: torch
  2.13's CPU flex attention has no backward, and on CUDA it compiles per shape; usable for no-grad passes.
- `sdpa`: the dense block-diagonal mask, the fallback (any model whose attention does not go through
  transformers' `AttentionInterface`).

Shared-prompt rows (`packing.pack_shared_prefixes`, grpo_varlen only, `shares_prefixes`): GRPO's n responses to one
prompt go into one row as [prompt | response 1 | response 2 | ...]; each response segment attends to the prompt's
keys and values and causally to itself (the `CONTINUES_KWARG` forward kwarg names the segment it continues), so the
decoder runs over the prompt once for all n and its gradient is their sum: the saving works without length spread.

`select_attn_implementation(device)` picks the first available; `available_implementations(device)` says for each
whether it runs here and why not (the tests run packing equivalence on every available one and skip the others with
that reason). `is_varlen(model)` tells `logprobs.token_logprobs` to pack into one row with the varlen kwargs instead
of several rows for a dense mask.
Run: `python -m pytest tests/test_attention.py`.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

VARLEN_NAME = "grpo_varlen"
# Implementations that take packed rows as cu_seq_lens kwargs (one row, no pad segment needed).
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", VARLEN_NAME)
# Forward kwarg of a shared-prefix row (`packing.pack_shared_prefixes`): per segment, the index of the segment it
# continues, or -1. Only grpo_varlen reads it (`shares_prefixes`).
CONTINUES_KWARG = "grpo_segment_continues"


def _torch_varlen_attn():
    """torch.nn.attention.varlen.varlen_attn, or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _segments(position_ids: Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each sequence: a sequence starts where position_ids do not continue by +1.

    Example: [[0, 1, 2, 0, 1, 0]] -> [[(0, 3), (3, 5), (5, 6)]].
    """
    rows = []
    width = position_ids.shape[-1]
    for row in position_ids.reshape(-1, width).tolist():
        starts = [0] + [t for t in range(1, width) if row[t] != row[t - 1] + 1]
        rows.append(list(zip(starts, starts[1:] + [width])))
    return rows


def _segments_from_cu(cu_seq_lens: Tensor, batch_size: int, width: int) -> list[list[tuple[int, int]]]:
    """cu_seq_lens over the flattened [b * width] tokens -> per-row (start, end) lists (a sequence never spans rows)."""
    bounds = cu_seq_lens.tolist()
    rows: list[list[tuple[int, int]]] = [[] for _ in range(batch_size)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        row = start // width
        assert (end - 1) // width == row, f"packed sequence [{start}, {end}) spans two rows of {width} tokens"
        rows[row].append((start - row * width, end - row * width))
    return rows


def varlen_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers attention function of `grpo_varlen`: query [b, Hq, T, D], key / value [b, Hkv, T, D] -> ([b, T, Hq, D], None).

    Packed (cu_seq_lens_q given, or position_ids that restart, and no 2D mask): every sequence attends causally to
    itself only. Otherwise transformers' sdpa with its mask, unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    batch_size, num_heads, width, head_dim = query.shape
    continues = kwargs.get(CONTINUES_KWARG)
    if continues is not None:  # a shared-prefix row (packing.pack_shared_prefixes)
        return _shared_prefix_attention(module, query, key, value, cu_seq_lens, continues, dropout=dropout,
                                        scaling=scaling, sliding_window=kwargs.get("sliding_window"))
    packed = attention_mask is None and key.shape[2] == width and (
        cu_seq_lens is not None or (position_ids is not None and bool((position_ids.diff(dim=-1) != 1).any())))
    if not packed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    assert kwargs.get("sliding_window") is None, (
        "grpo_varlen: packed sequences with sliding-window attention are not supported; set model.use_remove_padding: false")
    enable_gqa = key.shape[1] != num_heads
    varlen_attn = _torch_varlen_attn()
    if varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        if cu_seq_lens is None:  # from position_ids: sequence starts over the flattened rows
            starts = [r * width + s for r, row in enumerate(_segments(position_ids)) for s, _ in row]
            cu_seq_lens = torch.tensor(starts + [batch_size * width], dtype=torch.int32, device=query.device)
        cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)  # [segments + 1]
        max_len = int(kwargs.get("max_length_q") or int(cu.diff().max()))
        flat = [x.transpose(1, 2).reshape(batch_size * width, x.shape[1], head_dim) for x in (query, key, value)]  # [b*T, H, D]
        out = varlen_attn(*flat, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0), enable_gqa=enable_gqa)  # [b*T, Hq, D]
        return out.view(batch_size, width, num_heads, head_dim), None
    rows = _segments_from_cu(cu_seq_lens, batch_size, width) if cu_seq_lens is not None else _segments(position_ids)
    dropout_p = dropout if module.training else 0.0
    out_rows = []
    for r, row in enumerate(rows):
        parts = [F.scaled_dot_product_attention(query[r : r + 1, :, s:e], key[r : r + 1, :, s:e], value[r : r + 1, :, s:e],
                                                dropout_p=dropout_p, is_causal=True, scale=scaling, enable_gqa=enable_gqa)
                 for s, e in row]  # each [1, Hq, L, D]
        out_rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])  # [1, Hq, T, D]
    out = torch.cat(out_rows, dim=0) if len(out_rows) > 1 else out_rows[0]  # [b, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None  # [b, T, Hq, D]


def _lower_right_causal(queries: int, keys: int, device: torch.device):
    """Mask of `queries` queries that are the last of `keys` positions: query j sees keys 0 .. keys - queries + j. On
    CUDA torch's lower-right causal bias (built per call, it holds no mask; its flash kernel takes it without one in
    half precision, other dtypes fall back to a mask inside sdpa); elsewhere a boolean mask cached per shape (on CPU
    cheaper than the bias, which builds one per call). Example: (2, 3) -> [[1, 1, 0], [1, 1, 1]]."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(queries, keys)
    return _cached_lower_right_mask(queries, keys, device)


@functools.lru_cache(maxsize=16)  # a micro-batch's continuation lengths; at most 16 masks of queries x keys bytes kept
def _cached_lower_right_mask(queries: int, keys: int, device: torch.device) -> Tensor:
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(diagonal=keys - queries)  # [queries, keys]


def _shared_prefix_attention(module, query: Tensor, key: Tensor, value: Tensor, cu_seq_lens: Tensor,
                             continues: Tensor | tuple[int, ...], *, dropout: float, scaling: float | None,
                             sliding_window: int | None) -> tuple[Tensor, None]:
    """Attention of one packed row whose segments may continue an earlier segment (a prompt computed once for the
    responses that share it): segment i attends causally to itself, after all of segment continues[i] when that is
    >= 0. query [1, Hq, N, D], key / value [1, Hkv, N, D] -> ([1, N, Hq, D], None).

    A continuation's queries attend to its prefix's keys / values followed by its own, under a lower-right causal
    mask (query j of an L-token continuation of a P-token prefix sees keys 0 .. P + j): the attention the padded path
    computes for those positions, without re-running the prefix's queries (answered in the prefix's own call).
    Example: segments [0, 3) prompt, [3, 5) and [5, 7) two responses, continues (-1, 0, 0): outputs of 3..4 equal
    positions 3..4 of the 5-token sequence prompt + response 1 run alone.
    """
    assert sliding_window is None, (
        "grpo_varlen: shared prompts with sliding-window attention are not supported; set model.use_remove_padding: false")
    assert query.shape[0] == 1, f"a shared-prefix pack is one row, got {query.shape[0]}"
    seg_lens = cu_seq_lens.diff().tolist()
    continues = continues.tolist() if isinstance(continues, Tensor) else list(continues)
    assert len(seg_lens) == len(continues), f"{len(seg_lens)} segments but {len(continues)} continuation entries"
    enable_gqa = key.shape[1] != query.shape[1]
    dropout_p = dropout if module.training else 0.0
    # One split per tensor (its backward is one concatenation; per-segment slices would each add a full-size zero
    # gradient in the backward: quadratic in the segment count).
    qs, ks, vs = (x.split(seg_lens, dim=2) for x in (query, key, value))  # per segment [1, H, L, D]
    parts = []
    for i, prefix in enumerate(continues):
        if prefix < 0:  # a prefix, or a row sharing nothing: plain causal
            parts.append(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], dropout_p=dropout_p, is_causal=True,
                                                        scale=scaling, enable_gqa=enable_gqa))  # [1, Hq, L, D]
            continue
        k, v = (torch.cat([xs[prefix], xs[i]], dim=2) for xs in (ks, vs))  # [1, Hkv, P + L, D]
        mask = _lower_right_causal(seg_lens[i], k.shape[2], query.device)  # query j sees keys 0 .. P + j
        parts.append(F.scaled_dot_product_attention(qs[i], k, v, attn_mask=mask, dropout_p=dropout_p, scale=scaling,
                                                    enable_gqa=enable_gqa))  # [1, Hq, L, D]
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # [1, Hq, N, D]
    return out.transpose(1, 2).contiguous(), None  # [1, N, Hq, D]


def _varlen_mask(*args, attention_mask: Tensor | None = None, **kwargs):
    """Mask of `grpo_varlen`: none when there is no 2D padding mask (packed rows, or rows without padding: the
    attention function is causal per sequence), else sdpa's 4D mask."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register `grpo_varlen` with transformers (idempotent; before a model is loaded with it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_NAME, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_NAME, _varlen_mask)


def available_implementations(device: torch.device) -> dict[str, str | None]:
    """Every packed-attention implementation -> None when it trains here, else the reason it does not."""
    cuda = device.type == "cuda"
    flash = None
    if importlib.util.find_spec("flash_attn") is None:
        flash = "the flash_attn package is not installed"
    elif not cuda:
        flash = "flash-attn runs on CUDA only"
    flex = None if cuda else "torch's CPU flex_attention has no backward (training needs one)"
    return {"flash_attention_2": flash, VARLEN_NAME: None, "flex_attention": flex, "sdpa": None}


def select_attn_implementation(device: torch.device, compute_dtype: torch.dtype) -> str:
    """flash_attention_2 where it runs (CUDA, flash_attn installed, fp16 / bf16 compute), else grpo_varlen (which runs
    everywhere); registers grpo_varlen with transformers either way."""
    register()
    flash = available_implementations(device)["flash_attention_2"] is None and compute_dtype in (torch.float16, torch.bfloat16)
    return "flash_attention_2" if flash else VARLEN_NAME


def describe(implementation: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """What packed rows run on, for the start-up line. Example: 'grpo_varlen (one causal sdpa call per sequence)'."""
    if implementation == VARLEN_NAME:
        fast = (_torch_varlen_attn() is not None and device.type == "cuda" and compute_dtype in (torch.float16, torch.bfloat16))
        return f"{VARLEN_NAME} ({'torch varlen_attn flash kernel' if fast else 'one causal sdpa call per sequence'})"
    if implementation in VARLEN_IMPLEMENTATIONS:
        return f"{implementation} (varlen kernel)"
    return f"{implementation} (dense block-diagonal mask)"


def _implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def is_varlen(model: torch.nn.Module) -> bool:
    """Does `model`'s attention take packed rows as cu_seq_lens (one packed row, no dense mask)?"""
    return _implementation(model) in VARLEN_IMPLEMENTATIONS


def shares_prefixes(model: torch.nn.Module) -> bool:
    """Can `model`'s attention run shared-prefix rows (segments continuing a prompt computed once)? grpo_varlen only."""
    return _implementation(model) == VARLEN_NAME
