"""Prompt datasets: parquet/jsonl loading in verl's row schema, chat template, overlong policy, resumable order.

A row (verl's schema, what `data_prep/` writes):

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold ... after \\"####\\"."}],
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

becomes a tokenized prompt (`prompt_ids`) plus what the reward needs. Prompts longer than
`data.max_prompt_length` are dropped and counted (`filter_overlong_prompts`), or cut / reported with their
file and row (`truncation`). The order is a seeded permutation per epoch; `PromptSampler.state_dict()` is
the position to resume from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from grpo_lib.types import PromptBatch

REQUIRED_COLUMNS = ("data_source", "reward_model")


class DataError(ValueError):
    """A data file that cannot be used: the message names the file, row or column and the fix."""


def read_table(path: str | Path) -> pd.DataFrame:
    """One parquet / jsonl / json file as a DataFrame; clear errors for a missing or empty file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data file {str(path)!r} does not exist: run the data_prep script first or fix data.train_files / data.val_files")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif suffix in (".jsonl", ".json"):
        frame = pd.read_json(path, lines=suffix == ".jsonl")
    else:
        raise DataError(f"data file {str(path)!r}: unsupported extension {suffix!r}; use .parquet, .jsonl or .json")
    if len(frame) == 0:
        raise DataError(f"data file {str(path)!r} holds no rows")
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


@dataclass
class PromptDataset:
    prompt_ids: list[list[int]]  # [rows][prompt_len]
    uids: list[str]  # [rows] "file-stem:row"
    data_sources: list[str]
    ground_truths: list
    extra_infos: list[dict]
    num_filtered: int  # prompts dropped as overlong
    num_truncated: int  # prompts cut by data.truncation

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(self, idx: list[int]) -> PromptBatch:
        return PromptBatch(
            prompt_ids=[self.prompt_ids[i] for i in idx],
            group_ids=[self.uids[i] for i in idx],
            data_sources=[self.data_sources[i] for i in idx],
            ground_truths=[self.ground_truths[i] for i in idx],
            extra_infos=[self.extra_infos[i] for i in idx],
        )


def render_prompt(prompt, tokenizer, *, apply_chat_template: bool, system_prompt: str | None) -> list[int]:
    """Chat messages (or a plain string) -> prompt token ids, generation prompt included.

    Example: [{"role": "user", "content": "What is 3 + 4?"}] with a Qwen template ->
    ids of "<|im_start|>user\\nWhat is 3 + 4?<|im_end|>\\n<|im_start|>assistant\\n".
    """
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt and not any(m.get("role") == "system" for m in prompt):
        prompt = [{"role": "system", "content": system_prompt}] + list(prompt)
    if apply_chat_template:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_prompts(files: list[str], tokenizer, cfg) -> PromptDataset:
    """Read and tokenize every file of `files` with the `data` config section `cfg`."""
    out = PromptDataset([], [], [], [], [], 0, 0)
    for file in files:
        frame = read_table(file)
        missing = [c for c in (cfg.prompt_key, *REQUIRED_COLUMNS) if c not in frame.columns]
        if missing:
            raise DataError(f"data file {file!r} lacks column(s) {missing}; columns found: {list(frame.columns)}. "
                            f"Rows need verl's schema (see data_prep/) or set data.prompt_key")
        stem = Path(file).stem
        for row_index, row in enumerate(frame.to_dict("records")):
            ids = render_prompt(_plain(row[cfg.prompt_key]), tokenizer, apply_chat_template=cfg.apply_chat_template, system_prompt=cfg.system_prompt)
            if len(ids) > cfg.max_prompt_length:
                if cfg.filter_overlong_prompts:
                    out.num_filtered += 1
                    continue
                if cfg.truncation == "error":
                    raise DataError(f"data file {file!r} row {row_index}: prompt has {len(ids)} tokens > data.max_prompt_length="
                                    f"{cfg.max_prompt_length}; raise the limit, set data.filter_overlong_prompts=true "
                                    "or data.truncation=left|right")
                ids = ids[-cfg.max_prompt_length:] if cfg.truncation == "left" else ids[:cfg.max_prompt_length]
                out.num_truncated += 1
            reward_model = _plain(row["reward_model"]) or {}
            if "ground_truth" not in reward_model:
                raise DataError(f"data file {file!r} row {row_index}: reward_model has no 'ground_truth' (found {sorted(reward_model)})")
            out.prompt_ids.append(ids)
            out.uids.append(f"{stem}:{row_index}")
            out.data_sources.append(str(row["data_source"]))
            out.ground_truths.append(reward_model["ground_truth"])
            extra = _plain(row.get("extra_info")) if "extra_info" in row else None
            out.extra_infos.append(extra if isinstance(extra, dict) else {})
    if len(out) == 0:
        raise DataError(f"no prompts left from {files}: {out.num_filtered} were longer than data.max_prompt_length="
                        f"{cfg.max_prompt_length}; raise it or check the files")
    return out


class PromptSampler:
    """Seeded per-epoch permutation served in fixed-size batches (drop_last); its state resumes a run."""

    def __init__(self, num_rows: int, *, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > num_rows:
            raise DataError(f"data.train_batch_size={batch_size} is larger than the dataset ({num_rows} prompts): lower it")
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        rng = np.random.default_rng(self.seed + self.epoch)
        return rng.permutation(self.num_rows).tolist()

    def next_batch(self) -> list[int]:
        """The next `batch_size` row indices, starting a new epoch when the current one is used up."""
        if self.position + self.batch_size > self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
