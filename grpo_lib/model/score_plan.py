"""The host's side of one `logprobs.token_scores` call: how a micro-batch runs, and every index its forward reads.

Everything a micro-batch's forward needs to know about its shape is decided here, on the host, from host tensors and
python ints: how its rows run (`choose_layout`: padded, packed, or with shared prompts computed once), which tokens are
scored, and where the hidden state predicting each one sits (`ScorePlan`, built by `plan_scores`). `RowFacts` reads a
batch's per-row facts in one go (two `.tolist()` per batch), and each micro-batch's layout and plan are built from
them without reading a tensor again. The plan goes to the device without the host waiting (`ScorePlan.to`,
`devices.to_device`), and `token_scores` given it only gathers and scatters by its indices: no `.item()`,
`.tolist()`, boolean-mask index or blocking copy, so the host queues micro-batch i + 1 while the device computes
micro-batch i (docs/GPU.md). The values are the ones the tensor-reading path gave, bit for bit: the same layout, the
same tokens in the same order, the same chunks.

Layout rules (`choose_layout`; grpo_lib/model/logprobs.py re-exports them): a micro-batch is packed only when its real
tokens are under PACK_BELOW_REAL_FRACTION of its padded block, and its rows share their prompt's forward when that
computes under the same fraction of what the next choice would. Both are functions of the micro-batch alone, so the
old-logprob pass and the update decide alike on the same micro-batch (first update's ratio bitwise 1).

The actor's passes over a `RolloutBatch` (the update, the old-logprob and reference passes) use the last three
functions: `batch_facts` once per batch, then per micro-batch `micro_batch_rows` and `plan_forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from grpo_lib.core.devices import to_device
from grpo_lib.core.types import RolloutBatch
from grpo_lib.model.batching import dummy_micro_batch
from grpo_lib.model.packing import PackedBatch, SharedPrefixPack, group_shared_prefixes, pack_rows, shared_prefix_layout

# Pack a micro-batch only when its real tokens are under this fraction of its padded block: above it the padding
# saved is smaller than what packing costs (the per-sequence attention calls, or a dense [row, row] mask).
PACK_BELOW_REAL_FRACTION = 0.9
PACKED_ROW_TOKENS = 512  # token_scores' default packed_row_tokens (dense attention: rows of at least this many tokens)


@dataclass(frozen=True)
class RowFacts:
    """Per row of a right-padded batch, what the host decides layouts and plans from, read from the tensors once
    (`of`) and sliced per micro-batch (`select`) without reading a tensor again."""

    lens: list[int]  # real tokens
    right_padded: list[bool]  # the mask row is 1s then 0s
    score_tokens: list[int] | None = None  # tokens the score mask marks (None: no score mask)
    prefix_lens: list[int] | None = None  # tokens before the first scored one (the prompt), 0 when none is scored
    prefix_keys: list[int] | None = None  # equal for two rows exactly when their prefixes are (-1: no prefix)

    @classmethod
    def of(cls, attention_mask: Tensor, score_mask: Tensor | None = None, *, input_ids: Tensor | None = None) -> RowFacts:
        """The facts of [B, T] host tensors: one `.tolist()`, and one more for the prefix keys (with `input_ids`: the
        rows' prefixes compared token by token, `packing.shared_prefix_rows`' rule, needed for shared prompts only).
        Example: mask [[1, 1, 1], [1, 1, 0]], score mask [[0, 1, 1], [0, 1, 0]] -> lens [3, 2], score_tokens [2, 1],
        prefix_lens [1, 1]."""
        mask = attention_mask.to(torch.long)  # [B, T]
        columns = [mask.sum(dim=1), (mask[:, 1:] <= mask[:, :-1]).all(dim=1).long()]  # [B] each
        if score_mask is not None:
            scored = score_mask.bool()  # [B, T]
            first = scored.to(torch.uint8).argmax(dim=1)  # [B], 0 where nothing is scored
            columns += [scored.sum(dim=1), torch.where(scored.any(dim=1), first, torch.zeros_like(first))]  # [B] each
        values = torch.stack(columns).tolist()  # the one read of the tensors
        facts = cls(lens=values[0], right_padded=[bool(v) for v in values[1]],
                    score_tokens=values[2] if score_mask is not None else None,
                    prefix_lens=values[3] if score_mask is not None else None)
        if input_ids is None or score_mask is None:
            return facts
        return replace(facts, prefix_keys=_prefix_keys(input_ids, facts.lens, facts.prefix_lens))

    def select(self, idx: list[int]) -> RowFacts:
        """The facts of rows `idx` (a micro-batch), in that order."""
        pick = (lambda values: None if values is None else [values[i] for i in idx])
        return RowFacts(lens=pick(self.lens), right_padded=pick(self.right_padded), score_tokens=pick(self.score_tokens),
                        prefix_lens=pick(self.prefix_lens), prefix_keys=pick(self.prefix_keys))


def _prefix_keys(input_ids: Tensor, lens: list[int], prefix_lens: list[int]) -> list[int]:
    """Per row, the index of its prefix (first min(prefix length, real tokens) tokens, with that length) among the
    batch's distinct prefixes, -1 for an empty one: rows with equal keys have equal prefixes. One `torch.unique`."""
    p = [min(a, n) for a, n in zip(prefix_lens, lens)]
    width = max(p, default=0)
    if width == 0:
        return [-1] * len(p)
    length = torch.tensor(p, dtype=torch.long)  # [B]
    tokens = torch.where(torch.arange(width) < length[:, None], input_ids[:, :width].cpu().long(), -1)  # [B, width]
    _, inverse = torch.unique(torch.cat([length[:, None], tokens], dim=1), dim=0, return_inverse=True)  # [B]
    return torch.where(length > 0, inverse, -1).tolist()


