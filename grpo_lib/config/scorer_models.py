"""The checks of the models that score responses (`reward_model:`, `judge:`; grpo_lib/config/schema_reward_model.py):
their keys, the reward.functions entries that weigh them, and what their files must hold, each problem naming its key
and the fix. Reads only small files (a config.json, the judge's template), never weights, so a bad setting exits 2
within a second. Torch-free, like the whole config package.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from grpo_lib.config.schema import Config
from grpo_lib.core.names import JUDGE_TEMPLATE_TOKENS

SCORE_PARSERS = ("last_number_in_tag", "last_number")  # judge.score_parser's named functions (or FILE.py:FUNCTION)
TEMPLATE_FIELDS = ("response", "prompt", "ground_truth")  # the judge template's placeholders ({response} required)


def add_model_functions(cfg: Config) -> None:
    """resolve_defaults' part: an enabled reward model or judge not listed in reward.functions joins it with weight 1.0."""
    listed = [fn.get("name") for fn in cfg.reward.functions if isinstance(fn, dict)]
    for name, on in (("reward_model", cfg.reward_model.enable), ("judge", cfg.judge.enable)):
        if on and name not in listed:
            cfg.reward.functions = [*cfg.reward.functions, {"name": name, "weight": 1.0}]


def model_functions_on(cfg: Config) -> list[str]:
    """The model scorers this run has ([] , ["reward_model"], ["judge"] or both), in reward.functions' order."""
    on = {"reward_model": cfg.reward_model.enable, "judge": cfg.judge.enable}
    return [fn["name"] for fn in cfg.reward.functions if isinstance(fn, dict) and on.get(fn.get("name"), False)]


