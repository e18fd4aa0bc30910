"""DESIGN invariant 1 on one process: micro-batch size, token budget and packing never change the gradient.

The Actor's own loss path (`Actor.accumulate_gradients`: micro-batches, global counts, backward each) on the fixed
mini-batch of `tests/scripts/grad_case.py` must give the gradient of the plain full-batch loss (one padded forward,
full-vocabulary logits, counts of the batch) for every loss_agg_mode, with the KL and entropy terms on and the
PPO clip binding on some tokens. Every test runs twice: on the contiguous batch and on the same batch with holes in
its loss mask (`grad_case.with_holes`); `test_holes_are_left_out_of_the_loss` checks the holed gradient against the
loss written by hand with those positions dropped. Run: `.venv/bin/python -m pytest tests/model/test_grad_invariance.py`.
"""

from __future__ import annotations

import pytest
import torch

import grpo_lib.model.actor as actor_module
import grpo_lib.model.passes as passes_module
from grpo_lib.algorithms import LOSS_AGG_MODES
from grpo_lib.model.actor import Actor
from grpo_lib.trainer import step
from tests.scripts import grad_case as case

MICRO_SETTINGS = [dict(micro_batch_size=s) for s in case.FIXED_SIZES] + [dict(max_tokens=t) for t in case.TOKEN_BUDGETS]


@pytest.fixture(scope="module", params=[False, True], ids=["contiguous", "holes"])
def setup(tmp_path_factory, request):
    """One Actor (built with packing on, so the start-up isolation check runs), the batch (with loss-mask holes
    for the "holes" parameter), and a cache of reference gradients per config."""
    torch.set_num_threads(1)  # the machine is shared; the model is tiny
    model_dir = case.write_tiny_model(tmp_path_factory.mktemp("grad") / "model")
    actor = Actor(case.make_config(model_dir, remove_padding=True), device=torch.device("cpu"))
    batch = case.make_batch(actor.model)
    if request.param:
        batch = case.with_holes(batch)
    return dict(model_dir=model_dir, actor=actor, batch=batch, refs={}, holes=request.param)


def reference(setup, cfg, key):
    if key not in setup["refs"]:
        setup["refs"][key] = case.reference_grads(setup["actor"].model, setup["batch"], cfg)
    return setup["refs"][key]


