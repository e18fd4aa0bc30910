"""`python train_grpo.py RECIPE [key=value ...] --print-plan`: the run's numbers before it spends GPU hours.

Loads no model and no engine. Prints the batch arithmetic (prompts and trajectories per step, optimizer updates,
trajectories per process per mini-batch, micro-batch bounds of each pass), steps per epoch from the data files'
row counts (parquet metadata, no rows read), every divisibility check with its numbers, every derived default as
config validation resolved it, the verl keys accepted without effect, and a memory plan per GPU from the model's
`config.json` (a local folder, the Hugging Face hub cache, or `--model-config FILE`).

Flags: `--num-processes N` (default: trainer.n_gpus_per_node x trainer.nnodes when given, else the current
launch's WORLD_SIZE), `--gpu-memory-gb G` (default 80), `--model-config FILE`, `--teacher-model-config FILE`, `--reward-model-config FILE` (the reward model's; default: its path's) (the
distillation teacher's config.json; default: its model_path's), `--measure` (the training phase measured on fake
tensors; train_grpo.py or `python -m grpo_lib.planning.measure` passes the measuring function in, so this module imports
neither torch nor transformers).

Exit codes, so a script can gate on the plan: 0 every part of the plan was computed and it fits; 2 a config or flag
problem, as the run itself would report it; 4 (`EXIT_DOES_NOT_FIT`) the peak per GPU is larger than --gpu-memory-gb
("DOES NOT FIT" in the plan); 5 (`EXIT_NO_MEMORY_PLAN`) the plan has no memory part, because no config.json of the
model was reachable (a hub name not downloaded yet): pass `--model-config FILE` (or download the model) to get it.

The memory plan and the token budgets that fit are computed in `grpo_lib/planning/memory.py` (its docstring has the table
of terms); this module turns them and the batch arithmetic into the printed plan.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from grpo_lib.config import Config, ConfigError, launch_world_size, load_config, read_raw
from grpo_lib.config.checks import environment_problems, greedy_baseline_needed, mini_batch_sizes, needs_old_logprobs
from grpo_lib.core import names
from grpo_lib.core.dtypes import DTYPE_BYTES
from grpo_lib.rollout.engines.settings import library_problems as engine_library_problems
from grpo_lib.planning.memory import (CPU_AUTO_BUDGET, FIT_FRACTION, GIB, PHASES, ModelSizes, activation_bytes_per_token,
                                  all_gathers_per_mini_batch, context_terms, find_model_config, fitting_budget,
                                  fitting_logprob_budget, gpu_dtype_bytes, host_memory, lora_params, memory_plan,
                                  model_sizes, push_bytes, resolve_auto_budgets)
from grpo_lib.planning.beside import reward_model_sizes, teacher_sizes


EXIT_DOES_NOT_FIT = 4  # --print-plan's exit code when the memory plan's peak per GPU exceeds --gpu-memory-gb
EXIT_NO_MEMORY_PLAN = 5  # --print-plan's exit code when no model config.json was reachable: the plan lacks its memory part


def count_rows(files: list[str]) -> int | None:
    """Rows of parquet (from the footer metadata) and jsonl files; None when a file is missing or unreadable."""
    total = 0
    for name in files:
        path = Path(name).expanduser()
        if not path.is_file():
            return None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        elif path.suffix in (".jsonl", ".json"):
            with open(path, "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            return None
    return total


def _micro_bound(dynamic: bool, tokens: int | None, count: int | None) -> str:
    return f"{tokens} tokens per process (use_dynamic_bsz)" if dynamic else f"{count} trajectories per process"


def batch_lines(cfg: Config, world_size: int) -> list[str]:
    d, a, r, t = cfg.data, cfg.actor, cfg.rollout, cfg.trainer
    n, seq = r.n, d.max_prompt_length + d.max_response_length
    sizes = mini_batch_sizes(d.train_batch_size, a.ppo_mini_batch_size)
    updates_per_epoch = len(sizes)
    per_proc_mini = a.ppo_mini_batch_size * n // world_size
    split = (f"{d.train_batch_size} / {a.ppo_mini_batch_size} = {updates_per_epoch}" if sizes[-1] == a.ppo_mini_batch_size else
             f"{d.train_batch_size} = {len(sizes) - 1} x {a.ppo_mini_batch_size} + {sizes[-1]} (the last mini-batch smaller, "
             f"as in verl) = {updates_per_epoch}")
    engine = (f"processes: {world_size} training + {r.n_gpus_per_node} for one engine (one-step-off: it generates step k+1 "
              f"with step k-1's weights while the trainer updates on step k)" if r.n_gpus_per_node > 0 else
              f"processes: {world_size}; engines: {world_size // r.tensor_model_parallel_size} (tensor parallel "
              f"{r.tensor_model_parallel_size})")
    lines = [
        engine,
        f"prompts per step: {d.train_batch_size}; trajectories per step: {d.train_batch_size} x {n} = {d.train_batch_size * n}",
        f"mini-batch: {a.ppo_mini_batch_size} prompts x {n} = {a.ppo_mini_batch_size * n} trajectories; "
        f"{split} updates per epoch x {a.ppo_epochs} epochs "
        f"= {updates_per_epoch * a.ppo_epochs} optimizer updates per step",
        f"trajectories per process per mini-batch: {a.ppo_mini_batch_size * n} / {world_size} = {per_proc_mini}",
        f"sequence length: {d.max_prompt_length} prompt + {d.max_response_length} response = {seq} tokens at most",
        f"update micro-batch bound: {_micro_bound(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, a.ppo_micro_batch_size_per_gpu)}",
    ]
    if a.use_dynamic_bsz:
        fewest = math.ceil(per_proc_mini * seq / a.ppo_max_token_len_per_gpu)
        full = math.ceil(per_proc_mini / max(1, a.ppo_max_token_len_per_gpu // seq))
        lines.append(f"  when every sequence is full length: {a.ppo_max_token_len_per_gpu} // {seq} = "
                     f"{a.ppo_max_token_len_per_gpu // seq} per micro-batch, {full} micro-batches per mini-batch "
                     f"(shorter sequences pack tighter: no fewer than {fewest})")
    else:
        lines.append(f"  {math.ceil(per_proc_mini / a.ppo_micro_batch_size_per_gpu)} micro-batches per mini-batch")
    old = _micro_bound(r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu, r.log_prob_micro_batch_size_per_gpu)
    lines.append(f"old-logprob pass: {'runs' if needs_old_logprobs(cfg) else 'skipped (one on-policy update per step)'}; "
                 f"bound {old}")
    kl = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref = _micro_bound(cfg.ref.log_prob_use_dynamic_bsz, cfg.ref.log_prob_max_token_len_per_gpu, cfg.ref.log_prob_micro_batch_size_per_gpu)
    lines.append(f"reference pass: {'runs (KL term on)' if kl else 'skipped (no KL term)'}; bound {ref}")
    if cfg.distillation.enabled:
        dl = cfg.distillation.distillation_loss
        how = "the negative divergence as the advantage of a PPO clip" if dl.use_policy_gradient else "backpropagated directly"
        loss = (f"GRPO loss + {dl.distillation_loss_coef} x distillation" if dl.use_task_rewards else
                "the distillation term alone (rewards logged, not trained on)")
        lines.append(f"teacher pass: runs (distillation, loss_mode={dl.loss_mode}"
                     + (f", top {dl.topk}" if dl.loss_mode == "forward_kl_topk" else "") + f"; {how}); bound {ref}; loss = {loss}")
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        rounds = fg.max_num_gen_batches or "unlimited"
        lines.append(f"dynamic sampling (DAPO): up to {rounds} generate rounds of {d.train_batch_size} prompts per step until "
                     f"{d.train_batch_size} groups have differing scores")
    pr = cfg.rollout.partial_rollout
    if pr.enable:
        active = pr.active_batch_size  # resolved at load (twice the batch by default)
        lines.append(f"carry-over (rollout.partial_rollout): {active} groups in flight; a step's generation stops when "
                     f"{d.train_batch_size} are complete ({d.train_batch_size / active:.0%}), the rest resume next step; no "
                     f"trained token older than {pr.max_staleness} weight version(s); decoupled loss "
                     f"{'on' if a.use_decoupled_loss else 'OFF'} (cap {a.behav_imp_weight_cap}); the first step draws "
                     f"{active // d.train_batch_size} batches of prompts, each later step one")
    lines += advantage_lines(cfg)
    rows = count_rows(d.train_files)
    if rows is None:
        lines.append(f"steps per epoch: unknown (data.train_files {d.train_files} not found); total steps: "
                     + (f"{t.total_training_steps} (trainer.total_training_steps)" if t.total_training_steps else
                        f"{t.total_epochs} epochs x steps per epoch"))
    else:
        per_epoch = rows // d.train_batch_size
        total = t.total_training_steps or t.total_epochs * per_epoch
        how = "trainer.total_training_steps" if t.total_training_steps else f"{t.total_epochs} epochs x {per_epoch}"
        lines.append(f"steps per epoch: {rows} rows // {d.train_batch_size} = {per_epoch} (before the overlong-prompt filter); "
                     f"total steps: {total} ({how})")
        if per_epoch == 0:
            lines.append(f"  PROBLEM: {rows} rows are fewer than data.train_batch_size={d.train_batch_size}: the run would stop "
                         "at the data loader (exit 2); lower data.train_batch_size or add data")
    return lines


def advantage_lines(cfg: Config) -> list[str]:
    """algorithm.adv_estimator resolved: verl's alias, the keys it reads, and remax's extra generation."""
    alg, d = cfg.algorithm, cfg.data
    name = alg.adv_estimator
    alias = names.ADV_ESTIMATOR_ALIASES.get(name)
    keys = " ".join(f"algorithm.{key}={getattr(alg, key)}" for key in names.ADV_ESTIMATOR_KEYS.get(name, ()))
    lines = [f"advantages: algorithm.adv_estimator={name}" + (f" (verl's spelling of {alias})" if alias else "")
             + (f"; {keys}" if keys else "")]
    if greedy_baseline_needed(cfg):
        lines.append(f"  greedy baseline: + {d.train_batch_size} greedy generations per step (one per prompt, 1/{cfg.rollout.n} of the "
                     f"{d.train_batch_size * cfg.rollout.n} sampled) and their rewards, after the sampled ones (timing_s/gen_max)")
    return lines


def check_lines(cfg: Config, world_size: int) -> list[str]:
    """Every divisibility check with its numbers (load_config already refused a failing one)."""
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    checks = [
        ("actor.ppo_mini_batch_size % processes", a.ppo_mini_batch_size, world_size),
        ("data.train_batch_size % processes", d.train_batch_size, world_size),
    ] + ([] if r.n_gpus_per_node > 0 else [("processes % rollout.tensor_model_parallel_size", world_size, r.tensor_model_parallel_size)])
    lines = [f"data.train_batch_size >= actor.ppo_mini_batch_size: {d.train_batch_size} >= {a.ppo_mini_batch_size} ok"]
    lines += [f"{name}: {x} % {y} = {x % y} ok" for name, x, y in checks]
    t = cfg.trainer
    if t.n_gpus_per_node is not None:
        lines.append(f"trainer.n_gpus_per_node x trainer.nnodes = {t.n_gpus_per_node} x {t.nnodes} = "
                     f"{world_size + r.n_gpus_per_node} processes ok")
    return lines


# The parameters each policy loss reads (grpo_lib/algorithms/policy_losses.py), as `--print-plan` shows them.
LOSS_PARAMS: dict[str, tuple[str, ...]] = {
    "vanilla": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"), "gspo": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
    "cispo": ("clip_ratio_low", "clip_ratio_high"), "sapo": ("tau_pos", "tau_neg"), "geo_mean": ("clip_ratio_low", "clip_ratio_high"),
    "clip_cov": ("clip_ratio_low", "clip_ratio_high", "policy_loss.clip_cov_ratio", "policy_loss.clip_cov_lb", "policy_loss.clip_cov_ub"),
    "kl_cov": ("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef"),
    "dppo_tv": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"), "dppo_kl": ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
    "gpg": (), "dro": ("policy_loss.dro_beta",),
}


def policy_loss_line(cfg: Config) -> str:
    """The loss mode, the resolved values it reads and the aggregation of its loss (forced for sapo / geo_mean)."""
    a = cfg.actor
    mode = a.policy_loss.loss_mode
    values = " ".join(f"actor.{key}={getattr(a.policy_loss if key.startswith('policy_loss.') else a, key.split('.')[-1])}"
                      for key in LOSS_PARAMS.get(mode, ()))
    forced = names.FORCED_AGG.get(mode)
    agg = (f"its loss aggregated {forced} (fixed for {mode}, as verl; actor.loss_agg_mode={a.loss_agg_mode} aggregates the "
           "KL and entropy terms)" if forced else f"aggregated actor.loss_agg_mode={a.loss_agg_mode}")
    if mode in ("clip_cov", "kl_cov"):
        agg += "; its tokens are picked within each micro-batch, as verl: the gradient depends on the micro-batching"
    return f"actor.policy_loss.loss_mode={mode}: {values + '; ' if values else ''}{agg}"


def resolved_lines(cfg: Config) -> list[str]:
    a, r, ref = cfg.actor, cfg.rollout, cfg.ref
    return [
        policy_loss_line(cfg),
        f"actor.clip_ratio_low={a.clip_ratio_low} actor.clip_ratio_high={a.clip_ratio_high} (default: actor.clip_ratio={a.clip_ratio})",
        f"actor.loss_scale_factor={a.loss_scale_factor} (default: data.max_response_length; used by seq-mean-token-sum-norm)",
        f"rollout.log_prob_use_dynamic_bsz={r.log_prob_use_dynamic_bsz} rollout.log_prob_max_token_len_per_gpu="
        f"{r.log_prob_max_token_len_per_gpu} rollout.log_prob_micro_batch_size_per_gpu={r.log_prob_micro_batch_size_per_gpu}",
        f"ref.log_prob_use_dynamic_bsz={ref.log_prob_use_dynamic_bsz} ref.log_prob_max_token_len_per_gpu="
        f"{ref.log_prob_max_token_len_per_gpu} ref.log_prob_micro_batch_size_per_gpu={ref.log_prob_micro_batch_size_per_gpu}",
        f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} trainer.nnodes={cfg.trainer.nnodes} (None: from the launch)",
    ] + ([f"distillation.distillation_loss.clip_ratio_low={cfg.distillation.distillation_loss.clip_ratio_low} clip_ratio_high="
          f"{cfg.distillation.distillation_loss.clip_ratio_high} (default: clip_ratio="
          f"{cfg.distillation.distillation_loss.clip_ratio}; used by use_policy_gradient)"] if cfg.distillation.enabled else [])


def memory_lines(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_gb: float,
                 teacher_config: str | None = None, reward_model_config: str | None = None) -> tuple[list[str], bool]:
    """The memory plan's lines and whether its peak fits in `gpu_gb` GiB; `teacher_config`: the distillation teacher's
    config.json (--teacher-model-config; default: its model_path's)."""
    teacher, teacher_where = teacher_sizes(cfg, teacher_config)
    rm, rm_where = reward_model_sizes(cfg, reward_model_config)
    parts = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB, teacher=teacher, reward_model=rm)
    lines = [f"model: {sizes.params / 1e9:.2f}B parameters ({sizes.layers} layers, hidden {sizes.hidden}, vocab {sizes.vocab}); "
             f"sharded over {world_size} processes"]
    if cfg.distillation.enabled:
        lines.append(f"teacher: {teacher.params / 1e9:.2f}B parameters ({teacher.layers} layers, hidden {teacher.hidden}, vocab "
                     f"{teacher.vocab}; {teacher_where}); sharded like the reference, "
                     + ("its shards on the host between uses (ref.fsdp_config.param_offload)" if cfg.ref.fsdp_config.param_offload
                        else "resident on the GPU") if teacher is not None else
                     f"teacher: not planned ({teacher_where}); its memory is missing from the plan below")
    if cfg.reward_model.enable:
        lines.append(f"reward model: {rm.params / 1e9:.2f}B parameters ({rm.layers} layers, hidden {rm.hidden}; {rm_where}); "
                     "sharded like the reference, " + ("its shards on the host between uses" if
                                                       cfg.reward_model.model.fsdp_config.param_offload else "resident on the GPU")
                     if rm is not None else f"reward model: not planned ({rm_where}); its memory is missing from the plan below")
    if cfg.judge.enable:
        lines.append(f"judge: its own vLLM engine ({cfg.judge.model_path}), judge.gpu_memory_utilization="
                     f"{cfg.judge.gpu_memory_utilization} of the GPU, resident in every phase (one sleep allocator per process)")
    if cfg.model.lora_rank > 0:  # what a push moves (bench/bench_lora_push.py measures both)
        push = push_bytes(cfg, sizes)
        mode = cfg.rollout.lora_mode
        lines.append(f"push per step: merged {push['merged'] / GIB:.2f} GiB, adapter (rank {cfg.model.lora_rank}) "
                     f"{push['adapter'] / 2**20:.1f} MiB; this run pushes {mode} (rollout.lora_mode)")
    lines += [f"  {name:<26} {value / GIB:7.2f} GiB" for name, value in parts.items() if name not in PHASES]
    if parts["CUDA context + NCCL"]:  # its parts, each an estimate (grpo_lib/planning/memory.py says from what)
        context = context_terms(cfg, world_size=world_size)
        lines += [f"    {name:<24} {value / GIB:7.2f} GiB" for name, value in context.items()]
    sleep = "KV cache freed, weights offloaded" if cfg.rollout.free_cache_engine else "engine stays resident"
    offloaded = [name for name, on in (("actor weights", cfg.actor.fsdp_config.param_offload),
                                       ("AdamW", cfg.actor.fsdp_config.optimizer_offload)) if on]
    held = " + ".join([n for n in ("actor weights", "AdamW") if n not in offloaded] + ["reference"]
                      + (["judge engine"] if cfg.judge.enable else []) + ["vLLM share",
                                                                                      "CUDA context + NCCL"])
    lines.append(f"  generation phase           {parts['generation phase'] / GIB:7.2f} GiB ({held}"
                 + (f"; offloaded: {', '.join(offloaded)})" if offloaded else ")"))
    if "scoring phase" in parts:
        lines.append(f"  scoring phase              {parts['scoring phase'] / GIB:7.2f} GiB (right after generation, the policy's "
                     "engine still awake: + the reward model's units gathered one at a time and its no-grad activations)")
    if "teacher pass" in parts:
        lines.append(f"  teacher pass               {parts['teacher pass'] / GIB:7.2f} GiB (the engine asleep: the actor and AdamW as "
                     "held, the teacher's units gathered one at a time, its head chunk and no-grad activations)")
    lines.append(f"  training phase             {parts['training phase'] / GIB:7.2f} GiB (at the {parts['training phase at']}; "
                 f"{sleep})")
    lines.append(f"  resume phase               {parts['resume phase'] / GIB:7.2f} GiB (checkpoint.load creates AdamW's "
                 f"state; {'the engine released' if cfg.rollout.free_cache_engine else 'the engine stays resident'})")
    fits = parts["peak"] <= gpu_gb * GIB
    margin = parts["margin"]
    lines.append(f"  peak per GPU               {parts['peak'] / GIB:7.2f} GiB of {gpu_gb:g} GiB: "
                 + (f"fits; margin {margin / GIB:.2f} GiB ({margin / (gpu_gb * GIB):.1%} of the GPU) for what no term "
                    "counts (allocator fragmentation, FSDP2's prefetch, the estimates' errors)" if fits else
                    f"DOES NOT FIT, short by {-margin / GIB:.2f} GiB"))
    host = host_memory(cfg, sizes, world_size=world_size, teacher=teacher, reward_model=rm)
    lines.append(f"  host memory per machine    {host['start'] / GIB:7.2f} GiB at start (process 0 reads the model in "
                 f"float32 once and broadcasts it into the shards), {host['resident'] / GIB:.2f} GiB resident after "
                 f"(reference shards, vLLM's pinned sleep backup: weights {host['engine weights backup'] / GIB:.2f} + "
                 f"CUDA-graph pools {host['engine graph pool backup'] / GIB:.2f} GiB, offloaded state)")
    return lines, fits


