"""Prompt datasets: parquet/jsonl loading in verl's row schema, chat template, overlong policy, resumable order.

A row (verl's schema, what `data_prep/` writes):

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold ... after \\"####\\"."}],
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

becomes a tokenized prompt (`prompt_ids`) plus what the reward needs:

    load_prompts(["~/data/gsm8k/train.parquet"], tokenizer, cfg.data)
    -> PromptDataset(prompt_ids=[[151644, 872, 198, ...]], uids=["0:train:0"], data_sources=["openai/gsm8k"],
                     ground_truths=["72"], extra_infos=[{"split": "train", "index": 0, ...}], ...)

Rules (the `data` config section):
- `prompt_key` names the prompt column: a list of chat messages or a plain string (read as one user message).
- `apply_chat_template`: render with the tokenizer's template (generation prompt added, no extra special
  tokens); off, the message contents are joined with newlines and tokenized with the tokenizer's special
  tokens (a base model's BOS). `system_prompt` goes in front of every prompt that has no system message.
- Prompts longer than `max_prompt_length` tokens are dropped and counted (`filter_overlong_prompts`, a
  warning says how many), else `truncation` decides: `error` (names file, row and length), `left` (keep the
  end, where the question and generation prompt are) or `right` (keep the start).
- Multi-turn runs (`load_prompts(..., tools=schemas)`) render the prompt with the template's `tools=` (the system
  message lists the tools, as verl's dataset does) and keep each prompt's messages (`PromptDataset.messages`): the
  episode loop renders the conversation again as it grows (grpo_lib/rollout/episodes.py).
- The order is a seeded permutation per epoch (`PromptSampler`); `state_dict()` is the position to resume from.

Speed: each file is rendered row by row (cheap) and tokenized in batched calls: a 7.5k-row GSM8K file
loads in about a second (2 CPU cores, tiny tokenizer).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from grpo_lib.core.types import PromptBatch

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")
TRUNCATION_MODES = ("error", "left", "right")
_TOKENIZE_CHUNK_ROWS = 8192  # rows per batched tokenizer call (bounds the transient encodings of a large file)


class DataError(ValueError):
    """A data file that cannot be used: the message names the file, row or column and the fix."""


# ------------------------------------------------------------------------------------------------ reading
def _read_json_records(path: Path) -> list[dict]:
    """Rows of a .jsonl file, or of a .json file holding a list, {"data": [...]}, or JSON lines.

    Parsed with `json`, not pandas: pandas' read_json turns a column of "72" strings into integers.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:  # e.g. a latin-1 export: name the place, not a decoder traceback
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataError(f"data file {str(path)!r} is not valid UTF-8: byte {error.start} (line {line}) is "
                        f"{raw[error.start:error.start + 1]!r} ({error.reason}); JSON data files are UTF-8: re-encode the "
                        f"file (for example iconv -f latin1 -t utf-8) or fix that line") from None
    if path.suffix.lower() == ".json" and text.strip():
        try:
            content = json.loads(text)
        except json.JSONDecodeError:
            content = None  # JSON lines in a .json file, as `datasets.to_json` writes
        if isinstance(content, dict) and "data" in content:
            content = content["data"]
        if isinstance(content, list):
            return content
        if content is not None:
            raise DataError(f"data file {str(path)!r}: expected a JSON list of rows (or {{'data': [...]}}), "
                            f"got {type(content).__name__}")
    records = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise DataError(f"data file {str(path)!r} line {line_number} is not valid JSON ({error})") from error
    return records


def read_table(path: str | Path) -> pd.DataFrame:
    """One .parquet / .jsonl / .json file as a DataFrame; a DataError for a missing, unreadable or empty file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data file {str(path)!r} does not exist: run the data_prep script first "
                        "or fix data.train_files / data.val_files")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            frame = pd.read_parquet(path)
        except Exception as error:  # pyarrow raises several types for a damaged file
            raise DataError(f"data file {str(path)!r} cannot be read as parquet ({type(error).__name__}: {error})") from error
    elif suffix in (".jsonl", ".json"):
        records = _read_json_records(path)
        bad = next((i for i, record in enumerate(records) if not isinstance(record, dict)), None)
        if bad is not None:
            raise DataError(f"data file {str(path)!r} row {bad} is not a JSON object: {str(records[bad])[:200]!r}")
        frame = pd.DataFrame.from_records(records)
    else:
        raise DataError(f"data file {str(path)!r}: unsupported extension {suffix!r}; use .parquet, .jsonl or .json")
    if len(frame) == 0:
        raise DataError(f"data file {str(path)!r} holds no rows (columns found: {list(frame.columns)})")
    return frame


def _plain(value):
    """parquet gives numpy arrays for lists; turn nested values into plain python."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# -------------------------------------------------------------------------------------------- rendering
