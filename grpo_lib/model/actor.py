"""The trained policy: model load, FSDP2 sharding, optimizer, the shared logprob pass over micro-batches, the update.

Every forward of the actor, the reference and the old-logprob pass goes through `logprobs_over_batch`, which
calls the FSDP2 root `policy` (`grpo_lib.model.fsdp.LogprobModel`), whose forward is the one logprob function
(`grpo_lib.model.logprobs.token_logprobs`), on token-budgeted micro-batches built by `grpo_lib.model.batching`, and returns
results in the original row order (DESIGN invariant 2).

Sharding, mixed precision and offload live in `grpo_lib.model.fsdp` (read its docstring): the actor is loaded in
float32 (master weights; AdamW state float32 too) and computes in `actor.fsdp_config.param_dtype`.

The update divides every micro-batch loss by the mini-batch's *global* token / sequence counts (loss_mask tokens,
rows with at least one; all-reduced over processes) and multiplies it by the world size; FSDP2's reduce-scatter then AVERAGES the gradients over
processes (it divides by the world size), so `.grad` is the gradient of the whole mini-batch's loss for any
micro-batching and process count (DESIGN invariant 1). There is no manual all-reduce: frozen parameters get
no gradient at all (never a zero gradient that AdamW would decay).
Every process runs the same number of forward (and backward) passes: the micro-batch count is agreed
across processes (`batching.agree_num_micro_batches`), and a process with fewer rows than micro-batches
runs a dummy two-token row whose loss is multiplied by 0 for each empty one, so the per-unit collectives
(FSDP all-gathers / reduce-scatters) always pair up.
No micro-batch loop reads a value back from the device, so the host queues micro-batch i + 1 while the device runs
micro-batch i: each micro-batch's layout and indices are planned on the host from row facts read once per batch
(`grpo_lib.model.score_plan`), host tensors reach the device without a wait (`devices.to_device`), and the metrics are
summed on the device and read in one copy per mini-batch, with the gradient norm (`grpo_lib.model.update_metrics`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

from grpo_lib import algorithms
from grpo_lib.algorithms import distillation
from grpo_lib.core import dtypes, perf
from grpo_lib.model import attention, fsdp
from grpo_lib.model.batching import (
    StepPlan,
    make_step_plan,
    restore_order,
    split_mini_batches,
)
from grpo_lib.config.checks import engine_logprobs_needed, mini_batch_sizes
from grpo_lib.core.devices import to_device
from grpo_lib.core.distributed import Reduction, all_reduce_max, all_reduce_sum, rank as _rank, world_size as _world_size
from grpo_lib.core.types import RolloutBatch
from grpo_lib.model.logprobs import PACK_BELOW_REAL_FRACTION, layout_kwargs
from grpo_lib.model.packing import check_packing_isolated
from grpo_lib.model.passes import HEAD_CHECKPOINT_MIN_BYTES, logprobs_over_batch, micro_batches
from grpo_lib.model.score_plan import RowFacts, batch_facts, micro_batch_rows, plan_forward
from grpo_lib.model.update_metrics import SUMMED_LOSSES, MicroBatchSums
from grpo_lib.model.weights import weights_for


def saved_dtype(path: str, trust_remote_code: bool = False) -> torch.dtype:
    """The dtype `path`'s weights were saved in (its config's dtype: bfloat16 for most hub models), for the Hugging Face
    export; float32 when the config names none or a non-float type. Read before loading: loading in float32 rewrites
    the in-memory config's dtype."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def load_model(path: str, *, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
               attn_implementation: str = "sdpa", empty: bool = False, auto_class=AutoModelForCausalLM):
    """The Hugging Face model at `path` in `dtype` on `device`; with `empty`, its architecture only, every parameter and
    buffer on the meta device (no memory, nothing read): `fsdp.shard` fills it from process 0.
    `attn_implementation`: `grpo_lib.model.attention.select_attn_implementation` for the device the model will compute on.
    `auto_class`: the transformers Auto class (the reward model's: AutoModelForSequenceClassification)."""
    if empty:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):  # keeps tied embeddings tied (accelerate's init_empty_weights would untie them)
            return auto_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                          attn_implementation=attn_implementation)
    model = auto_class.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                       attn_implementation=attn_implementation)
    return model.to(device)


