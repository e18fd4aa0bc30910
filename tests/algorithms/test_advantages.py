"""grpo_lib.algorithms.advantages: every estimator against hand-computed values (derivation in the comments), the loss mask's holes,
verl's aliases, 2 processes = 1 for the batch statistics, and the config / plan / step wiring (remax's greedy baseline).
Run: `.venv/bin/python -m pytest tests/algorithms/test_advantages.py`.

Tolerances: float64 throughout; every expected value below is a few float64 operations away from the computed one, and
the whitening adds verl's 1e-8 to the variance and to the token count, a relative change of at most ~1e-8 / var
(var >= 0.14 here): rtol 1e-7 covers it.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from grpo_lib.algorithms.advantages import ADV_ESTIMATORS, compute_advantages, discounted_returns, masked_whiten, token_advantages
from grpo_lib.config import ConfigError, load_config
from grpo_lib.core import distributed, names
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.planning.plan import print_plan
from grpo_lib.trainer import rounds
from grpo_lib.trainer import step

F64 = torch.float64
EPS = 1e-6
RTOL = 1e-7  # the whitening's 1e-8 terms (module docstring)


def t(values):
    return torch.tensor(values, dtype=F64)


def last_token_rewards(scores: list[float], masks: list[list[int]]) -> torch.Tensor:
    """Each row's score on its last loss token (the single-turn layout)."""
    mask = t(masks)
    rewards = torch.zeros_like(mask)  # [B, T]
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)  # [B]
    rewards[torch.arange(len(scores)), last] = t(scores)
    return rewards


# ----------------------------------------------------------------------------- registry and aliases


def test_registry_holds_verls_estimators_and_aliases():
    assert tuple(ADV_ESTIMATORS) == names.ADV_ESTIMATORS
    assert {"grpo", "rloo", "grpo_passk", "opo", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
            "remax", "grpo_vectorized", "rloo_vectorized"} == set(ADV_ESTIMATORS)
    assert set(names.GROUP_ADV_ESTIMATORS) | {"reinforce_plus_plus", "remax"} == set(ADV_ESTIMATORS)
    with pytest.raises(ValueError, match="unknown adv_estimator 'gae'; supported: grpo, rloo, grpo_passk"):
        token_advantages(t([[1.0]]), t([[1.0]]), [0], estimator="gae")


@pytest.mark.parametrize("alias, target", sorted(names.ADV_ESTIMATOR_ALIASES.items()))
def test_vectorized_aliases_are_their_estimators(alias, target):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (40, 6), generator=gen).to(F64)  # [40, 6]
    mask = (torch.rand(40, 6, generator=gen) < 0.7).to(F64)  # [40, 6] holes anywhere
    groups = torch.arange(40) // 5
    assert ADV_ESTIMATORS[alias] is ADV_ESTIMATORS[target]
    assert torch.equal(token_advantages(rewards, mask, groups, estimator=alias),
                       token_advantages(rewards, mask, groups, estimator=target))


# ----------------------------------------------------------------------------- each estimator by hand


def test_grpo_passk_only_the_best_of_each_group():
    # group a = [1, 3, 2, 0]: best row 1 (3), second best 2 -> gap 1; std: mean 1.5, squared deviations
    # 0.25 + 2.25 + 0.25 + 2.25 = 5, / 3 -> std sqrt(5/3) = 1.29099 -> A_1 = 1 / (1.29099 + eps), others 0.
    # group b = [0, 5, 5]: best the first 5 (row 5), second best 5 -> gap 0: every row 0. group c = [2, 2]: all equal.
    scores = [1.0, 3.0, 2.0, 0.0, 0.0, 5.0, 5.0, 2.0, 2.0]
    groups = ["a"] * 4 + ["b"] * 3 + ["c"] * 2
    masks = [[1, 1, 0]] * 9
    masks[1] = [1, 0, 1]  # a hole in the best row: its advantage is 0 there
    adv = token_advantages(last_token_rewards(scores, masks), t(masks), groups, estimator="grpo_passk")
    expected = torch.zeros(9, 3, dtype=F64)
    expected[1] = t([1, 0, 1]) / (math.sqrt(5 / 3) + EPS)
    torch.testing.assert_close(adv, expected, rtol=RTOL, atol=0)
    # without the std: the gap itself, 1
    adv = compute_advantages(t(scores), groups, estimator="grpo_passk", norm_by_std=False)
    assert adv.tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0]


