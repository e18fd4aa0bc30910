"""grpo_lib.algorithms.distillation: the per-token divergences and the distillation term against hand-computed values (each
derivation in a comment), gradients by gradcheck in float64, and the config checks of the distillation section.
Run: `.venv/bin/python -m pytest tests/algorithms/test_distillation.py`."""

import math

import pytest
import torch

from grpo_lib.algorithms import distillation as D
from grpo_lib.config import ConfigError, load_config

TOL = 1e-12  # float64 arithmetic of a handful of terms: rounding ~1e-16 each


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_sampled_token_estimators_are_reverse_kl_estimators_of_student_vs_teacher():
    # student lp = -1.0, teacher lp = -0.5 at the sampled token:
    # k1 = lp_S - lp_T = -0.5; k3 = e^x - x - 1 with x = lp_T - lp_S = 0.5: e^0.5 - 1.5 = 0.14872127...;
    # k2 = 0.5 (lp_S - lp_T)^2 = 0.125; abs = 0.5
    student, teacher = t([-1.0]), t([-0.5])
    expected = {"k1": -0.5, "kl": -0.5, "k3": math.exp(0.5) - 1.5, "low_var_kl": math.exp(0.5) - 1.5, "k2": 0.125,
                "mse": 0.125, "abs": 0.5}
    for mode, value in expected.items():
        got = D.token_divergence(mode, logprobs=student, teacher_logprobs=teacher)
        assert got.item() == pytest.approx(value, abs=TOL), mode


def test_forward_kl_topk_by_hand():
    # teacher top-2 p = [.5, .25], student [.25, .25] at those ids:
    # .5 (log .5 - log .25) + .25 (log .25 - log .25) = .5 log 2 = 0.34657...
    teacher, student = t([[math.log(0.5), math.log(0.25)]]), t([[math.log(0.25), math.log(0.25)]])  # [1, 1, 2] below
    got = D.token_divergence("forward_kl_topk", student_topk_logprobs=student[None], teacher_topk_logprobs=teacher[None])
    assert got.item() == pytest.approx(0.5 * math.log(2), abs=TOL)
    # log_prob_min_clamp=-1: teacher [log .5, -1.0], student [-1.0, -1.0]:
    # .5 (log .5 + 1) + e^-1 (-1 + 1) = .5 (1 - log 2) = 0.15342...
    got = D.forward_kl_topk(student_topk_logprobs=student[None], teacher_topk_logprobs=teacher[None], log_prob_min_clamp=-1.0)
    assert got.item() == pytest.approx(0.5 * (1 - math.log(2)), abs=TOL)
    # a truncated sum below 0 is clamped at 0 (verl): teacher [log .25], student [log .5]: .25 (log .25 - log .5) < 0
    got = D.forward_kl_topk(student_topk_logprobs=t([[math.log(0.5)]])[None], teacher_topk_logprobs=t([[math.log(0.25)]])[None])
    assert got.item() == 0.0


def test_unknown_loss_mode_names_the_supported_ones():
    with pytest.raises(ValueError, match="supported: kl, k1, .*forward_kl_topk"):
        D.token_divergence("jsd", logprobs=t([0.0]), teacher_logprobs=t([0.0]))


def test_direct_term_metrics_and_clamp():
    # divergence [0.5, 1.5, 9.0], mask [1, 1, 0]: token-mean (0.5 + 1.5) / 2 = 1.0; with the mini-batch's global
    # num_tokens = 4: 2.0 / 4 = 0.5; loss_max_clamp 1.0: (0.5 + 1.0) / 2 = 0.75 (the metrics are before the clamp)
    div, mask = t([0.5, 1.5, 9.0]), t([1.0, 1.0, 0.0])
    lp = t([-1.0, -2.0, -3.0])
    loss, metrics = D.distillation_term(div, lp, lp, mask, use_policy_gradient=False)
    assert loss.item() == pytest.approx(1.0, abs=TOL)
    assert metrics == {"distillation/kl_mean": 1.0, "distillation/abs_loss": 1.0, "distillation/loss_min": 0.5,
                       "distillation/loss_max": 1.5}
    loss, _ = D.distillation_term(div, lp, lp, mask, use_policy_gradient=False, num_tokens=4)
    assert loss.item() == pytest.approx(0.5, abs=TOL)
    loss, metrics = D.distillation_term(div, lp, lp, mask, use_policy_gradient=False, loss_max_clamp=1.0)
    assert loss.item() == pytest.approx(0.75, abs=TOL) and metrics["distillation/loss_max"] == 1.5
    _, empty = D.distillation_term(div, lp, lp, torch.zeros(1, 3, dtype=torch.float64), use_policy_gradient=False)
    assert empty["distillation/loss_min"] == math.inf and empty["distillation/loss_max"] == -math.inf, "neutral for the reduction"


