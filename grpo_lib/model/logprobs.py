"""The one token log-probability function (docs/DESIGN.md invariant 2).

The actor update, the reference pass and the old-logprob pass all call `token_logprobs`, so the forward path
(packing, temperature scaling of logits exactly as the sampler did, float32 log-softmax) is identical and the
importance ratio is exactly 1 on the first on-policy update.

How it works:
1. The ROOT model is called (so FSDP2 / peft wrappers run their forward hooks) with `logits_to_keep=1`, and
   the decoder's final hidden states are captured by a forward hook on `model.get_decoder()`: the full
   [tokens, vocab] logits are never computed by the model itself.
2. The output head (`model.get_output_embeddings()`, also right for tied embeddings and under peft) is applied
   to the hidden states of the predicting positions only (pads skipped; with `score_mask`, only the positions
   that predict a scored token, e.g. the response), in chunks of `chunk_size` tokens under
   `torch.utils.checkpoint` (use_reentrant=False): at most one float32 [chunk_size, vocab] block is alive at a
   time, and the backward recomputes it chunk by chunk. Where the micro-batch's logits are small (at most
   `checkpoint_min_bytes`), checkpointing saves no memory worth its recompute: the head then runs as one chunk
   that keeps its activations for the backward (fewer, larger matmuls), in the no-grad passes given the same bound
   too, so the old-logprob pass and the update score in the same chunks.
3. The log-probabilities go through one autograd function (`_TargetLogprobs`: fused forward, closed-form backward
   from the softmax it keeps). Entropy is only logged unless it carries a coefficient: `entropy_grad=False` computes
   it inside the same function from that softmax, without a graph.
4. Which rows run how (padded, packed, prompts shared) and every index the forward gathers and scatters by (the
   packed tokens, each scored token and its predicting position) come from a host-side plan
   (`grpo_lib.model.score_plan`: built from host tensors and moved to the device without waiting), so the forward reads
   nothing back from the device: no boolean-mask index, no `.tolist()`, no `.item()` (the layout rules,
   `choose_layout` and friends, live there too and are re-exported here).

Alignment (verl's `logprobs_from_logits` shifted to token positions):
    logprobs[:, t] = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]
position 0 of every sequence and pad positions are 0. Entropy uses the same alignment.
Run: `python -m pytest tests/model/test_logprobs.py`.
"""

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from grpo_lib.model.attention import is_varlen, packing_known, shares_prefixes
from grpo_lib.model.packing import packed_forward_kwargs, shared_prefix_forward_kwargs
from grpo_lib.model.score_plan import (PACK_BELOW_REAL_FRACTION, PACKED_ROW_TOKENS, RowFacts, ScorePlan,  # noqa: F401 (re-exported)
                                 choose_layout, layout_kwargs, num_packed_rows, packing_pays, plan_scores, prefix_lengths,
                                 real_token_fraction)