def prompt_messages(prompt, *, system_prompt: str | None) -> list[dict]:
    """A prompt cell (chat messages or a plain string) -> its messages, system_prompt in front when it has none.

    Example: prompt_messages("What is 3 + 4?", system_prompt="Be brief.") -> [{"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 3 + 4?"}]. Raises ValueError for anything else.
    """
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt or \
            not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in prompt):
        raise ValueError(f"a prompt is a string or a non-empty list of {{'role', 'content'}} messages, got {str(prompt)[:200]!r}")
    if system_prompt and not any(m["role"] == "system" for m in prompt):
        prompt = [{"role": "system", "content": system_prompt}] + prompt
    return prompt


def render_text(prompt, tokenizer, *, apply_chat_template: bool, system_prompt: str | None,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """Chat messages (or a plain string) -> the prompt text the model sees, generation prompt included.

    Example: [{"role": "user", "content": "What is 3 + 4?"}] with a Qwen template ->
    "<|im_start|>user\\nWhat is 3 + 4?<|im_end|>\\n<|im_start|>assistant\\n"; without the template ->
    "What is 3 + 4?". `chat_template_kwargs` (data.apply_chat_template_kwargs) go to the template: Qwen3's
    {"enable_thinking": False} appends an empty think block so the model answers directly. `tools` (OpenAI function
    schemas, multi-turn runs) go to the template's `tools=`. Raises ValueError for a prompt that is neither a string nor
    a list of messages.
    """
    prompt = prompt_messages(prompt, system_prompt=system_prompt)
    if apply_chat_template:
        extra = {"tools": tools} if tools is not None else {}  # single-turn runs call the template exactly as before
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **extra,
                                             **(chat_template_kwargs or {}))
    return "\n".join(m["content"] for m in prompt)


def render_prompt(prompt, tokenizer, *, apply_chat_template: bool, system_prompt: str | None,
                  chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
    """`render_text` then tokenize: the prompt token ids, exactly as `load_prompts` makes them."""
    text = render_text(prompt, tokenizer, apply_chat_template=apply_chat_template, system_prompt=system_prompt,
                       chat_template_kwargs=chat_template_kwargs, tools=tools)
    return tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"]


# ---------------------------------------------------------------------------------------------- dataset
@dataclass
class PromptDataset:
    prompt_ids: list[list[int]]  # [rows][prompt_len]
    uids: list[str]  # [rows] "file-number:file-stem:row", unique even when two files share a name
    data_sources: list[str]  # [rows]
    ground_truths: list  # [rows]
    extra_infos: list[dict]  # [rows]
    num_filtered: int  # prompts dropped as longer than data.max_prompt_length
    num_truncated: int  # prompts cut to data.max_prompt_length by data.truncation
    num_invalid: int = 0  # rows dropped for a missing / None / NaN / empty ground truth (data.invalid_rows=drop)
    messages: list[list[dict]] = field(default_factory=list)  # [rows][messages] kept for multi-turn runs and text scorers, else []

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(self, idx: list[int]) -> PromptBatch:
        return PromptBatch(
            prompt_ids=[self.prompt_ids[i] for i in idx],
            group_ids=[self.uids[i] for i in idx],
            data_sources=[self.data_sources[i] for i in idx],
            ground_truths=[self.ground_truths[i] for i in idx],
            extra_infos=[self.extra_infos[i] for i in idx],
            messages=[self.messages[i] for i in idx] if self.messages else None,
        )


def _where(file: str, row_index: int) -> str:
    return f"data file {file!r} row {row_index} (0-based)"


def _check_row(file: str, row_index: int, row: dict) -> tuple[str, object]:
    """(data_source, ground_truth) of one row, or a DataError naming the file and row."""
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise DataError(f"{_where(file, row_index)}: data_source must be a non-empty string, got {data_source!r}")
    reward_model = _plain(row["reward_model"])
    if reward_model is None or isinstance(reward_model, float) and reward_model != reward_model:
        return data_source, None  # no reward_model at all (a null in parquet): a missing ground truth
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        found = sorted(reward_model) if isinstance(reward_model, dict) else repr(reward_model)
        raise DataError(f"{_where(file, row_index)}: reward_model must be a dict with 'ground_truth' "
                        f"(verl's schema), found {found}")
    return data_source, reward_model["ground_truth"]


def usable_ground_truth(value) -> bool:
    """False for a ground truth no reward can score against: None, NaN, an empty string or an empty list.

    Example: usable_ground_truth("72") -> True; usable_ground_truth(None) -> False; usable_ground_truth(" ") -> False.
    """
    if value is None or value is pd.NA:
        return False
    if isinstance(value, float) and value != value:  # NaN
        return False
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (list, tuple, dict)):
        return len(value) > 0
    return True


