"""Tests for data_prep/gsm8k.py and data_prep/math.py, offline: made-up rows in each dataset's format,
run end to end as scripts (subprocess, by path) and as functions; schema, ground truths, subsampling, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep import gsm8k as gsm8k_prep
from data_prep import math as math_prep
from grpo_lib.rewards import compute_score

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"data_source", "prompt", "ability", "reward_model", "extra_info"}

GSM8K_TRAIN = [
    {"question": "Tom has 1,000 apples and buys 234 more. How many?", "answer": "1000+234=<<1000+234=1234>>1234\n#### 1,234"},
    {"question": "A shop sells 3 pens for $2. What do 12 pens cost?", "answer": "12/3=4, 4*2=8\n#### 8"},
    {"question": "The temperature drops 5 degrees from 0. What is it?", "answer": "0-5=-5\n#### -5"},
    {"question": "Ann has 7 cats. Bob has 2 fewer. How many does Bob have?", "answer": "7-2=5\n#### 5"},
    {"question": "Half of 9 liters?", "answer": "9/2=4.5\n#### 4.5"},
    {"question": "How many days in 3 weeks?", "answer": "3*7=21\n#### 21"},
]
GSM8K_TEST = [
    {"question": "2 + 2?", "answer": "2+2=4\n#### 4"},
    {"question": "One million minus one?", "answer": "1000000-1=999999\n#### 999,999"},
]
MATH_TRAIN = [
    {"problem": "What is $1 \\div 2$?", "solution": "Dividing, we get $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Who won?", "solution": "It was $\\boxed{\\text{Evelyn}}$.", "level": "Level 2", "type": "Algebra"},
    {"problem": "Convert $(0,3)$ to polar.", "solution": "So $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.", "level": "Level 2", "type": "Precalculus"},
    {"problem": "Solve $|x-2.5| \\le 4.5$.", "solution": "First \\boxed{x} is bad; the set is $\\boxed{[-2,7]}$.", "level": "Level 3", "type": "Algebra"},
    {"problem": "Simplify $\\sqrt{50}$.", "solution": "$\\sqrt{50} = \\boxed{5\\sqrt{2}}$", "level": "Level 1", "type": "Algebra"},
]
MATH_TEST = [  # MATH-500 columns: answer / subject / unique_id instead of type
    {"problem": "Compute $3 \\cdot 4$.", "solution": "$\\boxed{12}$", "answer": "12", "subject": "Prealgebra", "level": 1, "unique_id": "a"},
    {"problem": "Name the set.", "solution": "No box here.", "answer": "\\{1,2\\}", "subject": "Algebra", "level": 2, "unique_id": "b"},
]


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def write_parquet_file(path: Path, records: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run a data_prep script by path, from outside the repo (so only the script's own sys.path fix helps)."""
    return subprocess.run([sys.executable, str(REPO / "data_prep" / script), *args], capture_output=True, text=True,
                          cwd="/", timeout=120)


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def check_rows(rows: list[dict], *, data_source: str, split: str, instruction: str):
    for row in rows:
        assert set(row) == ROW_KEYS, f"verl schema keys, got {sorted(row)}"
        assert row["data_source"] == data_source and row["ability"] == "math", f"data_source/ability: {row}"
        assert len(row["prompt"]) == 1 and row["prompt"][0]["role"] == "user", f"one user message: {row['prompt']}"
        assert row["prompt"][0]["content"].endswith(" " + instruction), f"instruction appended: {row['prompt']}"
        assert row["reward_model"]["style"] == "rule", f"rule-based reward: {row['reward_model']}"
        assert row["extra_info"]["split"] == split, f"extra_info.split: {row['extra_info']}"
        assert row["prompt"][0]["content"].startswith(row["extra_info"]["question"]), "question kept in extra_info"