def test_policy_gradient_term_is_ppo_with_minus_divergence_as_advantage():
    # On-policy (lp == old, ratio 1, no clip binds): per-token loss -A r = divergence, token-mean over the 2 loss tokens
    # = (0.5 + 1.5) / 2 = 1.0; d loss / d lp_t = -A_t r_t / N = divergence_t / 2 = [0.25, 0.75, 0] (A is detached: the
    # divergence's own gradient does not flow)
    lp = t([-1.0, -2.0, -3.0]).requires_grad_()
    mask = t([1.0, 1.0, 0.0])
    divergence = D.token_divergence("k1", logprobs=lp, teacher_logprobs=t([-1.5, -3.5, 0.0]))  # [0.5, 1.5, -3.0]
    loss, metrics = D.distillation_term(divergence, lp, lp.detach(), mask, use_policy_gradient=True)
    assert loss.item() == pytest.approx(1.0, abs=TOL)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, t([0.25, 0.75, 0.0]), rtol=0, atol=TOL)
    assert metrics["distillation/pg_clipfrac"] == 0.0 and metrics["distillation/kl_mean"] == pytest.approx(1.0, abs=TOL)
    # off-policy: ratio e^0.5 = 1.65 on token 0 with A = -0.5 < 0: clip at 1 + 0.2 binds (max(-A r, -A clip(r)) keeps r)
    # -> unclipped -A r = 0.5 e^0.5 = 0.8244 is the larger; token 1 ratio 1: 1.5; token-mean (0.8244 + 1.5) / 2
    old = t([-1.5, -2.0, -3.0])
    loss, _ = D.distillation_term(divergence, lp, old, mask, use_policy_gradient=True)
    assert loss.item() == pytest.approx((0.5 * math.exp(0.5) + 1.5) / 2, abs=1e-9)


def test_total_loss():
    # use_task_rewards: 2.0 + 0.1 x 0.5 = 2.05; alone: the distillation term with coefficient 1 (verl)
    task, term = torch.tensor(2.0), torch.tensor(0.5)
    assert D.total_loss(task, term, use_task_rewards=True, distillation_loss_coef=0.1).item() == pytest.approx(2.05)
    assert D.total_loss(task, term, use_task_rewards=False, distillation_loss_coef=0.1).item() == 0.5


def test_topk_mass_metrics():
    # teacher top-2 probabilities [.5, .25] -> .75; student [.25, .25] -> .5; the masked position is left out
    teacher = t([[math.log(0.5), math.log(0.25)], [0.0, 0.0]])[None]  # [1, 2, 2]
    student = t([[math.log(0.25), math.log(0.25)], [0.0, 0.0]])[None]
    got = D.topk_mass_metrics(student, teacher, t([1.0, 0.0])[None])
    assert got == pytest.approx({"distillation/student_mass": 0.5, "distillation/teacher_mass": 0.75})