def actor_grads(actor: Actor, cfg, batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    actor.cfg = cfg
    actor.model.zero_grad(set_to_none=True)
    metrics = actor.accumulate_gradients(batch)
    return case.grads_of(actor.model), metrics


def assert_same_grads(grads, expected, what: str) -> None:
    case.assert_close_grads(grads, expected, what)  # tolerance derived in grad_case (GRAD_TOL)


@pytest.fixture
def sharing(setup, request):
    """The actor with rows of one prompt sharing its forward (grpo_varlen's default) or not (plain packing)."""
    setup["actor"].share_prefixes = request.param
    yield request.param
    setup["actor"].share_prefixes = True


@pytest.mark.parametrize("remove_padding, sharing", [(False, True), (True, True), (True, False)],
                         ids=["padded", "packed, prompts shared", "packed"], indirect=["sharing"])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_micro_batching_never_changes_the_gradient(setup, loss_agg_mode, remove_padding, sharing):
    actor, batch = setup["actor"], setup["batch"]
    expected, expected_loss = reference(setup, case.make_config(setup["model_dir"], loss_agg_mode=loss_agg_mode), loss_agg_mode)
    assert any(g.abs().max() > 0 for g in expected.values())
    shared_seen = 0.0
    for micro in MICRO_SETTINGS:
        cfg = case.make_config(setup["model_dir"], loss_agg_mode=loss_agg_mode, remove_padding=remove_padding, **micro)
        grads, metrics = actor_grads(actor, cfg, batch)
        shared_seen = max(shared_seen, metrics["perf/shared_prefix"])
        assert_same_grads(grads, expected, f"{loss_agg_mode} {micro} remove_padding={remove_padding} sharing={sharing}")
        assert case.metrics_loss(metrics, cfg) == pytest.approx(expected_loss, rel=case.LOSS_REL_TOL)
        assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/kl_loss"] > 0, "the clip and the KL term are active"
    if not setup["holes"]:  # with holes too few prompt tokens are shared for it to pay (tests/model/test_shared_prefix.py has them)
        assert (shared_seen > 0) == (remove_padding and sharing), "some micro-batch ran its shared prompts once"


def dropped_positions_loss(model, batch, cfg) -> torch.Tensor:
    """The mini-batch loss written per row with every position outside the loss mask simply left out (no mask, no
    `algorithms` call), for the config's loss_agg_mode, the vanilla clipped loss, low_var_kl and the entropy bonus.

    Row i keeps K_i = {t : loss_mask[i, t] = 1}; S = the rows with K_i non-empty (the others are no sequence); per
    kept token v_t = L_t + kl_coef * k3_t - entropy_coeff * H_t with r_t = exp(lp_t - old_t),
    L_t = max(-A_i r_t, -A_i clip(r_t, 1 - c, 1 + c)), and L_t = min(L_t, -3 A_i) where A_i < 0 (docs/ALGORITHMS.md):
      token-mean               sum_i sum_{K_i} v_t / sum_i |K_i|
      token-sum                sum_i sum_{K_i} v_t (no denominator: the mini-batch's sum)
      seq-mean-token-sum       sum_i sum_{K_i} v_t / S
      seq-mean-token-mean      sum_i (sum_{K_i} v_t / |K_i|) / S
      seq-mean-token-sum-norm  sum_i sum_{K_i} v_t / (S * max_response_length)
    """
    a = cfg.actor
    lp, entropy = case.naive_logprobs(model, batch)  # [B, T] each
    row_sums, row_lengths = [], []
    for i in range(len(batch)):
        keep = batch.loss_mask[i] > 0  # [T]
        if not keep.any():
            continue
        lp_i, old, ref, adv = lp[i, keep], batch.old_logprobs[i, keep], batch.ref_logprobs[i, keep], batch.advantages[i, keep]
        ratio = (lp_i - old).exp()  # [K_i]; |lp - old| is ~0.25 here, far inside the +-20 clamp
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - a.clip_ratio_low, 1 + a.clip_ratio_high))  # [K_i]
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * a.clip_ratio_c), pg)  # [K_i]
        x = ref - lp_i  # [K_i], also far inside +-20
        k3 = (x.exp() - x - 1).clamp(-10.0, 10.0)  # [K_i]
        v = pg + a.kl_loss_coef * k3 - a.entropy_coeff * entropy[i, keep]  # [K_i]
        row_sums.append(v.sum())
        row_lengths.append(int(keep.sum()))
    total, num_seqs = torch.stack(row_sums).sum(), len(row_sums)
    if a.loss_agg_mode == "token-sum":
        return total
    if a.loss_agg_mode == "token-mean":
        return total / sum(row_lengths)
    if a.loss_agg_mode == "seq-mean-token-sum":
        return total / num_seqs
    if a.loss_agg_mode == "seq-mean-token-mean":
        return sum(r / n for r, n in zip(row_sums, row_lengths)) / num_seqs
    return total / (num_seqs * cfg.data.max_response_length)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_holes_are_left_out_of_the_loss(setup, loss_agg_mode):
    """The Actor's gradient (micro-batched, packed) equals the gradient of the loss with the masked positions dropped."""
    actor, batch = setup["actor"], setup["batch"]
    cfg = case.make_config(setup["model_dir"], loss_agg_mode=loss_agg_mode)
    actor.model.zero_grad(set_to_none=True)
    loss = dropped_positions_loss(actor.model, batch, cfg)
    loss.backward()
    expected, expected_loss = case.grads_of(actor.model), float(loss.detach())
    for micro in (dict(micro_batch_size=3), dict(max_tokens=case.LONGEST)):
        cfg = case.make_config(setup["model_dir"], loss_agg_mode=loss_agg_mode, remove_padding=True, **micro)
        grads, metrics = actor_grads(actor, cfg, batch)
        assert_same_grads(grads, expected, f"{loss_agg_mode} {micro} against the loss without the holes")
        assert case.metrics_loss(metrics, cfg) == pytest.approx(expected_loss, rel=case.LOSS_REL_TOL)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_masked_truncation_is_the_row_masked_by_hand(setup, loss_agg_mode):
    """actor.mask_truncated_responses (`step.mask_truncated`): one truncated row (row 2, 48 response tokens, the
    longest) -> the gradient of the batch with that row's loss positions zeroed by hand, whose seq-mean counts have
    one sequence fewer (`dropped_positions_loss` skips a row without loss tokens: S = 7, or 6 with the holes' row 3)."""
    actor, batch = setup["actor"], setup["batch"]
    truncated = batch.select(list(range(len(batch))))
    truncated.loss_mask = batch.loss_mask.clone()  # [B, T]
    truncated.truncated = torch.zeros(len(batch), dtype=torch.bool)
    truncated.truncated[2] = True
    step.mask_truncated(truncated)
    by_hand = batch.select(list(range(len(batch))))
    by_hand.loss_mask = batch.loss_mask.clone()  # [B, T]
    by_hand.loss_mask[2] = 0.0
    assert torch.equal(truncated.loss_mask, by_hand.loss_mask) and torch.equal(truncated.scores, batch.scores)
    cfg = case.make_config(setup["model_dir"], loss_agg_mode=loss_agg_mode)
    actor.model.zero_grad(set_to_none=True)
    dropped_positions_loss(actor.model, by_hand, cfg).backward()
    expected = case.grads_of(actor.model)
    unmasked, _ = reference(setup, cfg, loss_agg_mode)
    assert any((unmasked[k] - expected[k]).abs().max() > 1e-4 * expected[k].abs().max() for k in expected), \
        "the truncated row's 48 tokens carried gradient before masking"
    cfg = case.make_config(setup["model_dir"], loss_agg_mode=loss_agg_mode, remove_padding=True, micro_batch_size=3)
    grads, _ = actor_grads(actor, cfg, truncated)
    assert_same_grads(grads, expected, f"{loss_agg_mode}: truncated row masked by actor.mask_truncated_responses")


