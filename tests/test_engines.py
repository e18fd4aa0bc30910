"""The two engines behind one interface: transformers (`rollout.name: hf`) generates what vLLM generates.

Each engine runs in its own process (tests/scripts/engine_generate.py) on the tiny fp32 model: greedy tokens
must be equal token for token, before and after a weight push, and a tensor-parallel vLLM engine over 2 processes
must generate what one process does; both satisfy the RolloutEngine protocol; sample k
of a request is seeded with seed + k in both; sampled-token logprobs equal the engine's own rescoring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, accelerate_launch

pytestmark = pytest.mark.slow  # tiers: conftest.py

SCRIPT = str(REPO / "tests" / "scripts" / "engine_generate.py")


def run_engine(name: str, model_dir, out_dir) -> list[dict]:
    """name: vllm, hf, or vllm_tp2 (2 gloo processes, one tensor-parallel vLLM engine over both)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, SCRIPT, name.removesuffix("_tp2"), str(model_dir), str(out_dir)]
    if name.endswith("_tp2"):
        cmd = [*accelerate_launch(2), *cmd[1:], "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        pytest.fail(f"{name} engine script exited {proc.returncode}\n{proc.stderr[-5000:]}")
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


@pytest.fixture(scope="module")
def outputs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    return {name: run_engine(name, tiny_model_dir, root / name) for name in ("vllm", "hf", "vllm_tp2")}


def test_hf_greedy_equals_vllm_token_for_token(outputs):
    (v,), (h,) = outputs["vllm"], outputs["hf"]
    assert len({tuple(t) for t in v["greedy"]}) > 1, "every prompt got the same continuation: the comparison would prove little"
    assert h["greedy"] == v["greedy"]
    assert v["greedy_after_push"] != v["greedy"], "the pushed weights did not change vLLM's output"
    assert h["greedy_after_push"] == v["greedy_after_push"], "after the same push the engines disagree"


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_engine_contract(outputs, name):
    (out,) = outputs[name]
    assert out["protocol"], f"{name} engine does not satisfy grpo_lib.engines.base.RolloutEngine"
    assert out["child_rule"], f"{name}: sample 1 of a request seeded s differs from a request seeded s + 1"
    assert len({tuple(s) for s in out["sampled"][0]}) == 3, "the 3 samples of one prompt are not independent"
    lp, rescored = out["sampled_logprobs"][0][0], out["sampled_rescored"]
    assert len(lp) == len(rescored) and max(abs(a - b) for a, b in zip(lp, rescored)) < 1e-4, (lp, rescored)


def test_tp2_generates_what_tp1_generates(outputs):
    """2 processes, rollout.tensor_model_parallel_size=2 (external_launcher, gloo): both ranks get the group's output,
    equal to the single-process engine's token for token, greedy and seeded sampling alike."""
    (one,), two = outputs["vllm"], outputs["vllm_tp2"]
    assert len(two) == 2
    for rank, out in enumerate(two):
        for key in ("greedy", "sampled", "greedy_after_push"):
            assert out[key] == one[key], f"TP 2 rank {rank} {key} differs from TP 1"


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_on_finished_reports_each_response_once_and_changes_nothing(outputs, name):
    """generate(on_finished=...) (the reward stream's path: vLLM then steps its engine with one request per sample)
    returns exactly what generate returns without it, reports every response once, after each engine step, as soon as
    it finishes."""
    (out,) = outputs[name]
    assert out["streamed_sampled"] == out["sampled"] and out["streamed_logprobs"] == out["sampled_logprobs"]
    assert out["streamed_greedy"] == out["greedy"]
    assert out["reported_once"] and out["reported_as_returned"]
    assert out["report_calls"] >= 12, "on_finished is called after every step (12 tokens: at least 12 steps)"
    # limits 4, 12, 8: a response is reported after the step that gave its last token, so shorter ones come first
    lengths = out["report_lengths"]
    assert len(lengths) == 3 and lengths == sorted(lengths) and len(set(lengths)) > 1, lengths