def make_optimizer(params: list[torch.nn.Parameter], actor_cfg, *, device_type: str) -> torch.optim.AdamW:
    """The actor's AdamW (float32 state), in the implementation whose memory the plan counts (grpo_lib/planning/memory.py):
    on CUDA the fused kernel (one launch over every shard, updated in place: no temporary; torch's default there,
    foreach, allocates a float32 temporary the size of all local shards at once: 4 P / W bytes, 3.75 GiB for Qwen3-4B
    on 4 GPUs), elsewhere the per-tensor loop (CPU's default; its temporaries are the size of one tensor). Also what
    `--print-plan --measure` measures (`device_type="cuda"`: the GPU run's path, CPU's fused kernel on fake tensors
    allocates as CUDA's does)."""
    fused = device_type == "cuda"
    return torch.optim.AdamW(params, lr=actor_cfg.lr, weight_decay=actor_cfg.weight_decay, betas=(0.9, 0.999),
                             fused=fused, foreach=False if not fused else None)


def policy_loss_kwargs(a) -> dict:
    """`algorithms.policy_loss`'s loss arguments from the actor config `a`, under verl's names (`actor.*`,
    `actor.policy_loss.*`): every loss reads the ones it needs (grpo_lib/algorithms/policy_losses.py)."""
    pl = a.policy_loss
    return dict(loss_mode=pl.loss_mode, loss_agg_mode=a.loss_agg_mode, clip_ratio_low=a.clip_ratio_low,
                clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c, tau_pos=a.tau_pos, tau_neg=a.tau_neg,
                clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
                kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef, dro_beta=pl.dro_beta)


