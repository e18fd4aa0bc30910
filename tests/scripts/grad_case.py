"""The fixed case of the gradient-invariance tests (DESIGN invariant 1), shared by the in-process tests and the
2-process worker (`grad_worker.py`): a tiny random Qwen3 saved to disk, one mini-batch of 8 trajectories of very
different lengths, the config, and the plain full-batch loss the Actor's micro-batched gradients must reproduce.

The mini-batch: 4 groups of 2 trajectories (a group shares its prompt), prompt + response from 5 to 60 tokens,
random advantages of both signs, old logprobs = current logprobs + noise (so the PPO clip and the dual clip bind
on some tokens), reference logprobs = current + noise (so the KL term has a gradient). `with_holes` gives the same
batch with holes in its loss mask (tool outputs of a multi-turn episode, a masked truncation): advantages, logprobs
and engine logprobs stay nonzero in the holes, so a term that read response_mask instead would change the gradient.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from grpo_lib import algorithms
from grpo_lib.config import Config, load_config
from grpo_lib.core import names
from grpo_lib.core.types import RolloutBatch
from grpo_lib.model.actor import policy_loss_kwargs
from tests.conftest import merge_overrides

VOCAB = 256
MAX_PROMPT, MAX_RESPONSE = 12, 48  # the longest trajectory is exactly 60 = the smallest allowed token budget
# (prompt length, [response lengths]) per group: totals 5, 43 | 60, 21 | 30, 8 | 38, 22 (sum 227)
GROUPS = [(3, [2, 40]), (12, [48, 9]), (5, [25, 3]), (8, [30, 14])]
LONGEST, TOTAL_TOKENS = 60, 227
# Loss-mask holes per row, (start, end) offsets into the response: row 1 two tool outputs, row 2 a hole and a masked
# tail, row 3 masked whole (a masked truncation: no loss token, no sequence of the loss), row 4 a hole, row 6 a hole,
# row 7 a masked head; rows 0 and 5 keep every token. 171 response tokens, 114 of them in the loss.
HOLES = {1: [(10, 18), (25, 30)], 2: [(20, 35), (44, 48)], 3: [(0, 9)], 4: [(1, 6)], 6: [(12, 20)], 7: [(0, 3)]}
TEMPERATURE = 0.8
# Tolerances of the comparisons, from float32 round-off (eps = 2^-23 = 1.19e-7), never fitted to a machine.
# Reordering a float32 sum of N terms moves it by at most ~N * eps times the size of its terms. Micro-batching,
# packing, the head's chunks and the process count only regroup sums over the batch's TOTAL_TOKENS = 227 tokens
# (every position's hidden state enters the backward: prompts and loss-mask holes too), so
# - a gradient entry may move by N * eps of its tensor's scale, max |entry|: normwise, since an entry near 0 is a
#   cancellation of terms about that large (a bound relative to the entry itself would say nothing there);
# - the loss, a sum over the same tokens, by N * eps of its terms' total size, which exceeds the loss itself up to
#   ~12x here (advantages of both signs cancel; 12x on the holed batch): bounded relative to the loss, on the
#   margin of random-sign rounding below (sqrt(227) = 15);
# - a logprob is no sum over the batch but one row's forward: its longest sums are the logsumexp over VOCAB = 256
#   shifted exponentials (each <= 1, their sum >= 1: <= 256 eps after the log) and the layers' dot products (hidden
#   64, intermediate 128, attention over <= 60 positions) of O(1) terms after the RMS norms: (256 + 64 + 128 + 60) eps.
# These are worst cases; rounding errors of random sign grow like sqrt(N) * eps, far below them.
GRAD_TOL = TOTAL_TOKENS * torch.finfo(torch.float32).eps  # 2.7e-5, times each tensor's max |entry|
LOSS_REL_TOL = TOTAL_TOKENS * torch.finfo(torch.float32).eps  # 2.7e-5
LOGPROB_ATOL = (VOCAB + 64 + 128 + LONGEST) * torch.finfo(torch.float32).eps  # 6.1e-5
KL_COEF, ENTROPY_COEFF = 0.3, 0.05


def write_tiny_model(path: Path) -> Path:
    """Random float32 Qwen3 (vocab 256, hidden 64, 2 layers, head_dim 32, tied embeddings) saved to `path`."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    Qwen3ForCausalLM(config).float().save_pretrained(path)
    return Path(path)


