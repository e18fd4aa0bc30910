"""The reward model (reward_model.enable): a sequence-classification checkpoint that scores each whole response.

It is built as the KL reference is (grpo_lib/model/reference.py `FrozenModel`): read by process 0, sharded with FSDP2 over
every trainer process, stored in model.dtype and computing in the actor's param_dtype, its shards in CPU memory between
uses with reward_model.model.fsdp_config.param_offload. It scores right after generation (the rule rewards streamed
meanwhile), in token-budgeted micro-batches (reward_model.micro_batch_size_per_gpu, or use_dynamic_bsz with
forward_max_token_len_per_gpu) whose count every process agrees on (an empty one runs a dummy row), so it also scores
validation and DAPO's extra rounds. Its forward is a collective of the trainer's processes: it cannot interleave with
each process's own engine steps, so it does not overlap generation (the rule rewards do).

The score of a row: the classification head (`score`, or `classifier`) on the hidden state of the row's LAST real token
(right-padded rows, attention mask; read from the head's per-token output, so a pad id equal to eos cannot move it).

Inputs: with reward_model.model.input_tokenizer null, the row's own token ids (prompt + response, as the policy
rendered them; the tokenizers are checked to match at start). With input_tokenizer set (the policy's tokenizer), the
response is decoded to text (special tokens dropped) and the chat [prompt messages..., {"role": "assistant", "content":
response}] is rendered with the reward model's own chat template (verl's `_switch_chat_template`); an input longer than
the reward model's max length (or, with use_dynamic_bsz, than its token budget) keeps its last tokens (counted:
reward_model/truncated).
"""

from __future__ import annotations

import torch

from grpo_lib.core import perf
from grpo_lib.core.types import RolloutBatch
from grpo_lib.model import fsdp
from grpo_lib.model.batching import restore_order
from grpo_lib.model.passes import micro_batches
from grpo_lib.model.reference import FrozenModel

HEAD_NAMES = ("score", "classifier")  # the classification head's attribute in transformers' *ForSequenceClassification


def tokenizer_problem(cfg, policy_tokenizer) -> str | None:
    """Why the reward model cannot read the policy's token ids as they are (None: it can, or it re-renders text):
    without reward_model.model.input_tokenizer its tokenizer's vocabulary must be model.path's. Reads tokenizers only."""
    from transformers import AutoTokenizer

    rm = cfg.reward_model
    key = f"reward_model.model.path={rm.model.path!r}"
    try:
        tokenizer = AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        return f"{key}: cannot load a tokenizer from it ({exc}); point it at a Hugging Face model folder or hub name"
    if rm.model.input_tokenizer is None and tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        return (f"{key} has another tokenizer than model.path={cfg.model.path!r} ({len(tokenizer)} vs {len(policy_tokenizer)} "
                f"tokens): set reward_model.model.input_tokenizer={cfg.model.path} so each response is re-rendered as text "
                "with the reward model's own chat template")
    if rm.model.input_tokenizer is not None and not tokenizer.chat_template:
        return (f"{key}: its tokenizer has no chat template, so a response cannot be re-rendered for it "
                "(reward_model.model.input_tokenizer is set); use a reward model with a chat template")
    return None


class RewardModel(FrozenModel):
    """The frozen reward model; `score(batch)` -> one float per row (and `metrics`)."""

    def __init__(self, cfg, *, device: torch.device, policy_tokenizer):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        rm = cfg.reward_model
        super().__init__(cfg, rm.model.path, name="reward model", device=device, offload=rm.model.fsdp_config.param_offload,
                         trust_remote_code=rm.model.trust_remote_code, auto_class=AutoModelForSequenceClassification,
                         remove_padding=False)
        head = next((name for name in HEAD_NAMES if isinstance(getattr(self.model, name, None), torch.nn.Module)), None)
        if head is None:
            raise ValueError(f"reward_model.model.path={rm.model.path!r}: {type(self.model).__name__} has no classification "
                             f"head named {HEAD_NAMES}; use a transformers *ForSequenceClassification reward model")
        self.head = head
        self.tokenizer = AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
        self.policy_tokenizer = policy_tokenizer
        self.rerender = rm.model.input_tokenizer is not None
        self.max_length = rm.max_length or int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        if rm.use_dynamic_bsz:  # a row over the token budget could not be placed in any micro-batch
            self.max_length = min(self.max_length, rm.forward_max_token_len_per_gpu)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.budget = dict(max_tokens=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None,
                           micro_batch_size=rm.micro_batch_size_per_gpu)
        self.metrics: dict[str, float] = {}

    def inputs(self, batch: RolloutBatch) -> tuple[list[list[int]], int]:
        """Each row's input ids for the reward model and how many were cut to max_length (from the left; with
        use_dynamic_bsz also to forward_max_token_len_per_gpu)."""
        if len(batch) == 0:  # a process without rows (it still joins the forwards: `score` runs dummies)
            return [], 0
        if not self.rerender:
            rows = [batch.input_ids[i][batch.attention_mask[i] > 0].tolist() for i in range(len(batch))]
        else:
            assert batch.prompt_messages is not None, "re-rendering needs the prompts' messages: load_prompts(keep_messages=True)"
            rows = []
            for i in range(len(batch)):
                response_ids = batch.input_ids[i][batch.response_mask[i] > 0].tolist()
                response = self.policy_tokenizer.decode(response_ids, skip_special_tokens=True)
                chat = self.tokenizer.apply_chat_template([*batch.prompt_messages[i], {"role": "assistant", "content": response}],
                                                          tokenize=False, add_generation_prompt=False)
                rows.append(self.tokenizer(chat, add_special_tokens=False)["input_ids"])  # as load_prompts tokenizes a render
        cut = sum(len(r) > self.max_length for r in rows)
        return [r[-self.max_length:] for r in rows], cut

    @perf.with_trainer_threads
    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> list[float]:
        """The reward model's score of every row of `batch` (in row order); every trainer process calls it (the forwards
        are collectives), with however many rows it holds (none: dummy forwards). Sets `metrics` (local sums)."""
        rows, cut = self.inputs(batch)
        index_lists = micro_batches([len(r) for r in rows], **self.budget)
        scores = []
        for idx in index_lists:
            chunk = [rows[i] for i in idx] or [[self.pad_id, self.pad_id]]  # a dummy row keeps the collectives in step
            width = max(len(r) for r in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # [b, T] right padded
            mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [b, T]
            for j, r in enumerate(chunk):
                ids[j, :len(r)], mask[j, :len(r)] = torch.tensor(r), 1
            last = torch.tensor([len(r) - 1 for r in chunk], device=self.device)  # [b]
            ids, mask = ids.to(self.device), mask.to(self.device)

            def forward(model, ids=ids, mask=mask, last=last):
                hidden = getattr(model, model.base_model_prefix)(input_ids=ids, attention_mask=mask).last_hidden_state
                per_token = getattr(model, self.head)(hidden)  # [b, T, 1]
                return per_token[torch.arange(per_token.shape[0], device=per_token.device), last, 0].float()  # [b]

            with self.autocast():
                out = fsdp.in_root_forward(self.policy, forward)
            scores.append(out.cpu()[:len(idx)])
        self.metrics = {"reward_model/truncated": float(cut)}
        return restore_order(scores, index_lists).tolist() if rows else []