# ------------------------------------------------------------------------------------------------ gsm8k
def test_gsm8k_script_end_to_end(tmp_path):
    train = write_parquet_file(tmp_path / "train.parquet", GSM8K_TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_TEST)
    result = run_script("gsm8k.py", "--input-train", train, "--input-test", test, "--out", str(tmp_path / "out"))
    assert result.returncode == 0, f"script failed: {result.stderr}"
    assert "wrote 6 train rows" in result.stdout and "sample row" in result.stdout, result.stdout
    rows = read_rows(tmp_path / "out" / "train.parquet")
    check_rows(rows, data_source="openai/gsm8k", split="train", instruction=gsm8k_prep.INSTRUCTION)
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["1234", "8", "-5", "5", "4.5", "21"], \
        "ground truth: text after ####, thousands commas removed"
    assert rows[0]["extra_info"] == {"split": "train", "index": 0, "question": GSM8K_TRAIN[0]["question"],
                                     "answer": GSM8K_TRAIN[0]["answer"]}, f"extra_info: {rows[0]['extra_info']}"
    test_rows = read_rows(tmp_path / "out" / "test.parquet")
    assert [row["reward_model"]["ground_truth"] for row in test_rows] == ["4", "999999"], "test ground truths"
    for row in rows + test_rows:  # every written ground truth is scorable by the trainer's reward
        gt = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], f"Let me think. #### {gt}", gt) == 1.0, f"gt {gt!r} must score 1"


def test_gsm8k_make_rows_for_synthetic_data():
    rows = gsm8k_prep.make_rows([{"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"}], "train",
                                data_source="synthetic/arithmetic")
    assert rows[0]["data_source"] == "synthetic/arithmetic", "data_source is passed through"
    assert rows[0]["prompt"][0]["content"] == f"What is 3 + 4? {gsm8k_prep.INSTRUCTION}", rows[0]["prompt"]
    assert compute_score("synthetic/arithmetic", "#### 7", rows[0]["reward_model"]["ground_truth"]) == 1.0


def test_gsm8k_subsampling_is_seeded_and_keeps_original_index(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_TEST)
    common = ["--input-train", train, "--input-test", test, "--train-size", "3", "--test-size", "1"]
    gsm8k_prep.main([*common, "--out", str(tmp_path / "a")])
    gsm8k_prep.main([*common, "--out", str(tmp_path / "b")])
    first, second = read_rows(tmp_path / "a" / "train.parquet"), read_rows(tmp_path / "b" / "train.parquet")
    assert len(first) == 3 and len(read_rows(tmp_path / "a" / "test.parquet")) == 1, "subsample sizes"
    assert first == second, "the same seed picks the same rows"
    indices = [row["extra_info"]["index"] for row in first]
    assert indices == sorted(indices) and len(set(indices)) == 3, f"original indices, in order: {indices}"
    for row in first:
        original = GSM8K_TRAIN[row["extra_info"]["index"]]
        assert row["extra_info"]["question"] == original["question"], "index points at the source record"


def test_gsm8k_single_input_with_split_column_and_saved_dataset(tmp_path):
    import datasets

    combined = [{**r, "split": "train"} for r in GSM8K_TRAIN] + [{**r, "split": "test"} for r in GSM8K_TEST]
    single = write_parquet_file(tmp_path / "all.parquet", combined)
    paths = gsm8k_prep.main(["--input", single, "--out", str(tmp_path / "one")])
    assert len(read_rows(Path(paths["train"]))) == 6 and len(read_rows(Path(paths["test"]))) == 2, "split column"
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_TRAIN),
                          "test": datasets.Dataset.from_list(GSM8K_TEST)}).save_to_disk(str(folder))
    paths = gsm8k_prep.main(["--input", str(folder), "--out", str(tmp_path / "two")])
    assert len(read_rows(Path(paths["test"]))) == 2, "saved DatasetDict folder"
    json_path = tmp_path / "train.json"
    json_path.write_text(json.dumps(GSM8K_TRAIN))
    paths = gsm8k_prep.main(["--input", str(json_path), "--input-test", str(folder), "--out", str(tmp_path / "three")])
    assert len(read_rows(Path(paths["train"]))) == 6, "--input without a split column is the train set"