def make_config(model_dir: Path, *, loss_agg_mode: str = "token-mean", remove_padding: bool = False,
                micro_batch_size: int | None = 8, max_tokens: int | None = None, extra: tuple[str, ...] = (),
                world_size: int = 1) -> Config:
    """Validated config: one mini-batch of 4 prompts x 2, KL loss (low_var_kl, coef 0.3), entropy bonus 0.05.

    Exactly one of micro_batch_size (trajectories per micro-batch) / max_tokens (use_dynamic_bsz budget).
    """
    dynamic = max_tokens is not None
    overrides = [
        f"model.path={model_dir}", "model.dtype=float32", f"model.use_remove_padding={str(remove_padding).lower()}",
        "data.train_files=[unused.parquet]", f"data.max_prompt_length={MAX_PROMPT}", f"data.max_response_length={MAX_RESPONSE}",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", f"rollout.temperature={TEMPERATURE}",
        f"actor.loss_agg_mode={loss_agg_mode}", "actor.use_kl_loss=true", f"actor.kl_loss_coef={KL_COEF}",
        "actor.kl_loss_type=low_var_kl", f"actor.entropy_coeff={ENTROPY_COEFF}", "actor.grad_clip=0",
        f"actor.use_dynamic_bsz={str(dynamic).lower()}",
        f"actor.ppo_max_token_len_per_gpu={max_tokens}" if dynamic else f"actor.ppo_micro_batch_size_per_gpu={micro_batch_size}",
        *extra,
    ]
    return load_config(None, merge_overrides(*overrides), world_size=world_size)  # `extra` replaces a base setting


