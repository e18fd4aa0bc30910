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

`choose_attn_implementation(device, dtype, remove_padding=...)` picks one and says why (the start-up line prints it):
with `model.use_remove_padding` grpo_varlen (it shares a prompt's forward among its responses, which flash-attn's
integration cannot, and on CUDA in half precision it runs torch's own flash kernel), without it flash_attention_2
where transformers can run it, else grpo_varlen. `available_implementations(device)` says for each whether it runs
here and why not, flash-attn detected as transformers detects it (`is_flash_attn_2_available`: the distribution, its
version, a CUDA torch; a bare `find_spec` also found CPU-only builds and namesakes) and then by loading its compiled
extension (a wheel built for another torch ABI passes the metadata check and fails at model load). `is_varlen(model)` tells
`logprobs.token_logprobs` to pack into one row with the varlen kwargs instead of several rows for a dense mask.

No host reads per layer: a row is packed exactly when the caller passes `cu_seq_lens_q` (decided once per
micro-batch by `packing.packed_forward_kwargs`); the per-sequence loop reads the boundaries from their host copy
(`HOST_CU_KWARG`), the CUDA kernels take the device copy. (transformers itself reads restarting position_ids once per
forward to build a mask; grpo_varlen does not look at them.) torch's `varlen_attn` is used only when the call it makes
binds its signature (`torch_varlen_attn`): another torch (the lent GPU's 2.11) falls back to per-sequence sdpa and the
start-up line says why.
Run: `python -m pytest tests/model/test_attention.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

VARLEN_NAME = "grpo_varlen"
# Implementations that take packed rows as cu_seq_lens kwargs (one row, no pad segment needed).
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", VARLEN_NAME)
# Forward kwarg of a shared-prefix row (`packing.pack_shared_prefixes`): per segment, the index of the segment it
# continues, or -1. Only grpo_varlen reads it (`shares_prefixes`).
CONTINUES_KWARG = "grpo_segment_continues"
# Forward kwarg of a packed row: its cu_seq_lens on the HOST (the per-sequence loop's boundaries; reading the device
# copy would sync the device in every layer).
HOST_CU_KWARG = "grpo_cu_seq_lens_host"
# Forward kwargs of a shared-prefix row for the one-call kernel path (`shared_prefix_kv_plan`, on the device): per
# continuation the key / value positions it attends to (its prefix's, then its own), and their cumulative lengths.
SHARED_KV_INDEX_KWARG, SHARED_CU_K_KWARG, SHARED_CU_Q_KWARG = "grpo_shared_kv_index", "grpo_shared_cu_k", "grpo_shared_cu_q"
SHARED_MAX_K_KWARG = "grpo_shared_max_k"


@functools.lru_cache(maxsize=1)
def torch_varlen_attn() -> tuple[Callable | None, str | None]:
    """(torch.nn.attention.varlen.varlen_attn, None) when this torch has it and it takes the call grpo_varlen makes
    (positional q, k, v, cu_q, cu_k, max_q, max_k and the keywords scale, window_size, enable_gqa), else (None, why).
    Checked once by binding the real signature: a torch without `enable_gqa` (older releases) falls back to
    per-sequence sdpa with this reason in the start-up line instead of a TypeError in the first forward."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    try:
        inspect.signature(varlen_attn).bind(*([None] * 7), scale=1.0, window_size=(-1, 0), enable_gqa=False)
    except (TypeError, ValueError) as exc:
        return None, f"torch {torch.__version__}'s varlen_attn does not take grpo_varlen's call ({exc})"
    return varlen_attn, None


def fast_kernel(device: torch.device, dtype: torch.dtype):
    """torch's varlen_attn where grpo_varlen runs it (CUDA, fp16 / bf16, a torch whose varlen_attn binds), else None
    (the per-sequence sdpa path; `torch_varlen_attn` says why where the torch is the reason)."""
    return torch_varlen_attn()[0] if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) else None


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

    Packed (cu_seq_lens_q given and no 2D mask: `packing.packed_forward_kwargs`): every sequence attends causally to
    itself only. Otherwise transformers' sdpa with its mask, unchanged. Nothing here reads a device tensor on the host:
    the decision is the caller's (the kwargs), the loop's boundaries come from `HOST_CU_KWARG`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    batch_size, num_heads, width, head_dim = query.shape
    continues = kwargs.get(CONTINUES_KWARG)
    if continues is not None:  # a shared-prefix row (packing.pack_shared_prefixes)
        return _shared_prefix_attention(module, query, key, value, cu_seq_lens, continues, dropout=dropout,
                                        scaling=scaling, sliding_window=kwargs.get("sliding_window"), plan=kwargs)
    packed = attention_mask is None and key.shape[2] == width and cu_seq_lens is not None
    if not packed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    assert kwargs.get("sliding_window") is None, (
        "grpo_varlen: packed sequences with sliding-window attention are not supported; set model.use_remove_padding: false")
    enable_gqa = key.shape[1] != num_heads
    varlen_attn = fast_kernel(query.device, query.dtype)
    if varlen_attn is not None:
        cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)  # [segments + 1], already there from packing
        max_len = kwargs.get("max_length_q")
        max_len = int(max_len) if max_len is not None else int(cu.diff().max())  # packing always passes it
        flat = [x.transpose(1, 2).reshape(batch_size * width, x.shape[1], head_dim) for x in (query, key, value)]  # [b*T, H, D]
        out = varlen_attn(*flat, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0), enable_gqa=enable_gqa)  # [b*T, Hq, D]
        return out.view(batch_size, width, num_heads, head_dim), None
    host_cu = kwargs.get(HOST_CU_KWARG)
    rows = _segments_from_cu(host_cu if host_cu is not None else cu_seq_lens, batch_size, width)
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


def shared_prefix_kv_plan(seg_lens: list[int], continues: list[int]) -> tuple[Tensor, Tensor, int]:
    """The one-call layout of a shared-prefix row (host tensors, built once per micro-batch by packing): per segment
    its keys / values are its prefix's followed by its own (a prefix, or a row sharing nothing: its own only), so one
    varlen call with these key sequences and the row's own query sequences (cu_seq_q = the row's cu_seq_lens) under
    bottom-right causal masking (`window_size=(-1, 0)`) is every segment's attention. Returns (kv_index [M] long:
    positions of the row's keys to gather, cu_seq_k [S + 1] int32, max_k). The price: each continuation copies its
    prompt's keys and values (M - N extra rows of K and V per layer) to save 2 sdpa calls and 2 cats per continuation.
    Example: seg_lens [3, 2, 2], continues [-1, 0, 0] -> kv_index [0 1 2 | 0 1 2 3 4 | 0 1 2 5 6], cu_seq_k [0 3 8 13], 5.
    """
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    index: list[int] = []
    cu_k = [0]
    for i, prefix in enumerate(continues):
        own = list(range(starts[i], starts[i + 1]))
        keys = (list(range(starts[prefix], starts[prefix + 1])) if prefix >= 0 else []) + own
        index.extend(keys)
        cu_k.append(cu_k[-1] + len(keys))
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return torch.tensor(index, dtype=torch.long), torch.tensor(cu_k, dtype=torch.int32), max(lens_k, default=0)


def _shared_prefix_one_call(query: Tensor, key: Tensor, value: Tensor, *, kv_index: Tensor, cu_q: Tensor, cu_k: Tensor,
                            max_q: int, max_k: int, scaling: float | None, kernel: Callable) -> Tensor:
    """Every segment of a shared-prefix row in ONE varlen call (`shared_prefix_kv_plan`): query [1, Hq, N, D], key /
    value [1, Hkv, N, D] -> [1, N, Hq, D]. `kernel` is torch's varlen_attn (CUDA); the tests pass a CPU twin."""
    q = query[0].transpose(0, 1)  # [N, Hq, D]
    k, v = (x[0].transpose(0, 1).index_select(0, kv_index) for x in (key, value))  # [M, Hkv, D]
    out = kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=(-1, 0),
                 enable_gqa=key.shape[1] != query.shape[1])  # [N, Hq, D]
    return out.unsqueeze(0)  # [1, N, Hq, D]


def _shared_prefix_attention(module, query: Tensor, key: Tensor, value: Tensor, cu_seq_lens: Tensor,
                             continues: Tensor | tuple[int, ...], *, dropout: float, scaling: float | None,
                             sliding_window: int | None, plan: dict | None = None) -> tuple[Tensor, None]:
    """Attention of one packed row whose segments may continue an earlier segment (a prompt computed once for the
    responses that share it): segment i attends causally to itself, after all of segment continues[i] when that is
    >= 0. query [1, Hq, N, D], key / value [1, Hkv, N, D] -> ([1, N, Hq, D], None).

    A continuation's queries attend to its prefix's keys / values followed by its own, under a lower-right causal
    mask (query j of an L-token continuation of a P-token prefix sees keys 0 .. P + j): the attention the padded path
    computes for those positions, without re-running the prefix's queries (answered in the prefix's own call).
    Example: segments [0, 3) prompt, [3, 5) and [5, 7) two responses, continues (-1, 0, 0): outputs of 3..4 equal
    positions 3..4 of the 5-token sequence prompt + response 1 run alone.
    On CUDA in half precision, with the one-call plan in `plan` (the forward kwargs: `shared_prefix_forward_kwargs`
    sends it), all segments run in one varlen_attn call instead (`_shared_prefix_one_call`).
    """
    assert sliding_window is None, (
        "grpo_varlen: shared prompts with sliding-window attention are not supported; set model.use_remove_padding: false")
    assert query.shape[0] == 1, f"a shared-prefix pack is one row, got {query.shape[0]}"
    kernel = fast_kernel(query.device, query.dtype)
    if kernel is not None and plan is not None and plan.get(SHARED_KV_INDEX_KWARG) is not None and not (
            dropout and module.training):
        out = _shared_prefix_one_call(
            query, key, value, kv_index=plan[SHARED_KV_INDEX_KWARG], cu_q=plan[SHARED_CU_Q_KWARG],
            cu_k=plan[SHARED_CU_K_KWARG], max_q=int(plan["max_length_q"]), max_k=int(plan[SHARED_MAX_K_KWARG]),
            scaling=scaling, kernel=kernel)
        return out, None
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


# transformers' mask preparation probes, once per forward given position ids and no 2-D mask, whether the positions
# pack several sequences (`masking_utils.find_packed_sequence_indices`): an `.all()` read of the device, so a host sync
# per micro-batch on a GPU. Its answer only shapes a dense mask. Inside `packing_known()` it answers None unread.
_PACKING_KNOWN: contextvars.ContextVar[bool] = contextvars.ContextVar("grpo_packing_known", default=False)


@contextlib.contextmanager
def packing_known():
    """Model calls inside need no packed-sequence probe from transformers: their mask function ignores its answer (the
    varlen implementations, grpo_varlen and flash attention: no dense mask) or the answer is None anyway (right padding:
    one arange of positions per row). The probe then answers None without reading the device (per context: another
    thread's model calls still probe). Example: `with packing_known(): model(input_ids=..., position_ids=...)`."""
    _install_probe_switch()
    token = _PACKING_KNOWN.set(True)
    try:
        yield
    finally:
        _PACKING_KNOWN.reset(token)


def _install_probe_switch() -> None:
    """Wrap transformers' probe once (idempotent): outside `packing_known()` it runs as before."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    if getattr(original, "grpo_switch", False):
        return

    def find_packed_sequence_indices(position_ids):
        return None if _PACKING_KNOWN.get() else find_packed_sequence_indices.original(position_ids)

    find_packed_sequence_indices.grpo_switch = True
    find_packed_sequence_indices.original = original
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


FLASH_ATTN_EXTENSION = "flash_attn_2_cuda"  # flash-attn 2's compiled kernels (flash_attn_interface imports it)


def flash_attention_2_reason(device: torch.device) -> str | None:
    """None when transformers can run flash_attention_2 for a model on `device`, else why not. Detected as transformers
    detects it (`is_flash_attn_2_available`: the flash-attn distribution, version >= 2.3.3, a CUDA torch), not by
    `find_spec` alone, which also finds a build for another CUDA or a namesake module; then its compiled extension
    (`FLASH_ATTN_EXTENSION`) is loaded: the metadata also passes a wheel built for another torch ABI or CUDA, whose
    binary fails to load (an undefined symbol, a missing libcudart) only when the model first runs attention."""
    if device.type != "cuda":
        return "flash-attn runs on CUDA only"
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return "transformers finds no usable flash-attn (the flash-attn distribution >= 2.3.3 and a CUDA torch)"
    try:
        importlib.import_module(FLASH_ATTN_EXTENSION)
    except (ImportError, OSError) as exc:
        return (f"flash-attn is installed but its CUDA extension {FLASH_ATTN_EXTENSION} does not load ({exc}): a wheel "
                f"built for another torch / CUDA than torch {torch.__version__}")
    return None


def available_implementations(device: torch.device) -> dict[str, str | None]:
    """Every packed-attention implementation -> None when it trains here, else the reason it does not."""
    flex = None if device.type == "cuda" else "torch's CPU flex_attention has no backward (training needs one)"
    return {"flash_attention_2": flash_attention_2_reason(device), VARLEN_NAME: None, "flex_attention": flex, "sdpa": None}


def choose_attn_implementation(device: torch.device, compute_dtype: torch.dtype, *,
                               remove_padding: bool = True) -> tuple[str, str]:
    """(implementation, why) for a model computing on `device` in `compute_dtype`; registers grpo_varlen either way.

    model.use_remove_padding on: grpo_varlen, whose shared-prompt rows run a prompt once for its n responses (the
    flash-attn integration has no such rows) and whose packed rows run torch's flash kernel on CUDA in half precision.
    Off (padded batches): flash_attention_2 where transformers can run it in fp16 / bf16, else grpo_varlen (sdpa).
    """
    register()
    if remove_padding:
        return VARLEN_NAME, "model.use_remove_padding: packed rows and shared prompts (one prompt forward for its responses)"
    flash = flash_attention_2_reason(device)
    if flash is None and compute_dtype in (torch.float16, torch.bfloat16):
        return "flash_attention_2", "padded batches (model.use_remove_padding off) on flash-attn"
    why = flash or f"flash-attn has no {compute_dtype} kernel"
    return VARLEN_NAME, f"padded batches run transformers' sdpa ({why})"


def select_attn_implementation(device: torch.device, compute_dtype: torch.dtype, *, remove_padding: bool = True) -> str:
    """The implementation `choose_attn_implementation` picks (without its reason)."""
    return choose_attn_implementation(device, compute_dtype, remove_padding=remove_padding)[0]


def describe(implementation: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """What packed rows run on, for the start-up line. Example: 'grpo_varlen (one causal sdpa call per sequence)'."""
    if implementation == VARLEN_NAME:
        if fast_kernel(device, compute_dtype) is None:
            why = torch_varlen_attn()[1] if device.type == "cuda" and compute_dtype in (torch.float16, torch.bfloat16) else None
            return f"{VARLEN_NAME} (one causal sdpa call per sequence{': ' + why if why else ''})"
        return f"{VARLEN_NAME} (torch varlen_attn flash kernel; shared prompts in one call per layer)"
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