def read_config_json(path: str) -> dict | None:
    """A local model folder's config.json as a dict; None for a hub name or a folder without one (the load reports it)."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # check_model_folder names the damaged file
    return value if isinstance(value, dict) else None


def template_problem(path: str) -> str | None:
    """Why judge.prompt_template cannot render a judge prompt (None: it can): a missing file, a format error, a
    placeholder other than TEMPLATE_FIELDS, or no {response}."""
    key = f"judge.prompt_template={path!r}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"{key}: cannot read it ({exc}); point it at a text file holding the judge's instructions with {{response}}"
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as exc:
        return f"{key}: not a valid template ({exc}); write literal braces as {{{{ and }}}}"
    unknown = sorted(fields - set(TEMPLATE_FIELDS))
    if unknown:
        return (f"{key}: unknown placeholder(s) {unknown}; the template may use {{response}}, {{prompt}}, {{ground_truth}} "
                "(literal braces doubled: {{ }})")
    if "response" not in fields:
        return (f"{key} has no {{response}} placeholder, so the judge would never see the response it scores: add "
                "{response} where the answer to judge goes")
    return None


def scorer_model_problems(cfg: Config) -> list[str]:
    """Every problem of the reward_model: and judge: sections and their reward.functions entries (see the module docstring)."""
    p: list[str] = []
    rm, judge = cfg.reward_model, cfg.judge
    listed = [fn.get("name") for fn in cfg.reward.functions if isinstance(fn, dict)]
    for name, on, key in (("reward_model", rm.enable, "reward_model.enable"), ("judge", judge.enable, "judge.enable")):
        if name in listed and not on:
            p.append(f"reward.functions lists {name!r} but {key}=false: set {key}=true (and its model), or drop the entry")
    if rm.enable:
        p += _reward_model_problems(cfg)
    if judge.enable:
        if not judge.model_path:
            p.append("judge.enable=true needs judge.model_path: the judge's Hugging Face folder or hub name (a chat model)")
        if not judge.prompt_template:
            p.append("judge.enable=true needs judge.prompt_template: a text file with the judge's instructions and "
                     "{response} (e.g. recipes/judge/tiny_judge_template.txt)")
        elif problem := template_problem(judge.prompt_template):
            p.append(problem)
        parser = judge.score_parser
        if parser not in SCORE_PARSERS:
            file, _, function = parser.partition(":")
            if not (file.endswith(".py") and function):
                p.append(f"judge.score_parser={parser!r}: use one of {list(SCORE_PARSERS)} or FILE.py:FUNCTION (fn(text) -> "
                         "float or None)")
            elif not Path(file).expanduser().is_file():
                p.append(f"judge.score_parser={parser!r}: the file {file!r} does not exist")
        if not judge.score_tag or not judge.score_tag.replace("_", "").replace("-", "").isalnum():
            p.append(f"judge.score_tag={judge.score_tag!r}: a tag name of letters, digits, - or _ (default score)")
        if not judge.score_scale > 0:
            p.append(f"judge.score_scale={judge.score_scale}: must be > 0 (the parsed number is divided by it)")
        if judge.max_tokens < 1:
            p.append(f"judge.max_tokens={judge.max_tokens}: must be >= 1 (the judge's text holds its score)")
        if judge.temperature < 0:
            p.append(f"judge.temperature={judge.temperature}: must be >= 0 (0: greedy)")
        if not 0 < judge.gpu_memory_utilization < 1:
            p.append(f"judge.gpu_memory_utilization={judge.gpu_memory_utilization}: a share of the GPU in (0, 1)")
        judge_config = read_config_json(judge.model_path) if judge.model_path else None
        need = cfg.data.max_prompt_length + cfg.data.max_response_length + judge.max_tokens
        limit = (judge_config or {}).get("max_position_embeddings")
        if isinstance(limit, int) and limit < need + JUDGE_TEMPLATE_TOKENS:
            p.append(f"judge.model_path={judge.model_path!r} reads {limit} tokens (max_position_embeddings), below "
                     f"data.max_prompt_length + data.max_response_length + judge.max_tokens + {JUDGE_TEMPLATE_TOKENS} for the "
                     f"template = {need + JUDGE_TEMPLATE_TOKENS}: lower judge.max_tokens or those lengths, or pick a judge with a "
                     "longer context")
        if cfg.rollout.tensor_model_parallel_size > 1:
            p.append("judge.enable with rollout.tensor_model_parallel_size > 1 is not built: the judge engine runs on each "
                     "process alone; use tensor_model_parallel_size=1")
    if (rm.enable or judge.enable) and cfg.rollout.n_gpus_per_node > 0:
        p.append("reward_model.enable / judge.enable with rollout.n_gpus_per_node (one-step-off on split GPUs) is not built: "
                 "the model scorers run in the colocated step; drop rollout.n_gpus_per_node")
    return p


def _reward_model_problems(cfg: Config) -> list[str]:
    rm, d, p = cfg.reward_model, cfg.data, []
    path = rm.model.path
    if not path:
        return ["reward_model.enable=true needs reward_model.model.path: a sequence-classification checkpoint (a Hugging "
                "Face folder or hub name whose architectures end in ForSequenceClassification)"]
    if rm.micro_batch_size_per_gpu < 1:
        p.append(f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu}: must be >= 1")
    need = d.max_prompt_length + d.max_response_length
    if rm.use_dynamic_bsz and rm.forward_max_token_len_per_gpu < need:
        p.append(f"reward_model.forward_max_token_len_per_gpu={rm.forward_max_token_len_per_gpu} is below one sequence "
                 f"(data.max_prompt_length + data.max_response_length = {need}): raise it to at least {need}")
    config = read_config_json(path)
    if config is None:
        return p  # a hub name: the load checks the head
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        p.append(f"reward_model.model.path={path!r} has no classification head (architectures {architectures}): a reward model "
                 "is a *ForSequenceClassification checkpoint with one label; convert it (AutoModelForSequenceClassification "
                 "with num_labels=1, trained on preferences) or point reward_model.model.path at one")
    elif int(config.get("num_labels", len(config.get("id2label") or {0: 0}))) != 1:
        p.append(f"reward_model.model.path={path!r} has {len(config.get('id2label') or {})} labels: a reward model scores with "
                 "one (num_labels=1); pick a reward checkpoint, not a classifier")
    limit = rm.max_length if rm.max_length is not None else config.get("max_position_embeddings")
    if rm.max_length is not None and rm.max_length < 1:
        p.append(f"reward_model.max_length={rm.max_length}: must be >= 1 (null: the model's max_position_embeddings)")
    elif isinstance(limit, int) and limit < need:
        key = "reward_model.max_length" if rm.max_length is not None else f"reward_model.model.path={path!r}'s max_position_embeddings"
        p.append(f"{key} is {limit} tokens, below data.max_prompt_length + data.max_response_length = {need}: the reward model "
                 f"could not read a whole response; lower those lengths, or pick a reward model with a longer context")
    if rm.model.input_tokenizer is None:
        policy = read_config_json(cfg.model.path)
        if policy is not None and "vocab_size" in config and policy.get("vocab_size") != config.get("vocab_size"):
            p.append(f"reward_model.model.path={path!r} has vocab_size {config.get('vocab_size')}, model.path "
                     f"{policy.get('vocab_size')}: it cannot read the policy's token ids; set reward_model.model.input_tokenizer="
                     f"{cfg.model.path} so responses are re-rendered as text with the reward model's own chat template")
    return p
