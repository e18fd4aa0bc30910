"""Tests for grpo_lib.rollout.data: reading parquet/jsonl, chat template, overlong filter / truncation, clear errors,
the seeded resumable sampler. In-process and fast: a tiny byte-level BPE tokenizer with a Qwen-style template."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_lib.config import DataConfig
from grpo_lib.rollout.data import DataError, PromptSampler, load_prompts, render_prompt

SOURCE = "openai/gsm8k"


@pytest.fixture(scope="module")
def tokenizer():
    from data_prep.tiny_model import build_tokenizer

    return build_tokenizer([f"What is {a} + {b}? #### {a + b}" for a in range(10) for b in range(10)])


def cfg(**overrides) -> DataConfig:
    return dataclasses.replace(DataConfig(train_files=["unused"]), **overrides)


def row(question: str, answer: str = "7", index: int = 0, **extra) -> dict:
    return {"data_source": SOURCE, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": "train", "index": index},
            **extra}


def write_parquet(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def ids_of(tokenizer, question: str, **kwargs) -> list[int]:
    return render_prompt([{"role": "user", "content": question}], tokenizer, apply_chat_template=True,
                         system_prompt=kwargs.get("system_prompt"))


# Questions of clearly different lengths; LENGTHS[i] = tokens of QUESTIONS[i] after the chat template.
QUESTIONS = ["What is 1 + 2?", "What is 3 + 4? " * 8, "What is 5 + 6?", "What is 7 + 8? " * 20, "What is 9 + 0? " * 3]


@pytest.fixture(scope="module")
def lengths(tokenizer) -> list[int]:
    found = [len(ids_of(tokenizer, q)) for q in QUESTIONS]
    assert found[0] < found[4] < found[1] < found[3], f"test data must have distinct lengths: {found}"
    return found


# ------------------------------------------------------------------------------------- rendering
def test_chat_template_row_schema_and_fields(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [row("What is 3 + 4?", "7", 0), row("What is 1 + 1?", "2", 1)])
    data = load_prompts([path], tokenizer, cfg())
    text = tokenizer.decode(data.prompt_ids[0])
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n", f"chat template applied: {text!r}"
    assert data.ground_truths == ["7", "2"] and data.data_sources == [SOURCE, SOURCE], "reward fields kept"
    assert data.extra_infos[1] == {"split": "train", "index": 1}, f"extra_info as a plain dict: {data.extra_infos[1]}"
    assert (data.num_filtered, data.num_truncated) == (0, 0)
    batch = data.batch([1, 0])
    assert batch.ground_truths == ["2", "7"] and batch.group_ids == [data.uids[1], data.uids[0]], "batch picks rows"


def test_system_prompt_added_once(tokenizer, tmp_path):
    with_system = row("q", extra_info=None)
    with_system["prompt"] = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 1 + 2?"}]
    path = write_parquet(tmp_path / "t.parquet", [row("What is 1 + 2?"), with_system])
    data = load_prompts([path], tokenizer, cfg(system_prompt="Answer with ####."))
    first, second = (tokenizer.decode(ids) for ids in data.prompt_ids)
    assert first.startswith("<|im_start|>system\nAnswer with ####.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?"), first
    assert second.count("system") == 1 and "Be exact." in second and "Answer with" not in second, \
        f"a row with its own system message keeps it: {second!r}"


def test_prompt_as_plain_string_and_prompt_key(tokenizer, tmp_path):
    rows = [{"data_source": SOURCE, "question": "What is 3 + 4?", "reward_model": {"ground_truth": "7"}}]
    path = write_jsonl(tmp_path / "plain.jsonl", rows)
    data = load_prompts([path], tokenizer, cfg(prompt_key="question"))
    assert data.prompt_ids[0] == ids_of(tokenizer, "What is 3 + 4?"), "a plain string is one user message"
    assert data.extra_infos == [{}], "no extra_info column -> empty dict"
    raw = load_prompts([path], tokenizer, cfg(prompt_key="question", apply_chat_template=False))
    assert raw.prompt_ids[0] == tokenizer("What is 3 + 4?")["input_ids"], "no template: the text as is"
    digits = write_jsonl(tmp_path / "digits.jsonl", [{**rows[0], "question": "12"}, {**rows[0], "question": "34"}])
    data = load_prompts([digits], tokenizer, cfg(prompt_key="question"))  # pandas' read_json would make these ints
    assert data.prompt_ids[1] == ids_of(tokenizer, "34"), "a jsonl column of digit strings stays text"


def test_jsonl_and_json_equal_parquet(tokenizer, tmp_path):
    rows = [row(q, str(i), i) for i, q in enumerate(QUESTIONS)]
    rows[0]["reward_model"]["ground_truth"] = "0072"  # a string that looks like a number stays a string
    from_parquet = load_prompts([write_parquet(tmp_path / "a.parquet", rows)], tokenizer, cfg())
    from_jsonl = load_prompts([write_jsonl(tmp_path / "a.jsonl", rows)], tokenizer, cfg())
    (tmp_path / "a.json").write_text(json.dumps(rows))
    from_json = load_prompts([str(tmp_path / "a.json")], tokenizer, cfg())
    for other in (from_jsonl, from_json):
        assert other.prompt_ids == from_parquet.prompt_ids and other.ground_truths == from_parquet.ground_truths
        assert other.extra_infos == from_parquet.extra_infos
    assert from_jsonl.ground_truths[0] == "0072", f"jsonl ground truth kept verbatim: {from_jsonl.ground_truths[0]!r}"


def test_several_files_concatenated_with_unique_uids(tokenizer, tmp_path):
    first = write_parquet(tmp_path / "a" / "train.parquet", [row("What is 1 + 2?", "3", 0), row("What is 2 + 2?", "4", 1)])
    second = write_jsonl(tmp_path / "b" / "train.jsonl", [row("What is 5 + 5?", "10", 0)])
    data = load_prompts([first, second], tokenizer, cfg())
    assert data.ground_truths == ["3", "4", "10"], "files in order, rows in order"
    assert len(set(data.uids)) == 3, f"uids unique even when two files share the stem 'train': {data.uids}"
    single = load_prompts(first, tokenizer, cfg())
    assert len(single) == 2, "a single path (string) is accepted too"


# -------------------------------------------------------------------------- overlong prompts
def test_overlong_prompts_filtered_and_counted(tokenizer, tmp_path, lengths, caplog):
    path = write_parquet(tmp_path / "train.parquet", [row(q, str(i), i) for i, q in enumerate(QUESTIONS)])
    limit = lengths[4]  # rows 1 and 3 are longer; row 4 is exactly at the limit and stays
    with caplog.at_level(logging.WARNING, logger="grpo_lib.rollout.data"):
        data = load_prompts([path], tokenizer, cfg(max_prompt_length=limit, filter_overlong_prompts=True))
    assert data.num_filtered == 2 and data.ground_truths == ["0", "2", "4"], (data.num_filtered, data.ground_truths)
    assert all(len(ids) <= limit for ids in data.prompt_ids)
    assert f"dropped 2 of 5 prompts longer than data.max_prompt_length={limit}" in caplog.text, caplog.text


def test_everything_filtered_is_an_error(tokenizer, tmp_path, lengths):
    path = write_parquet(tmp_path / "train.parquet", [row(QUESTIONS[1]), row(QUESTIONS[3])])
    with pytest.raises(DataError, match="no prompts left .* all 2 were longer"):
        load_prompts([path], tokenizer, cfg(max_prompt_length=lengths[0]))


def test_truncation_error_names_file_row_and_length(tokenizer, tmp_path, lengths):
    path = write_parquet(tmp_path / "long.parquet", [row(q) for q in QUESTIONS])
    with pytest.raises(DataError) as info:
        load_prompts([path], tokenizer, cfg(max_prompt_length=lengths[4], filter_overlong_prompts=False, truncation="error"))
    message = str(info.value)
    for part in ("long.parquet", "row 1", f"{lengths[1]} tokens", f"data.max_prompt_length={lengths[4]}"):
        assert part in message, f"{part!r} missing from: {message}"


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_left_right(tokenizer, tmp_path, lengths, side, caplog):
    path = write_parquet(tmp_path / "t.parquet", [row(q) for q in QUESTIONS])
    limit = lengths[4]
    with caplog.at_level(logging.WARNING, logger="grpo_lib.rollout.data"):
        data = load_prompts([path], tokenizer, cfg(max_prompt_length=limit, filter_overlong_prompts=False, truncation=side))
    assert len(data) == 5 and data.num_truncated == 2 and data.num_filtered == 0
    full = ids_of(tokenizer, QUESTIONS[3])
    expected = full[-limit:] if side == "left" else full[:limit]
    assert data.prompt_ids[3] == expected, f"{side} truncation keeps the {'end' if side == 'left' else 'start'}"
    assert data.prompt_ids[0] == ids_of(tokenizer, QUESTIONS[0]), "short prompts untouched"
    assert "truncated 2 of 5 prompts" in caplog.text, caplog.text


# ------------------------------------------------------------------------------------ errors
def test_missing_column_names_columns_found(tokenizer, tmp_path):
    rows = [{"data_source": SOURCE, "question": "1+1?", "reward_model": {"ground_truth": "2"}}]
    path = write_parquet(tmp_path / "nocol.parquet", rows)
    with pytest.raises(DataError) as info:
        load_prompts([path], tokenizer, cfg())
    message = str(info.value)
    for part in ("nocol.parquet", "['prompt']", "columns found", "question", "data.prompt_key"):
        assert part in message, f"{part!r} missing from: {message}"


def test_empty_files(tokenizer, tmp_path):
    empty_parquet = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([row("x")]).slice(0, 0), empty_parquet)
    with pytest.raises(DataError, match=r"empty\.parquet.* holds no rows"):
        load_prompts([str(empty_parquet)], tokenizer, cfg())
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl.* holds no rows"):
        load_prompts([str(empty_jsonl)], tokenizer, cfg())


def test_missing_file_and_bad_files(tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet.* does not exist"):
        load_prompts([str(tmp_path / "nope.parquet")], tokenizer, cfg())
    with pytest.raises(DataError, match="no data files"):
        load_prompts([], tokenizer, cfg())
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported extension '.csv'"):
        load_prompts([str(csv)], tokenizer, cfg())
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(row("x")) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken\.jsonl.* line 2 is not valid JSON"):
        load_prompts([str(broken)], tokenizer, cfg())
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"garbage\.parquet.* cannot be read as parquet"):
        load_prompts([str(garbage)], tokenizer, cfg())


def test_bad_rows_name_the_row(tokenizer, tmp_path):
    no_truth = row("x")
    no_truth["reward_model"] = {"style": "rule"}
    path = write_jsonl(tmp_path / "rows.jsonl", [row("ok"), no_truth])
    with pytest.raises(DataError, match=r"rows\.jsonl.* row 1 \(0-based\): reward_model must be a dict with 'ground_truth'"):
        load_prompts([path], tokenizer, cfg())
    bad_prompt = row("x")
    bad_prompt["prompt"] = [{"role": "user"}]  # no content
    path = write_jsonl(tmp_path / "prompt.jsonl", [row("ok"), row("ok"), bad_prompt])
    with pytest.raises(DataError, match=r"prompt\.jsonl.* row 2 \(0-based\): cannot render column 'prompt'"):
        load_prompts([path], tokenizer, cfg())
    no_source = {k: v for k, v in row("x").items() if k != "data_source"}
    path = write_jsonl(tmp_path / "source.jsonl", [row("ok"), no_source])
    with pytest.raises(DataError, match=r"source\.jsonl.* row 1 \(0-based\): data_source must be a non-empty string"):
        load_prompts([path], tokenizer, cfg())


def test_tokenizer_without_chat_template(tokenizer, tmp_path):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    path = write_parquet(tmp_path / "t.parquet", [row("What is 1 + 2?")])
    with pytest.raises(DataError, match="no chat template: set data.apply_chat_template=false"):
        load_prompts([path], plain, cfg())
    assert len(load_prompts([path], plain, cfg(apply_chat_template=False))) == 1


# ------------------------------------------------------------------------------------ sampler
def take(sampler: PromptSampler, count: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(count)]


def test_sampler_seeded_epochs_and_drop_last():
    batches = take(PromptSampler(10, batch_size=4, seed=3), 4)  # 2 per epoch: rows of 2 epochs
    assert all(len(b) == 4 for b in batches)
    assert len(set(batches[0] + batches[1])) == 8, "no row twice within an epoch"
    assert batches[:2] != batches[2:], "each epoch draws a new permutation"
    assert take(PromptSampler(10, batch_size=4, seed=3), 4) == batches, "same seed, same batches"
    assert take(PromptSampler(10, batch_size=4, seed=4), 4) != batches, "another seed, another order"
    assert take(PromptSampler(10, batch_size=4, seed=3, shuffle=False), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]], \
        "no shuffle: file order, the incomplete last batch dropped"
    with pytest.raises(DataError, match="train_batch_size=11 is larger than the dataset"):
        PromptSampler(10, batch_size=11, seed=0)


def test_sampler_state_dict_resumes_the_same_batches():
    reference = PromptSampler(23, batch_size=5, seed=7)
    expected = take(reference, 12)  # crosses 2 epoch boundaries (4 batches per epoch)
    for stop in (0, 3, 4, 9):
        first = PromptSampler(23, batch_size=5, seed=7)
        head = take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
        resumed = PromptSampler(23, batch_size=5, seed=7)
        resumed.load_state_dict(state)
        assert head + take(resumed, 12 - stop) == expected, f"resume after {stop} batches changes the order"


def test_sampler_refuses_a_changed_dataset_or_seed():
    state = PromptSampler(23, batch_size=5, seed=7).state_dict()
    with pytest.raises(DataError, match="num_rows 23 -> 22"):
        PromptSampler(22, batch_size=5, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match="seed 7 -> 8"):
        PromptSampler(23, batch_size=5, seed=8).load_state_dict(state)


# ----------------------------------------------------------------------------- data_prep outputs
def test_math_prep_output_loads_and_ground_truths_score(tokenizer, tmp_path):
    from data_prep import math as math_prep
    from grpo_lib.rewards import compute_score

    records = [
        {"problem": "What is $1 \\div 2$?", "solution": "We get $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Algebra"},
        {"problem": "Convert $(0,3)$.", "solution": "So $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.", "level": "Level 2",
         "type": "Precalculus"},
        {"problem": "Name the set.", "solution": "No box.", "answer": "\\{1,2\\}", "level": "Level 1", "type": "Algebra"},
    ]
    source = write_jsonl(tmp_path / "math.jsonl", records)
    paths = math_prep.main(["--input-train", source, "--input-test", source, "--out", str(tmp_path / "out")])
    data = load_prompts([paths["train"], paths["test"]], tokenizer, cfg(max_prompt_length=1024))
    assert len(data) == 6 and data.ground_truths[:3] == ["\\frac{1}{2}", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\{1,2\\}"]
    assert "\\boxed{}" in tokenizer.decode(data.prompt_ids[0]), "MATH instruction in the rendered prompt"
    for data_source, truth in zip(data.data_sources, data.ground_truths):
        assert compute_score(data_source, f"So the answer is \\boxed{{{truth}}}.", truth) == 1.0, f"{truth!r} must score 1"


def test_gsm8k_sized_file_tokenizes_in_seconds(tokenizer, tmp_path):
    from data_prep.gsm8k import make_rows

    records = [{"question": f"Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in May. "
                            "How many clips did Natalia sell altogether in April and May?", "answer": f"#### {i}"}
               for i in range(7473)]
    path = write_parquet(tmp_path / "gsm8k_train.parquet", make_rows(records, "train"))
    start = time.perf_counter()
    data = load_prompts([path], tokenizer, cfg(max_prompt_length=1024))
    elapsed_s = time.perf_counter() - start
    assert len(data) == 7473
    assert elapsed_s < 30, f"7.5k GSM8K-sized prompts took {elapsed_s:.1f} s to load (about 1-2 s expected)"
