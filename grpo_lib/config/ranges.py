"""The value checks of the config: every numeric key's range (rates, clip ranges, probabilities, step counts), the policy
loss's and the distillation section's parameters; one problem per bad value, each naming its key and the fix.
`checks.validate` collects them with the rest. Torch-free, like the whole config package.
"""

from __future__ import annotations

import math

from grpo_lib.config.schema import Config
from grpo_lib.core import names

SEED_MAX = 2**32 - 1  # numpy's (legacy) seeds lie in [0, 2**32 - 1]; vLLM seeds numpy, python and torch with trainer.seed


def distillation_problems(cfg: Config) -> list[str]:
    """The distillation section (grpo_lib/algorithms/distillation.py): a teacher to score with, a known loss mode, and the
    combinations verl refuses (k1 backpropagated directly: its gradient does not depend on the teacher)."""
    ds, p = cfg.distillation, []
    dl, key = ds.distillation_loss, "distillation.distillation_loss"
    if dl.loss_mode not in names.DISTILLATION_LOSS_MODES:
        p.append(f"{key}.loss_mode={dl.loss_mode!r} is not supported: use one of {list(names.DISTILLATION_LOSS_MODES)}")
    if not ds.enabled:
        return p
    if not ds.teacher_models.teacher_model.model_path:
        p.append("distillation.enabled=true needs distillation.teacher_models.teacher_model.model_path: the teacher's "
                 "Hugging Face folder or hub name (it must share model.path's tokenizer)")
    if dl.loss_mode in names.DISTILLATION_DIRECT_REFUSED and not dl.use_policy_gradient:
        p.append(f"{key}.loss_mode={dl.loss_mode} with {key}.use_policy_gradient=false: the gradient of k1 (student - teacher "
                 "log-probability) does not depend on the teacher, so backpropagating it directly learns nothing from it; "
                 "set use_policy_gradient=true (on-policy distillation) or loss_mode=k3 / forward_kl_topk")
    if dl.loss_mode == "forward_kl_topk" and dl.topk < 1:
        p.append(f"{key}.topk={dl.topk}: forward_kl_topk needs at least 1 teacher token per position (verl's default 32)")
    if dl.policy_loss_mode != "vanilla":
        p.append(f"{key}.policy_loss_mode={dl.policy_loss_mode!r} is not supported: only vanilla (verl supports only it too)")
    if outside(dl.distillation_loss_coef, 0.0, None):
        p.append(f"{key}.distillation_loss_coef={dl.distillation_loss_coef}: must be a finite number >= 0 (default 1.0)")
    if dl.loss_max_clamp is not None and outside(dl.loss_max_clamp, 0.0, None, low_open=True):
        p.append(f"{key}.loss_max_clamp={dl.loss_max_clamp}: must be > 0 (the per-token bound), or null for no clamp")
    if dl.log_prob_min_clamp is not None and outside(dl.log_prob_min_clamp, None, 0.0):
        p.append(f"{key}.log_prob_min_clamp={dl.log_prob_min_clamp}: a log-probability bound must be <= 0 (verl's scripts "
                 "use -10.0), or null for no clamp")
    if outside(dl.clip_ratio_low, 0.0, 1.0, high_open=True) or outside(dl.clip_ratio_high, 0.0, None):
        p.append(f"{key}.clip_ratio_low={dl.clip_ratio_low} / clip_ratio_high={dl.clip_ratio_high}: use_policy_gradient's "
                 "clip epsilons need 0 <= low < 1 and high >= 0 (default 0.2 each)")
    return p


def policy_loss_problems(a) -> list[str]:
    """The parameters the chosen actor.policy_loss.loss_mode reads (grpo_lib/algorithms/policy_losses.py), each in its range."""
    p: list[str] = []
    pl, mode = a.policy_loss, a.policy_loss.loss_mode
    if mode == "dro" and (pl.dro_beta is None or outside(pl.dro_beta, 0.0, None, low_open=True)):
        p.append(f"actor.policy_loss.dro_beta={pl.dro_beta}: loss_mode dro needs its quadratic penalty weight > 0 "
                 "(no default, as verl): set e.g. actor.policy_loss.dro_beta=0.05")
    for key, value in (("actor.tau_pos", a.tau_pos), ("actor.tau_neg", a.tau_neg)):
        if outside(value, 0.0, None, low_open=True):
            p.append(f"{key}={value}: SAPO's gate temperature must be > 0 (defaults 1.0 / 1.05)")
    for key, value, needed_by in (("actor.policy_loss.clip_cov_ratio", pl.clip_cov_ratio, "clip_cov"),
                                  ("actor.policy_loss.kl_cov_ratio", pl.kl_cov_ratio, "kl_cov")):
        if outside(value, 0.0, 1.0, low_open=True):
            p.append(f"{key}={value}: {needed_by}'s fraction of tokens must lie in (0, 1] (default 0.0002)")
    if not pl.clip_cov_lb < pl.clip_cov_ub:
        p.append(f"actor.policy_loss.clip_cov_lb={pl.clip_cov_lb} >= clip_cov_ub={pl.clip_cov_ub}: the covariance band "
                 "(lb, ub) would be empty (defaults 1.0 / 5.0)")
    if outside(pl.ppo_kl_coef, 0.0, None):
        p.append(f"actor.policy_loss.ppo_kl_coef={pl.ppo_kl_coef}: kl_cov's penalty weight must be >= 0 (default 0.1)")
    return p