def _decoder_hidden_states(model: torch.nn.Module, **forward_kwargs) -> Tensor:
    """Run the root model and return the decoder's last hidden states [b, T, hidden] (captured by a hook)."""
    captured: list[Tensor] = []

    def hook(module, args, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        captured.append(hidden)

    handle = model.get_decoder().register_forward_hook(hook)
    try:
        model(**forward_kwargs, logits_to_keep=1)  # logits of one position only: [b, 1, V], discarded
    finally:
        handle.remove()
    assert len(captured) == 1, f"decoder ran {len(captured)} times in one forward, expected 1"
    return captured[0]  # [b, T, hidden]


class _TargetLogprobs(torch.autograd.Function):
    """log softmax(logits)[target] per row (and, when asked, the entropy, without grad) in few passes over the [c, V]
    block: max, exp, sum, normalise, one gather (and, for the entropy, one product and its sum). The backward is
    log-softmax's closed form, -softmax * g with g added at the target, from the probabilities kept by the forward (the
    [c, V] block autograd would keep anyway): one pass where autograd's logsumexp + gather take five (a zero fill, a
    scatter, exp, product, sum), and on a small model the head's element-wise work is several percent of the update.
    Targets [c] give [c]; targets [c, m] (several ids per row: the sampled token and a teacher's top-k) give [c, m],
    each column the same gather minus the same logsumexp as a [c] call (bit-identical), and the backward
    -softmax * sum_j g_j with each g_j added at its id (d log p_j / d z = e_j - softmax).
    Example: logits [[0, 0]], target [1] -> log p = log 0.5; its gradient with g = 1: [[-0.5, 0.5]]."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, compute_entropy: bool) -> tuple[Tensor, Tensor]:
        top = logits.amax(dim=-1, keepdim=True)  # [c, 1]
        probs = torch.sub(logits, top).exp_()  # [c, V], unnormalised
        total = probs.sum(dim=-1, keepdim=True)  # [c, 1]
        log_norm = (top + total.log()).squeeze(-1)  # [c]: logsumexp
        if targets.dim() == 1:
            logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm  # [c]
        else:
            logprobs = logits.gather(-1, targets) - log_norm.unsqueeze(-1)  # [c, m]
        probs = probs.div_(total)  # [c, V]: softmax
        # entropy = logsumexp(z) - sum(softmax(z) * z); [0] when not asked (an output must be a tensor)
        # (a product and a sum, not linalg.vecdot: CPU autocast would run that in bf16)
        entropy = log_norm - (probs * logits).sum(dim=-1) if compute_entropy else logits.new_zeros(0)  # [c]
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(probs, targets)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward treats the kept softmax as a constant
    def backward(ctx, grad: Tensor, _entropy_grad: Tensor | None) -> tuple[Tensor, None, None]:
        probs, targets = ctx.saved_tensors
        if targets.dim() == 1:
            grad_logits = probs * grad.neg().unsqueeze(-1)  # [c, V]
            return grad_logits.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1)), None, None
        grad_logits = probs * grad.sum(dim=-1).neg().unsqueeze(-1)  # [c, V]
        return grad_logits.scatter_add_(-1, targets, grad), None, None  # grad [c, m]


def _head_logprobs(
    head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float, compute_entropy: bool,
    entropy_grad: bool = True, extra_ids: Tensor | None = None, topk: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """log p(target), entropy, log p at `extra_ids` [c, k] and the `topk` ids [c, k] for one chunk, log-softmax in float32.

    Written for few passes over the [c, V] block (the head is a large share of a small model's step): no division
    when temperature == 1 (x / 1.0 == x exactly), and `_TargetLogprobs`' fused forward and closed-form backward. The
    log-probabilities come from the same function with grad or without (the first ratio stays bitwise 1); an entropy
    that carries a gradient (entropy_coeff != 0) is built by autograd beside them. `extra_ids` (a teacher's top-k ids at
    these positions) or `topk` (this model's own k most likely ids, found without grad) are scored by the same call as
    the targets, as further columns: log p(target) is the same value as without them.
    """
    logits = head(hidden).float()  # [c, V]
    if temperature != 1.0:
        logits = logits / temperature  # [c, V]
    entropy_with_grad = compute_entropy and entropy_grad and torch.is_grad_enabled()
    if topk > 0:
        with torch.no_grad():
            extra_ids = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # [c, k]
    ids = targets if extra_ids is None else torch.cat([targets.unsqueeze(-1), extra_ids], dim=-1)  # [c] or [c, 1 + k]
    logprobs, entropy = _TargetLogprobs.apply(logits, ids, compute_entropy and not entropy_with_grad)  # [c] or [c, 1+k], [c]
    extra = None
    if extra_ids is not None:
        logprobs, extra = logprobs[:, 0], logprobs[:, 1:]  # [c], [c, k]
    if entropy_with_grad:
        entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)  # [c]
    return logprobs, (entropy if compute_entropy else None), extra, (extra_ids if topk > 0 else None)


def _chunked_head(
    head: torch.nn.Module,
    hidden: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
    entropy_grad: bool = True,
    checkpoint_min_bytes: int = 0,
    extra_ids: Tensor | None = None,
    topk: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """`_head_logprobs` over [N, hidden] in chunks, each recomputed in backward when grads are on and the float32
    logits of all N tokens would exceed `checkpoint_min_bytes`; within it, one chunk of all N (with or without grad,
    so a no-grad pass given the same bound scores in the same chunks as the update). Returns logprobs [N], entropy [N]
    or None, the log-probabilities at `extra_ids` [N, k] (or at the `topk` ids) or None, the `topk` ids [N, k] or None."""
    vocab = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", [1 << 20])[0]  # peft wraps Linear
    small = 0 < hidden.shape[0] * vocab * 4 <= checkpoint_min_bytes  # float32 logits of all N tokens under the bound
    recompute = torch.is_grad_enabled() and not small
    if small:  # one chunk: with grad every chunk's logits would be kept for the backward anyway (fewer, larger calls)
        chunk_size = max(chunk_size, hidden.shape[0])
    chunks: list[tuple] = []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (head, hidden[start : start + chunk_size], targets[start : start + chunk_size])  # [c, hidden], [c]
        ids = None if extra_ids is None else extra_ids[start : start + chunk_size]  # [c, k]
        if recompute:
            chunks.append(checkpoint(_head_logprobs, *args, temperature, compute_entropy, entropy_grad, ids, topk,
                                     use_reentrant=False))
        else:
            chunks.append(_head_logprobs(*args, temperature, compute_entropy, entropy_grad, ids, topk))
    if not chunks:  # no token has a predecessor (empty or one-token sequences)
        empty = hidden.new_zeros(0, dtype=torch.float32)  # [0]
        width = extra_ids.shape[-1] if extra_ids is not None else topk
        extra = hidden.new_zeros(0, width, dtype=torch.float32) if (extra_ids is not None or topk > 0) else None  # [0, k]
        top = targets.new_zeros(0, topk) if topk > 0 else None  # [0, k]
        return empty, (empty if compute_entropy else None), extra, top
    logprobs, entropy, extra, top = zip(*chunks)
    return (torch.cat(logprobs), torch.cat(entropy) if compute_entropy else None,  # [N], [N]
            torch.cat(extra) if extra[0] is not None else None, torch.cat(top) if top[0] is not None else None)  # [N, k] x 2


class TokenScores(NamedTuple):
    """What `token_scores` returns (a NamedTuple, so FSDP2 finds its tensors for its backward hooks). Entry t of each
    tensor is about token t, from the distribution that predicted it (position 0 and unscored positions are 0)."""

    logprobs: Tensor  # [b, T] float32, log p(input_ids[:, t])
    entropy: Tensor | None  # [b, T] float32 with compute_entropy, else None
    extra_logprobs: Tensor | None  # [b, T, k] float32: log p at extra_ids (or at the topk ids), else None
    topk_ids: Tensor | None  # [b, T, k] long: this model's k most likely ids (with topk > 0), else None


def token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
    """(logprobs, entropy) of `token_scores` (same arguments): the actor's, the reference's and the old-logprob pass's
    call. Example: ids [[5, 6, 7]], mask [[1, 1, 1]] -> ([[0, log p(6 | 5), log p(7 | 5 6)]], None)."""
    scores = token_scores(model, input_ids, attention_mask, **kwargs)
    return scores.logprobs, scores.entropy


def token_scores(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    remove_padding: bool = False,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
    packed_row_tokens: int | None = PACKED_ROW_TOKENS,
    score_mask: Tensor | None = None,
    score_unmasked: bool = False,
    entropy_grad: bool = True,
    checkpoint_min_bytes: int = 0,
    share_prefixes: bool = False,
    extra_ids: Tensor | None = None,
    topk: int = 0,
    plan: ScorePlan | None = None,
) -> TokenScores:
    """Per-token log-probabilities (and optionally entropies) of `input_ids` under `model`, float32 [b, T].

    logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) with logits / temperature; 0 at position 0 and
    at pads. entropy[:, t] is the entropy of the distribution that predicted token t (None unless
    compute_entropy). Gradients flow to the model parameters when grad is enabled.

    remove_padding=True packs the rows (they must be right-padded) into k rows of whole sequences and calls the
    model with attention_mask=None, restarting position_ids and use_cache=False: only exact when the attention
    backend isolates packed sequences (`packing.check_packing_isolated`). k = ceil(real tokens /
    max(packed_row_tokens, longest sequence)), balanced by `batching.partition_balanced`; packed_row_tokens=None
    packs everything into one row. Why several rows: sdpa and eager compute the dense [row, row] attention of a
    packed row, so k rows cost ~1/k of one row's attention, for a little padding (rows are right-padded to the
    longest; bench/results_cpu.md). With a varlen implementation (`attention.is_varlen`: flash_attention_2,
    grpo_varlen) everything goes into ONE row, no pad segment, and the boundaries travel as cu_seq_lens kwargs
    (`packing.packed_forward_kwargs`). Whether packing pays is the caller's call (`packing_pays`).
    remove_padding=False runs the padded batch: right-padded rows with no mask at all (plain causal attention is exact
    for every real token; no [b, T, T] mask is built), other paddings with the attention_mask and position_ids =
    cumsum(mask) - 1.
    score_mask [b, T] (the loss mask): only tokens where it is nonzero are scored, the others get 0 (the prompt's
    tokens and the response's holes are never used by the loss; the decoder still runs over them, the output head does
    not).
    score_unmasked=True scores the other tokens too, without grad, in chunks of their own after the masked ones: the
    masked tokens' values are then bit-identical to a score_mask-only call, and every position has its value.
    share_prefixes=True (with remove_padding and a score_mask; grpo_varlen only): one packed row in which rows beginning
    with the same prompt (the tokens before their first scored token) share one copy of it
    (`packing.pack_shared_prefixes`): the decoder runs over each prompt once, its hidden states serve every row of
    the group and their gradients add up. The same values as the padded path up to float rounding.
    entropy_grad=False: entropy without grad (logged only). checkpoint_min_bytes: recompute the head in the backward
    only when the scored tokens' float32 logits exceed this size (0: always, the most memory-frugal); under it the
    head runs in one chunk.
    On-policy distillation's top-k forward KL (grpo_lib/algorithms/distillation.py) reads two more outputs, from the same head
    call: topk=k gives the k most likely ids of each scored position's distribution (`topk_ids` [b, T, k], found
    without grad) and their log-probabilities (`extra_logprobs`): the teacher's pass; extra_ids [b, T, k] gives the
    log-probabilities at those ids, with grad (`extra_logprobs`): the student's update at the teacher's top-k. Either
    way `logprobs` holds the same values as without them.
    plan: the micro-batch's `score_plan.ScorePlan` for these arguments, built on the host from host tensors and moved
    to the device (`ScorePlan.to`): the call then reads nothing back from the device, so the host can queue the next
    micro-batch meanwhile. Without it one is built here from host copies of the masks (one device-to-host copy).
    Example: ids [[5, 6, 7]], mask [[1, 1, 1]] -> logprobs [[0, log p(6 | 5), log p(7 | 5 6)]].
    """
    assert input_ids.shape == attention_mask.shape and input_ids.dim() == 2, (
        f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [b, T]"
    )
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    assert chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size}"
    assert packed_row_tokens is None or packed_row_tokens >= 1, (
        f"packed_row_tokens must be >= 1 or None, got {packed_row_tokens}"
    )
    assert score_mask is None or score_mask.shape == input_ids.shape, (
        f"score_mask {tuple(score_mask.shape)} must be [b, T] like input_ids")
    batch_size, seq_len = input_ids.shape
    varlen = is_varlen(model)
    shared = remove_padding and share_prefixes and score_mask is not None
    layout = "shared_prefix" if shared else "packed" if remove_padding else "padded"
    assert not shared or shares_prefixes(model), (
        f"share_prefixes needs grpo_varlen attention, the model has {getattr(model.config, '_attn_implementation', None)!r}")
    if plan is None:  # built here: the masks copied to the host once (a device sync where they are on a device)
        host_mask, host_scores = attention_mask.cpu(), None if score_mask is None else score_mask.cpu()
        facts = RowFacts.of(host_mask, host_scores, input_ids=input_ids.cpu() if shared else None)
        plan = plan_scores(host_mask, host_scores, facts=facts, layout=layout, varlen=varlen, score_unmasked=score_unmasked,
                           packed_row_tokens=packed_row_tokens).to(input_ids.device)
    assert (plan.layout, plan.shape, plan.varlen) == (layout, (batch_size, seq_len), varlen), (
        f"plan {plan.layout} {plan.shape} varlen={plan.varlen} for a {layout} call on {tuple(input_ids.shape)}, varlen={varlen}")
    assert len(plan.targets) == (2 if score_mask is not None and score_unmasked else 1), "plan and score_unmasked disagree"
    # transformers' packed-sequence probe reads the device once per forward; its answer is not needed where the
    # attention is varlen (no dense mask) or the rows are right-padded (one arange of positions each): attention.packing_known
    right_padded = plan.layout == "padded" and plan.right_padded
    with packing_known() if varlen or right_padded else contextlib.nullcontext():
        if plan.layout == "shared_prefix":
            hidden = _decoder_hidden_states(model, **shared_prefix_forward_kwargs(plan.pack.with_tokens(input_ids)))  # [1, N, hidden]
        elif plan.layout == "packed":
            hidden = _decoder_hidden_states(model, **packed_forward_kwargs(plan.pack.with_tokens(input_ids), varlen=varlen))  # [k, width, hidden]
        elif right_padded:
            # Right padding: a real token's causal past holds only real tokens, so plain causal attention (no mask, no
            # [b, T, T] mask built) gives its exact values; the pads' outputs are never read.
            position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch_size, -1)  # [b, T]
            hidden = _decoder_hidden_states(model, input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                            use_cache=False)  # [b, T, hidden]
        else:
            position_ids = (attention_mask.to(torch.long).cumsum(dim=1) - 1).clamp(min=0)  # [b, T], left padding too
            hidden = _decoder_hidden_states(model, input_ids=input_ids, position_ids=position_ids,
                                            attention_mask=attention_mask, use_cache=False)  # [b, T, hidden]
    # Each scored token's predicting hidden state by its index in the flattened rows (`plan.sources`): index_select's
    # backward is an index_add, several times faster on CPU than the index_put of a mask or gather index's backward.
    # (On CUDA that index_add adds a shared prompt's repeated last state with atomics: its gradient is reproducible to
    # rounding, as flash attention's backward is, not bitwise.)
    predicting = hidden.reshape(-1, hidden.shape[-1])  # [rows * width, hidden]
    flat_ids = input_ids.reshape(-1)  # [b * T]
    assert extra_ids is None or (extra_ids.shape[:2] == input_ids.shape and extra_ids.dim() == 3), (
        f"extra_ids {tuple(extra_ids.shape)} must be [b, T, k] like input_ids {tuple(input_ids.shape)}")
    assert extra_ids is None or topk == 0, "extra_ids (ids to score) and topk (ids to find) exclude each other"
    head = model.get_output_embeddings()
    head_kwargs = dict(temperature=temperature, compute_entropy=compute_entropy, chunk_size=chunk_size,
                       entropy_grad=entropy_grad, checkpoint_min_bytes=checkpoint_min_bytes, topk=topk)

    def to_padded(values: Tensor, target: Tensor) -> Tensor:  # [n, ...] -> [b, T, ...], unscored positions 0
        padded = values.new_zeros(batch_size * seq_len, *values.shape[1:])  # [b * T, ...]
        return padded.index_copy(0, target, values).view(batch_size, seq_len, *values.shape[1:])  # position 0 stays 0

    logprobs, entropy, extra, top = None, None, None, None
    for i, (target, source) in enumerate(zip(plan.targets, plan.sources)):  # the score mask's tokens, then the others
        group_hidden = predicting.index_select(0, source)  # [n, hidden]
        group_targets = flat_ids.index_select(0, target)  # [n]
        group_extra = None if extra_ids is None else extra_ids.reshape(batch_size * seq_len, -1).index_select(0, target)  # [n, k]
        with torch.set_grad_enabled(torch.is_grad_enabled() and i == 0):  # unmasked tokens: values only, no graph
            lp, ent, ex, tk = _chunked_head(head, group_hidden, group_targets, extra_ids=group_extra,
                                            **head_kwargs)  # [n], [n] or None, [n, k] or None, [n, k] or None
        lp = to_padded(lp, target)  # [b, T]
        logprobs = lp if logprobs is None else logprobs + lp  # groups are disjoint
        if ent is not None:
            ent = to_padded(ent, target)  # [b, T]
            entropy = ent if entropy is None else entropy + ent
        if ex is not None:
            ex = to_padded(ex, target)  # [b, T, k]
            extra = ex if extra is None else extra + ex
        if tk is not None:
            tk = to_padded(tk, target)  # [b, T, k]
            top = tk if top is None else top + tk
    return TokenScores(logprobs, entropy, extra, top)