class Actor:
    """Owns the policy model (sharded with FSDP2 when a process group exists), its optimizer and LR schedule.

    `model`: the Hugging Face model, whose parameters are the float32 master shards (DTensors under FSDP2);
    `policy`: the FSDP2 root that every forward goes through; `optimizer` (AdamW, float32 state), `scheduler`;
    `weights`: full fine-tuning or LoRA, chosen once (grpo_lib/model/weights.py): what trains, is pushed and exported.
    """

    def __init__(self, cfg, *, device: torch.device):
        """A run's actor: model.path loaded, then built by `_build` (the one path `from_model` takes too)."""
        fc = cfg.actor.fsdp_config
        param_dtype = dtypes.torch_dtype(fc.param_dtype, device)
        # Master weights are float32 on every device: bf16 weights + bf16 AdamW state round a 1e-6 update to nothing.
        # Read on the host by process 0 only (the others build it on the meta device); `fsdp.shard` shards it unit by
        # unit and broadcasts process 0's weights into every process's shards: neither the device nor another process's
        # host memory ever holds it whole.
        attn = attention.choose_attn_implementation(device, param_dtype, remove_padding=cfg.model.use_remove_padding)
        model = load_model(cfg.model.path, dtype=torch.float32, device=torch.device("cpu"),
                           trust_remote_code=cfg.model.trust_remote_code, attn_implementation=attn[0],
                           empty=not fsdp.reads_weights())
        self._build(cfg, model, device=device, param_dtype=param_dtype,
                    compute_dtype=dtypes.torch_dtype(fc.param_dtype, device, cpu_auto=next(model.parameters()).dtype),
                    optimizer_device_type=device.type, attn=attn,
                    export_dtype=saved_dtype(cfg.model.path, cfg.model.trust_remote_code),  # the HF export's dtype
                    fill=True, check_packing=cfg.model.use_remove_padding)
        print(fsdp.describe(self.model, name="actor", param_dtype=self.param_dtype, trainable=True), flush=True)
        print(f"[rank {_rank()}] attention: {attention.describe(self.attn_implementation, device, self.param_dtype)} "
              f"({self.attn_reason}); "
              + (f"packing on: a micro-batch packs when its real tokens are < {PACK_BELOW_REAL_FRACTION:.0%} of its padded block"
                 + ("; responses to one prompt share its forward (one copy per micro-batch)" if self.share_prefixes else "")
                 if cfg.model.use_remove_padding else "packing off (model.use_remove_padding)"), flush=True)

    @classmethod
    def from_model(cls, cfg, model: torch.nn.Module, *, device: torch.device, param_dtype: torch.dtype,
                   compute_dtype: torch.dtype, optimizer_device_type: str, attn: tuple[str, str],
                   export_dtype: torch.dtype, fill: bool, check_packing: bool) -> Actor:
        """An actor around an already-built float32 `model`, through the same `_build` as a run's: what
        `--print-plan --measure` measures (a model from its config on fake tensors, the GPU's dtypes and optimizer on
        the CPU, `fill=False`, no packing check). The arguments are `_build`'s."""
        actor = cls.__new__(cls)
        actor._build(cfg, model, device=device, param_dtype=param_dtype, compute_dtype=compute_dtype,
                     optimizer_device_type=optimizer_device_type, attn=attn, export_dtype=export_dtype, fill=fill,
                     check_packing=check_packing)
        return actor

    def _build(self, cfg, model: torch.nn.Module, *, device: torch.device, param_dtype: torch.dtype,
               compute_dtype: torch.dtype, optimizer_device_type: str, attn: tuple[str, str], export_dtype: torch.dtype,
               fill: bool, check_packing: bool) -> None:
        """Every attribute of an actor, set here and only here: `model` prepared (checkpointing, compile, LoRA), sharded
        (`fill`: broadcast process 0's weights into the shards), the packing isolation check (`check_packing`), AdamW
        (`optimizer_device_type`'s implementation, `make_optimizer`) and its LR schedule.

        `param_dtype`: FSDP2's gather dtype; `compute_dtype`: the autocast dtype on CPU (the master dtype: none);
        `attn`: (implementation the model was built with, why); `export_dtype`: the Hugging Face export's dtype."""
        self.cfg, self.device = cfg, device
        self.param_dtype, reduce_dtype = param_dtype, getattr(torch, cfg.actor.fsdp_config.reduce_dtype)
        self.export_dtype = export_dtype
        self.attn_implementation, self.attn_reason = attn
        self.model = model
        if cfg.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = False
        self.master_dtype = next(self.model.parameters()).dtype
        self.share_prefixes = attention.shares_prefixes(self.model)  # rows sharing a prompt compute it once
        self.compute_dtype = compute_dtype
        if device.type == "cpu" and self.compute_dtype != self.master_dtype and not perf.native_bf16_cpu():
            warnings.warn(f"actor.fsdp_config.param_dtype={cfg.actor.fsdp_config.param_dtype} on a CPU without native bf16 "
                          f"({torch.backends.cpu.get_cpu_capability()}): emulated, slower than float32; set it to auto", stacklevel=3)
        if cfg.actor.use_torch_compile:  # verl's name; each decoder layer, dynamic shapes (lengths vary every micro-batch)
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
        self.weights = weights_for(cfg)
        with warnings.catch_warnings():  # on the meta build, loading model.lora_adapter_path is a no-op (process 0's counts)
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
            self.model = self.weights.wrap(self.model)  # LoRA: base frozen, only the adapters train; sharded like the full model
        self.policy = fsdp.shard(self.model, device=device, param_dtype=self.param_dtype, reduce_dtype=reduce_dtype, fill=fill)
        if check_packing:  # fails loudly if this attention backend lets packed rows attend to each other
            self.check_packing()
        a = cfg.actor
        self.optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], a,
                                        device_type=optimizer_device_type)
        warmup = max(0, a.lr_warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.world_size = _world_size()
        self.steps_done = 0  # update() calls so far (seeds the step's mini-batch shuffle, `plan_step`)
        self.offload_device = torch.device("cpu")
        self.collective_bytes = fsdp.count_collectives(self.policy)  # FSDP2 all-gather / reduce-scatter bytes (None: no group)

    def check_packing(self) -> None:
        """The start-up packing isolation check where the run runs: on the sharded policy, inside one forward of its
        FSDP2 root as a scored pass (`fsdp.in_root_forward`, every process at once), on the device, in the compute dtype,
        with the dtype's tolerance; so the kernels checked are the run's (on CUDA torch's varlen_attn and the
        shared-prompt call, flash-attn's). Every process stops when one finds a leak."""
        problem = None
        with self.autocast():
            try:  # in_root_forward raises the check's error after FSDP2's post-forward
                fsdp.in_root_forward(self.policy, functools.partial(check_packing_isolated, dtype=self.compute_dtype))
            except RuntimeError as exc:
                problem = exc
        if all_reduce_max(1.0 if problem else 0.0) > 0:  # every process stops, not only the one that found it
            raise problem or RuntimeError("the packed-sequence isolation check failed on another process (its error says why)")

    # -- offload (actor.fsdp_config.param_offload / optimizer_offload; no-ops on CPU) -----------------------

    def load_params(self) -> None:
        """Parameter shards back on the device (before a logprob pass, the update, the push)."""
        if self.cfg.actor.fsdp_config.param_offload and fsdp.params_device(self.model) != self.device:
            fsdp.move_params(self.policy, self.device)

    def offload(self) -> None:
        """Between phases the actor rests on the host: its parameter shards (actor.fsdp_config.param_offload) and AdamW
        state (optimizer_offload) leave the device, and the freed blocks go back to it, so the vLLM KV cache can be
        mapped. Called before every generation phase (at start, after the push, after a checkpoint's export, which
        all bring the shards back); a no-op without the offload keys and on CPU."""
        fc = self.cfg.actor.fsdp_config
        if fc.param_offload:
            fsdp.move_params(self.policy, self.offload_device)
        if fc.optimizer_offload:
            fsdp.move_optimizer_state(self.optimizer, self.offload_device)
        if self.device.type == "cuda" and (fc.param_offload or fc.optimizer_offload):
            torch.cuda.synchronize()  # the non-blocking copies to the host are complete before anything reads them
            torch.cuda.empty_cache()

    def autocast(self):
        """Compute-dtype context of every actor forward on CPU (a no-op unless actor.fsdp_config.param_dtype < master;
        under FSDP2 the MixedPrecisionPolicy casts too)."""
        return perf.compute_autocast(self.device, self.compute_dtype, self.master_dtype)

    # -- logprobs --------------------------------------------------------------------------------------

    @perf.with_trainer_threads
    def compute_logprobs(self, batch: RolloutBatch, plan: StepPlan | None = None) -> torch.Tensor:
        """Old logprobs (before this step's updates), [B, T], over `plan.old_logprob` (the step's `StepPlan`; None: this
        step's `plan_step`): the update's first-epoch mini-batches, micro-batched as the update does them (rollout.log_prob_*
        default to the update's budget): the first update then sees every row in the same micro-batch at the same
        padded / packed width, so its logprobs are bit-identical and its ratio is exactly 1 (DESIGN invariant 2;
        tests/algorithms/test_ratio.py).
        """
        plan = plan or self.plan_step(batch)
        self.load_params()
        self.policy.eval()
        chunks = []
        for mini in plan.old_logprob:
            lp = logprobs_over_batch(
                self.policy, batch.select(mini.rows), temperature=self.cfg.rollout.temperature,
                remove_padding=self.cfg.model.use_remove_padding, max_tokens=None, micro_batch_size=None,
                device=self.device, autocast=self.autocast, planned=mini.micro_batches)
            chunks.append(torch.nn.functional.pad(lp, (0, batch.input_ids.shape[1] - lp.shape[1])))  # [b, T]
        return restore_order(chunks, [mini.rows for mini in plan.old_logprob])  # [B, T]

    def named_weights(self):
        """(Hugging Face name, full tensor) pairs for the engine push and the export, gathered one at a time.

        A collective under FSDP2: every process must consume the iterator to its end, in the same order. With tied
        embeddings `lm_head.weight` is included (`fsdp.gathered_state`). With LoRA: base + scaled adapters, new tensors.
        """
        self.load_params()
        yield from self.weights.named_weights(self.model)

    def engine_weights(self):
        """What a push hands the engine: `named_weights` (lazy), or with lora_mode=adapter the adapter (gathered now)."""
        if not self.weights.pushes_adapter:
            return self.named_weights()
        self.load_params()
        return self.weights.adapter(self.model)

    # -- update ----------------------------------------------------------------------------------------

    def micro_batch_loss(self, mb: RolloutBatch, *, num_tokens: float, num_seqs: float, compute_entropy: bool,
                         facts: RowFacts | None = None):
        """Loss of one micro-batch normalised by the mini-batch's global counts, its metrics and its loss tokens.

        Nothing here reads a device value: the layout and the forward's indices are decided on the host from `facts`
        (its rows' `RowFacts`; read from `mb` when not given), the host tensors go to the device without waiting
        (`devices.to_device`), and the metrics stay device scalars (the `perf/` counts host floats) that
        `update_metrics.MicroBatchSums` adds up and reads once per mini-batch."""
        a, alg = self.cfg.actor, self.cfg.algorithm
        remove_padding = self.cfg.model.use_remove_padding
        facts = facts or batch_facts(mb, share_prefixes=remove_padding and self.share_prefixes)
        # Packed only where it pays (the old-logprob pass decides alike on the same micro-batch); the prompt and the
        # response's holes are not scored at all here (score_unmasked=False): the loss reads the loss tokens only, and
        # those are scored in the same chunks as in the old-logprob pass, so the first ratio stays bitwise 1.
        score_mask, layout, computed, plan = plan_forward(mb, facts, remove_padding=remove_padding,
                                                          share_prefixes=self.share_prefixes,
                                                          varlen=attention.is_varlen(self.model), score_unmasked=False)
        dev = functools.partial(to_device, device=self.device)
        mask = dev(mb.loss_mask)  # [b, T] every term, count and metric below reads the loss mask
        teacher_ids = distillation.student_topk_ids(self.cfg.distillation, mb)  # [b, T, k]: forward_kl_topk's ids
        with self.autocast():
            lp, entropy, *topk = self.policy(dev(mb.input_ids), dev(mb.attention_mask),
                                             temperature=self.cfg.rollout.temperature, **layout_kwargs(layout),
                                             compute_entropy=compute_entropy, entropy_grad=a.entropy_coeff != 0,
                                             score_mask=None if score_mask is None else mask, score_unmasked=False,
                                             checkpoint_min_bytes=HEAD_CHECKPOINT_MIN_BYTES, plan=plan.to(self.device),
                                             **({} if teacher_ids is None else {"extra_ids": dev(teacher_ids)}))
        lp = lp.float()  # [b, T]
        old = dev(mb.old_logprobs) if mb.old_logprobs is not None else lp.detach()  # [b, T]
        rollout = dev(mb.rollout_logprobs)  # [b, T]
        is_weights = algorithms.rollout_is_weights(old, rollout, mask,  # ones for mode "none"
                                                   mode=alg.rollout_correction.mode, cap=alg.rollout_correction.cap)  # [b, T]
        stale = None
        if mb.token_versions is not None:  # carried responses: tokens of older weights (rollout.partial_rollout)
            stale = (dev(mb.token_versions) < mb.weight_version) & mask.bool()  # [b, T]
            if a.use_decoupled_loss:  # old = the proximal policy; behaviour = the engine's logprob when it sampled
                is_weights = algorithms.decoupled_weights(is_weights, old, rollout, stale, cap=a.behav_imp_weight_cap)
        counts = dict(num_tokens=num_tokens, num_seqs=num_seqs,
                      loss_scale_factor=a.loss_scale_factor)
        pg_loss, metrics = algorithms.policy_loss(lp, old, dev(mb.advantages), mask, is_weights=is_weights,
                                                  **policy_loss_kwargs(a), **counts)
        loss = pg_loss
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = pg_loss.detach()
        metrics.update({"perf/packed": float(layout != "padded"), "perf/shared_prefix": float(layout == "shared_prefix"),
                        "perf/real_tokens": float(sum(facts.lens)), "perf/computed_tokens": float(computed)})
        if stale is not None:  # the share of off-policy tokens and their behaviour weight
            stale_f = stale.float()
            metrics["actor/stale_token_fraction"] = (stale_f.sum() / mask.sum().clamp(min=1)).detach()
            metrics["actor/behav_imp_weight_mean"] = ((is_weights * stale_f).sum() / stale_f.sum().clamp(min=1)).detach()
        if engine_logprobs_needed(self.cfg):  # engine vs trainer logprobs of the sampled tokens (both pre-update)
            fresh = mask if stale is None else mask * ~stale  # older weights' tokens differ by the policy's drift too
            gap = ((old - rollout).abs() * fresh).sum() / fresh.sum().clamp(min=1)
            metrics["rollout/logprob_abs_diff_mean"] = gap.detach()
        if a.use_kl_loss:
            kl = algorithms.kl_penalty(lp, dev(mb.ref_logprobs), a.kl_loss_type)  # [b, T]
            kl_loss = algorithms.aggregate_loss(kl, mask, a.loss_agg_mode, **counts)
            loss = loss + a.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        if entropy is not None:
            ent = algorithms.aggregate_loss(entropy.float(), mask, a.loss_agg_mode, **counts)
            if a.entropy_coeff != 0:
                loss = loss - a.entropy_coeff * ent
            metrics["actor/entropy"] = ent.detach()
        if self.cfg.distillation.enabled:  # the teacher's term beside (use_task_rewards) or instead of the GRPO loss
            loss = distillation.micro_batch_loss(self.cfg.distillation.distillation_loss, mb, loss, lp, topk[0] if topk else None,
                                                 old, mask, is_weights, counts, metrics, loss_agg_mode=a.loss_agg_mode,
                                                 device=self.device)
        return loss, metrics, sum(facts.score_tokens)

    def mini_batch_rows(self, batch: RolloutBatch, generator: torch.Generator | None = None) -> list[list[int]]:
        """Row indices of each mini-batch of one epoch (`batching.split_mini_batches`): whole groups, actor.ppo_mini_batch_size
        prompts per global mini-batch, shuffled with `generator` if actor.shuffle. Without a generator: the unshuffled
        mini-batches that balancing keeps (`step.balance_batch`).

        Example (4 groups of 2 rows, 2 mini-batches, no shuffle): [[0, 1, 2, 3], [4, 5, 6, 7]].
        """
        a = self.cfg.actor
        return split_mini_batches(batch.group_ids, sizes=mini_batch_sizes(self.cfg.data.train_batch_size, a.ppo_mini_batch_size),
                                  generator=generator if a.shuffle else None)

    def plan_step(self, batch: RolloutBatch) -> StepPlan:
        """This step's mini-batches and micro-batches (`batching.StepPlan`), decided once, after balancing, for the
        old-logprob pass and the update: actor.ppo_epochs passes of `mini_batch_rows`, shuffled (actor.shuffle) by this
        step's generator (trainer.seed and `steps_done`, which a checkpoint saves: a resumed run draws the same), each
        mini-batch cut under the actor.ppo_* budget; the old-logprob pass's are epoch 0's, cut under rollout.log_prob_*
        (the update's own where those are the same budget, their default). A collective: the micro-batch counts are
        agreed over processes (`micro_batches`)."""
        a, r = self.cfg.actor, self.cfg.rollout
        groups = batch.group_ids if self.cfg.model.use_remove_padding and self.share_prefixes else None

        def cutter(max_tokens: int | None, micro_batch_size: int | None):
            def cut(rows: list[int]) -> list[list[int]]:
                return micro_batches([batch.seq_lens[i] for i in rows], max_tokens=max_tokens, micro_batch_size=micro_batch_size,
                                     groups=None if groups is None else [groups[i] for i in rows])
            return cut

        # (max_tokens, micro_batch_size) as `micro_batches` reads them: a token budget ignores the size
        update = (a.ppo_max_token_len_per_gpu, None) if a.use_dynamic_bsz else (None, a.ppo_micro_batch_size_per_gpu)
        old = (r.log_prob_max_token_len_per_gpu, None) if r.log_prob_use_dynamic_bsz else (None, r.log_prob_micro_batch_size_per_gpu)
        return make_step_plan(batch.group_ids, sizes=mini_batch_sizes(self.cfg.data.train_batch_size, a.ppo_mini_batch_size),
                              epochs=a.ppo_epochs, generator=self._shuffle_generator() if a.shuffle else None,
                              cut=cutter(*update), cut_old_logprob=None if old == update else cutter(*old))

    @perf.with_trainer_threads
    def update(self, batch: RolloutBatch, plan: StepPlan | None = None) -> dict[str, float]:
        """The passes of `plan.epochs` over `batch` (the step's `StepPlan`; None: this step's `plan_step`), one optimizer
        step per mini-batch; returns averaged metrics."""
        a = self.cfg.actor
        plan = plan or self.plan_step(batch)  # before steps_done moves on
        self.load_params()
        if a.fsdp_config.optimizer_offload:
            fsdp.move_optimizer_state(self.optimizer, self.device)
        self.policy.train()
        summed: dict[str, float] = defaultdict(float)
        extrema: dict[str, float] = {}  # distillation.EXTREMA's metrics
        num_updates = 0
        if self.collective_bytes is not None:
            self.collective_bytes.update(all_gather=0, reduce_scatter=0)
        for epoch in plan.epochs:
            for mini in epoch:
                summed_step = self._optimizer_step(batch.select(mini.rows), micro=mini.micro_batches)
                for k, v in summed_step.items():
                    summed[k] += v
                    if k in distillation.EXTREMA:
                        extrema[k] = (min if distillation.EXTREMA[k] == "min" else max)(extrema.get(k, v), v)
                num_updates += 1
        self.steps_done += 1
        if a.fsdp_config.optimizer_offload:  # not needed again before the next update: make room for the push
            fsdp.move_optimizer_state(self.optimizer, self.offload_device)
        metrics = {k: v / num_updates for k, v in summed.items()}
        metrics.update(extrema)  # the range over the step's updates, not their mean
        metrics["memory/actor_params_mb"] = fsdp.local_bytes(self.model.parameters()) / fsdp.MB  # this process's shard
        if self.collective_bytes is not None:  # this process's FSDP2 traffic of the update, per optimizer step
            metrics["perf/collective_mb_per_update"] = sum(self.collective_bytes.values()) / fsdp.MB / max(num_updates, 1)
        metrics["memory/peak_mb"] = all_reduce_max(fsdp.peak_memory_mb(self.device))  # the largest process
        metrics["actor/skipped_nonfinite_steps"] = summed["actor/skipped_nonfinite_steps"]  # a count, not a mean
        return metrics

    def _shuffle_generator(self) -> torch.Generator:
        """Mini-batch shuffle order of the current step (a new permutation every step, reproducible; `plan_step`)."""
        return torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + self.steps_done)

    def _optimizer_step(self, mini: RolloutBatch, micro: list[list[int]] | None = None) -> dict[str, float]:
        """Backward over the micro-batches of one mini-batch (`micro`: the plan's, else cut here), then one optimizer step."""
        a = self.cfg.actor
        sums, facts = self._backward_micro_batches(mini, micro)
        params = [p for p in self.model.parameters() if p.grad is not None]
        # Norm of the sharded gradients: each DTensor norm is a partial result; full_tensor() reduces it over processes.
        grad_norm = fsdp.full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params], 2.0))
        if a.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, a.grad_clip, grad_norm)
        metrics, (norm,) = self._mini_batch_metrics(sums, facts, grad_norm)  # the mini-batch's one read, the norm with it
        metrics["actor/grad_norm"] = norm
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(norm) and all(math.isfinite(v) for v in metrics.values())
        skip = all_reduce_sum(0.0 if finite else 1.0) > 0  # every process skips the same updates
        metrics["actor/skipped_nonfinite_steps"] = float(skip)
        if not skip:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def accumulate_gradients(self, mini: RolloutBatch, micro: list[list[int]] | None = None) -> dict[str, float]:
        """Backward over the micro-batches of this process's share of one mini-batch (`micro`: positions in `mini`, the
        step plan's; None: cut here under the actor.ppo_* budget), gradients averaged over processes; leaves the
        mini-batch gradient in `.grad` (no optimizer step) and returns its metrics.

        Loss sums are divided by the mini-batch's global token / sequence counts and multiplied by the world size
        (undone by the average), so `.grad` is the gradient of the whole mini-batch's loss on every process, for
        any micro-batching, packing and process count (DESIGN invariant 1). Losses in the metrics are global.
        """
        return self._mini_batch_metrics(*self._backward_micro_batches(mini, micro))[0]

    def _backward_micro_batches(self, mini: RolloutBatch, micro: list[list[int]] | None) -> tuple[MicroBatchSums, RowFacts]:
        """`accumulate_gradients`' forward and backward passes: the host reads `mini`'s row facts once, then queues
        every micro-batch without reading anything back from the device (its metrics stay device sums, returned
        unread with the facts)."""
        a = self.cfg.actor
        share = self.cfg.model.use_remove_padding and self.share_prefixes
        facts = batch_facts(mini, share_prefixes=share)
        # Loss tokens, and rows with at least one (a row whose loss mask is all 0, e.g. a masked truncation, is no
        # sequence of the loss: aggregate_loss's own default count, so the gradient equals the plain batch loss's).
        counts = Reduction()  # both in one all-reduce
        counts.sum("tokens", sum(facts.score_tokens))
        counts.sum("seqs", sum(1 for n in facts.score_tokens if n > 0))
        num_tokens, num_seqs = counts.reduce().values()
        compute_entropy = True  # logged from the same forward; the bonus applies only when entropy_coeff != 0
        idx_lists = micro if micro is not None else micro_batches(
            facts.lens, max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
            micro_batch_size=a.ppo_micro_batch_size_per_gpu, groups=mini.group_ids if share else None)
        sums, dummy = MicroBatchSums(), []
        fc = a.fsdp_config  # which all-gathers / reduce-scatters the micro-batches share (fsdp.mini_batch_collectives)
        with fsdp.mini_batch_collectives(self.policy, keep_root_gathered=fc.keep_root_gathered,
                                         reshard_after_forward=fc.reshard_after_forward,
                                         defer_grad_reduce=fc.defer_grad_reduce) as before_micro_batch:
            for i, idx in enumerate(idx_lists):
                before_micro_batch(i, len(idx_lists))
                mb, mb_facts = micro_batch_rows(mini, facts, idx, dummy)
                weight = 1.0 if idx else 0.0  # an empty micro-batch still runs forward + backward, contributing exactly 0
                loss, mb_metrics, mb_tokens = self.micro_batch_loss(mb, num_tokens=num_tokens, num_seqs=num_seqs,
                                                                    compute_entropy=compute_entropy, facts=mb_facts)
                (loss * (weight * self.world_size)).backward()
                sums.add(mb_metrics, weight=weight, loss_tokens=mb_tokens)
        return sums, facts  # gradients were averaged by FSDP2's reduce-scatter (after each micro-batch, or the last)

    @staticmethod
    def _mini_batch_metrics(sums: MicroBatchSums, facts: RowFacts, *extra: torch.Tensor) -> tuple[dict[str, float], list[float]]:
        """The mini-batch's metrics, reduced over processes, from its device sums read in one copy (with the `extra`
        device scalars, returned as floats)."""
        metrics, weighted, extra_values = sums.read(*extra)
        # The same keys on every process (the dummy reports them too), in sorted order: one all-reduce per kind.
        reduction = Reduction()
        reduction.count("loss_tokens", sum(facts.score_tokens))  # this process's share of num_tokens
        for k in sorted(weighted):  # per-micro-batch fractions: token-weighted means
            reduction.mean(k, weighted[k], over="loss_tokens")
        for k in SUMMED_LOSSES:
            if k in metrics:  # normalised by the global counts already: the processes' shares add up
                reduction.sum(k, metrics[k])
        extrema = sorted(k for k in metrics if k in distillation.EXTREMA)
        for k in extrema:  # the range over every process's loss tokens
            (reduction.min if distillation.EXTREMA[k] == "min" else reduction.max)(k, metrics[k])
        # Share of the (non-dummy) micro-batches that were packed, and real / computed tokens of their forwards.
        perf_counts = sums.perf
        reduction.count("micro_batches", perf_counts["micro_batches"])
        reduction.count("computed_tokens", perf_counts["perf/computed_tokens"])
        reduction.mean("perf/packed", perf_counts["perf/packed"], over="micro_batches")
        reduction.mean("perf/shared_prefix", perf_counts["perf/shared_prefix"], over="micro_batches")
        reduction.mean("perf/real_token_fraction", perf_counts["perf/real_tokens"], over="computed_tokens")
        metrics.update(reduction.reduce())
        for k in extrema:
            metrics[k] = metrics[k] if math.isfinite(metrics[k]) else 0.0  # no loss token on any process
        return metrics, extra_values

    # -- save ------------------------------------------------------------------------------------------

    def save_hf(self, path, tokenizer) -> None:
        """Hugging Face folder loadable by AutoModelForCausalLM and vLLM, in the dtype model.path was saved in
        (`export_dtype`; the exact float32 master weights are in the checkpoint's sharded state). EVERY process calls
        it (the tensors are gathered from the shards one by one); process 0 keeps a CPU copy of each and writes.
        With LoRA: path/adapter (peft format) and, with trainer.save_merged, path/merged (`lora.save_lora_checkpoint`)."""
        self.load_params()
        self.weights.save_hf(self.model, path, tokenizer, export_dtype=self.export_dtype, write=_rank() == 0)
