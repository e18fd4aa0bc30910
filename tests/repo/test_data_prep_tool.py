"""data_prep/gsm8k_tool.py, offline: made-up GSM8K rows through the script (by path) and its functions; verl's
multi-turn tool fields (system prompt naming the tool, tools_kwargs with the ground truth, interaction_kwargs), and the
written rows driving the gsm8k tool of recipes/tool_config/gsm8k_tool_config.yaml as the episode loop drives it."""

from __future__ import annotations

import pytest

from data_prep import gsm8k as gsm8k_prep
from data_prep import gsm8k_tool
from grpo_lib.rewards import compute_score
from tests.repo.test_data_prep import GSM8K_TEST, GSM8K_TRAIN, REPO, read_rows, run_script, write_jsonl, write_parquet_file

TOOL_CONFIG = REPO / "recipes" / "tool_config" / "gsm8k_tool_config.yaml"


def test_gsm8k_tool_script_writes_verls_multi_turn_fields(tmp_path):
    train = write_parquet_file(tmp_path / "train.parquet", GSM8K_TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_TEST)
    result = run_script("gsm8k_tool.py", "--input-train", train, "--input-test", test, "--out", str(tmp_path / "out"))
    assert result.returncode == 0, f"script failed: {result.stderr}"
    rows = read_rows(tmp_path / "out" / "train.parquet")
    single = gsm8k_prep.make_rows(GSM8K_TRAIN, "train")
    assert len(rows) == len(GSM8K_TRAIN) == len(single)
    for row, plain, record in zip(rows, single, GSM8K_TRAIN):
        gt = plain["reward_model"]["ground_truth"]
        assert row["data_source"] == "openai/gsm8k" and row["reward_model"] == {"style": "rule", "ground_truth": gt}
        system, user = row["prompt"]
        assert system["role"] == "system" and "`calc_gsm8k_reward`" in system["content"], "the system prompt names the tool"
        assert user == plain["prompt"][0], "the user turn is single-turn GSM8K's (question + instruction)"
        info = row["extra_info"]
        assert info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gt}}}, info
        assert info["interaction_kwargs"] == {"query": user["content"], "ground_truth": gt}, info
        assert info["need_tools_kwargs"] is True and info["question"] == record["question"] and info["split"] == "train"
        assert compute_score(row["data_source"], f"... #### {gt}", gt) == 1.0, "the final reward is GSM8K's rule"
    test_rows = read_rows(tmp_path / "out" / "test.parquet")
    assert [r["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] for r in test_rows] == \
        ["4", "999999"], "test split too"


def test_written_rows_give_the_gsm8k_tool_its_ground_truth(tmp_path):
    """The row's tools_kwargs reach Gsm8kTool.create as the episode loop passes them (ToolBox.start), so a call with the
    right answer scores 1.0 and a wrong one 0.0 (calc_reward, the episode's tool reward)."""
    import datasets

    from grpo_lib.tools.calls import ToolBox
    from grpo_lib.tools.config import load_tools
    from grpo_lib.tools.hermes import ToolCall

    paths = gsm8k_tool.main(["--input-train", write_jsonl(tmp_path / "tr.jsonl", GSM8K_TRAIN),
                             "--input-test", write_jsonl(tmp_path / "te.jsonl", GSM8K_TEST), "--out", str(tmp_path / "out")])
    loaded = datasets.load_dataset("parquet", data_files=paths["train"], split="train")  # as verl reads it
    first, second = loaded[0]["extra_info"], loaded[1]["extra_info"]
    box = ToolBox(load_tools(str(TOOL_CONFIG)), timeout_s=10, max_response_chars=256, truncate_side="middle")
    try:
        assert box.start([("a", first["tools_kwargs"]), ("b", second["tools_kwargs"])]) == [[], []]
        right, wrong = box.run([("a", ToolCall("calc_gsm8k_reward", {"answer": "1234"})),
                                ("b", ToolCall("calc_gsm8k_reward", {"answer": "9"}))])
        assert right.kind == wrong.kind == "ok" and "reward=1.0" in right.text and "reward=0.0" in wrong.text, (right, wrong)
        (rewards_a, failed_a), (rewards_b, _) = box.finish(["a", "b"])
        assert rewards_a == {"calc_gsm8k_reward": 1.0} and rewards_b == {"calc_gsm8k_reward": 0.0} and not failed_a
    finally:
        box.close()


def test_gsm8k_tool_make_rows_names_another_tool_and_checks_records():
    rows = gsm8k_tool.make_rows([{"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"}], "train",
                                data_source="synthetic/arithmetic", tool_name="calculator", system_prompt="Use `{tool}`.")
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Use `calculator`."}, rows[0]["prompt"]
    assert rows[0]["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {"ground_truth": "7"}}}
    with pytest.raises(ValueError, match="record 0"):
        gsm8k_tool.make_rows([{"question": "1+1?", "answer": "it is 2"}], "train")


def test_gsm8k_tool_script_errors_name_the_file(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"query": "1+1?", "answer": "#### 2"}])
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_TEST)
    result = run_script("gsm8k_tool.py", "--input-train", bad, "--input-test", test, "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "bad.jsonl" in result.stderr and "Traceback" not in result.stderr, result.stderr
