"""data_prep/python_tool.py, offline: made-up GSM8K and MATH rows through the script (by path); verl's multi-turn
fields for the code tool (the system prompt naming it, tools_kwargs, interaction_kwargs), the user turn and ground truth
of the single-turn rows, and the written rows driving the code tool of recipes/tool_config/python_tool_config.yaml."""

from __future__ import annotations

import pytest

from data_prep import gsm8k as gsm8k_prep
from data_prep import math as math_prep
from data_prep import python_tool
from tests.repo.test_data_prep import GSM8K_TEST, GSM8K_TRAIN, MATH_TEST, MATH_TRAIN, REPO, read_rows, run_script, write_jsonl

TOOL_CONFIG = REPO / "recipes" / "tool_config" / "python_tool_config.yaml"


@pytest.mark.parametrize("dataset, train, test, single", [("gsm8k", GSM8K_TRAIN, GSM8K_TEST, gsm8k_prep),
                                                          ("math", MATH_TRAIN, MATH_TEST, math_prep)])
def test_python_tool_script_writes_verls_multi_turn_fields(tmp_path, dataset, train, test, single):
    result = run_script("python_tool.py", "--dataset", dataset, "--input-train", write_jsonl(tmp_path / "tr.jsonl", train),
                        "--input-test", write_jsonl(tmp_path / "te.jsonl", test), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, f"script failed: {result.stderr}"
    rows = read_rows(tmp_path / "out" / "train.parquet")
    plain_rows = single.make_rows(train, "train")
    assert len(rows) == len(plain_rows) == len(train)
    for row, plain in zip(rows, plain_rows):
        gt = plain["reward_model"]["ground_truth"]
        assert row["data_source"] == plain["data_source"] and row["reward_model"] == plain["reward_model"]
        system, user = row["prompt"]
        assert system["role"] == "system" and "`code_interpreter`" in system["content"], "the system prompt names the tool"
        assert user == plain["prompt"][0], "the user turn is the single-turn row's (problem + instruction)"
        assert row["extra_info"]["tools_kwargs"] == {"code_interpreter": {"create_kwargs": {"ground_truth": gt}}}
        assert row["extra_info"]["need_tools_kwargs"] is True
        assert row["extra_info"]["interaction_kwargs"] == {"query": user["content"], "ground_truth": gt}
        assert gt not in system["content"], "the ground truth is never shown to the model"


def test_unknown_dataset_is_refused():
    with pytest.raises(ValueError, match="dataset 'aime': one of"):
        python_tool.make_rows([], "train", dataset="aime")


def test_rows_drive_the_code_tool_of_the_tool_config(tmp_path):
    from grpo_lib.tools import sandbox
    from grpo_lib.tools.calls import ToolBox
    from grpo_lib.tools.config import load_tools
    from grpo_lib.tools.hermes import ToolCall

    if {"landlock", "seccomp", "sandbox"} & set(sandbox.isolation_layers()["missing"]):
        pytest.skip(reason="the sandbox's layers are missing here (tests/tools/test_tools_python.py tests the refusal)")
    [row] = python_tool.make_rows(GSM8K_TRAIN[:1], "train", dataset="gsm8k")
    box = ToolBox(load_tools(str(TOOL_CONFIG)), timeout_s=30, max_response_chars=512, truncate_side="middle")
    try:
        assert box.start([("a", row["extra_info"]["tools_kwargs"])]) == [[]]
        [out] = box.run([("a", ToolCall("code_interpreter", {"code": "print(17 * 23)"}))])
        assert (out.kind, out.text) == ("ok", "391\n")
    finally:
        box.close()