def load_prompts(files: list[str] | str, tokenizer, cfg, *, tools: list[dict] | None = None,
                 keep_messages: bool = False) -> PromptDataset:
    """Read, render and tokenize every file of `files` (in order) with the `data` config section `cfg`; with `tools`
    (a multi-turn run's tool schemas) the template lists them and each row's messages are kept, as with `keep_messages`
    (the reward model re-rendering a response with its own template, the judge quoting the prompt).

    Raises DataError (missing / empty / unreadable file, missing column, bad row, overlong prompt with
    truncation=error, nothing left after filtering). Warns with the count of dropped / truncated prompts.
    """
    files = [files] if isinstance(files, (str, Path)) else list(files)
    if not files:
        raise DataError("no data files given: set data.train_files (and data.val_files) to parquet/jsonl files")
    if cfg.truncation not in TRUNCATION_MODES:
        raise DataError(f"data.truncation={cfg.truncation!r}: use one of {list(TRUNCATION_MODES)}")
    if cfg.apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template: "
                        "set data.apply_chat_template=false to tokenize the prompt text as is, or use a chat model's tokenizer")
    out = PromptDataset([], [], [], [], [], 0, 0)
    limit = cfg.max_prompt_length
    for file_index, file in enumerate(files):
        file = str(file)
        frame = read_table(file)
        missing = [c for c in (cfg.prompt_key, *REQUIRED_COLUMNS) if c not in frame.columns]
        if missing:
            raise DataError(f"data file {file!r} lacks column(s) {missing}; columns found: {list(frame.columns)}. "
                            "Rows need verl's schema (see data_prep/), or set data.prompt_key to the prompt column")
        records = frame.to_dict("records")
        texts, checked, kept_rows, chats = [], [], [], []
        for row_index, row in enumerate(records):
            data_source, ground_truth = _check_row(file, row_index, row)
            if not usable_ground_truth(ground_truth):  # can never score: never trained or validated on
                if cfg.invalid_rows == "error":
                    raise DataError(f"{_where(file, row_index)}: reward_model.ground_truth is {ground_truth!r}, which no reward "
                                    "can score; fix the row, or set data.invalid_rows=drop to skip such rows (counted)")
                out.num_invalid += 1
                continue
            checked.append((data_source, ground_truth))
            kept_rows.append(row_index)
            try:
                texts.append(render_text(_plain(row[cfg.prompt_key]), tokenizer, apply_chat_template=cfg.apply_chat_template,
                                         system_prompt=cfg.system_prompt, chat_template_kwargs=cfg.apply_chat_template_kwargs,
                                         tools=tools))
                if tools is not None or keep_messages:
                    chats.append(prompt_messages(_plain(row[cfg.prompt_key]), system_prompt=cfg.system_prompt))
            except Exception as error:  # a malformed message list, or the chat template rejecting it
                raise DataError(f"{_where(file, row_index)}: cannot render column {cfg.prompt_key!r} "
                                f"({type(error).__name__}: {error})") from error
        all_ids = []  # batched calls: per-row calls cost ~3x more in Python overhead
        for start in range(0, len(texts), _TOKENIZE_CHUNK_ROWS):
            all_ids += tokenizer(texts[start:start + _TOKENIZE_CHUNK_ROWS], add_special_tokens=not cfg.apply_chat_template,
                                 return_attention_mask=False)["input_ids"]
        stem = Path(file).stem
        for position, (row_index, ids, (data_source, ground_truth)) in enumerate(zip(kept_rows, all_ids, checked)):
            row = records[row_index]
            if len(ids) > limit:
                if cfg.filter_overlong_prompts:
                    out.num_filtered += 1
                    continue
                if cfg.truncation == "error":
                    raise DataError(f"{_where(file, row_index)}: prompt has {len(ids)} tokens > data.max_prompt_length="
                                    f"{limit}; raise the limit, set data.filter_overlong_prompts=true or data.truncation=left|right")
                ids = ids[-limit:] if cfg.truncation == "left" else ids[:limit]
                out.num_truncated += 1
            out.prompt_ids.append(list(ids))
            if tools is not None or keep_messages:
                out.messages.append(chats[position])
            out.uids.append(f"{file_index}:{stem}:{row_index}")
            out.data_sources.append(data_source)
            out.ground_truths.append(ground_truth)
            extra = _plain(row.get("extra_info"))
            out.extra_infos.append(extra if isinstance(extra, dict) else {})
    total = len(out) + out.num_filtered + out.num_invalid
    if out.num_invalid:
        logger.warning("data: dropped %d of %d rows whose ground truth is missing, None, NaN or empty (data.invalid_rows=drop) "
                       "from %s", out.num_invalid, total, files)
    if out.num_filtered:
        logger.warning("data: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens "
                       "(data.filter_overlong_prompts=true) from %s", out.num_filtered, total, limit, files)
    if out.num_truncated:
        logger.warning("data: truncated %d of %d prompts to data.max_prompt_length=%d tokens (data.truncation=%s) from %s",
                       out.num_truncated, total, limit, cfg.truncation, files)
    if len(out) == 0 and out.num_invalid:
        raise DataError(f"no prompts left from {files}: {out.num_invalid} rows have no usable ground truth and "
                        f"{out.num_filtered} were longer than data.max_prompt_length={limit} tokens; check the files")
    if len(out) == 0:
        raise DataError(f"no prompts left from {files}: all {out.num_filtered} were longer than data.max_prompt_length="
                        f"{limit} tokens; raise data.max_prompt_length or check the files")
    return out