def outside(value: float, low: float | None, high: float | None, *, low_open: bool = False, high_open: bool = False) -> bool:
    """True if `value` is NaN/inf or outside [low, high] (an open end excludes the bound; None: unbounded)."""
    if not math.isfinite(value):
        return True
    if low is not None and (value < low or (low_open and value == low)):
        return True
    return high is not None and (value > high or (high_open and value == high))


def value_range_problems(cfg: Config) -> list[str]:
    """Values a run cannot use (negative or NaN rates, clip ranges, probabilities, step counts): one problem each."""
    p: list[str] = []
    a, r, t, rw = cfg.actor, cfg.rollout, cfg.trainer, cfg.reward
    # (key, value, low, high, low_open, high_open, why / fix)
    ranges = [
        ("actor.lr", a.lr, 0.0, None, False, False, "the learning rate must be a finite number >= 0 (default 1e-6)"),
        ("actor.weight_decay", a.weight_decay, 0.0, None, False, False, "must be a finite number >= 0 (default 0.01)"),
        ("actor.grad_clip", a.grad_clip, 0.0, None, False, False, "must be >= 0 (0 disables clipping; default 1.0)"),
        ("actor.clip_ratio", a.clip_ratio, 0.0, 1.0, True, True, "the PPO clip epsilon must lie in (0, 1) (default 0.2)"),
        ("actor.kl_loss_coef", a.kl_loss_coef, 0.0, None, False, False,
         "a KL coefficient must be >= 0 (a negative one rewards drifting from the reference; default 0.001)"),
        ("actor.entropy_coeff", a.entropy_coeff, 0.0, None, False, False, "must be a finite number >= 0 (0: entropy only logged)"),
        ("algorithm.kl_ctrl.kl_coef", cfg.algorithm.kl_ctrl.kl_coef, 0.0, None, False, False,
         "a KL coefficient must be >= 0 (a negative one rewards drifting from the reference; default 0.001)"),
        ("algorithm.rollout_correction.cap", cfg.algorithm.rollout_correction.cap, 0.0, None, True, False,
         "the importance-weight cap must be > 0 (default 2.0)"),
        ("rollout.top_p", r.top_p, 0.0, 1.0, True, False, "nucleus sampling needs 0 < top_p <= 1 (1.0: off)"),
        ("rollout.gpu_memory_utilization", r.gpu_memory_utilization, 0.0, 1.0, True, False, "a fraction in (0, 1]"),
        ("rollout.val_kwargs.temperature", r.val_kwargs.temperature, 0.0, None, False, False, "must be >= 0 (0: greedy)"),
        ("reward.timeout_s", rw.timeout_s, 0.0, None, True, False, "seconds, must be > 0 (default 10)"),
        ("reward.import_timeout_s", rw.import_timeout_s, 0.0, None, True, False, "seconds, must be > 0 (default 120)"),
        ("reward.max_error_fraction", rw.max_error_fraction, 0.0, 1.0, False, False, "a fraction in [0, 1] (default 0.5)"),
    ]
    cispo = a.policy_loss.loss_mode == "cispo"  # its bounds truncate an importance weight: 1 + high may pass 2
    for key, value in (("actor.clip_ratio_low", a.clip_ratio_low), ("actor.clip_ratio_high", a.clip_ratio_high)):
        if value is not None and value != a.clip_ratio:  # resolved from clip_ratio: reported once, as clip_ratio
            if cispo and key.endswith("_low"):
                ranges.append((key, value, 0.0, 1.0, False, False, "cispo's lower bound 1 - low must be >= 0: low in [0, 1] (1: none)"))
            elif cispo:
                ranges.append((key, value, 0.0, None, True, False, "cispo's weight is truncated at 1 + high: high must be > 0"))
            else:
                ranges.append((key, value, 0.0, 1.0, True, True, "a clip epsilon must lie in (0, 1) (DAPO's clip-higher: 0.28)"))
    if a.loss_scale_factor is not None:
        ranges.append(("actor.loss_scale_factor", a.loss_scale_factor, 0.0, None, True, False, "a divisor, must be > 0"))
    for key, value, low, high, low_open, high_open, why in ranges:
        if outside(value, low, high, low_open=low_open, high_open=high_open):
            p.append(f"{key}={value}: {why}")
    if not t.val_only:
        if outside(r.temperature, 0.0, None, low_open=True):
            group = f": the rollout.n={r.n} responses of a group would be identical (zero advantages)" if r.n > 1 else ""
            p.append(f"rollout.temperature={r.temperature}: training needs a temperature > 0; 0 is greedy decoding{group}, and the "
                     "trainer divides logits by it. Use 1.0 (rollout.val_kwargs.temperature=0 keeps validation greedy)")
    if r.val_kwargs.n < 1:
        p.append(f"rollout.val_kwargs.n={r.val_kwargs.n}: must be >= 1")
    elif r.val_kwargs.n > 1 and (r.val_kwargs.temperature == 0 or not r.val_kwargs.do_sample):
        why = "rollout.val_kwargs.temperature=0" if r.val_kwargs.temperature == 0 else "rollout.val_kwargs.do_sample=false"
        p.append(f"rollout.val_kwargs.n={r.val_kwargs.n} with {why}: greedy decoding gives {r.val_kwargs.n} identical responses "
                 "(pass@n = mean@n); set rollout.val_kwargs.do_sample=true and a temperature (e.g. 1.0), or val_kwargs.n=1")
    if r.top_k < -1 or r.top_k == 0:
        p.append(f"rollout.top_k={r.top_k}: use -1 (off) or a number of tokens >= 1")
    for key, value in (("rollout.max_num_seqs", r.max_num_seqs), ("actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu)):
        if value != "auto" and value < 1:
            p.append(f"{key}={value}: must be >= 1")
    if r.kv_cache_memory_bytes is not None and r.kv_cache_memory_bytes < 1:
        p.append(f"rollout.kv_cache_memory_bytes={r.kv_cache_memory_bytes}: bytes, must be > 0 (or null for the default)")
    for key, value in (("actor.lr_warmup_steps", a.lr_warmup_steps), ("reward.num_workers", rw.num_workers),
                       ("algorithm.filter_groups.max_num_gen_batches", cfg.algorithm.filter_groups.max_num_gen_batches),
                       ("trainer.val_generations_to_log", t.val_generations_to_log)):
        if value < 0:
            p.append(f"{key}={value}: must be >= 0")
    for key, value, what in (("trainer.seed", t.seed, "the engine's, the samples' and torch's seeds come from it"),
                             ("data.seed", cfg.data.seed, "the prompt order")):
        if not 0 <= value <= SEED_MAX:
            p.append(f"{key}={value}: a seed must lie in [0, 2**32 - 1] = [0, {SEED_MAX}] ({what}; vLLM and numpy take no "
                     "other; default 1)")
    if t.total_training_steps is not None and t.total_training_steps < 1:
        p.append(f"trainer.total_training_steps={t.total_training_steps}: must be >= 1 (null: trainer.total_epochs x steps per epoch)")
    if t.val_only and not cfg.data.val_files:
        p.append("trainer.val_only=true needs data.val_files (the validation set to evaluate)")
    if a.fsdp_config.param_dtype == "float16":  # bf16 has float32's exponent range; float16 does not
        p.append("actor.fsdp_config.param_dtype=float16: float16 gradients need loss scaling, which this trainer does not do "
                 "(small per-token gradients would underflow to 0); use bfloat16 (or auto: bfloat16 on GPU)")
    listed = [fn.get("name") for fn in rw.functions if isinstance(fn, dict)]
    for i, fn in enumerate(rw.functions):
        if not isinstance(fn, dict) or "name" not in fn:
            continue  # reported above
        if fn["name"] not in names.REWARD_FUNCTIONS or set(fn) - {"name", "weight"}:
            p.append(f"reward.functions[{i}]={fn!r}: use {{name: one of {list(names.REWARD_FUNCTIONS)}, weight: number}}")
        weight = fn.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            p.append(f"reward.functions[{i}].weight={weight!r}: must be a finite number")
        if listed.count(fn["name"]) > 1 and listed.index(fn["name"]) == i:
            p.append(f"reward.functions: {fn['name']!r} is listed more than once; give it one entry with the summed weight")
    if "custom" in listed and rw.custom.path is None:
        p.append("reward.functions lists 'custom' but reward.custom.path is not set: point it at a Python file with compute_score")
    ob = rw.overlong_buffer
    max_resp_len = cfg.data.max_response_length if ob.max_resp_len is None else ob.max_resp_len
    if ob.enable and not 0 < ob.len <= max_resp_len:
        p.append(f"reward.overlong_buffer.len={ob.len} with enable: the buffer must be 1 to max_resp_len={max_resp_len} tokens "
                 "(DAPO: 4096 of 20480); set it, or reward.overlong_buffer.enable=false")
    if outside(ob.penalty_factor, 0.0, None):
        p.append(f"reward.overlong_buffer.penalty_factor={ob.penalty_factor}: must be >= 0 (the penalty at max_resp_len; 1.0 in DAPO)")
    if ob.max_resp_len is not None and ob.max_resp_len < 1:
        p.append(f"reward.overlong_buffer.max_resp_len={ob.max_resp_len}: tokens, must be >= 1 (null: data.max_response_length)")
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        p.append("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the in-reward KL penalty "
                 "needs the old and reference logprobs, computed after dynamic sampling; use metric=seq_reward (the score "
                 "before that penalty) or use_kl_in_reward=false")
    if fg.enable and fg.metric == "acc" and not {"accuracy", "custom"} & set(listed):
        p.append("algorithm.filter_groups.metric=acc: reward.functions has neither accuracy nor custom (whose `acc` field it "
                 f"reads), only {listed}; add one, or use metric=seq_reward")
    return p