@pytest.mark.parametrize("mode", ["k3", "k2", "abs"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_direct_term_gradcheck(mode, agg):
    generator = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3).requires_grad_()  # [b, T]
    teacher = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    mask = (torch.rand(3, 5, generator=generator) > 0.3).double()

    def loss(x):
        div = D.token_divergence(mode, logprobs=x, teacher_logprobs=teacher)
        return D.distillation_term(div, x, x.detach(), mask, use_policy_gradient=False, loss_agg_mode=agg)[0]

    assert torch.autograd.gradcheck(loss, (lp,))


def test_policy_gradient_term_gradcheck():
    # The surrogate's gradient with the advantage held fixed (the term detaches it: -divergence is a reward, not a path
    # for the gradient), so gradcheck differentiates the PPO loss in lp alone. |lp - old| < 0.05: every ratio within
    # (0.95, 1.05), inside the clip range, so the loss is smooth there
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    lp = (old + (torch.rand(3, 5, generator=generator, dtype=torch.float64) - 0.5) * 0.1).requires_grad_()
    teacher = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    mask = (torch.rand(3, 5, generator=generator) > 0.3).double()

    div = D.token_divergence("k1", logprobs=lp.detach(), teacher_logprobs=teacher)  # the rollout's divergence, fixed

    def loss(x):
        return D.distillation_term(div, x, old, mask, use_policy_gradient=True)[0]

    assert torch.autograd.gradcheck(loss, (lp,))


def test_forward_kl_topk_gradcheck():
    # d/d log p_S(j) of sum_j p_T(j)(log p_T(j) - log p_S(j)) = -p_T(j) where the sum is > 0 (the clamp at 0 is inactive)
    generator = torch.Generator().manual_seed(2)
    teacher = torch.log_softmax(torch.randn(2, 3, 6, generator=generator, dtype=torch.float64) * 2, -1)[..., :4]  # [b, T, k]
    student = (teacher - torch.rand(2, 3, 4, generator=generator, dtype=torch.float64) - 0.1).requires_grad_()  # below: KL > 0
    f = lambda s: D.forward_kl_topk(student_topk_logprobs=s, teacher_topk_logprobs=teacher)  # noqa: E731
    assert torch.autograd.gradcheck(f, (student,))
    (grad,) = torch.autograd.grad(f(student).sum(), student)
    torch.testing.assert_close(grad, -teacher.exp(), rtol=0, atol=TOL)


# ------------------------------------------------------------------ the config section


BASE = ["model.path=m", "data.train_files=[t.parquet]", "rollout.n=2", "actor.use_dynamic_bsz=true", "distillation.enabled=true"]


def problems_of(*overrides):
    try:
        load_config(None, [*BASE, *overrides])
    except ConfigError as exc:
        return exc.problems
    return []


def test_config_defaults_are_verls_yaml():
    cfg = load_config(None, [*BASE, "distillation.teacher_models.teacher_model.model_path=t"])
    dl = cfg.distillation.distillation_loss
    assert (dl.loss_mode, dl.topk, dl.use_task_rewards, dl.distillation_loss_coef, dl.loss_max_clamp, dl.log_prob_min_clamp,
            dl.use_policy_gradient, dl.policy_loss_mode, dl.clip_ratio_low, dl.clip_ratio_high) == \
        ("k3", 32, True, 1.0, None, None, False, "vanilla", 0.2, 0.2)


def test_config_refuses_what_verl_refuses_and_names_the_key():
    assert any("teacher_model.model_path" in p for p in problems_of())
    teacher = "distillation.teacher_models.teacher_model.model_path=t"
    assert any("use_policy_gradient=false" in p and "k1" in p for p in problems_of(teacher, "distillation.distillation_loss.loss_mode=k1"))
    assert not problems_of(teacher, "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true")
    assert any("loss_mode='jsd'" in p for p in problems_of(teacher, "distillation.distillation_loss.loss_mode=jsd"))
    assert any("policy_loss_mode" in p for p in problems_of(teacher, "distillation.distillation_loss.policy_loss_mode=gspo"))
    assert any("topk=0" in p for p in problems_of(teacher, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                                 "distillation.distillation_loss.topk=0"))
    assert any("loss_max_clamp" in p for p in problems_of(teacher, "distillation.distillation_loss.loss_max_clamp=-1"))


def test_verl_pool_and_server_keys_are_ignored_with_a_reason():
    cfg = load_config(None, [*BASE, "distillation.teacher_models.teacher_model.model_path=t", "distillation.n_gpus_per_node=4",
                             "distillation.nnodes=1", "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
                             "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.4",
                             "distillation.distillation_loss.clip_ratio_low=null"])
    assert any(k.startswith("distillation.n_gpus_per_node") for k in cfg.ignored)
    assert any(k.startswith("distillation.teacher_models.teacher_model.inference.") for k in cfg.ignored)
    assert cfg.distillation.distillation_loss.clip_ratio_low == 0.2, "null falls back to clip_ratio (verl)"