# ---------------------------------------------------------------------------------------------- sampler
class PromptSampler:
    """Seeded per-epoch permutation served in fixed-size batches (drop_last); its state resumes a run.

    Example: PromptSampler(10, batch_size=4, seed=1) serves 2 batches of epoch 0 (rows 8 of the permutation
    are used, 2 dropped), then epoch 1's permutation (seed + 1). Same seed -> same batches, on any machine.
    """

    def __init__(self, num_rows: int, *, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > num_rows:
            raise DataError(f"data.train_batch_size={batch_size} is larger than the dataset ({num_rows} prompts): lower it")
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order_cache: tuple[int, list[int]] | None = None  # (epoch, permutation)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            rng = np.random.default_rng(self.seed + self.epoch)
            self._order_cache = (self.epoch, rng.permutation(self.num_rows).tolist())
        return self._order_cache[1]

    def next_batch(self) -> list[int]:
        """The next `batch_size` row indices, starting a new epoch when the current one is used up."""
        if self.position + self.batch_size > self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return idx

    def state_dict(self) -> dict:
        """Where the next batch starts, plus what the order depends on (checked by load_state_dict)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`; a DataError if the data or the seed changed (the saved position would be meaningless)."""
        changed = [f"{key} {state[key]} -> {getattr(self, key)}" for key in ("num_rows", "seed", "shuffle")
                   if state[key] != getattr(self, key)]
        if changed:
            raise DataError(f"cannot resume the prompt order: {', '.join(changed)} since the checkpoint "
                            "(num_rows: the training files or the overlong filter changed; seed/shuffle: data.seed / "
                            "data.shuffle). Restore them, or start a fresh run")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