def budget_lines(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_gb: float) -> list[str]:
    """What token budgets fit (defect 7 of issue 19): the largest that fit, what `auto` chooses, the all-gathers saved."""
    gpu = gpu_gb * GIB
    best = fitting_budget(cfg, sizes, world_size=world_size, gpu_bytes=gpu)
    best_lp = fitting_logprob_budget(cfg, sizes, world_size=world_size, gpu_bytes=gpu)
    slope = activation_bytes_per_token(cfg, sizes, gpu_dtype_bytes(cfg.actor.fsdp_config.param_dtype))
    lines = [f"largest actor.ppo_max_token_len_per_gpu that fits {FIT_FRACTION:.0%} of {gpu_gb:g} GiB: {best} "
             f"(activations {slope / 2**20:.3f} MiB per token; `auto` chooses this)"]
    if cfg.actor.use_dynamic_bsz:
        now = cfg.actor.ppo_max_token_len_per_gpu
        before, after = all_gathers_per_mini_batch(cfg, now, world_size), all_gathers_per_mini_batch(cfg, best, world_size)
        lines.append(f"  all-gathers of the model per mini-batch per process (full-length sequences): {before} at {now} tokens, "
                     f"{after} at {best} ({before / after:.1f}x fewer)")
    lines.append(f"largest rollout.log_prob_max_token_len_per_gpu / ref.log_prob_max_token_len_per_gpu that fits: {best_lp} "
                 "(no-grad passes; `auto` chooses this)")
    return lines


