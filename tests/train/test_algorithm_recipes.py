"""The Dr. GRPO, DAPO and GSPO recipes, and the wiring of every algorithm key from the config into the math.

Two kinds of checks:

* In-process, no vLLM (fast): each recipe's config drives `Actor.micro_batch_loss` / `step.compute_advantages`
  on a fixed batch, and the result must equal a hand formula written out below with the recipe's numbers
  typed in (not read from the config), and must differ from what any one of those numbers' defaults would
  give. DAPO's dynamic sampling (`rounds.collect_rollouts`) runs on a fake engine and scorer.
* End to end (real vLLM on CPU, tiny random model): each recipe trains 3 steps; one run with KL in the reward
  and token-level rollout correction trains 2 steps. A custom reward file gives groups that differ (prompts
  whose extra_info index % 3 != 0 score a hash parity of the response) and groups that are all 0 (the rest).

Run: .venv/bin/python -m pytest tests/train/test_algorithm_recipes.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from grpo_lib.config import load_config
from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.model.actor import Actor
from grpo_lib.model.logprobs import token_logprobs
from grpo_lib.rewards import RewardOutput
from grpo_lib.trainer import rounds
from grpo_lib.trainer import step
from tests.conftest import HF_ENGINE, REPO, read_metrics, run_train, tiny_overrides
from tests.algorithms.test_ratio import fake_rollout

RECIPES = REPO / "recipes"

# ------------------------------------------------------------------------------------------- hand formulas

SCORES = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 1.0, 0.25, 0.0, 1.0, 0.0])  # [12]: 3 groups of 4, all mixed
# log-ratio lp - old per response token, cycled: ratios 1.65 (past 1 + 0.28 and the dual clip 1.5), 0.74 (under
# 1 - 0.2), 1.246 (between 1.2 and 1.28: clipped by 0.2, not by DAPO's 0.28), 1.05, 0.64, 1.105
DELTAS = [0.5, -0.3, 0.22, 0.05, -0.45, 0.1]


def hand_advantages(estimator: str, norm_by_std: bool) -> torch.Tensor:
    """Per response: grpo (s - mean) / (std + 1e-6) (Bessel std), Dr. GRPO s - mean, rloo s - mean of the others."""
    s = SCORES.view(3, 4)  # [groups, n]
    mean = s.mean(-1, keepdim=True)
    if estimator == "rloo":
        adv = s - (s.sum(-1, keepdim=True) - s) / 3
    else:
        adv = (s - mean) / (s.std(-1, keepdim=True) + 1e-6) if norm_by_std else s - mean
    return adv.flatten()  # [12]


def aggregate(v: torch.Tensor, m: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    """docs/ALGORITHMS.md's table; every row has >= 1 response token."""
    row_sums = (v * m).sum(-1)  # [B]
    return {"token-mean": (v * m).sum() / m.sum(),
            "seq-mean-token-sum": row_sums.mean(),
            "seq-mean-token-mean": (row_sums / m.sum(-1)).mean(),
            "seq-mean-token-sum-norm": row_sums.sum() / (len(v) * scale)}[mode]


DEFAULTS = dict(estimator="grpo", norm_by_std=True, ratio="token", low=0.2, high=0.2, c=3.0, agg="token-mean", scale=16.0,
                kl_coef=0.0, ent_coef=0.0, is_mode="none", cap=2.0)


