"""The distillation teacher: a frozen model that scores the student's rollouts token by token (distillation.enabled).

It is built as the KL reference is (grpo_lib/model/reference.py `FrozenModel`): read by process 0 and sharded with FSDP2 over
every process (the others build it on the meta device), stored in model.dtype, computing in the actor's param_dtype,
its shards in CPU memory between uses with ref.fsdp_config.param_offload (each unit copied to the device only for its
forward); micro-batched by the reference pass's keys (ref.log_prob_*). It is scored by the one logprob function
(`grpo_lib.model.logprobs.token_scores`) at temperature 1 (verl's teacher logprobs are its inference engine's raw ones), on
the loss tokens only: their logprobs and, for forward_kl_topk, the teacher's k most likely ids and their
log-probabilities, from the same head call.

Before anything loads (train_grpo.py's setup, with the plan's fit check beside it): `tokenizer_problem` refuses a teacher whose tokenizer is not the
student's, naming both; `grpo_lib.planning.beside.teacher_fit_problem` refuses a teacher that does not fit the GPU.
The per-token math is grpo_lib/algorithms/distillation.py; the term joins the loss in `distillation.micro_batch_loss`.
"""

from __future__ import annotations

import torch

from grpo_lib.algorithms import distillation
from grpo_lib.core import perf
from grpo_lib.core.types import RolloutBatch
from grpo_lib.model import attention
from grpo_lib.model.batching import dummy_micro_batch, restore_order
from grpo_lib.model.logprobs import choose_layout, layout_kwargs
from grpo_lib.model.passes import HEAD_CHECKPOINT_MIN_BYTES, micro_batches, response_scores
from grpo_lib.model.reference import FrozenModel, ref_pass_budget

TEACHER_TEMPERATURE = 1.0  # verl's teacher logprobs: its engine's prompt logprobs, of the raw logits


def tokenizer_problem(cfg, student_tokenizer) -> str | None:
    """Why the teacher cannot score the student's token ids (None: it can): its tokenizer's vocabulary (token -> id)
    differs from model.path's, or, for forward_kl_topk, its output head is wider or narrower than the student's (its
    top-k ids would index another vocabulary). Reads the teacher's tokenizer and config.json, no weights."""
    from transformers import AutoConfig, AutoTokenizer

    path, student = cfg.distillation.teacher_models.teacher_model.model_path, cfg.model.path
    key = "distillation.teacher_models.teacher_model.model_path"
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        return f"{key}={path!r}: cannot load a tokenizer from it ({exc}); point it at a Hugging Face model folder or hub name"
    ours, theirs = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        return (f"{key}={path!r} and model.path={student!r} have different tokenizers ({len(theirs)} vs {len(ours)} tokens; "
                f"e.g. {differ}): the teacher must score the student's own token ids, so pick a teacher of the student's "
                "family (Qwen3-8B for Qwen3-1.7B)")
    if distillation.uses_topk(cfg.distillation.distillation_loss.loss_mode):
        width = [AutoConfig.from_pretrained(p, trust_remote_code=cfg.model.trust_remote_code).vocab_size for p in (student, path)]
        if width[0] != width[1]:
            return (f"distillation.distillation_loss.loss_mode=forward_kl_topk: the teacher {path!r} has {width[1]} output "
                    f"logits, the student {student!r} {width[0]}: its top-k ids need the student's head; use loss_mode=k3 "
                    "(the sampled token's logprob only) or a teacher with the same vocab_size")
    return None


class Teacher(FrozenModel):
    """The frozen teacher, a `FrozenModel` like the reference. `score(batch)` fills the batch's teacher_* fields."""

    def __init__(self, cfg, *, device: torch.device):
        super().__init__(cfg, cfg.distillation.teacher_models.teacher_model.model_path, name="teacher", device=device)
        dl = cfg.distillation.distillation_loss
        self.topk = dl.topk if distillation.uses_topk(dl.loss_mode) else 0

    @perf.with_trainer_threads
    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> None:
        """The teacher's logprobs of `batch`'s loss tokens ([B, T], 0 elsewhere), and with forward_kl_topk its top-k ids
        and log-probabilities there ([B, T, k]), set on the batch; token-budgeted micro-batches (ref.log_prob_*), the
        results in the batch's row order. An empty micro-batch (fewer rows here than the agreed count) runs a dummy."""
        width = batch.input_ids.shape[1]
        share = attention.shares_prefixes(self.model)
        remove_padding = self.cfg.model.use_remove_padding
        index_lists = micro_batches(batch.seq_lens, **ref_pass_budget(self.cfg),
                                    groups=batch.group_ids if remove_padding and share else None)
        logprobs, topk_logprobs, topk_ids = [], [], []
        for idx in index_lists:
            mb = batch.select(idx) if idx else dummy_micro_batch(batch)
            score_mask = response_scores(mb)
            layout, _ = choose_layout(mb.input_ids, mb.attention_mask, score_mask, remove_padding=remove_padding,
                                      share_prefixes=share)
            with self.autocast():
                out = self.policy(mb.input_ids.to(self.device), mb.attention_mask.to(self.device),
                                  temperature=TEACHER_TEMPERATURE, **layout_kwargs(layout),
                                  score_mask=None if score_mask is None else score_mask.to(self.device),
                                  checkpoint_min_bytes=HEAD_CHECKPOINT_MIN_BYTES, topk=self.topk)
            pad = width - out[0].shape[1]
            logprobs.append(torch.nn.functional.pad(out[0].float().cpu(), (0, pad))[:len(idx)])  # [b, T]
            if self.topk:
                topk_logprobs.append(torch.nn.functional.pad(out.extra_logprobs.float().cpu(), (0, 0, 0, pad))[:len(idx)])
                topk_ids.append(torch.nn.functional.pad(out.topk_ids.cpu(), (0, 0, 0, pad))[:len(idx)])  # [b, T, k]
        batch.teacher_logprobs = restore_order(logprobs, index_lists)  # [B, T]
        if self.topk:
            batch.teacher_topk_logprobs = restore_order(topk_logprobs, index_lists)  # [B, T, k]
            batch.teacher_topk_ids = restore_order(topk_ids, index_lists)  # [B, T, k]