# ------------------------------------------------------------------ FSDP2 collectives of the update (issue 21)


def collective_lines(cfg: Config, sizes: ModelSizes, *, world_size: int, gpu_gb: float) -> list[str]:
    """Bytes all-gathered and reduce-scattered per mini-batch per process by the update, today's FSDP2 schedule and this
    config's (actor.fsdp_config.keep_root_gathered / reshard_after_forward / defer_grad_reduce), and each choice's
    memory cost per GPU; M = micro-batches per mini-batch when every sequence is full length (the batch section's).

    With R / L the root's / all layers' parameters, c / r the param / reduce dtype bytes and T_R / T_L their trained
    parameters: today = 2 M c (R + L) gathered + M r (T_R + T_L) reduce-scattered; keep_root_gathered gathers the root
    once (c R), reshard_after_forward=false the layers once per micro-batch (M c L), defer_grad_reduce root / all
    reduce-scatters the root / every unit once (r T). tests/model/test_multiprocess.py checks these counts on 2 processes.
    """
    a, d, fc = cfg.actor, cfg.data, cfg.actor.fsdp_config
    if world_size < 2:
        return ["one process: the shards are the whole model, no all-gather or reduce-scatter moves data"]
    seq = d.max_prompt_length + d.max_response_length
    per_proc = a.ppo_mini_batch_size * cfg.rollout.n // world_size
    M = math.ceil(per_proc / max(1, a.ppo_max_token_len_per_gpu // seq)) if a.use_dynamic_bsz else \
        math.ceil(per_proc / a.ppo_micro_batch_size_per_gpu)
    c, r = gpu_dtype_bytes(fc.param_dtype), DTYPE_BYTES[fc.reduce_dtype]
    L = sizes.layers * sizes.layer_params
    R = sizes.params - L
    lora = cfg.model.lora_rank > 0
    TR, TL = (0, lora_params(sizes, cfg.model.lora_rank)) if lora else (R, L)

    def traffic(keep_root: bool, reshard: bool, defer: str) -> tuple[float, float]:
        gathered = (c * R if keep_root else 2 * M * c * R) + (2 if reshard else 1) * M * c * L
        reduced = (r * TR if defer in ("root", "all") else M * r * TR) + (r * TL if defer == "all" else M * r * TL)
        return gathered, reduced

    today = sum(traffic(False, True, "none"))
    ag, rs = traffic(fc.keep_root_gathered, fc.reshard_after_forward, fc.defer_grad_reduce)
    extra = {  # memory per GPU each choice adds at the training peak
        "reshard_after_forward": 0.0 if fc.reshard_after_forward else c * L,
        "defer_grad_reduce": {"none": 0.0, "root": r * TR, "all": r * (TR + TL)}[fc.defer_grad_reduce],
    }
    training = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)["training phase"]
    lines = [
        f"M = {M} micro-batches per mini-batch (every sequence full length); param_dtype {c} B, reduce_dtype {r} B; root "
        f"{R / 1e6:.0f}M parameters, layers {L / 1e6:.0f}M",
        f"  today's schedule (per micro-batch): {today / GIB:.1f} GiB per mini-batch per process",
        f"  this config (keep_root_gathered={fc.keep_root_gathered}, reshard_after_forward={fc.reshard_after_forward}, "
        f"defer_grad_reduce={fc.defer_grad_reduce}): all-gather {ag / GIB:.1f} + reduce-scatter {rs / GIB:.1f} = "
        f"{(ag + rs) / GIB:.1f} GiB ({today / (ag + rs):.2f}x fewer)",
        "  choices (actor.fsdp_config.*), bytes saved per mini-batch per process, memory added at the training peak:",
        f"    keep_root_gathered=true        -{(2 * M - 1) * c * R / GIB:.1f} GiB; +0 GiB (the root is gathered through every "
        "micro-batch anyway)",
        f"    reshard_after_forward=false    -{M * c * L / GIB:.1f} GiB; +{c * L / GIB:.2f} GiB (every layer gathered from "
        "forward to backward)",
        f"    defer_grad_reduce=root         -{(M - 1) * r * TR / GIB:.1f} GiB; +{r * TR / GIB:.2f} GiB (the root's unsharded "
        "gradient)",
        f"    defer_grad_reduce=all          -{(M - 1) * r * (TR + TL) / GIB:.1f} GiB; +{r * (TR + TL) / GIB:.2f} GiB (every "
        "unit's unsharded gradient)",
        f"  training phase with this config's choices: {(training + sum(extra.values())) / GIB:.2f} GiB of {gpu_gb:g} "
        f"({'fits' if training + sum(extra.values()) <= gpu_gb * GIB else 'DOES NOT FIT'})",
    ]
    return lines


_MISSING = "<missing>"  # the value of a flag given last, without one
_EXAMPLE = {"--num-processes": "4", "--gpu-memory-gb": "80", "--model-config": "tests/data/qwen3_4b_config.json",
            "--teacher-model-config": "tests/data/qwen3_8b_config.json",
            "--reward-model-config": "tests/data/qwen3_1_7b_config.json"}


def check_flags(flags: dict[str, str | None]) -> tuple[dict, list[str]]:
    """--num-processes, --gpu-memory-gb and --model-config as given -> (their values, problems naming the flag and the fix).

    Example: {"--num-processes": "0", "--gpu-memory-gb": "nan", "--model-config": None} -> two problems (>= 1 process;
    a finite number of GiB > 0); {"--num-processes": "4", "--gpu-memory-gb": "80", ...} -> ({... 4, 80.0 ...}, []).
    """
    values: dict = {"--num-processes": None, "--gpu-memory-gb": None, "--model-config": None}
    problems = [f"{flag} needs a value (for example {flag} {_EXAMPLE[flag]})" for flag, given in flags.items() if given == _MISSING]
    processes, gpu_gb, config_file = (None if flags.get(f) == _MISSING else flags.get(f) for f in values)
    for flag, whose in (("--teacher-model-config", "the distillation teacher's"), ("--reward-model-config", "the reward model's")):
        given = flags.get(flag)
        if given not in (None, _MISSING):
            values[flag] = given
            if not Path(given).expanduser().is_file():
                problems.append(f"{flag} {given!r}: no such file; give {whose} config.json (for example {flag} {_EXAMPLE[flag]})")
    if processes is not None:
        try:
            values["--num-processes"] = int(processes)
        except ValueError:
            problems.append(f"--num-processes {processes!r}: expected a whole number of processes, for example --num-processes 4")
        else:
            if values["--num-processes"] < 1:
                problems.append(f"--num-processes {processes}: must be >= 1 (the processes the run would launch)")
    if gpu_gb is not None:
        try:
            values["--gpu-memory-gb"] = float(gpu_gb)
        except ValueError:
            values["--gpu-memory-gb"] = math.nan
        if not (math.isfinite(values["--gpu-memory-gb"]) and values["--gpu-memory-gb"] > 0):
            problems.append(f"--gpu-memory-gb {gpu_gb}: must be a finite number of GiB > 0 (one GPU's memory, for example "
                            "--gpu-memory-gb 80)")
    if config_file is not None:
        values["--model-config"] = config_file
        if not Path(config_file).expanduser().is_file():
            problems.append(f"--model-config {config_file!r}: no such file; give a model's config.json (for example "
                            "--model-config tests/data/qwen3_4b_config.json), or leave the flag out to read model.path's")
    return values, problems


def print_plan(argv: list[str], measure=None) -> int:
    """argv: RECIPE [key=value ...] with --print-plan and the optional flags; returns the exit code.

    `measure`: with --measure, a function (cfg, config.json dict, sizes, world_size, parts, gpu_bytes) -> lines that measures the
    training phase (grpo_lib.planning.measure.measure_lines; passed in by train_grpo.py / `python -m grpo_lib.planning.measure`,
    so this module stays light). The engine's settings against its installed library (grpo_lib/rollout/engines/settings.py,
    torch-free) are noted like the installation checks."""
    args, flags = [], {"--num-processes": None, "--gpu-memory-gb": "80", "--model-config": None, "--teacher-model-config": None,
                       "--reward-model-config": None}
    wants_measure = "--measure" in argv
    if wants_measure and measure is None:
        print("error: --measure needs the measuring module: python train_grpo.py RECIPE --print-plan --measure, or "
              "python -m grpo_lib.planning.measure RECIPE", file=sys.stderr)
        return 2
    it = iter(a for a in argv if a not in ("--print-plan", "--measure"))
    for item in it:
        key = item.split("=", 1)[0]
        if key in flags:
            flags[key] = item.split("=", 1)[1] if "=" in item else next(it, _MISSING)
        else:
            args.append(item)
    if not args:
        print("error: --print-plan needs a recipe: python train_grpo.py RECIPE.yaml [key=value ...] --print-plan", file=sys.stderr)
        return 2
    values, problems = check_flags(flags)
    if problems:
        print("error: " + "\n".join(problems), file=sys.stderr)
        return 2
    gpu_gb = values["--gpu-memory-gb"]
    try:
        raw = read_raw(args[0], args[1:])
        launched = launch_world_size(raw)
        if launched is not None:
            world_size, source = launched, "trainer.n_gpus_per_node x trainer.nnodes"
        elif values["--num-processes"] is not None:
            world_size, source = values["--num-processes"], "--num-processes"
        else:
            world_size, source = int(os.environ.get("WORLD_SIZE", "1")), "the current launch (WORLD_SIZE)"
        cfg = load_config(args[0], args[1:], world_size=world_size)
        config_json, where = find_model_config(cfg.model.path, values["--model-config"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # unreadable, not JSON (json.JSONDecodeError is a ValueError)
        print(f"error: the model's config.json cannot be read ({exc}); pass --model-config FILE with a readable one",
              file=sys.stderr)
        return 2
    sizes = None
    if config_json is not None:
        try:
            sizes = model_sizes(config_json)
        except (KeyError, TypeError) as exc:
            print(f"error: {where} is not a decoder model's config.json (no usable {exc}); pass --model-config FILE with the "
                  "model's own config.json", file=sys.stderr)
            return 2
    launch, split = world_size, cfg.rollout.n_gpus_per_node
    if split > 0:  # one-step-off: the trainer's plan over its own processes, without an engine on its GPUs
        import copy

        world_size, engine_cfg = launch - split, cfg
        cfg = copy.deepcopy(cfg)
        cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_model_parallel_size = 0.0, 1
    auto = resolve_auto_budgets(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)
    out = [f"plan for {args[0]} on {launch} processes (from {source})", "", "batch:"]
    if split > 0:
        out[0] += (f": {world_size} train (processes 0-{world_size - 1}), {split} run the engine (processes "
                   f"{world_size}-{launch - 1}, one-step-off; rollout.n_gpus_per_node={split})")
    out += [f"  {line}" for line in batch_lines(cfg, world_size)]
    out += ["", "divisibility checks:"] + [f"  {line}" for line in check_lines(cfg, world_size)]
    out += ["", "derived defaults (resolved once, in config validation):"] + [f"  {line}" for line in resolved_lines(cfg)]
    why = (f"the largest that fits {gpu_gb:g} GiB, below" if sizes is not None else
           f"no model config.json to plan from: max(one sequence, {CPU_AUTO_BUDGET})")
    out += [f"  {key}=auto -> {value} ({why})" for key, value in auto.items()]
    if cfg.ignored:
        out += ["", "verl keys accepted and ignored (performance only):"] + [f"  {k}: {why}" for k, why in cfg.ignored.items()]
    for problem in environment_problems(cfg) + engine_library_problems(cfg):
        out += ["", f"note: the run itself would exit 2: {problem}"]
    out += ["", f"memory plan per GPU ({gpu_gb:g} GiB):"]
    fits = True
    if sizes is None:
        out += [f"  the memory plan needs the model's config.json: {where}; pass --model-config FILE"]
    else:
        lines, fits = memory_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb,
                                   teacher_config=values.get("--teacher-model-config"),
                                   reward_model_config=values.get("--reward-model-config"))
        if split > 0:
            share = engine_cfg.rollout.gpu_memory_utilization * gpu_gb
            out += [f"  engine GPUs ({split}, processes {world_size}-{launch - 1}): vLLM's share {share:.2f} GiB each "
                    f"(rollout.gpu_memory_utilization={engine_cfg.rollout.gpu_memory_utilization}: weights over "
                    f"{engine_cfg.rollout.tensor_model_parallel_size}-way tensor parallelism + KV cache) + its CUDA context; "
                    "never released (nothing else uses them)" + ("; raise gpu_memory_utilization to about 0.85"
                                                                 if engine_cfg.rollout.gpu_memory_utilization < 0.8 else ""),
                    f"  trainer GPUs ({world_size}, processes 0-{world_size - 1}), below: the update alone (no engine share)"]
        out += [f"  config: {where}"] + [f"  {line}" for line in lines]
        out += ["", "FSDP2 collectives of the update:"] + [f"  {line}" for line in
                                                          collective_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb)]
        out += ["", "token budgets that fit:"] + [f"  {line}" for line in budget_lines(cfg, sizes, world_size=world_size, gpu_gb=gpu_gb)]
        if wants_measure:
            print("\n".join(out), flush=True)
            out = ["", f"measured training phase (rank 0 of {world_size}, our update on fake tensors, {where}):"]
            parts = memory_plan(cfg, sizes, world_size=world_size, gpu_bytes=gpu_gb * GIB)
            try:
                out += [f"  {line}" for line in measure(cfg, config_json, sizes, world_size, parts, gpu_gb * GIB)]
            except RuntimeError as exc:  # plan_measure.MeasureError: another torch version, LoRA, a launch
                print("\n".join(out) + f"\nerror: {exc}", file=sys.stderr)
                return 2
    print("\n".join(out))
    if not fits:
        print(f"error: the plan DOES NOT FIT in {gpu_gb:g} GiB per GPU (exit code {EXIT_DOES_NOT_FIT}): see the memory plan "
              "above; offload (actor.fsdp_config.param_offload / optimizer_offload), a lower rollout.gpu_memory_utilization "
              "or token budget, or more processes lower the peak", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if sizes is None:
        print(f"error: the plan has no memory part (exit code {EXIT_NO_MEMORY_PLAN}): {where}. Pass --model-config FILE "
              "with the model's config.json (for example --model-config tests/data/qwen3_4b_config.json), or download the "
              "model first (huggingface-cli download NAME) and rerun", file=sys.stderr)
        return EXIT_NO_MEMORY_PLAN
    return 0