def hand_loss(t: dict, **params) -> torch.Tensor:
    """Total loss of one mini-batch from the tensors `t` (lp, old, rollout, ref, entropy, mask) and explicit settings."""
    p = {**DEFAULTS, **params}
    lp, old, m = t["lp"], t["old"], t["mask"]  # [B, T]
    adv = hand_advantages(p["estimator"], p["norm_by_std"])[:, None] * m  # [B, T]
    if p["ratio"] == "seq":  # GSPO: exp(mean over the row's tokens of lp - old), the same for every token of the row
        r = (((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)).exp().expand_as(lp)
    else:
        r = (lp - old).exp()
    loss = torch.maximum(-adv * r, -adv * r.clamp(1 - p["low"], 1 + p["high"]))  # [B, T]
    loss = torch.where(adv < 0, torch.minimum(loss, -adv * p["c"]), loss)  # dual clip
    log_w = {"none": torch.zeros_like(lp), "token": old - t["rollout"],
             "sequence": ((old - t["rollout"]) * m).sum(-1, keepdim=True).expand_as(lp)}[p["is_mode"]]
    loss = loss * log_w.exp().clamp(max=p["cap"])
    total = aggregate(loss, m, p["agg"], p["scale"])
    total = total + p["kl_coef"] * aggregate(0.5 * (lp - t["ref"]) ** 2, m, p["agg"], p["scale"])  # mse / k2
    return total - p["ent_coef"] * aggregate(t["entropy"], m, p["agg"], p["scale"])


# Each case: recipe, overrides, and the same settings typed in for the hand formula.
WIRING_CASES = {
    "dr_grpo": ("tiny_cpu_dr_grpo.yaml", [], dict(norm_by_std=False, agg="seq-mean-token-sum-norm", scale=16.0)),
    "dr_grpo_scale": ("tiny_cpu_dr_grpo.yaml", ["actor.loss_scale_factor=7"],
                      dict(norm_by_std=False, agg="seq-mean-token-sum-norm", scale=7.0)),
    "dapo": ("tiny_cpu_dapo.yaml", [], dict(low=0.2, high=0.28)),
    "gspo": ("tiny_cpu_gspo.yaml", [], dict(ratio="seq", low=3e-4, high=4e-4, agg="seq-mean-token-mean")),
    "knobs": ("tiny_cpu.yaml", ["actor.clip_ratio=0.1", "actor.clip_ratio_c=1.5", "actor.loss_agg_mode=seq-mean-token-sum",
                                "actor.kl_loss_type=mse", "actor.kl_loss_coef=0.3", "actor.entropy_coeff=0.05",
                                "algorithm.rollout_correction.mode=token", "algorithm.rollout_correction.cap=1.2"],
              dict(low=0.1, high=0.1, c=1.5, agg="seq-mean-token-sum", kl_coef=0.3, ent_coef=0.05, is_mode="token", cap=1.2)),
    "sequence_is_rloo": ("tiny_cpu.yaml", ["actor.use_kl_loss=false", "algorithm.adv_estimator=rloo",
                                           "algorithm.rollout_correction.mode=sequence", "algorithm.rollout_correction.cap=3.0"],
                         dict(estimator="rloo", is_mode="sequence", cap=3.0)),
}


@pytest.mark.parametrize("name", WIRING_CASES)
def test_config_keys_reach_the_loss(tiny_model_dir, name):
    recipe, overrides, settings = WIRING_CASES[name]
    cfg = load_config(RECIPES / recipe, [f"model.path={tiny_model_dir}", *overrides])
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    batch = fake_rollout()
    batch.scores = SCORES.clone()
    step.compute_advantages(cfg, batch)  # the step's own call: adv_estimator, norm_adv_by_std_in_grpo
    m = batch.loss_mask  # [12, T]
    torch.testing.assert_close(batch.advantages, hand_advantages(settings.get("estimator", "grpo"), settings.get("norm_by_std", True))[:, None] * m)
    with torch.no_grad():
        lp, entropy = token_logprobs(actor.model, batch.input_ids, batch.attention_mask, temperature=cfg.rollout.temperature,
                                     compute_entropy=True)  # [12, T]
    position = m.cumsum(-1).long() % len(DELTAS)  # [12, T]
    delta = torch.tensor(DELTAS)[position] * m  # [12, T]
    batch.old_logprobs = lp - delta
    batch.rollout_logprobs = batch.old_logprobs - torch.where(position % 2 == 0, 0.4, -0.1) * m  # IS weights 1.49 and 0.90
    batch.ref_logprobs = lp + 0.3 * torch.where(position % 3 == 0, 1.0, -1.0) * m
    tensors = dict(lp=lp, old=batch.old_logprobs, rollout=batch.rollout_logprobs, ref=batch.ref_logprobs, entropy=entropy, mask=m)

    loss, metrics, _ = actor.micro_batch_loss(batch, num_tokens=float(m.sum()), num_seqs=float(len(batch)), compute_entropy=True)
    expected = hand_loss(tensors, **settings)
    assert loss.item() == pytest.approx(float(expected), rel=1e-5), f"{name}: loss {loss.item()} vs hand formula {float(expected)}"
    assert math.isfinite(metrics["actor/pg_clipfrac"]) and metrics["actor/pg_clipfrac"] > 0, metrics
    # every setting of the case matters on this batch: back at its default, the hand formula moves
    for key in settings:
        if settings[key] == DEFAULTS[key]:
            continue
        ablated = hand_loss(tensors, **{**settings, key: DEFAULTS[key]})
        assert abs(float(ablated) - float(expected)) > 1e-4 * max(1.0, abs(float(expected))), (
            f"{name}: {key} does not change the loss on this batch, the test would not notice it being ignored")


def test_kl_in_reward_reaches_the_advantages(tiny_model_dir):
    cfg = load_config(RECIPES / "tiny_cpu.yaml", [f"model.path={tiny_model_dir}", "algorithm.use_kl_in_reward=true",
                                                  "algorithm.kl_penalty=mse", "algorithm.kl_ctrl.kl_coef=0.5"])
    batch = fake_rollout()
    batch.scores = SCORES.clone()
    m = batch.loss_mask  # [12, T]
    batch.old_logprobs = -1.0 - 0.1 * m.cumsum(-1) * m  # [12, T]
    batch.ref_logprobs = -1.2 * m  # [12, T]
    metrics = step.compute_advantages(cfg, batch)
    kl = 0.5 * (batch.old_logprobs - batch.ref_logprobs) ** 2 * m  # mse, [12, T]
    r = batch.response_mask  # [12, T] the score sits on the response's last token, in the loss or not
    last = r * (r.cumsum(-1) == r.sum(-1, keepdim=True))  # 1 on each row's last response token
    torch.testing.assert_close(batch.token_rewards, SCORES[:, None] * last - 0.5 * kl)
    s = batch.token_rewards.sum(-1).view(3, 4)  # sequence scores after the penalty
    adv = ((s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-6)).flatten()  # [12]
    torch.testing.assert_close(batch.advantages, adv[:, None] * m)
    assert metrics["critic/kl_in_reward"] == pytest.approx(float(kl.sum() / m.sum()), rel=1e-6)


# ------------------------------------------------------------------------------- dynamic sampling, faked


class FakeEngine:
    """n responses per prompt: texts r0, r1, ...; records the prompts of each generate call."""

    pad_id = 0  # as VLLMEngine.pad_id
    weight_version = 0  # the engine's weights as built (engines.base.EngineGlue)
    preemptions_per_generate = 0

    def __init__(self):
        self.calls = []
        self.preemptions = 0.0

    def release(self):
        pass

    def pop_metrics(self, prefix=""):  # as engines.base.EngineGlue.pop_metrics: the count since the last pop
        counters, self.preemptions = {"rollout/preemptions": self.preemptions}, 0.0
        return {k: v for k, v in counters.items() if k.startswith(prefix)}

    def generate(self, prompt_ids, *, n, **kwargs):
        self.calls.append([p[0] for p in prompt_ids])
        self.preemptions += self.preemptions_per_generate
        return [[Generation(token_ids=[10 + j, 1], logprobs=[-1.0, -0.5], text=f"r{j}", finish_reason="stop") for j in range(n)]
                for _ in prompt_ids]


class FakeScorer:
    """Prompts with extra_info index < 3 score 0 (all-equal groups); the others score 1 for r0 only."""

    def score(self, *, responses, data_sources, ground_truths, extra_infos):
        scores = [0.0 if e["index"] < 3 else float(r == "r0") for r, e in zip(responses, extra_infos)]
        return RewardOutput(scores=scores, per_function={"accuracy": scores}, extra={}, num_errors=0, num_timeouts=0)


class FakeData:
    """6 prompts; prompt i is [100 + i, 7], group id f"p{i}"."""

    def batch(self, idx):
        return PromptBatch(prompt_ids=[[100 + i, 7] for i in idx], group_ids=[f"p{i}" for i in idx], data_sources=["fake"] * len(idx),
                           ground_truths=["0"] * len(idx), extra_infos=[{"index": i} for i in idx])


class CyclingSampler:
    """0, 1, 2, 3 | 4, 5, 0, 1 | 2, 3, 4, 5 | ... (a new epoch starts inside the second batch)."""

    def __init__(self):
        self.position = 0

    def next_batch(self):
        idx = [(self.position + k) % 6 for k in range(4)]
        self.position += 4
        return idx


def test_dynamic_sampling_drops_and_refills(tmp_path):
    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused.parquet]", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=3",
                             "algorithm.filter_groups.enable=true",
                             "algorithm.filter_groups.max_num_gen_batches=4", "reward.num_workers=0"])
    engine = FakeEngine()
    batch, metrics = rounds.collect_rollouts(cfg, engine, FakeScorer(), FakeData(), CyclingSampler(), step=1, world_size=1, rank=0,
                                           timings={})
    # round 1 keeps p3 (drops p0-p2), round 2 keeps p4, p5 (drops p0, p1), round 3 keeps p3 again (drops p2): 4 groups.
    # Only 3 prompts are informative, so the 4th group is p3 drawn a second time: it must be a group of its own.
    assert engine.calls == [[100, 101, 102, 103], [104, 105, 100, 101], [102, 103, 104, 105]]
    assert (metrics["batch/gen_rounds"], metrics["batch/dropped_groups"], metrics["batch/kept_groups"]) == (3.0, 6.0, 4.0), metrics
    groups = list(dict.fromkeys(batch.group_ids))
    assert len(groups) == 4 and all(batch.group_ids.count(g) == 3 for g in groups), batch.group_ids
    assert [batch.input_ids[batch.group_ids.index(g), 0].item() for g in groups] == [103, 104, 105, 103]
    assert metrics["reward/mean"] == pytest.approx(6 / 36), "reward metrics cover all 36 generated responses"

    cfg.algorithm.filter_groups.max_num_gen_batches = 2  # not enough rounds: the step trains on the 3 groups it has
    batch, metrics = rounds.collect_rollouts(cfg, FakeEngine(), FakeScorer(), FakeData(), CyclingSampler(), step=1, world_size=1,
                                           rank=0, timings={})
    assert (metrics["batch/gen_rounds"], metrics["batch/kept_groups"], len(batch)) == (2.0, 3.0, 9), metrics


