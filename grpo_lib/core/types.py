"""Containers that travel between the phases of a step. Every tensor field carries its shape.

Layout of one trajectory row (B rows, T = longest prompt + response in the batch, right padded):

    input_ids      [p0 p1 p2 r0 r1 r2 r3 pad pad]
    attention_mask [ 1  1  1  1  1  1  1   0   0]
    response_mask  [ 0  0  0  1  1  1  1   0   0]   where the response is: every position after the prompt
    loss_mask      [ 0  0  0  1  1  1  1   0   0]   positions the loss trains on (here: all sampled tokens)

A row with a hole (a multi-turn episode: assistant tokens a*, then a tool's output t* that the policy did not
sample, then assistant tokens again; a masked truncation is a row whose loss_mask is all 0):

    input_ids      [p0 p1 a0 a1 t0 t1 t2 a2 a3 pad]
    response_mask  [ 0  0  1  1  1  1  1  1  1   0]   one contiguous span: prompt end to sequence end
    loss_mask      [ 0  0  1  1  0  0  0  1  1   0]   a subset of response_mask, holes allowed

Every loss term, count and per-token metric reads `loss_mask`; `response_mask` says where the prompt ends (the
response length metrics, the prompt text). Every per-token tensor (`*_logprobs`, `advantages`) is aligned with
`input_ids`: entry t is about token t, predicted from tokens < t. Rows of one prompt group are adjacent and share
a `group_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class PromptBatch:
    """Prompts of one step on this process, already tokenized."""

    prompt_ids: list[list[int]]  # [num_prompts][prompt_len]
    group_ids: list[str]  # [num_prompts] unique id of each prompt (the GRPO group key)
    data_sources: list[str]  # [num_prompts]
    ground_truths: list  # [num_prompts]
    extra_infos: list[dict]  # [num_prompts]
    messages: list[list[dict]] | None = None  # [num_prompts][messages] the chat the prompt renders (multi-turn, text scorers)

    def __len__(self) -> int:
        return len(self.prompt_ids)


@dataclass
class EpisodeStats:
    """What one multi-turn episode did (grpo_lib/rollout/episodes.py): the step's episode/* and tools/* metrics, and the tool
    rewards the reward function receives."""

    assistant_turns: int  # generations of the episode (>= 1)
    user_turns: int  # tool-response turns appended (one per assistant turn whose calls ran)
    stop: str  # "answer" (a turn without tool call), "turn_limit" (max_assistant_turns / max_user_turns), "length"
    calls: dict[str, int]  # tool name -> calls that reached its execute (well-formed calls, answered or not)
    failures: dict[str, int]  # tool name -> those of its calls that raised or timed out (a failed create included)
    invalid_calls: int = 0  # malformed JSON, unknown tool name, wrong arguments
    errors: int = 0  # tool methods that raised (or returned no text / no number)
    timeouts: int = 0  # tool methods stopped at rollout.multi_turn.tool_timeout_s
    truncated_responses: int = 0  # tool responses cut to rollout.multi_turn.max_tool_response_length
    dropped_calls: int = 0  # calls past rollout.multi_turn.max_parallel_calls in one turn (not run)
    abandoned_calls: int = 0  # timeouts of plain (sync) tool methods run in threads: they ran on
    reward_errors: int = 0  # calc_reward calls that raised, timed out or returned no finite number (scored 0)
    tool_rewards: dict[str, float] | None = None  # tool name -> calc_reward at the episode's end
    step_rewards: list[float] | None = None  # execute's step reward of each call run, in order


@dataclass
class Generation:
    """What the engine returns for one sampled response (or the episode loop for one multi-turn episode)."""

    token_ids: list[int]  # [response_len] (includes the eos token when the model stopped)
    logprobs: list[float]  # [response_len] engine's logprob of each sampled token (0 where none was sampled)
    text: str
    finish_reason: str  # "stop" or "length"
    loss_mask: list[int] | None = None  # [response_len] 1 on tokens the loss trains on, 0 on holes; None: all 1
    episode: EpisodeStats | None = None  # a multi-turn episode's facts; None for a single-turn response
    versions: list[int] | None = None  # [response_len] weight version that sampled each token (carry-over); None: the batch's


@dataclass
class ScoreRequest:
    """Sequences an engine scores inside a generate call that carries them (`generate(..., score=request)`; the weight
    probe, every step): the call fills `scores` with score_logprobs' result for the weights it generated with, and
    `weight_version` with that version; vLLM batches them with the call's requests, another engine scores them in it.
    Example: ScoreRequest([[5, 6, 7]]) after the call -> scores [[0.0, -1.2, -0.4]] (entry 0 of each is 0)."""

    sequences: list[list[int]]  # [S][L_s] token ids
    scores: list[list[float]] | None = None  # [S][L_s] filled by the generate call that carried the request
    weight_version: int | None = None  # the engine's weight version when it scored them

    def fill(self, scores: list[list[float]], *, weight_version: int) -> None:
        """The engine's side: the scores of `sequences`, from the weights of `weight_version`."""
        assert self.scores is None, "a ScoreRequest is scored by one generate call only"
        self.scores, self.weight_version = scores, weight_version