def test_metrics_are_means_over_loss_tokens(setup):
    """actor/ppo_kl and rollout/logprob_abs_diff_mean (logged with rollout correction on) average over the loss tokens
    of the whole mini-batch, whatever the micro-batching: mean over loss_mask of old - lp and of |old - rollout|."""
    actor, batch = setup["actor"], setup["batch"]
    with torch.no_grad():
        lp, _ = case.naive_logprobs(actor.model, batch)  # [B, T]
    mask = batch.loss_mask  # [B, T]
    ppo_kl = float(((batch.old_logprobs - lp) * mask).sum() / mask.sum())
    gap = float(((batch.old_logprobs - batch.rollout_logprobs).abs() * mask).sum() / mask.sum())
    # Each term carries its logprob's error (LOGPROB_ATOL), plus the mean's float32 reordering over <= 227 terms: N eps
    # times the largest term, < 8 (|old - lp| is noise of std 0.25; |old - rollout| <= |old| + 1 with the engine
    # logprobs in [-1, 0] and old about -log(256) = -5.5 +- 1 for random tokens of the random model).
    atol = case.LOGPROB_ATOL + case.GRAD_TOL * 8
    for micro in (dict(micro_batch_size=3), dict(max_tokens=case.LONGEST)):
        cfg = case.make_config(setup["model_dir"], remove_padding=True, extra=("algorithm.rollout_correction.mode=token",), **micro)
        _, metrics = actor_grads(actor, cfg, batch)
        assert metrics["actor/ppo_kl"] == pytest.approx(ppo_kl, rel=0, abs=atol), micro
        assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(gap, rel=0, abs=atol), micro


def test_sweep_really_splits(setup):
    """The settings above make 8, 3, 1 (fixed) and 4+ .. 1 (budget) micro-batches: the sweep is not vacuous."""
    seq_lens = setup["batch"].seq_lens
    counts = [len(passes_module.micro_batches(seq_lens, max_tokens=m.get("max_tokens"), micro_batch_size=m.get("micro_batch_size")))
              for m in MICRO_SETTINGS]
    assert counts == [8, 3, 1, 4, 3, 2, 1], counts


