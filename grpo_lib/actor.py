"""The trained policy: model load, optimizer, the shared logprob pass over micro-batches, and the update.

Every forward of the actor, the reference and the old-logprob pass goes through `logprobs_over_batch`,
which calls the one logprob function (`grpo_lib.logprobs.token_logprobs`) on token-budgeted micro-batches
built by `grpo_lib.batching` and returns results in the original row order (DESIGN invariant 2).

The update divides every micro-batch loss by the mini-batch's *global* token / sequence counts
(all-reduced over processes) and multiplies by the world size before the gradients are averaged over
processes, so micro-batching and the process count never change the gradient (DESIGN invariant 1).

Multi-process: gradients are all-reduced explicitly after the micro-batches of a mini-batch (no DDP
wrapper: DDP needs every forward to go through its own `forward`, and the chunked logprob path calls the
decoder and the output head separately). FSDP2 sharding (its own issue) plugs in right after `load_model` in `Actor.__init__`.
Every process runs the same number of forward (and backward) passes: the micro-batch count is agreed
across processes (`batching.agree_num_micro_batches`), and a process with fewer rows than micro-batches
runs a dummy two-token row whose loss is multiplied by 0 for each empty one, so per-module collectives
(FSDP all-gathers / reduce-scatters) always pair up.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import fields

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from grpo_lib import algorithms, lora
from grpo_lib.batching import agree_num_micro_batches, check_packing_isolated, micro_batch_indices, restore_order
from grpo_lib.distributed import all_reduce_sum, is_on as _dist_on
from grpo_lib.logprobs import token_logprobs
from grpo_lib.types import RolloutBatch


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)


def load_model(path: str, *, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa")
    return model.to(device)


def micro_batches(seq_lens: list[int], *, max_tokens: int | None, micro_batch_size: int | None) -> list[list[int]]:
    """Row indices per micro-batch (token budget if `max_tokens`, else fixed size); the count is agreed by all processes."""
    budget = {"max_tokens": max_tokens} if max_tokens is not None else {"micro_batch_size": micro_batch_size}
    local = micro_batch_indices(seq_lens, **budget)
    agreed = agree_num_micro_batches(len(local))
    return local if agreed == len(local) else micro_batch_indices(seq_lens, **budget, min_num_micro_batches=agreed)


def dummy_micro_batch(template: RolloutBatch) -> RolloutBatch:
    """One two-token row (token id 0, real tokens, EMPTY response mask) shaped like `template`'s fields.

    Run in place of an empty micro-batch so this process makes the same forward/backward calls as the others;
    its loss is multiplied by 0. Two tokens, so one token is scored and the output head is part of the graph.
    """
    out = {}
    for f in fields(template):
        value = getattr(template, f.name)
        if isinstance(value, torch.Tensor):
            shape = (1, 2) if value.dim() == 2 else (1, *value.shape[1:])
            out[f.name] = torch.zeros(shape, dtype=value.dtype)
        elif isinstance(value, list):
            out[f.name] = [value[0] if value else None]
        else:
            out[f.name] = value
    out["attention_mask"] = torch.ones(1, 2, dtype=template.attention_mask.dtype)  # [1, 2]
    return RolloutBatch(**out)


@torch.no_grad()
def logprobs_over_batch(model, batch: RolloutBatch, *, temperature: float, remove_padding: bool, max_tokens: int | None,
                        micro_batch_size: int | None, device: torch.device) -> torch.Tensor:
    """No-grad logprobs of every row of `batch` ([B, T], original order) over micro-batches.

    An empty micro-batch (this process has fewer rows than the agreed count) runs a dummy forward, discarded.
    """
    width = batch.input_ids.shape[1]
    index_lists = micro_batches(batch.seq_lens, max_tokens=max_tokens, micro_batch_size=micro_batch_size)
    chunks = []
    for idx in index_lists:
        mb = batch.select(idx) if idx else dummy_micro_batch(batch)
        lp, _ = token_logprobs(model, mb.input_ids.to(device), mb.attention_mask.to(device), temperature=temperature,
                               remove_padding=remove_padding)  # [b, t]
        chunks.append(torch.nn.functional.pad(lp.float().cpu(), (0, width - lp.shape[1]))[:len(idx)])  # [b, T]
    return restore_order(chunks, index_lists)  # [B, T]


class Actor:
    """Owns the policy model, its optimizer and LR schedule."""

    def __init__(self, cfg, *, device: torch.device):
        self.cfg, self.device = cfg, device
        self.model = load_model(cfg.model.path, dtype=resolve_dtype(cfg.model.dtype, device), device=device,
                                trust_remote_code=cfg.model.trust_remote_code)
        if cfg.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = False
        if cfg.model.use_remove_padding:
            check_packing_isolated(self.model)  # fails loudly if this attention backend lets packed rows attend to each other
        if lora.lora_on(cfg):  # base frozen; only the adapters train (grpo_lib/lora.py)
            self.model = lora.apply_lora(self.model, cfg.model)
        a = cfg.actor
        self.optimizer = torch.optim.AdamW(lora.adapter_parameters(self.model), lr=a.lr, weight_decay=a.weight_decay, betas=(0.9, 0.999))
        warmup = max(0, a.lr_warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.world_size = dist.get_world_size() if _dist_on() else 1
        self.steps_done = 0  # update() calls so far (seeds the mini-batch shuffle)

    # -- logprobs --------------------------------------------------------------------------------------

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """Old logprobs (before this step's updates), [B, T].

        Cut into the mini-batches of the update's first epoch (same shuffle seed), each micro-batched as the update
        does: the first update then sees every row in the same micro-batch at the same padded / packed width, so
        its logprobs are bit-identical and its ratio is exactly 1 (DESIGN invariant 2; tests/test_ratio.py).
        """
        r = self.cfg.rollout  # verl's home of the old-logprob pass's knobs (resolved in config validation)
        self.model.eval()
        index_lists = self.mini_batch_rows(batch, self._shuffle_generator())
        chunks = []
        for rows in index_lists:
            lp = logprobs_over_batch(
                self.model, batch.select(rows), temperature=self.cfg.rollout.temperature,
                remove_padding=self.cfg.model.use_remove_padding,
                max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                micro_batch_size=r.log_prob_micro_batch_size_per_gpu, device=self.device)
            chunks.append(torch.nn.functional.pad(lp, (0, batch.input_ids.shape[1] - lp.shape[1])))  # [b, T]
        return restore_order(chunks, index_lists)  # [B, T]

    def named_weights(self):
        """(name, full tensor) pairs in Hugging Face naming, for the engine push and checkpoints."""
        if lora.lora_on(self.cfg):  # base + scaled adapters, new tensors (the base is not modified)
            yield from lora.merged_named_weights(self.model)
            return
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    # -- update ----------------------------------------------------------------------------------------

    def micro_batch_loss(self, mb: RolloutBatch, *, num_tokens: float, num_seqs: float, compute_entropy: bool):
        """Loss of one micro-batch normalised by the mini-batch's global counts, and its metrics."""
        a, alg = self.cfg.actor, self.cfg.algorithm
        mask = mb.response_mask.to(self.device)  # [b, T]
        lp, entropy = token_logprobs(self.model, mb.input_ids.to(self.device), mb.attention_mask.to(self.device),
                                     temperature=self.cfg.rollout.temperature, remove_padding=self.cfg.model.use_remove_padding,
                                     compute_entropy=compute_entropy)
        lp = lp.float()  # [b, T]
        old = mb.old_logprobs.to(self.device) if mb.old_logprobs is not None else lp.detach()  # [b, T]
        is_weights = algorithms.rollout_is_weights(old, mb.rollout_logprobs.to(self.device), mask,  # ones for mode "none"
                                                   mode=alg.rollout_correction.mode, cap=alg.rollout_correction.cap)  # [b, T]
        counts = dict(num_tokens=num_tokens, num_seqs=num_seqs,
                      loss_scale_factor=a.loss_scale_factor)
        pg_loss, metrics = algorithms.policy_loss(
            lp, old, mb.advantages.to(self.device), mask, loss_mode=a.policy_loss.loss_mode,
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, is_weights=is_weights, **counts)
        loss = pg_loss
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = pg_loss.item()
        if a.use_kl_loss:
            kl = algorithms.kl_penalty(lp, mb.ref_logprobs.to(self.device), a.kl_loss_type)  # [b, T]
            kl_loss = algorithms.aggregate_loss(kl, mask, a.loss_agg_mode, **counts)
            loss = loss + a.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.item()
        if entropy is not None:
            ent = algorithms.aggregate_loss(entropy.float(), mask, a.loss_agg_mode, **counts)
            if a.entropy_coeff != 0:
                loss = loss - a.entropy_coeff * ent
            metrics["actor/entropy"] = ent.item()
        return loss, metrics, int(mask.sum().item())

    def mini_batch_rows(self, batch: RolloutBatch, generator: torch.Generator | None = None) -> list[list[int]]:
        """Row indices of each mini-batch of one epoch: whole groups, shuffled with `generator` if actor.shuffle.

        Without shuffling, local mini-batch m of every process holds that process's part of global mini-batch m
        (prompts are dealt out strided), so the process count never changes what an update sees. Shuffling
        permutes each process's groups locally: the mini-batches then depend on the process count.

        Example (4 groups of 2 rows, 2 mini-batches, no shuffle): [[0, 1, 2, 3], [4, 5, 6, 7]].
        """
        a = self.cfg.actor
        n_mini = max(1, self.cfg.data.train_batch_size // a.ppo_mini_batch_size)
        groups = list(dict.fromkeys(batch.group_ids))  # group order as generated
        rows_of = defaultdict(list)
        for i, g in enumerate(batch.group_ids):
            rows_of[g].append(i)
        shuffle = a.shuffle and generator is not None
        order = torch.randperm(len(groups), generator=generator).tolist() if shuffle else list(range(len(groups)))
        size = math.ceil(len(groups) / n_mini)
        chosen = [[groups[order[j]] for j in range(m, len(groups), n_mini)] if shuffle else groups[m * size:(m + 1) * size]
                  for m in range(n_mini)]
        return [[i for g in c for i in rows_of[g]] for c in chosen]

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """ppo_epochs passes over `batch`, one optimizer step per mini-batch; returns averaged metrics."""
        a = self.cfg.actor
        self.model.train()
        summed: dict[str, float] = defaultdict(float)
        num_updates = 0
        generator = self._shuffle_generator()  # compute_logprobs replayed this step's first epoch with the same seed
        for _epoch in range(a.ppo_epochs):
            for rows in self.mini_batch_rows(batch, generator):
                summed_step = self._optimizer_step(batch.select(rows))
                for k, v in summed_step.items():
                    summed[k] += v
                num_updates += 1
        self.steps_done += 1
        return {k: v / num_updates for k, v in summed.items()}

    def _shuffle_generator(self) -> torch.Generator:
        """Mini-batch shuffle order of the current step (a new permutation every step, reproducible)."""
        return torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + self.steps_done)

    def _optimizer_step(self, mini: RolloutBatch) -> dict[str, float]:
        """Backward over the micro-batches of one mini-batch, then one optimizer step."""
        a = self.cfg.actor
        metrics = self.accumulate_gradients(mini)
        grad_norm = torch.nn.utils.clip_grad_norm_(lora.adapter_parameters(self.model), a.grad_clip if a.grad_clip > 0 else float("inf"))
        metrics["actor/grad_norm"] = float(grad_norm)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        if math.isfinite(float(grad_norm)):
            self.optimizer.step()
        else:
            metrics["actor/skipped_nonfinite_steps"] = 1.0
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def accumulate_gradients(self, mini: RolloutBatch) -> dict[str, float]:
        """Backward over the micro-batches of this process's share of one mini-batch, gradients averaged over
        processes; leaves the mini-batch gradient in `.grad` (no optimizer step) and returns its metrics.

        Loss sums are divided by the mini-batch's global token / sequence counts and multiplied by the world size
        (undone by the average), so `.grad` is the gradient of the whole mini-batch's loss on every process, for
        any micro-batching, packing and process count (DESIGN invariant 1). Losses in the metrics are global.
        """
        a = self.cfg.actor
        num_tokens = all_reduce_sum(mini.response_mask.sum().item())
        num_seqs = all_reduce_sum(int((mini.response_mask.sum(-1) > 0).sum().item()))
        compute_entropy = True  # logged from the same forward; the bonus applies only when entropy_coeff != 0
        metrics: dict[str, float] = defaultdict(float)
        weighted: dict[str, float] = defaultdict(float)
        idx_lists = micro_batches(mini.seq_lens, max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
                                  micro_batch_size=a.ppo_micro_batch_size_per_gpu)
        for idx in idx_lists:
            mb = mini.select(idx) if idx else dummy_micro_batch(mini)
            weight = 1.0 if idx else 0.0  # an empty micro-batch still runs forward + backward, contributing exactly 0
            loss, mb_metrics, mb_tokens = self.micro_batch_loss(mb, num_tokens=num_tokens, num_seqs=num_seqs,
                                                                compute_entropy=compute_entropy)
            (loss * (weight * self.world_size)).backward()
            for k, v in mb_metrics.items():
                if k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
                    metrics[k] += weight * v  # already normalised by global counts: the sum is this process's share
                else:
                    weighted[k] += weight * v * mb_tokens  # per-micro-batch fractions: token-weighted mean
        # The same keys on every process (the dummy reports them too), reduced in sorted order.
        for k in sorted(weighted):
            metrics[k] = all_reduce_sum(weighted[k]) / max(num_tokens, 1.0)
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
            if k in metrics:
                metrics[k] = all_reduce_sum(metrics[k])
        self._average_gradients()
        return dict(metrics)

    def _average_gradients(self) -> None:
        if not _dist_on():
            return
        for p in lora.adapter_parameters(self.model):  # frozen (LoRA base) parameters have no gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(self.world_size)

    # -- save ------------------------------------------------------------------------------------------

    def save_hf(self, path, tokenizer) -> None:
        """Hugging Face folder loadable by AutoModelForCausalLM and vLLM."""
        self.model.save_pretrained(path, state_dict={k: v.cpu() for k, v in self.named_weights()})
        tokenizer.save_pretrained(path)


class Reference:
    """Frozen copy of the initial policy; lives on CPU between uses when ref.param_offload."""

    def __init__(self, cfg, *, device: torch.device):
        self.cfg, self.device = cfg, device
        self.offload = cfg.ref.param_offload and device.type != "cpu"
        self.model = load_model(cfg.model.path, dtype=resolve_dtype(cfg.model.dtype, device),
                                device=torch.device("cpu") if self.offload else device, trust_remote_code=cfg.model.trust_remote_code)
        self.model.eval().requires_grad_(False)

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        r = self.cfg.ref
        if self.offload:
            self.model.to(self.device)
        try:
            return logprobs_over_batch(
                self.model, batch, temperature=self.cfg.rollout.temperature, remove_padding=self.cfg.model.use_remove_padding,
                max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                micro_batch_size=r.log_prob_micro_batch_size_per_gpu, device=self.device)
        finally:
            if self.offload:
                self.model.to("cpu")
