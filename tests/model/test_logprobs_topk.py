"""The logprob function's distillation outputs (grpo_lib.model.logprobs.token_scores): the teacher's top-k ids and their
log-probabilities (`topk`), the student's log-probabilities at given ids with grad (`extra_ids`), against the naive
full-vocabulary log_softmax; the sampled-token logprobs stay bit-identical to a plain call (the first ratio stays 1).
Run: `.venv/bin/python -m pytest tests/model/test_logprobs_topk.py`."""

import pytest
import torch

from grpo_lib.model.fsdp import LogprobModel
from grpo_lib.model.logprobs import TokenScores, _TargetLogprobs, token_logprobs, token_scores
from tests.model.test_logprobs import make_batch, tiny_qwen3

K = 5
# float32 log_softmax over 128 logits, computed two ways (fused function vs log_softmax): a few ulps of the logsumexp
# (|logsumexp| < 10 here, eps 1.2e-7 -> ~1e-6), far below any wrong id's difference (>= 1e-3 between random logits)
ATOL = 1e-5


def naive_all(model, ids, mask):
    """[b, T, V] float32 log_softmax of the distribution that predicted each token (position 0 zero), and the scored
    positions [b, T]."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()  # [b, T, V]
    logp = torch.nn.functional.pad(logits[:, :-1].log_softmax(-1), (0, 0, 1, 0))  # [b, T, V]
    scored = torch.nn.functional.pad(mask[:, 1:] * mask[:, :-1], (1, 0)).bool()  # [b, T]
    return logp, scored


def test_fused_function_with_several_ids_is_log_softmax_and_passes_gradcheck():
    """Targets [c, m]: each column log_softmax at its id, bit-identical to the one-id call for column 0; the closed-form
    backward (-softmax * sum_j g_j, g_j added at id j) passes gradcheck in float64."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 11, generator=generator, dtype=torch.float64) * 5).requires_grad_()  # [c, V]
    ids = torch.randint(0, 11, (6, 4), generator=generator)  # [c, m], repeats allowed
    values, _ = _TargetLogprobs.apply(logits, ids, False)  # [c, m]
    torch.testing.assert_close(values, torch.log_softmax(logits, -1).gather(-1, ids), rtol=0, atol=1e-12)
    single, _ = _TargetLogprobs.apply(logits, ids[:, 0], False)  # [c]
    assert torch.equal(values[:, 0], single), "column 0 is the one-id call's value, bit for bit"
    assert torch.autograd.gradcheck(lambda z: _TargetLogprobs.apply(z, ids, False)[0], (logits,))


@pytest.mark.parametrize("remove_padding", [False, True])
def test_topk_ids_and_logprobs_are_the_full_distributions(remove_padding):
    model = tiny_qwen3()
    ids, mask = make_batch()
    with torch.no_grad():
        logp, scored = naive_all(model, ids, mask)
        scores = token_scores(model, ids, mask, remove_padding=remove_padding, topk=K, chunk_size=16)
        plain, _ = token_logprobs(model, ids, mask, remove_padding=remove_padding, chunk_size=16)
    assert isinstance(scores, TokenScores) and scores.topk_ids.shape == (*ids.shape, K)
    assert torch.equal(scores.logprobs, plain), "asking for the top-k leaves the sampled-token logprobs bit-identical"
    expected_values, expected_ids = logp.topk(K, dim=-1)  # [b, T, K]
    assert torch.equal(scores.topk_ids[scored], expected_ids[scored]), "the k most likely ids, in order"
    torch.testing.assert_close(scores.extra_logprobs[scored], expected_values[scored], rtol=0, atol=ATOL)
    assert not scores.topk_ids[~scored].any() and not scores.extra_logprobs[~scored].any(), "unscored positions are 0"


@pytest.mark.parametrize("remove_padding", [False, True])
def test_extra_ids_logprobs_and_gradients_match_naive(remove_padding):
    """extra_ids [b, T, k] on the loss tokens (score_mask): values = log_softmax at those ids, and the gradient of a
    weighted sum of them (and of the sampled-token logprobs) equals the naive full-logits one."""
    model = tiny_qwen3()
    ids, mask = make_batch()
    generator = torch.Generator().manual_seed(3)
    extra = torch.randint(0, 128, (*ids.shape, K), generator=generator)  # [b, T, K]
    score_mask = mask.clone()
    score_mask[:, :5] = 0  # a "prompt" that the loss does not read
    weights = torch.randn(*ids.shape, K, generator=generator)  # [b, T, K]

    model.zero_grad()
    scores = token_scores(model, ids, mask, remove_padding=remove_padding, score_mask=score_mask, extra_ids=extra,
                          chunk_size=16)
    (scores.logprobs.sum() + (scores.extra_logprobs * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    logp, scored = naive_all(model, ids, mask)
    wanted = scored & score_mask.bool()  # [b, T]
    sampled = logp.gather(-1, ids[..., None]).squeeze(-1) * wanted  # [b, T]
    at_extra = logp.gather(-1, extra) * wanted[..., None]  # [b, T, K]
    (sampled.sum() + (at_extra * weights).sum()).backward()
    torch.testing.assert_close(scores.extra_logprobs.detach(), at_extra.detach(), rtol=0, atol=ATOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")


def test_logprob_model_returns_token_scores_only_when_asked():
    """The FSDP2 root keeps its (logprobs, entropy) pair for every existing caller; with topk its TokenScores."""
    policy = LogprobModel(tiny_qwen3())
    ids, mask = make_batch()
    with torch.no_grad():
        pair = policy(ids, mask)
        scores = policy(ids, mask, topk=K)
    assert isinstance(pair, tuple) and len(pair) == 2
    assert isinstance(scores, TokenScores) and torch.equal(scores.logprobs, pair[0])