# ------------------------------------------------------------------------------------------ end to end

REWARD = '''
import hashlib

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # all-equal groups (prompt index % 3 == 0 scores 0) next to varied ones (a hash parity of the response)
    if extra_info["index"] % 3 == 0:
        return 0.0
    return float(hashlib.md5(solution_str.encode()).digest()[0] % 2)
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD)
    return path


def train(recipe: str, out: Path, model_dir, data, reward: Path, *extra: str) -> list[dict]:
    """A 3-step run of `recipe` on the in-process hf engine (the subject is the algorithm, not the engine)."""
    run_train([f"recipes/{recipe}", *tiny_overrides(model_dir, data, out, f"reward.custom.path={reward}",
               "trainer.logger=[console,jsonl]", HF_ENGINE, *extra)])
    return read_metrics(out)


def assert_finite(rows: list[dict], keys: tuple[str, ...]) -> None:
    for r in rows:
        for key in keys:
            assert key in r and math.isfinite(r[key]), f"step {r['step']}: {key}={r.get(key)} ({sorted(r)})"


COMMON = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "reward/mean",
          "critic/advantages_abs_mean")


def assert_no_reference(rows: list[dict]) -> None:
    for r in rows:
        assert "actor/kl_loss" not in r and "timing_s/ref" not in r, f"use_kl_loss: false, yet a KL term ran: {sorted(r)}"


@pytest.mark.slow
def test_dr_grpo_recipe_trains(tiny_model_dir, arith_data, reward_file, tmp_path):
    rows = train("tiny_cpu_dr_grpo.yaml", tmp_path, tiny_model_dir, arith_data, reward_file)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_finite(rows, COMMON)
    assert_no_reference(rows)
    assert any(r["actor/grad_norm"] > 0 for r in rows), "no gradient: the reward gave no signal"
    # Dr. GRPO advantages are s - mean of 0/1 scores: mean |A| <= 1/2 over any group of 4. Divided by the std (GRPO)
    # a mixed group averages >= 0.75.
    assert all(r["critic/advantages_abs_mean"] <= 0.5 + 1e-6 for r in rows), [r["critic/advantages_abs_mean"] for r in rows]


@pytest.mark.slow
def test_dapo_recipe_drops_and_refills_groups(tiny_model_dir, arith_data, reward_file, tmp_path):
    rows = train("tiny_cpu_dapo.yaml", tmp_path, tiny_model_dir, arith_data, reward_file)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_finite(rows, COMMON + ("batch/kept_groups", "batch/dropped_groups", "batch/gen_rounds"))
    assert_no_reference(rows)
    assert all(r["batch/kept_groups"] == 4 for r in rows), "every step trains on train_batch_size informative groups"
    assert sum(r["batch/dropped_groups"] for r in rows) > 0 and max(r["batch/gen_rounds"] for r in rows) > 1, (
        "the reward gives all-equal groups: some must be dropped and refilled", rows)


@pytest.mark.slow
def test_dapo_recipe_with_overlong_penalty_and_truncation_masking_trains(tiny_model_dir, arith_data, reward_file, tmp_path):
    # responses of up to 16 tokens, buffer 8: a response past 8 tokens is penalised; truncated ones leave the loss;
    # dynamic sampling on verl's acc (the custom reward's float score here, as in verl's DAPO manager)
    rows = train("tiny_cpu_dapo.yaml", tmp_path, tiny_model_dir, arith_data, reward_file, "trainer.total_training_steps=2",
                 "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8", "actor.mask_truncated_responses=true",
                 "algorithm.filter_groups.metric=acc")
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows, COMMON + ("reward/overlong_penalty_mean", "batch/kept_groups"))
    assert all(-1.0 <= r["reward/overlong_penalty_mean"] <= 0.0 for r in rows), rows


@pytest.mark.slow
def test_gspo_recipe_clips_later_updates(tiny_model_dir, arith_data, reward_file, tmp_path):
    # 4 prompts, 1 per mini-batch: 4 updates per step as in the recipe (32 / 8)
    rows = train("tiny_cpu_gspo.yaml", tmp_path, tiny_model_dir, arith_data, reward_file, "actor.ppo_mini_batch_size=1")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_finite(rows, COMMON + ("timing_s/old_logprob",))
    assert_no_reference(rows)
    # updates 2-4 of a step are off-policy: sequence ratios leave [1 - 3e-4, 1 + 4e-4] and are clipped
    assert any(r["actor/pg_clipfrac"] > 0 for r in rows), [r["actor/pg_clipfrac"] for r in rows]


@pytest.mark.slow
def test_kl_in_reward_with_rollout_correction_trains(tiny_model_dir, arith_data, reward_file, tmp_path):
    rows = train("tiny_cpu.yaml", tmp_path, tiny_model_dir, arith_data, reward_file, "trainer.total_training_steps=2",
                 "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true", "algorithm.rollout_correction.mode=token",
                 "actor.lr=1e-3")
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows, COMMON + ("critic/kl_in_reward", "timing_s/ref", "timing_s/old_logprob"))
    # step 1: actor == reference, same logprob function -> exactly 0; step 2: the actor has moved
    assert rows[0]["critic/kl_in_reward"] == 0.0 and rows[1]["critic/kl_in_reward"] != 0.0, [r["critic/kl_in_reward"] for r in rows]


@pytest.mark.slow
def test_remax_trains_with_a_greedy_baseline_per_prompt(tiny_model_dir, arith_data, reward_file, tmp_path):
    # algorithm.adv_estimator=remax: after the sampled responses the engine generates one greedy response per prompt;
    # its score is the prompt's baseline (tests/algorithms/test_advantages.py checks the values on a fake engine)
    rows = train("tiny_cpu.yaml", tmp_path, tiny_model_dir, arith_data, reward_file, "trainer.total_training_steps=2",
                 "algorithm.adv_estimator=remax")
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows, COMMON + ("timing_s/gen_max", "reward/greedy_baseline_mean"))
    assert all(0.0 <= r["reward/greedy_baseline_mean"] <= 1.0 for r in rows), rows
    assert any(r["actor/grad_norm"] > 0 for r in rows), "no gradient: every response scored its greedy baseline"