OTHER_CASES = {loss: case.loss_case(loss) for loss in case.LOSS_OVERRIDES}
OTHER_CASES |= {"rollout-is-token": ("token-mean", ("algorithm.rollout_correction.mode=token",)),
                "rollout-is-seq-k3+": ("token-mean", ("algorithm.rollout_correction.mode=sequence", "actor.kl_loss_type=k3+")),
                "cispo-token-sum-is": ("token-sum", ("actor.policy_loss.loss_mode=cispo", "algorithm.rollout_correction.mode=token")),
                "geo_mean-is-seq": ("seq-mean-token-mean", ("actor.policy_loss.loss_mode=geo_mean",
                                                            "algorithm.rollout_correction.mode=sequence")),
                # sapo's own seq-mean-token-mean for its loss, token-mean for the KL and entropy terms (verl's ppo_loss)
                "sapo-kl-entropy-token-mean": ("token-mean", ("actor.policy_loss.loss_mode=sapo",))}


@pytest.mark.parametrize("name", list(OTHER_CASES))
def test_other_losses_invariant(setup, name):
    """Every policy loss (grad_case.LOSS_OVERRIDES) and rollout correction: micro-batching and packing never change the
    gradient (reference: the plain full-batch loss through `algorithms.policy_loss` with the config's parameters)."""
    actor, batch = setup["actor"], setup["batch"]
    mode, extra = OTHER_CASES[name]
    expected, _ = reference(setup, case.make_config(setup["model_dir"], loss_agg_mode=mode, extra=extra), extra)
    assert any(g.abs().max() > 0 for g in expected.values())
    for micro in (dict(micro_batch_size=3), dict(max_tokens=case.LONGEST)):
        for remove_padding in (False, True):
            cfg = case.make_config(setup["model_dir"], loss_agg_mode=mode, remove_padding=remove_padding, extra=extra, **micro)
            grads, _ = actor_grads(actor, cfg, batch)
            assert_same_grads(grads, expected, f"{extra} {micro} remove_padding={remove_padding}")