@pytest.mark.parametrize("case", ["missing_file", "empty", "missing_column", "no_test_split", "no_marker"])
def test_gsm8k_errors_name_the_file(tmp_path, case):
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_TEST)
    if case == "missing_file":
        args, expected = ["--input-train", str(tmp_path / "nope.jsonl"), "--input-test", test], ["nope.jsonl", "not found"]
    elif case == "empty":
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        args, expected = ["--input-train", str(empty), "--input-test", test], ["empty.jsonl", "no rows"]
    elif case == "missing_column":
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"query": "1+1?", "answer": "#### 2"}])
        args, expected = ["--input-train", bad, "--input-test", test], ["bad.jsonl", "['question']", "columns found", "query"]
    elif case == "no_test_split":
        args, expected = ["--input-train", test], ["--input-test"]
    else:
        bad = write_jsonl(tmp_path / "nomarker.jsonl", [{"question": "1+1?", "answer": "it is 2"}])
        args, expected = ["--input-train", bad, "--input-test", test], ["record 0", "####"]
    result = run_script("gsm8k.py", *args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2, f"{case}: expected exit code 2, got {result.returncode}: {result.stderr}"
    for text in expected:
        assert text in result.stderr, f"{case}: {text!r} missing from the error: {result.stderr}"
    assert "Traceback" not in result.stderr, f"{case}: a clear message, not a traceback: {result.stderr}"


# ------------------------------------------------------------------------------------------------- math
def test_math_script_end_to_end(tmp_path):
    train = write_parquet_file(tmp_path / "train.parquet", MATH_TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl", MATH_TEST)
    result = run_script("math.py", "--input-train", train, "--input-test", test, "--out", str(tmp_path / "out"))
    assert result.returncode == 0, f"script failed: {result.stderr}"
    rows = read_rows(tmp_path / "out" / "train.parquet")
    check_rows(rows, data_source="DigitalLearningGmbH/MATH-lighteval", split="train", instruction=math_prep.INSTRUCTION)
    assert [row["reward_model"]["ground_truth"] for row in rows] == [
        "\\frac{1}{2}", "\\text{Evelyn}", "\\left( 3, \\frac{\\pi}{2} \\right)", "[-2,7]", "5\\sqrt{2}",
    ], "ground truth: the last \\boxed{} of the solution"
    assert rows[0]["extra_info"]["level"] == "Level 1" and rows[0]["extra_info"]["type"] == "Prealgebra", rows[0]
    assert rows[0]["extra_info"]["answer"] == MATH_TRAIN[0]["solution"], "the original solution is kept"
    test_rows = read_rows(tmp_path / "out" / "test.parquet")
    assert [row["reward_model"]["ground_truth"] for row in test_rows] == ["12", "\\{1,2\\}"], \
        "boxed answer, else MATH-500's answer column"
    assert test_rows[0]["extra_info"]["type"] == "Prealgebra", "MATH-500's subject fills type"
    for row in rows + test_rows:
        gt = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], f"So the answer is \\boxed{{{gt}}}.", gt) == 1.0, f"gt {gt!r}"


def test_math_function_subsample_and_data_source(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", MATH_TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl", MATH_TEST)
    paths = math_prep.main(["--input-train", train, "--input-test", test, "--train-size", "2", "--seed", "3",
                            "--data-source", "HuggingFaceH4/MATH-500", "--out", str(tmp_path / "out")])
    rows = read_rows(Path(paths["train"]))
    assert len(rows) == 2 and {row["data_source"] for row in rows} == {"HuggingFaceH4/MATH-500"}, rows
    import datasets  # verl reads the parquet with `datasets`; the nested columns must survive that

    loaded = datasets.load_dataset("parquet", data_files=paths["test"], split="train")
    assert loaded[0]["prompt"][0]["role"] == "user" and loaded[0]["reward_model"]["ground_truth"] == "12", loaded[0]


def test_math_errors(tmp_path):
    test = write_jsonl(tmp_path / "test.jsonl", MATH_TEST)
    gsm_style = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_TRAIN)
    result = run_script("math.py", "--input-train", gsm_style, "--input-test", test, "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "gsm.jsonl" in result.stderr and "columns found" in result.stderr, result.stderr
    with pytest.raises(ValueError, match="record 0"):
        math_prep.make_rows([{"problem": "x?", "solution": "cut off \\boxed{12"}], "train")