def shared_groups(facts: RowFacts) -> list[tuple[int, list[int]]]:
    """`packing.shared_prefix_rows` from the facts (with prefix keys): [(prefix length, rows)] in order of first row."""
    return group_shared_prefixes(facts.lens, facts.prefix_lens, facts.prefix_keys)


def _fraction(lens: list[int]) -> float:
    return sum(lens) / max(1, max(lens) * len(lens)) if lens else 1.0


def _packed_rows(lens: list[int], packed_row_tokens: int | None) -> int:
    if packed_row_tokens is None or not lens:
        return 1
    return max(1, -(-sum(lens) // max(packed_row_tokens, max(lens))))


def num_packed_rows(mask: Tensor, packed_row_tokens: int | None) -> int:
    """Rows for packing a [b, T] right-padded micro-batch: ceil(tokens / max(packed_row_tokens, longest)), >= 1.

    Example: lengths [500, 300, 100, 400], packed_row_tokens 512 -> ceil(1300 / 512) = 3 rows.
    """
    return _packed_rows(mask.sum(dim=1).tolist(), packed_row_tokens)


def real_token_fraction(attention_mask: Tensor) -> float:
    """Real tokens / (rows x longest row) of a right-padded [b, T] micro-batch: 1.0 without length spread.

    Example: lengths [4, 2] -> 6 / (2 x 4) = 0.75."""
    return _fraction(attention_mask.sum(dim=1).tolist())


def packing_pays(attention_mask: Tensor) -> bool:
    """Whether `model.use_remove_padding` packs this micro-batch: real_token_fraction < PACK_BELOW_REAL_FRACTION.

    A function of the micro-batch alone, so the old-logprob pass and the update decide alike on the same micro-batch
    (first update's ratio bitwise 1). Example: lengths [128, 128, 127] -> no; [480, 40, 60] -> yes."""
    return real_token_fraction(attention_mask) < PACK_BELOW_REAL_FRACTION


def prefix_lengths(score_mask: Tensor) -> list[int]:
    """Per row, the tokens before its first scored token (its prompt), 0 for a row that scores nothing.
    Example: [[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]] -> [2, 1, 0]."""
    scored = score_mask.bool()  # [b, T]
    first = scored.to(torch.uint8).argmax(dim=1)  # [b], 0 where nothing is scored
    return torch.where(scored.any(dim=1), first, torch.zeros_like(first)).tolist()


def layout_of(facts: RowFacts, *, scored: bool, remove_padding: bool, share_prefixes: bool) -> tuple[str, int]:
    """`choose_layout` from a micro-batch's facts (`scored`: it has a score mask; sharing needs its prefix keys)."""
    lens = facts.lens
    padded = max(lens) * len(lens) if lens else 0
    if not remove_padding:
        return "padded", padded
    real = sum(lens)
    packs = _fraction(lens) < PACK_BELOW_REAL_FRACTION
    if share_prefixes and scored:
        shared = real - sum(p * (len(rows) - 1) for p, rows in shared_groups(facts))
        # Against packing, sharing must save a tenth of the tokens too: its rows run one attention call per prompt
        # group member, where plain packing may have one varlen kernel call (CUDA).
        if shared < PACK_BELOW_REAL_FRACTION * (real if packs else padded):
            return "shared_prefix", shared
    if packs:
        return "packed", real
    return "padded", padded


def choose_layout(input_ids: Tensor, attention_mask: Tensor, score_mask: Tensor | None, *, remove_padding: bool,
                  share_prefixes: bool) -> tuple[str, int]:
    """How `token_logprobs` runs a right-padded micro-batch, and the tokens its decoder then computes.

    - "shared_prefix" (`remove_padding` and `share_prefixes`, i.e. grpo_varlen): rows that begin with the same prompt
      share one copy of it (`packing.pack_shared_prefixes`) when that computes under PACK_BELOW_REAL_FRACTION of
      what the next choice would (the real tokens where packing pays, else the padded block): GRPO's n responses per
      prompt then pay for the prompt once.
    - "packed" (`remove_padding`): `packing_pays`, the real tokens alone.
    - "padded": rows x longest row.
    A function of the micro-batch alone: the old-logprob pass and the update decide alike (first ratio bitwise 1).
    `layout_of` is the same decision from `RowFacts` already read.
    Example: 8 rows of a 30-token prompt + 128 response tokens: padded 1264, shared 30 + 8 * 128 = 1054 -> shared.
    """
    share = remove_padding and share_prefixes and score_mask is not None
    facts = RowFacts.of(attention_mask, score_mask, input_ids=input_ids if share else None)
    return layout_of(facts, scored=score_mask is not None, remove_padding=remove_padding, share_prefixes=share_prefixes)


def layout_kwargs(layout: str) -> dict:
    """`token_logprobs` keywords of a `choose_layout` layout. Example: "shared_prefix" -> remove_padding and
    share_prefixes True."""
    return dict(remove_padding=layout != "padded", share_prefixes=layout == "shared_prefix")


@dataclass(frozen=True)
class ScorePlan:
    """What `token_scores` reads about a micro-batch's shape, decided on the host (`plan_scores`).

    Token t of the micro-batch is index r * T + t of its flattened [b, T] tensors; the decoder's hidden states are
    flattened alike ([rows * width] of the packed rows, or of the padded [b, T]). Scored group g (the score mask's
    tokens first, then with score_unmasked the others) is `targets[g]`, row-major like a boolean mask's order, and
    `sources[g]`, the hidden state before each (the predicting position).
    """

    layout: str  # "padded", "packed" or "shared_prefix" (`choose_layout`)
    shape: tuple[int, int]  # [b, T]
    right_padded: bool  # the padded layout runs causal attention without a mask (else the mask, position ids from it)
    varlen: bool  # built for a varlen attention implementation (packed: one row, the boundaries as kwargs)
    pack: PackedBatch | SharedPrefixPack | None  # the decoder's rows of the packed layouts, tokens not gathered yet
    targets: tuple[Tensor, ...]  # per scored group [n] long: index of each scored token in the flattened [b * T]
    sources: tuple[Tensor, ...]  # per scored group [n] long: index of its predicting position in the flattened hidden

    def to(self, device: torch.device) -> ScorePlan:
        """The plan with its tensors on `device`, sent without the host waiting for the device (`devices.to_device`);
        the host's own copies (packed boundaries, shared-prompt segments) stay where their readers expect them."""
        return replace(self, pack=None if self.pack is None else self.pack.to(device),
                       targets=tuple(to_device(t, device) for t in self.targets),
                       sources=tuple(to_device(s, device) for s in self.sources))


def plan_scores(attention_mask: Tensor, score_mask: Tensor | None, *, facts: RowFacts, layout: str, varlen: bool,
                score_unmasked: bool, packed_row_tokens: int | None = PACKED_ROW_TOKENS) -> ScorePlan:
    """The `ScorePlan` of a [b, T] micro-batch in `layout` (`choose_layout` / `layout_of`), on the host, from HOST tensors
    (its attention mask, its score mask or None) and its `facts` (`RowFacts.select`; with prefix keys for the
    shared_prefix layout); reads no tensor back. `varlen`: `attention.is_varlen(model)` (packed: one row, else
    ceil(tokens / max(packed_row_tokens, longest)) rows). Token t is scored when it and token t - 1 are real;
    `score_mask` keeps those it marks (and with `score_unmasked` the others follow as a second group).
    Example: mask [[1, 1, 1]], score mask [[0, 1, 1]], padded -> targets ([1, 2],), sources ([0, 1],)."""
    assert attention_mask.device.type == "cpu", "plan_scores runs on the host, from host tensors"
    batch_size, seq_len = attention_mask.shape
    mask = attention_mask.to(torch.long)  # [b, T]
    pairs = (mask[:, 1:] * mask[:, :-1]).bool()  # [b, T - 1]: token t + 1 and its predecessor are real
    groups = [pairs]
    if score_mask is not None:
        wanted = score_mask[:, 1:].bool()  # [b, T - 1]
        groups = [pairs & wanted] + ([pairs & ~wanted] if score_unmasked else [])
    targets = []
    for group in groups:
        at = group.nonzero()  # [n, 2]: (row, column) in [b, T - 1], row-major
        targets.append(at[:, 0] * seq_len + at[:, 1] + 1)  # [n]: the token after the column
    if layout == "padded":
        pack, hidden_index = None, None  # the decoder's [b, T] is the micro-batch's own layout
    else:
        assert all(facts.right_padded), f"the {layout} layout needs right-padded rows"
        if layout == "packed":
            pack = pack_rows(facts.lens, seq_len, num_rows=1 if varlen else _packed_rows(facts.lens, packed_row_tokens))
            hidden_index = torch.full((batch_size * seq_len,), -1, dtype=torch.long)  # [b * T]
            hidden_index[pack.flat_index] = pack.real.reshape(-1).nonzero().squeeze(1)  # packed position of each token
        else:
            assert layout == "shared_prefix" and facts.prefix_keys is not None, (layout, "prefix keys")
            pack = shared_prefix_layout(facts.lens, seq_len, shared_groups(facts))
            hidden_index = pack.padded_to_packed.reshape(-1)  # [b * T]
    sources = [t - 1 if hidden_index is None else hidden_index[t - 1] for t in targets]  # [n] each
    return ScorePlan(layout=layout, shape=(batch_size, seq_len), right_padded=all(facts.right_padded), varlen=varlen,
                     pack=pack, targets=tuple(targets), sources=tuple(sources))


# ------------------------------------------------------------------ a RolloutBatch's micro-batches (the actor's passes)


def batch_facts(batch: RolloutBatch, *, share_prefixes: bool) -> RowFacts:
    """The host's per-row facts of `batch` (`RowFacts`, its loss mask as the score mask; the prefix keys
    with `share_prefixes`), read once: its micro-batches' plans read no tensor again."""
    return RowFacts.of(batch.attention_mask, batch.loss_mask, input_ids=batch.input_ids if share_prefixes else None)


def plan_forward(mb: RolloutBatch, facts: RowFacts, *, remove_padding: bool, share_prefixes: bool, varlen: bool,
                 score_unmasked: bool) -> tuple[Tensor | None, str, int, ScorePlan]:
    """One micro-batch's forward decided on the host from its `facts` (nothing read from a tensor): its score mask
    (`passes.response_scores`: its loss mask, None without a loss token), its layout and the tokens that computes
    (`choose_layout`), and its `ScorePlan` (host tensors; `.to(device)` sends it without waiting)."""
    score_mask = mb.loss_mask if any(facts.score_tokens) else None
    layout, computed = layout_of(facts, scored=score_mask is not None, remove_padding=remove_padding,
                                 share_prefixes=share_prefixes)
    plan = plan_scores(mb.attention_mask, score_mask, facts=facts, layout=layout, varlen=varlen, score_unmasked=score_unmasked)
    return score_mask, layout, computed, plan


def micro_batch_rows(batch: RolloutBatch, facts: RowFacts, idx: list[int], dummy: list) -> tuple[RolloutBatch, RowFacts]:
    """Rows `idx` of `batch` and their facts, with no read of a tensor; an empty `idx`: the dummy row
    (`batching.dummy_micro_batch`), its facts read once per batch (`dummy` caches them)."""
    if idx:
        mb_facts = facts.select(idx)
        return batch.select(idx, width=max(mb_facts.lens)), mb_facts
    mb = dummy_micro_batch(batch)
    if not dummy:
        dummy.append(RowFacts.of(mb.attention_mask, mb.loss_mask))
    return mb, dummy[0]