class _ForwardCounter:
    """Counts decoder forwards (each micro-batch, dummy or not, is one)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.get_decoder().register_forward_hook(self)

    def __call__(self, *args):
        self.count += 1


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_empty_micro_batches_run_a_zero_dummy(setup, monkeypatch, remove_padding):
    """When the processes agree on more micro-batches than this one has rows, the empty ones still run forward
    and backward (FSDP collectives pair up) and add exactly nothing."""
    actor, batch = setup["actor"], setup["batch"]
    expected, _ = reference(setup, case.make_config(setup["model_dir"]), "token-mean")
    monkeypatch.setattr(passes_module, "agree_num_micro_batches", lambda n: n + 3)  # as if another process had more
    cfg = case.make_config(setup["model_dir"], remove_padding=remove_padding, micro_batch_size=1)
    counter = _ForwardCounter(actor.model)
    try:
        grads, _ = actor_grads(actor, cfg, batch)
        assert counter.count == len(batch) + 3, "8 rows + 3 empty micro-batches -> 11 forwards"
        assert_same_grads(grads, expected, "with 3 dummy micro-batches")
        counter.count = 0
        logprobs = actor.compute_logprobs(batch)
        assert counter.count == len(batch) + 3
    finally:
        counter.handle.remove()
    with torch.no_grad():
        naive, _ = case.naive_logprobs(actor.model, batch)
    torch.testing.assert_close(logprobs, naive, atol=case.LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_logprob_passes_return_original_order(setup, remove_padding):
    """Old-logprob and reference passes: balanced micro-batches under their own budgets, rows back in order."""
    from grpo_lib.model.reference import Reference

    actor, batch = setup["actor"], setup["batch"]
    with torch.no_grad():
        naive, _ = case.naive_logprobs(actor.model, batch)
    budgets = (f"rollout.log_prob_max_token_len_per_gpu={case.LONGEST}", f"ref.log_prob_max_token_len_per_gpu={case.LONGEST + 10}")
    actor.cfg = case.make_config(setup["model_dir"], remove_padding=remove_padding, max_tokens=case.TOTAL_TOKENS, extra=budgets)
    torch.testing.assert_close(actor.compute_logprobs(batch), naive, atol=case.LOGPROB_ATOL, rtol=0)
    reference_model = Reference(actor.cfg, device=torch.device("cpu"))
    torch.testing.assert_close(reference_model.compute_logprobs(batch), naive, atol=case.LOGPROB_ATOL, rtol=0)


def test_packing_check_runs_at_start_up(setup, monkeypatch):
    calls = []
    monkeypatch.setattr(actor_module, "check_packing_isolated", lambda model, **kw: calls.append((model, kw)))
    Actor(case.make_config(setup["model_dir"], remove_padding=False), device=torch.device("cpu"))
    assert calls == []
    actor = Actor(case.make_config(setup["model_dir"], remove_padding=True), device=torch.device("cpu"))
    assert calls == [(actor.model, {"dtype": actor.compute_dtype})]  # the model the run trains, in its compute dtype


def test_update_steps_from_the_accumulated_gradient(setup):
    """`update` = accumulate_gradients + one AdamW step: one SGD-like sanity check that the parameters move."""
    actor = Actor(case.make_config(setup["model_dir"], max_tokens=case.LONGEST, extra=("actor.lr=1e-3",)), device=torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    metrics = actor.update(setup["batch"])
    assert metrics["actor/grad_norm"] > 0 and all(p.grad is None for p in actor.model.parameters())
    assert all(not torch.equal(before[n], p) for n, p in actor.model.named_parameters())


def test_packing_decided_per_micro_batch_and_logged(setup):
    """model.use_remove_padding packs a micro-batch only when its real tokens are < 90% of its padded block, and the
    update logs it: one row per micro-batch has no spread (never packed, nothing padded); all 8 rows in one micro-batch
    hold 227 real tokens of 8 x 60 = 480 (0.47: packed, on the varlen path every computed token is real); the 4
    groups' 2 rows each share their prompt (3 + 12 + 5 + 8 tokens computed once, not twice, where both rows score) when
    that saves a tenth of the packed tokens."""
    batch, actor = setup["batch"], setup["actor"]
    one_each = case.make_config(setup["model_dir"], remove_padding=True, micro_batch_size=1)
    _, metrics = actor_grads(actor, one_each, batch)
    assert metrics["perf/packed"] == 0.0 and metrics["perf/real_token_fraction"] == 1.0
    together = case.make_config(setup["model_dir"], remove_padding=True, max_tokens=case.TOTAL_TOKENS)
    _, metrics = actor_grads(actor, together, batch)
    # A group's two rows share the tokens before their first loss token when those are the same: the prompt, unless a
    # hole at the start of a response moves that row's first loss token (then nothing is shared), or a row scores nothing.
    first = [int(row.nonzero()[0]) if row.any() else -1 for row in batch.loss_mask]
    saved = sum(p for g, (p, _) in enumerate(case.GROUPS) if first[2 * g] == first[2 * g + 1] == p)
    assert saved > 0
    shares = case.TOTAL_TOKENS - saved < 0.9 * case.TOTAL_TOKENS  # against packing, sharing must save a tenth
    assert shares == (not setup["holes"]), "the contiguous batch shares 28 prompt tokens, the holed one 8"
    assert metrics["perf/packed"] == 1.0 and metrics["perf/shared_prefix"] == float(shares)
    assert metrics["perf/real_token_fraction"] == pytest.approx(case.TOTAL_TOKENS / (case.TOTAL_TOKENS - saved * shares))
    actor.share_prefixes = False
    try:
        _, metrics = actor_grads(actor, together, batch)
    finally:
        actor.share_prefixes = True
    assert metrics["perf/packed"] == 1.0 and metrics["perf/shared_prefix"] == 0.0
    assert metrics["perf/real_token_fraction"] == 1.0
    _, metrics = actor_grads(setup["actor"], case.make_config(setup["model_dir"], remove_padding=False, max_tokens=case.TOTAL_TOKENS), batch)
    assert metrics["perf/packed"] == 0.0
    assert metrics["perf/real_token_fraction"] == pytest.approx(sum(batch.seq_lens) / (len(batch) * batch.input_ids.shape[1]))