def naive_logprobs(model, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary logits of the padded batch, / temperature, float32, shifted to token positions: [B, T] x 2."""
    ids, mask = batch.input_ids, batch.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()
    logp = (logits[:, :-1] / TEMPERATURE).log_softmax(-1)  # [B, T-1, V]
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T-1]
    scored = (mask[:, 1:] * mask[:, :-1]).float()  # [B, T-1]
    pad = torch.nn.functional.pad
    return pad(lp * scored, (1, 0)), pad(entropy * scored, (1, 0))  # [B, T] each


def make_batch(model, *, seed: int = 0) -> RolloutBatch:
    """The fixed mini-batch (right padded to 60), its old / reference logprobs perturbed from the model's own."""
    generator = torch.Generator().manual_seed(seed)
    rows = [(p, r, g) for g, (p, responses) in enumerate(GROUPS) for r in responses]
    width = max(p + r for p, r, _ in rows)
    batch_size = len(rows)
    input_ids = torch.zeros(batch_size, width, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros(batch_size, width)  # [B, T]
    prompts = {g: torch.randint(2, VOCAB, (p,), generator=generator) for g, (p, _) in enumerate(GROUPS)}
    for i, (p, r, g) in enumerate(rows):
        input_ids[i, :p] = prompts[g]
        input_ids[i, p:p + r] = torch.randint(2, VOCAB, (r,), generator=generator)
        attention_mask[i, :p + r] = 1
        response_mask[i, p:p + r] = 1.0
    advantages = torch.randn(batch_size, 1, generator=generator) * response_mask  # [B, T], both signs
    batch = RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, loss_mask=response_mask.clone(),
        rollout_logprobs=-torch.rand(batch_size, width, generator=generator) * response_mask,
        group_ids=[f"g{g}" for _, _, g in rows], response_texts=[""] * batch_size, data_sources=["synthetic"] * batch_size,
        ground_truths=[None] * batch_size, extra_infos=[{} for _ in rows], truncated=torch.zeros(batch_size, dtype=torch.bool),
        scores=torch.zeros(batch_size), advantages=advantages)
    with torch.no_grad():
        current, _ = naive_logprobs(model, batch)  # [B, T]
    batch.old_logprobs = (current + 0.25 * torch.randn(current.shape, generator=generator)) * response_mask  # [B, T]
    batch.ref_logprobs = (current + 0.3 * torch.randn(current.shape, generator=generator)) * response_mask  # [B, T]
    return batch


def with_holes(batch: RolloutBatch) -> RolloutBatch:
    """`batch` with the loss-mask holes of HOLES (response_mask and every other field unchanged)."""
    holed = batch.select(list(range(len(batch))))
    holed.loss_mask = batch.loss_mask.clone()  # [B, T]
    starts = (batch.attention_mask - batch.response_mask).sum(-1).long()  # [B] prompt lengths
    for row, spans in HOLES.items():
        for lo, hi in spans:
            holed.loss_mask[row, starts[row] + lo:starts[row] + hi] = 0.0
    return holed


def reference_loss(model, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """The mini-batch loss written plainly (docs/ALGORITHMS.md), all rows in one padded forward, counts from the batch."""
    a = cfg.actor
    lp, entropy = naive_logprobs(model, batch)  # [B, T] each
    mask = batch.loss_mask  # [B, T]
    counts = dict(loss_scale_factor=a.loss_scale_factor or cfg.data.max_response_length)
    is_weights = None
    if cfg.algorithm.rollout_correction.mode != "none":
        is_weights = algorithms.rollout_is_weights(batch.old_logprobs, batch.rollout_logprobs, mask,
                                                   mode=cfg.algorithm.rollout_correction.mode, cap=cfg.algorithm.rollout_correction.cap)
    pg, _ = algorithms.policy_loss(lp, batch.old_logprobs, batch.advantages, mask, is_weights=is_weights,
                                   **policy_loss_kwargs(a), **counts)
    kl = algorithms.aggregate_loss(algorithms.kl_penalty(lp, batch.ref_logprobs, a.kl_loss_type), mask, a.loss_agg_mode, **counts)
    ent = algorithms.aggregate_loss(entropy, mask, a.loss_agg_mode, **counts)
    return pg + a.kl_loss_coef * kl - a.entropy_coeff * ent


def grads_of(model) -> dict[str, torch.Tensor]:
    """Full copies of every parameter's gradient (zeros where None; gathered from FSDP2 shards), then clears them."""
    from grpo_lib.model.fsdp import full_tensor

    out = {name: (full_tensor(p.grad.detach()).clone() if p.grad is not None else torch.zeros(p.shape))
           for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def reference_grads(model, batch: RolloutBatch, cfg: Config) -> tuple[dict[str, torch.Tensor], float]:
    """Gradient and value of `reference_loss` (the single full-batch gradient)."""
    model.zero_grad(set_to_none=True)
    loss = reference_loss(model, batch, cfg)
    loss.backward()
    return grads_of(model), float(loss.detach())


def assert_close_grads(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """Same parameter names, every gradient within GRAD_TOL of its tensor's scale (see GRAD_TOL)."""
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        atol = GRAD_TOL * float(expected[name].abs().max())
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=atol, msg=lambda m: f"{what}: gradient of {name}: {m}")


def metrics_loss(metrics: dict[str, float], cfg: Config) -> float:
    """The total loss from the Actor's (global) loss metrics."""
    a = cfg.actor
    return metrics["actor/pg_loss"] + a.kl_loss_coef * metrics["actor/kl_loss"] - a.entropy_coeff * metrics["actor/entropy"]


def group_rows(batch: RolloutBatch, groups: list[str]) -> list[int]:
    """Row indices of `groups`, in batch order."""
    wanted = set(groups)
    return [i for i, g in enumerate(batch.group_ids) if g in wanted]


# Every policy loss of grpo_lib/algorithms/policy_losses.py but vanilla (swept with every loss_agg_mode) with the overrides it runs
# under in the invariance suites. clip_cov and kl_cov pick tokens within each micro-batch (as verl), which no
# micro-batching can leave unchanged: they run with their pick made empty (no candidate in the covariance band
# (100, 200): |cov| < 10 on this batch) or weightless (ppo_kl_coef 0), so the suites check the rest of their loss.
LOSS_OVERRIDES: dict[str, tuple[str, ...]] = {
    "gspo": (), "cispo": (), "sapo": ("actor.tau_pos=1.5", "actor.tau_neg=2.0"), "geo_mean": (), "dppo_tv": (), "dppo_kl": (),
    "gpg": (), "dro": ("actor.policy_loss.dro_beta=0.5",),
    "clip_cov": ("actor.policy_loss.clip_cov_lb=100", "actor.policy_loss.clip_cov_ub=200"),
    "kl_cov": ("actor.policy_loss.ppo_kl_coef=0",),
}


def loss_case(loss_mode: str) -> tuple[str, tuple[str, ...]]:
    """(loss_agg_mode, overrides) of `loss_mode` in the invariance suites: its forced aggregation, else token-mean."""
    return names.FORCED_AGG.get(loss_mode, "token-mean"), (f"actor.policy_loss.loss_mode={loss_mode}", *LOSS_OVERRIDES[loss_mode])


# Micro-batch settings the tests sweep: fixed trajectories per micro-batch (1, 3, all 8) and token budgets from
# the longest trajectory (60: one long row alone) to everything (227: one micro-batch).
FIXED_SIZES = (1, 3, 8)
TOKEN_BUDGETS = (LONGEST, 90, 150, TOTAL_TOKENS)
