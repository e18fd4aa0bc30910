"""Shared glue for the data_prep scripts: read local files, check columns, subsample, write parquet, CLI.

Every script writes `train.parquet` and `test.parquet` in verl's row schema:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "<question> <instruction>"}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "question": "...", "answer": "..."}}

Inputs (offline machines): `--input-train PATH --input-test PATH`, or `--input PATH` holding both splits
(a file with a `split` column, or a `datasets.save_to_disk` DatasetDict folder). A PATH is a .parquet,
.jsonl, .json or .arrow file, or a saved dataset folder. Without any of them, the hub dataset is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Callable

SPLITS = ("train", "test")


def read_records(path: str, split: str | None = None) -> list[dict]:
    """Rows of one local table as dicts. A saved DatasetDict folder needs `split` (one of its splits).

    Example: read_records("train.jsonl") -> [{"question": "...", "answer": "... #### 72"}, ...]
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"input not found: {path}")
    if os.path.isdir(path):
        import datasets

        dataset = datasets.load_from_disk(path)
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise ValueError(f"{path}: saved DatasetDict has splits {list(dataset)}; wanted {split!r}")
            dataset = dataset[split]
        return dataset.to_list()
    suffix = path.rsplit(".", 1)[-1].lower()
    if suffix == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix in ("jsonl", "json"):
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        try:
            content = json.loads(text) if suffix == "json" and text.strip() else None
        except json.JSONDecodeError:
            content = None  # a .json file holding JSON lines, as `datasets.to_json` writes
        if content is None:
            try:
                return [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: not valid JSON / JSON lines ({error})") from error
        if isinstance(content, dict) and "data" in content:
            content = content["data"]
        if not isinstance(content, list):
            raise ValueError(f"{path}: expected a JSON list of rows (or {{'data': [...]}}), got {type(content).__name__}")
        return content
    if suffix == "arrow":
        import datasets

        return datasets.Dataset.from_file(path).to_list()
    raise ValueError(f"{path}: unsupported input type {suffix!r}; use .parquet, .jsonl, .json, .arrow or a saved dataset folder")


def require_columns(records: list[dict], columns: tuple[str, ...], origin: str) -> None:
    """Raise ValueError naming `origin` if there are no rows or a column is missing."""
    if not records:
        raise ValueError(f"{origin}: no rows")
    found = sorted({key for record in records[:100] for key in record})
    missing = [column for column in columns if column not in found]
    if missing:
        raise ValueError(f"{origin}: missing column(s) {missing}; columns found: {found}")


def load_local_splits(*, input_path: str | None, input_train: str | None, input_test: str | None
                      ) -> dict[str, tuple[list[dict], str]]:
    """{"train": (records, origin), "test": (records, origin)} from the CLI's local-input options."""
    splits: dict[str, tuple[list[dict], str]] = {}
    if input_path is not None:
        if os.path.isdir(input_path):
            import datasets

            saved = datasets.load_from_disk(input_path)
            if isinstance(saved, datasets.DatasetDict):
                for split in SPLITS:
                    if split in saved:
                        splits[split] = (read_records(input_path, split), f"{input_path}[{split}]")
        if not splits:
            records = read_records(input_path)
            if records and "split" in records[0]:
                for split in SPLITS:
                    rows = [record for record in records if record.get("split") == split]
                    if rows:
                        splits[split] = (rows, f"{input_path}[split={split}]")
            else:
                splits["train"] = (records, input_path)
    if input_train is not None:
        splits["train"] = (read_records(input_train, "train"), input_train)
    if input_test is not None:
        splits["test"] = (read_records(input_test, "test"), input_test)
    missing = [split for split in SPLITS if split not in splits]
    if missing:
        given = {"--input": input_path, "--input-train": input_train, "--input-test": input_test}
        raise ValueError(f"no {missing} split from the local inputs {given}: pass --input-train/--input-test, "
                         "or --input with a 'split' column (values 'train'/'test') or a saved DatasetDict")
    return splits


def subsample(rows: list, size: int | None, seed: int) -> list:
    """`size` rows picked at random with `seed`, kept in their original order; all rows if size is None.

    Example: subsample(list("abcdef"), 3, seed=0) -> 3 of the letters, in order, the same every run.
    """
    if size is None or size >= len(rows):
        return list(rows)
    assert size > 0, f"subsample size must be > 0, got {size}"
    picked = sorted(random.Random(seed).sample(range(len(rows)), size))
    return [rows[i] for i in picked]


def write_parquet(rows: list[dict], path: str) -> str:
    """Write rows to `path` (parent folders created; written to a temp file then renamed). Returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert rows, f"refusing to write an empty parquet file to {path}"
    path = os.path.expanduser(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp"
    pq.write_table(pa.Table.from_pylist(rows), temporary)
    os.replace(temporary, path)
    return path



def checked_records(records, split: str, columns: tuple[str, ...], ground_truth: Callable[[dict], str]):
    """(index, record, its ground truth) for each record, in order; a record without one of `columns`, or whose ground
    truth `ground_truth(record)` cannot extract (ValueError), raises ValueError naming the split and the record's index.

    Example: list(checked_records([{"q": "1+1?", "a": "#### 2"}], "train", ("q", "a"), lambda r: r["a"][5:]))
             -> [(0, {"q": "1+1?", "a": "#### 2"}, "2")]
    """
    for index, record in enumerate(records):
        missing = [column for column in columns if column not in record]
        if missing:
            raise ValueError(f"{split} record {index} lacks {missing}; keys found: {sorted(record)}")
        try:
            truth = ground_truth(record)
        except ValueError as error:
            raise ValueError(f"{split} record {index}: {error}") from error
        yield index, record, truth


def build_arg_parser(*, description: str, default_out: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=default_out, help=f"output folder (default {default_out})")
    parser.add_argument("--input", help="local file/folder holding both splits ('split' column or DatasetDict)")
    parser.add_argument("--input-train", help="local train file/folder (.parquet/.jsonl/.json/.arrow/saved dataset)")
    parser.add_argument("--input-test", help="local test file/folder")
    parser.add_argument("--train-size", type=int, default=None, help="subsample train to this many rows")
    parser.add_argument("--test-size", type=int, default=None, help="subsample test to this many rows")
    parser.add_argument("--seed", type=int, default=0, help="subsampling seed")
    return parser


def prepare(*, args: argparse.Namespace, load_hub: Callable[[], dict[str, tuple[list[dict], str]]],
            required_columns: tuple[str, ...], make_rows: Callable[[list[dict], str], list[dict]]) -> dict[str, str]:
    """Load (local inputs, else hub) -> check columns -> rows -> subsample -> write -> print. Returns paths."""
    local = any(value is not None for value in (args.input, args.input_train, args.input_test))
    splits = (load_local_splits(input_path=args.input, input_train=args.input_train, input_test=args.input_test)
              if local else load_hub())
    sizes = {"train": args.train_size, "test": args.test_size}
    written = {}
    for split in SPLITS:
        records, origin = splits[split]
        require_columns(records, required_columns, origin)
        rows = subsample(make_rows(records, split), sizes[split], args.seed)
        path = write_parquet(rows, os.path.join(os.path.expanduser(args.out), f"{split}.parquet"))
        print(f"wrote {len(rows)} {split} rows (of {len(records)} in {origin}) to {path}")
        written[split] = path
    print("sample row:", json.dumps(rows[0], indent=2, ensure_ascii=False, default=str))
    return written



def prepare_with_data_source(argv: list[str] | None, *, description: str, default_out: str, data_source: str,
                             load_hub: Callable[[], dict[str, tuple[list[dict], str]]], required_columns: tuple[str, ...],
                             make_rows: Callable[..., list[dict]]) -> dict[str, str]:
    """A data-prep script's command line: `build_arg_parser`'s flags and `--data-source` (written in each row, default
    `data_source`), then `prepare` with `make_rows(records, split, data_source=...)`. Returns the written paths."""
    parser = build_arg_parser(description=description, default_out=default_out)
    parser.add_argument("--data-source", default=data_source, help="data_source written in each row")
    args = parser.parse_args(argv)
    return prepare(args=args, load_hub=load_hub, required_columns=required_columns,
                   make_rows=lambda records, split: make_rows(records, split, data_source=args.data_source))


def run_cli(main: Callable[[], object]) -> None:
    """Run a script's main; input problems exit with code 2 and a one-line message instead of a traceback."""
    try:
        main()
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