def test_opo_length_weighted_baseline():
    # one group: row 0 scores 2 over L = 2 loss tokens, row 1 scores 0 over L = 3 (a hole at position 1).
    # b = (2 * 2 + 3 * 0) / (2 + 3) = 0.8 -> A = [2 - 0.8, 0 - 0.8] = [1.2, -0.8] on each row's loss tokens.
    # group 2: a single response -> 0 (no baseline); group 3: [1, 1] all equal -> 0 whatever the lengths.
    masks = [[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    rewards = last_token_rewards([2.0, 0.0, 7.0, 1.0, 1.0], masks)
    adv = token_advantages(rewards, t(masks), [1, 1, 2, 3, 3], estimator="opo")
    expected = t([[1.2, 1.2, 0, 0], [-0.8, 0, -0.8, -0.8], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(adv, expected, rtol=RTOL, atol=0)


def test_gpg_scales_by_the_share_of_nonzero_scores():
    # 6 responses, 3 with a non-zero score (1, 1, 2) -> alpha = 6 / 3 = 2; A = alpha * (s - mean_g), no std:
    # a = [1, 0] mean 0.5 -> [1, -1]; b = [0, 1] -> [-1, 1]; c = [2, 0] mean 1 -> [2, -2]
    adv = compute_advantages(t([1.0, 0.0, 0.0, 1.0, 2.0, 0.0]), ["a", "a", "b", "b", "c", "c"], estimator="gpg")
    torch.testing.assert_close(adv, t([1.0, -1.0, -1.0, 1.0, 2.0, -2.0]), rtol=RTOL, atol=0)
    # every score zero: alpha's denominator is clamped to 1, and every group is all-equal -> 0
    assert compute_advantages(t([0.0, 0.0]), [0, 0], estimator="gpg").tolist() == [0.0, 0.0]


def test_discounted_returns_single_turn_and_across_holes():
    # single turn, gamma 0.5, score 1 on the last of 3 tokens: G = [0.25, 0.5, 1] (verl's REINFORCE++ returns)
    torch.testing.assert_close(discounted_returns(t([[0, 0, 1]]), t([[1, 1, 1]]), 0.5), t([[0.25, 0.5, 1.0]]))
    # a hole at position 1 (a tool's output): it is not a step, so token 0 is one step before token 2 -> 0.5 * 2 = 1.
    # (verl resets its running return at the hole and gives token 0 a return of 0.)
    torch.testing.assert_close(discounted_returns(t([[0, 0, 2]]), t([[1, 0, 1]]), 0.5), t([[1.0, 0.0, 2.0]]))
    # the score on a hole that ends the row joins the loss token before it undiscounted: G = [0.5, 1, 0]
    torch.testing.assert_close(discounted_returns(t([[0, 0, 1]]), t([[1, 1, 0]]), 0.5), t([[0.5, 1.0, 0.0]]))
    # KL on every loss token and padding after the response: r = [-0.1, -0.1, 0.9, 0], mask [1, 1, 1, 0], gamma 1 ->
    # G = [0.7, 0.8, 0.9, 0]
    torch.testing.assert_close(discounted_returns(t([[-0.1, -0.1, 0.9, 0]]), t([[1, 1, 1, 0]]), 1.0),
                               t([[0.7, 0.8, 0.9, 0.0]]))


def test_reinforce_plus_plus_whitens_the_returns_over_the_batch():
    # gamma 0.5. row 0: mask [1, 1, 1], score 1 at the end -> G = [0.25, 0.5, 1];
    # row 1: mask [1, 0, 1], score 2 at the end -> G = [1, _, 2] (the hole is not a step).
    # Whitening over the 5 loss tokens: mean = (0.25 + 0.5 + 1 + 1 + 2) / 5 = 0.95; deviations -0.7, -0.45, 0.05,
    # 0.05, 1.05, squares sum 1.8 -> var = 1.8 / 5 * 5 / 4 = 0.45 -> A = deviation / sqrt(0.45); the hole gets 0.
    rewards, mask = t([[0, 0, 1], [0, 0, 2]]), t([[1, 1, 1], [1, 0, 1]])
    adv = token_advantages(rewards, mask, ["p", "q"], estimator="reinforce_plus_plus", gamma=0.5)
    expected = t([[-0.7, -0.45, 0.05], [0.05, 0.0, 1.05]]) / math.sqrt(0.45)
    torch.testing.assert_close(adv, expected, rtol=RTOL, atol=0)


def test_masked_whiten_matches_the_docstring():
    # v [1, 3, 9] with the 9 masked: mean 2, var ((1 + 1) / 2) * 2 / 1 = 2 -> (v - 2) / sqrt(2)
    torch.testing.assert_close(masked_whiten(t([[1, 3, 9]]), t([[1, 1, 0]])), t([[-1, 1, 7]]) / math.sqrt(2),
                               rtol=RTOL, atol=0)


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    # group a: scores [1, 0] over 2 and 1 loss tokens -> s - mean = +-0.5; group b: [2, 2] all equal -> 0 (over 1 and 2
    # tokens). Tokens: 0.5, 0.5, -0.5, 0, 0, 0: N = 6, mean 1/12; deviations 5/12 (x2), -7/12, -1/12 (x3); squares
    # (50 + 49 + 3) / 144 = 102/144 -> var = 102/144 / 6 * 6/5 = 102/720. The all-equal group ends at -1/12 / std,
    # not 0: the whitening shifts every token (as in verl).
    masks = [[1, 1], [1, 0], [1, 0], [1, 1]]
    rewards = last_token_rewards([1.0, 0.0, 2.0, 2.0], masks)
    adv = token_advantages(rewards, t(masks), ["a", "a", "b", "b"], estimator="reinforce_plus_plus_baseline")
    std = math.sqrt(102 / 720)
    expected = t([[5 / 12, 5 / 12], [-7 / 12, 0], [-1 / 12, 0], [-1 / 12, -1 / 12]]) / std
    torch.testing.assert_close(adv, expected, rtol=RTOL, atol=0)


def test_remax_return_to_go_minus_the_greedy_baseline():
    # row 0: mask [1, 1, 0, 1] (a hole at 2), KL -0.1 on token 1, score 1 on token 3; its prompt's greedy score 0.5.
    # Return to go (undiscounted, across the hole): [0.9, 0.9, _, 1] -> A = [0.4, 0.4, 0, 0.5].
    # row 1: mask [1, 1, 0, 0], score 0, greedy 0.5 -> [-0.5, -0.5, 0, 0]
    rewards, mask = t([[0, -0.1, 0, 1], [0, 0, 0, 0]]), t([[1, 1, 0, 1], [1, 1, 0, 0]])
    adv = token_advantages(rewards, mask, [0, 0], estimator="remax", reward_baselines=t([0.5, 0.5]), gamma=0.3)
    torch.testing.assert_close(adv, t([[0.4, 0.4, 0, 0.5], [-0.5, -0.5, 0, 0]]), rtol=RTOL, atol=1e-15)
    with pytest.raises(ValueError, match="remax' needs reward_baselines"):
        token_advantages(rewards, mask, [0, 0], estimator="remax")


# ----------------------------------------------------------------------------- properties of every estimator


def random_batch(seed: int, *, groups: int = 6, n: int = 4, width: int = 7):
    """Rows of n per group, a score on the last response token, in-reward KL on loss tokens, holes in the loss mask."""
    gen = torch.Generator().manual_seed(seed)
    rows = groups * n
    lengths = torch.randint(2, width + 1, (rows,), generator=gen)  # [B]
    response = (torch.arange(width)[None] < lengths[:, None]).to(F64)  # [B, T]
    mask = response * (torch.rand(rows, width, generator=gen) < 0.8)  # [B, T] holes inside the response
    rewards = -0.01 * torch.rand(rows, width, generator=gen, dtype=F64) * mask  # [B, T] KL in reward
    rewards[torch.arange(rows), lengths - 1] += torch.randint(0, 3, (rows,), generator=gen).to(F64)
    baselines = torch.rand(groups, generator=gen, dtype=F64).repeat_interleave(n)  # [B]
    return rewards, mask, torch.arange(rows) // n, baselines


@pytest.mark.parametrize("estimator", names.ADV_ESTIMATORS)
def test_every_estimator_is_zero_on_the_holes(estimator):
    rewards, mask, groups, baselines = random_batch(1)
    adv = token_advantages(rewards, mask, groups, estimator=estimator, gamma=0.9, reward_baselines=baselines)
    assert adv.shape == mask.shape and torch.isfinite(adv).all()
    assert (adv[mask == 0] == 0).all(), "an advantage on a position the loss does not train"
    assert adv.abs().sum() > 0


class ThreadSum:
    """Two 'processes' as threads: each call sums its tensor with the other thread's (an all-reduce)."""

    def __init__(self):
        self.barrier, self.slots = threading.Barrier(2), [None, None]

    def for_rank(self, rank: int):
        def batch_sum(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()  # both read before the next call overwrites
            return total
        return batch_sum


@pytest.mark.parametrize("estimator", names.ADV_ESTIMATORS)
def test_two_processes_give_the_advantages_of_one(estimator):
    # whole groups on each process (as the trainer shards them); the batch statistics (whitening, GPG's alpha) are
    # summed over both. Same values up to float64 summation order: a few ulps of values <= ~10.
    rewards, mask, groups, baselines = random_batch(2)
    kwargs = dict(estimator=estimator, gamma=0.9)
    whole = token_advantages(rewards, mask, groups, reward_baselines=baselines, **kwargs)
    half = len(groups) // 2
    parts, reducer = [None, None], ThreadSum()

    def run(rank: int):
        rows = slice(0, half) if rank == 0 else slice(half, None)
        parts[rank] = token_advantages(rewards[rows], mask[rows], groups[rows], reward_baselines=baselines[rows],
                                       batch_sum=reducer.for_rank(rank), **kwargs)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- config, plan, step


def cfg_with(tmp_path, *overrides: str, n: int = 2, prompts: int = 2):
    return load_config(None, [f"model.path={tmp_path}", "data.train_files=[unused.parquet]",
                              f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}",
                              "actor.ppo_micro_batch_size_per_gpu=2", f"rollout.n={n}", "reward.num_workers=0", *overrides])


@pytest.mark.parametrize("estimator", names.ADV_ESTIMATORS)
def test_config_accepts_every_estimator_and_the_plan_shows_it(estimator, capsys):
    code = print_plan(["recipes/tiny_cpu.yaml", f"algorithm.adv_estimator={estimator}", "algorithm.gamma=0.95",
                       "--print-plan", "--model-config", "tests/data/qwen2_5_0_5b_config.json"])  # a full plan: exit 0
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(x for x in out.splitlines() if "advantages: algorithm.adv_estimator=" in x)
    assert line.strip().startswith(f"advantages: algorithm.adv_estimator={estimator}")
    if estimator in names.ADV_ESTIMATOR_ALIASES:
        assert f"verl's spelling of {names.ADV_ESTIMATOR_ALIASES[estimator]}" in line
    if estimator == "reinforce_plus_plus":
        assert "algorithm.gamma=0.95" in line
    if estimator.startswith("grpo"):
        assert "algorithm.norm_adv_by_std_in_grpo=True" in line
    # tiny_cpu: 32 prompts x 8 -> remax adds 32 greedy generations, 1/8 of the 256 sampled
    assert ("+ 32 greedy generations per step (one per prompt, 1/8 of the 256 sampled)" in out) == (estimator == "remax")


def test_config_refuses_group_estimators_with_one_response_and_a_bad_gamma(tmp_path):
    for estimator in names.GROUP_ADV_ESTIMATORS:
        with pytest.raises(ConfigError, match=f"rollout.n=1 with algorithm.adv_estimator={estimator}"):
            cfg_with(tmp_path, f"algorithm.adv_estimator={estimator}", n=1)
    for estimator in ("reinforce_plus_plus", "remax"):  # a batch or greedy baseline: one response per prompt is enough
        cfg_with(tmp_path, f"algorithm.adv_estimator={estimator}", n=1)
    with pytest.raises(ConfigError, match=r"algorithm.gamma=1.5: the discount per response token must be in \[0, 1\]"):
        cfg_with(tmp_path, "algorithm.gamma=1.5")
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=gae: GAE needs a value model") as refused:
        cfg_with(tmp_path, "algorithm.adv_estimator=gae")
    assert "GAE needs a value model (a critic)" in str(refused.value)


class GreedyAwareEngine:
    """Sampled: responses [10, 1] and [11, 12] per prompt; greedy (temperature 0, n 1): [13]. Records each call."""

    pad_id = 0
    weight_version = 0  # the engine's weights as built (engines.base.EngineGlue)

    def __init__(self):
        self.calls = []

    def pop_metrics(self, prefix=""):
        return {"rollout/preemptions": 0.0}

    def generate(self, prompt_ids, *, n, temperature, **kwargs):
        self.calls.append((len(prompt_ids), n, temperature))
        if temperature == 0.0:
            return [[Generation(token_ids=[13], logprobs=[0.0], text="greedy", finish_reason="stop")] for _ in prompt_ids]
        return [[Generation(token_ids=[10, 1], logprobs=[-1.0, -0.5], text="a", finish_reason="stop"),
                 Generation(token_ids=[11, 12], logprobs=[-1.0, -1.0], text="b", finish_reason="stop")][:n]
                for _ in prompt_ids]


class TextScorer:
    """Scores by response text: a 1, b 0, greedy 0.25."""

    def score(self, *, responses, data_sources, ground_truths, extra_infos):
        from grpo_lib.rewards import RewardOutput
        values = [{"a": 1.0, "b": 0.0, "greedy": 0.25}[r] for r in responses]
        return RewardOutput(scores=values, per_function={"accuracy": values}, extra={}, num_errors=0, num_timeouts=0)


class TwoPrompts:
    def batch(self, idx):
        k = len(idx)
        return PromptBatch(prompt_ids=[[5, 6]] * k, group_ids=[f"g{i}" for i in idx], data_sources=["fake"] * k,
                           ground_truths=["0"] * k, extra_infos=[{}] * k)


class Sampler:
    def next_batch(self):
        return [0, 1]


def test_remax_step_generates_one_greedy_response_per_prompt(tmp_path):
    # 2 prompts x n 2 sampled (scores a 1, b 0), then one greedy call of 2 prompts, n 1, temperature 0 (score 0.25 each).
    # ReMax: A = return to go - 0.25 = [0.75, 0.75] for a's two tokens, [-0.25, -0.25] for b's.
    cfg = cfg_with(tmp_path, "algorithm.adv_estimator=remax")
    engine, timings = GreedyAwareEngine(), {}
    batch, metrics = rounds.collect_rollouts(cfg, engine, TextScorer(), TwoPrompts(), Sampler(), step=1, world_size=1,
                                           rank=0, timings=timings, stream_rewards=False)
    assert engine.calls == [(2, 2, cfg.rollout.temperature), (2, 1, 0.0)], "one sampled call, then one greedy call"
    assert batch.reward_baselines.tolist() == [0.25] * 4 and metrics["reward/greedy_baseline_mean"] == 0.25
    assert metrics["reward/mean"] == 0.5, "the greedy responses are not training responses"
    assert "timing_s/gen_max" in timings
    step.compute_advantages(cfg, batch)
    a, b = [0, 0, 0.75, 0.75], [0, 0, -0.25, -0.25]
    torch.testing.assert_close(batch.advantages, torch.tensor([a, b, a, b]))


def test_grpo_step_makes_no_greedy_call(tmp_path):
    cfg = cfg_with(tmp_path)
    engine = GreedyAwareEngine()
    batch, _ = rounds.collect_rollouts(cfg, engine, TextScorer(), TwoPrompts(), Sampler(), step=1, world_size=1, rank=0,
                                     timings={}, stream_rewards=False)
    assert len(engine.calls) == 1 and batch.reward_baselines is None


def test_verls_lam_is_ignored_with_its_reason(tmp_path):
    cfg = cfg_with(tmp_path, "algorithm.lam=0.95")
    assert "no estimator here reads it" in cfg.ignored["algorithm.lam=0.95"]


# ----------------------------------------------------------------------------- 2 real processes (gloo)

BATCH_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg")
RESPONSES = [[7, 2], [8, 9, 2], [7], [8, 8, 8, 2], [9, 2], [7, 7], [8, 2], [9]]  # 8 responses, 4 groups of 2
LOSS_MASKS = [None, [1, 0, 1], None, [1, 0, 0, 1], None, None, [0, 1], None]  # tool-output holes in two rows
SCORES = [1.0, 0.0, 1.0, 1.0, 0.0, 2.0, 1.0, 0.0]


def advantages_of_rows(estimator: str, rows: list[int], model_dir) -> torch.Tensor:
    """`step.compute_advantages` over `rows` (whole groups) of the fixed batch above, KL in the reward on."""
    cfg = load_config(None, [f"model.path={model_dir}", "data.train_files=[unused.parquet]", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "rollout.n=2",
                             f"algorithm.adv_estimator={estimator}", "algorithm.gamma=0.9",
                             "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1"],
                      world_size=distributed.world_size())
    groups = sorted({i // 2 for i in rows})
    prompt_batch = PromptBatch(prompt_ids=[[5]] * len(groups), group_ids=[f"g{g}" for g in groups],
                               data_sources=["fake"] * len(groups), ground_truths=["0"] * len(groups),
                               extra_infos=[{}] * len(groups))
    generations = [[Generation(token_ids=RESPONSES[i], logprobs=[-0.5] * len(RESPONSES[i]), text="", finish_reason="stop",
                               loss_mask=LOSS_MASKS[i]) for i in (2 * g, 2 * g + 1)] for g in groups]
    batch = step.build_rollout_batch(prompt_batch, generations, pad_id=0)
    batch.scores = torch.tensor([SCORES[i] for i in rows])  # [B]
    width = batch.input_ids.shape[1]
    batch.old_logprobs = -torch.arange(1, width + 1, dtype=torch.float32).repeat(len(rows), 1) / 10  # [B, T]
    batch.ref_logprobs = torch.full_like(batch.old_logprobs, -0.3)  # [B, T]
    step.compute_advantages(cfg, batch)
    return torch.nn.functional.pad(batch.advantages, (0, 5 - width))  # [B, 5]: every process's rows as wide


@pytest.mark.multiprocess
def test_two_real_processes_give_the_batch_statistics_of_one(tmp_path):
    from tests.conftest import torchrun_records

    records = torchrun_records("advantages_worker.py", str(tmp_path), out_dir=tmp_path)
    for name in BATCH_ESTIMATORS:
        two = torch.tensor(records[0][name] + records[1][name])  # [8, 5]
        one = advantages_of_rows(name, list(range(8)), tmp_path)  # [8, 5]
        assert one.abs().sum() > 0
        # float32 advantages; the sums are all-reduced in float64 and the order of additions differs: a few float32 ulps
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
