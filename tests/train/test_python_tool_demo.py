"""The tiny Python tool demo (make demo-python-tool: recipes/tiny_cpu_python_tool.yaml, data_prep/synthetic.py --tool
python, data_prep/tiny_model.py --tool-config recipes/tool_config/tiny_python_tool_config.yaml): the warm-up's calls
are code the real PythonTool answers with exactly the response the warm-up shows, the data names the Python tool, and
(slow) the variant's recipe trains with every turn a python call, each answered by the sandbox."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from data_prep import synthetic
from data_prep.tiny_model import load_tool_schemas, tool_episode_texts, tool_kind
from grpo_lib.tools.config import load_tools
from grpo_lib.tools.hermes import parse_tool_calls
from tests.conftest import HF_ENGINE, REPO, read_metrics
from tests.train.test_train_tools_e2e import run_with_tool_calls

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
def test_the_python_tool_variant_trains_with_every_call_answered(eos_model_dir, tmp_path):
    """The variant's recipe, tool config and data end to end for 2 steps (4 prompts x 4) with every assistant turn read
    as a `python` call (tests/scripts/train_with_tool_calls.py: the random tiny model writes no calls; the demo's
    warm-up, 600 steps, is too long for the suite): each call runs in the sandbox and is answered (no failures,
    errors or timeouts). The hf engine: the subject is the variant, not the engine (tests/conftest.py HF_ENGINE)."""
    data = synthetic.write_dataset(tmp_path / "data", train_size=64, test_size=8, tool="python")
    out = tmp_path / "run"
    proc = run_with_tool_calls(
        [str(REPO / "recipes" / "tiny_cpu_python_tool.yaml"), f"model.path={eos_model_dir}",
         f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]", f"trainer.default_local_dir={out}",
         "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.total_training_steps=2",
         "data.max_prompt_length=512", "data.max_response_length=160",  # eos_model_dir's tokenizer: longer prompts
         "trainer.val_before_train=false", "trainer.test_freq=-1", HF_ENGINE],
        tool="python", arguments={"code": "print(6 * 7)"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(Path(out))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tools/python/calls"] > 0, f"no python call at step {r['step']}"
        assert r["tools/python/failures"] == 0 and r["tools/errors"] == 0 and r["tools/timeouts"] == 0, r
