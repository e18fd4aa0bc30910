"""The tiny Python tool demo (make demo-python-tool: recipes/tiny_cpu_python_tool.yaml, data_prep/synthetic.py --tool
python, data_prep/tiny_model.py --tool-config recipes/tool_config/tiny_python_tool_config.yaml): the warm-up's calls
are code the real PythonTool answers with exactly the response the warm-up shows, the data names the Python tool, and
(slow) the warmed-up tiny model calls the tool in a short training run, with no tool errors."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from data_prep import synthetic
from data_prep.tiny_model import load_tool_schemas, tool_episode_texts, tool_kind
from grpo_lib.tools.config import load_tools
from grpo_lib.tools.hermes import parse_tool_calls
from tests.conftest import REPO, read_metrics, run_train

TOOL_CONFIG = REPO / "recipes" / "tool_config" / "tiny_python_tool_config.yaml"


def test_warm_up_calls_are_code_the_python_tool_answers_as_the_warm_up_shows():
    """The warm-up episode's call parses (hermes) as a `python` call with `print(3 + 4)`, and the sandboxed tool's
    answer to it is the tool turn the warm-up trains on ("7\\n" inside <tool_response>)."""
    from data_prep.tiny_model import build_tokenizer

    schemas = load_tool_schemas(TOOL_CONFIG)
    assert tool_kind(schemas) == "python"
    renderer = build_tokenizer(["What is 3 + 4? 3 + 4 = 7\n#### 7"])
    row = {"question": "What is 3 + 4?", "a": 3, "op": "+", "b": 4, "result": 7}
    prompt, (call, trained_call), (tool_turn, trained_tool), (answer, _) = tool_episode_texts(
        renderer, schemas, row, use_tool=True, answer=7)
    assert "Call `python` to print the sum" in prompt[0] and trained_call and not trained_tool
    [parsed] = parse_tool_calls(call)
    assert parsed.name == "python" and parsed.arguments == {"code": "print(3 + 4)"}, parsed
    tool = load_tools(str(TOOL_CONFIG))["python"]
    text, _, _ = tool.execute("t", parsed.arguments)
    assert text == "7\n" and f"<tool_response>\n{text}\n</tool_response>" in tool_turn, (text, tool_turn)
    assert answer.startswith("3 + 4 = 7\n#### 7")


def test_tool_kind_refuses_a_tool_the_warm_up_cannot_call():
    schema = {"type": "function", "function": {"name": "search", "parameters": {"properties": {"query": {}}}}}
    with pytest.raises(ValueError, match="search"):
        tool_kind([schema])


def test_synthetic_python_tool_rows_name_the_python_tool(tmp_path):
    paths = synthetic.write_dataset(tmp_path, train_size=4, test_size=2, tool="python")
    row = pd.read_parquet(paths["train"]).iloc[0]
    assert row["prompt"][0]["content"] == "Call `python` to print the sum, then answer after ####."
    assert set(row["extra_info"]["tools_kwargs"]) == {"python"}
    with pytest.raises(ValueError, match="calculator"):
        synthetic.write_dataset(tmp_path, train_size=1, test_size=1, tool="abacus")


@pytest.mark.slow
def test_the_warmed_up_tiny_model_calls_the_python_tool_in_training(tmp_path):
    """The demo's setup end to end for 2 steps, smaller (4 prompts x 4, 200 warm-up steps): the warmed-up model calls
    `python` in training episodes, every call answered (no failures, errors or timeouts)."""
    from data_prep.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", tool_config=TOOL_CONFIG, tool_warmup_fraction=0.9, warmup_steps=200, seed=0)
    data = synthetic.write_dataset(tmp_path / "data", train_size=64, test_size=8, tool="python")
    out = tmp_path / "run"
    run_train([str(REPO / "recipes" / "tiny_cpu_python_tool.yaml"), f"model.path={model}",
               f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]", f"trainer.default_local_dir={out}",
               "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.total_training_steps=2",
               "trainer.val_before_train=false", "trainer.test_freq=-1", "rollout.enforce_eager=true"], timeout=900)
    rows = read_metrics(Path(out))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tools/python/calls"] > 0, f"the model made no python call at step {r['step']}"
        assert r["tools/python/failures"] == 0 and r["tools/errors"] == 0 and r["tools/timeouts"] == 0, r