@dataclass
class RolloutBatch:
    """Trajectories of one step on this process (n per prompt, groups adjacent)."""

    input_ids: torch.Tensor  # [B, T] long, prompt + response, right padded
    attention_mask: torch.Tensor  # [B, T] long
    response_mask: torch.Tensor  # [B, T] float, 1 on every response position (prompt end to sequence end)
    loss_mask: torch.Tensor  # [B, T] float, 1 on the response tokens the loss trains on (a subset of response_mask)
    rollout_logprobs: torch.Tensor  # [B, T] float, engine's sampled-token logprobs (0 off-response)
    group_ids: list[str]  # [B]
    response_texts: list[str]  # [B]
    data_sources: list[str]  # [B]
    ground_truths: list  # [B]
    extra_infos: list[dict]  # [B]
    truncated: torch.Tensor  # [B] bool, hit max_response_length
    scores: torch.Tensor | None = None  # [B] float, weighted reward per response (+ the overlong penalty if enabled)
    overlong_penalties: torch.Tensor | None = None  # [B] float, the part of scores from reward.overlong_buffer (<= 0)
    accuracies: torch.Tensor | None = None  # [B] float, 1 correct / 0 wrong (accuracy reward > 0, or a custom `acc`); None: no such reward
    reward_baselines: torch.Tensor | None = None  # [B] float, remax: the score of a greedy response to the row's prompt
    token_rewards: torch.Tensor | None = None  # [B, T] score on the last response token (minus KL on loss tokens if in reward)
    advantages: torch.Tensor | None = None  # [B, T] float, algorithm.adv_estimator's advantage per loss token (0 elsewhere)
    old_logprobs: torch.Tensor | None = None  # [B, T] float, actor before this step's updates
    ref_logprobs: torch.Tensor | None = None  # [B, T] float, frozen reference
    teacher_logprobs: torch.Tensor | None = None  # [B, T] float, distillation teacher (temperature 1), 0 off the loss mask
    teacher_topk_logprobs: torch.Tensor | None = None  # [B, T, k] float, the teacher's k most likely tokens (forward_kl_topk)
    teacher_topk_ids: torch.Tensor | None = None  # [B, T, k] long, their ids (0 off the loss mask)
    weight_version: int | None = None  # the engine's weight version the rows were generated with (`engine.weight_version`)
    token_versions: torch.Tensor | None = None  # [B, T] long, weight version that sampled each response token (carry-over:
    # rollout.partial_rollout; a carried response's older tokens hold older versions); None: every token is weight_version's
    prompt_messages: list | None = None  # [B] the row's prompt as chat messages (kept for the reward model's re-rendering
    # and the judge: load_prompts(keep_messages=True)); None: not kept

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_lens(self) -> list[int]:
        """Real tokens (prompt + response) per row."""
        return self.attention_mask.sum(-1).tolist()

    @property
    def response_lengths(self) -> torch.Tensor:
        """Tokens after the prompt per row, holes included (the response/length_* metrics); not a loss count."""
        return self.response_mask.sum(-1)  # [B]

    def select(self, idx: list[int], *, width: int | None = None) -> RolloutBatch:
        """Rows `idx` (in that order), trimmed to their own longest row (`width`, when the caller knows it already:
        nothing is read from the tensors)."""
        index = torch.as_tensor(idx, dtype=torch.long)
        if width is None:
            width = int(self.attention_mask[index].sum(-1).max().item()) if len(idx) else 1
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index]
                if value.dim() >= 2:  # per-token tensors ([B, T] and the teacher's [B, T, k])
                    value = value[:, :width]
            elif isinstance(value, list):
                value = [value[i] for i in idx]
            out[f.name] = value
        return RolloutBatch(**out)

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Rows of several batches in one, per-token tensors right-padded to the widest."""
        if len(batches) == 1:
            return batches[0]
        width = max(b.input_ids.shape[1] for b in batches)
        out = {}
        for f in fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if isinstance(values[0], torch.Tensor):
                if values[0].dim() >= 2:  # per-token tensors, padded along T
                    values = [torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1])) for v in values]
                out[f.name] = torch.cat(values)
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif f.name == "weight_version":  # one batch, one version: rows of other weights are never mixed in
                if len(set(values)) > 1:
                    raise ValueError(f"RolloutBatch.concat: rows of weight versions {values}: a batch holds the rollouts "
                                     "of one weight version")
                out[f.name] = values[0]
            else:  # None: a field not filled yet
                out[f.name] = None
        return RolloutBatch(**out)


@dataclass
class AdapterWeights:
    """A LoRA adapter pushed on its own (rollout.lora_mode=adapter): the engine keeps its base weights and serves
    base + this adapter. `tensors`: PEFT's saved names (`base_model.model.<module>.lora_A.weight`, [r, in]; lora_B [out, r]),
    full (gathered from the shards), on the host; `config`: its peft LoraConfig as a dict (r, lora_alpha, target_modules)."""

    tensors: dict[str, torch.Tensor]
    config: dict

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
