"""The models beside the policy that score its responses: `reward_model:` (verl's key names: a sequence-classification
reward model) and `judge:` (a generative judge served by its own vLLM engine in the trainer's processes).

How their scores join the rule rewards (docs/TRAINING.md, "Reward models and judges"): each is a reward function of
`reward.functions` by name (`reward_model`, `judge`, listed with its weight; enabling one adds it with weight 1.0 when the
list leaves it out), so a row's reward is

    sum over the listed rule functions that apply to the row of weight x score  +  w_rm x RM(row)  +  w_judge x judge(row)

A rule applies to a row when its data_source has a built-in reward (or reward.custom.path is set): with a reward model or
a judge on, rows of other data sources score by the models alone (no rule error). `reward.functions: [{name:
reward_model}]` alone is verl's behaviour (the RM's score replaces the rule's).

Field docstrings feed the config reference (docs/REFERENCE.md), as in `grpo_lib.config.schema` (which includes these).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo_lib.config.fields import may_change_on_resume


@dataclass
class RewardModelFSDPConfig:
    param_offload: bool = may_change_on_resume(False)
    """Keep the reward model's shards in CPU memory between uses (each FSDP unit copied to the GPU only for its own
    forward, as ref.fsdp_config.param_offload): frees its bf16 shards from the GPU while the policy's engine generates."""


@dataclass
class RewardModelModelConfig:
    path: str | None = None
    """The reward model's Hugging Face folder or hub name: a sequence-classification checkpoint (architectures
    *ForSequenceClassification, one label: the score), required with reward_model.enable. Loaded like the reference
    (read by process 0, sharded with FSDP2 over the trainer's processes, stored in model.dtype)."""
    input_tokenizer: str | None = None
    """The policy's tokenizer (verl's key) when the reward model's tokenizer differs: each response is then decoded to
    text and re-rendered with the reward model's own chat template ([prompt messages..., assistant: response]). null:
    the reward model reads the policy's token ids as they are (its tokenizer must be the policy's; checked at start)."""
    trust_remote_code: bool = False
    """Allow the reward model's own modeling code from its folder / the hub."""
    fsdp_config: RewardModelFSDPConfig = field(default_factory=RewardModelFSDPConfig)


@dataclass
class RewardModelConfig:
    enable: bool = False
    """Score every response with a learned reward model (reward_model.model.path) beside the rule rewards; its weight is
    reward.functions' `reward_model` entry (added with weight 1.0 when not listed)."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = may_change_on_resume(8)
    """Responses per reward-model forward on one process (without use_dynamic_bsz)."""
    use_dynamic_bsz: bool = may_change_on_resume(False)
    """Cut the reward model's forwards by tokens (forward_max_token_len_per_gpu) instead of by rows."""
    forward_max_token_len_per_gpu: int = may_change_on_resume(32768)
    """Token budget of one reward-model forward per process (prompt + response tokens, with use_dynamic_bsz)."""
    max_length: int | None = None
    """Longest input the reward model reads, in its own tokens. null: its config's max_position_embeddings. It must hold
    data.max_prompt_length + data.max_response_length (checked at start); a re-rendered input (input_tokenizer) longer
    than it is cut from the left (the response's end, where the score is read, is kept) and counted
    (reward_model/truncated)."""


@dataclass
class JudgeConfig:
    enable: bool = False
    """Score every response with a generative judge: a second model (judge.model_path) served by its own vLLM engine in
    each trainer process, resident beside the policy's (vLLM's sleep mode is one allocator per process). Its weight is reward.functions' `judge` entry (added with
    weight 1.0 when not listed)."""
    model_path: str | None = None
    """The judge's Hugging Face folder or hub name (a chat model; any tokenizer: it reads text)."""
    prompt_template: str | None = None
    """A text file: the judge's user message, with {response} (required) and optionally {prompt} (the policy's last user
    message) and {ground_truth}; literal braces doubled ({{ }}). It should ask for the score in the tag score_tag."""
    score_parser: str = "last_number_in_tag"
    """How the score is read from the judge's text: last_number_in_tag (the last number inside the last
    <score_tag>...</score_tag>), last_number (the last number anywhere), or FILE.py:FUNCTION (fn(text) -> float | None).
    A text without a score scores 0, is counted (judge/unparsed) and one sample is logged per step."""
    score_tag: str = "score"
    """The tag of last_number_in_tag: <score>7</score> reads 7."""
    score_scale: float = 1.0
    """The parsed number is divided by this (a 0-10 scale: 10 gives rewards in [0, 1])."""
    max_tokens: int = 256
    """Tokens the judge may write per response (its reasoning and the score)."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy, the same text for the same response)."""
    gpu_memory_utilization: float = may_change_on_resume(0.15)
    """The judge engine's share of the GPU (vLLM's own key), resident through the run: the plan counts it in every phase
    beside the policy engine's rollout.gpu_memory_utilization."""
    kv_cache_memory_bytes: int | None = may_change_on_resume(None)
    """The judge engine's KV cache in bytes (vLLM's own key; on CPU the default is 64 MiB)."""
