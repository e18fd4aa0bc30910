"""Multi-turn episodes with the real engines (vLLM and transformers) on the tiny fp32 model, each engine in its own
process (tests/scripts/episode_engine.py): the episode holds the engine's sampled ids at the model's positions with
the template's tool turns between them, the trainer's logprobs of those ids equal the engine's across turns, and a
prompt's episodes do not depend on the other prompts of the batch (the seeds are per sample and turn).

The tiny model is random: its eos is made likely (conftest's `eos_model_dir`), so its turns end with its own
<|im_end|> after a few tokens, and every turn is read as a tool call by the script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # tiers: conftest.py: starts real engines

SCRIPT = str(REPO / "tests" / "scripts" / "episode_engine.py")


@pytest.fixture(scope="module", params=["vllm", "hf"])
def run(request, eos_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"episodes_{request.param}")
    proc = subprocess.run([sys.executable, SCRIPT, request.param, str(eos_model_dir), str(out_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        pytest.fail(f"{request.param} episode script exited {proc.returncode}\n{proc.stderr[-5000:]}")
    return request.param, json.loads((out_dir / "out.json").read_text())


def rows(out):
    return [(p, e) for p, group in zip(out["prompt_ids"], out["episodes"]) for e in group]


def test_episodes_hold_the_engines_sampled_ids_with_the_templates_tool_turns_between(run):
    name, out = run
    assert any(e["turns"] > 1 for _, e in rows(out)), f"{name}: no episode reached a second turn: the test would prove little"
    for (prompt, e), holes in zip(rows(out), out["holes"]):
        sequence = prompt + e["token_ids"]
        mine = []  # per engine call, the turn whose context is this episode's (identical twins match either one)
        for call in out["calls"]:
            match = [(c, s, lp) for c, s, lp in zip(call["prompts"], call["sampled"], call["logprobs"])
                     if sequence[:len(c) + len(s)] == c + s]
            mine += match[:1]
        assert len(mine) == e["turns"]
        mask = [0] * len(e["token_ids"])
        for context, sampled, logprobs in mine:  # the engine's ids and logprobs right after their context
            start = len(context) - len(prompt)
            assert e["logprobs"][start:start + len(sampled)] == logprobs
            mask[start:start + len(sampled)] = [1] * len(sampled)
        assert e["loss_mask"] == mask, f"{name}: the loss mask is not exactly the sampled positions"
        tool_turn = "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        if e["loss_mask"][-1] == 1:  # ended on a turn of the model's (turn limit, or a turn cut by the budget)
            assert holes == tool_turn * (e["turns"] - 1), name
        else:  # ended in a tool turn cut by the budget
            assert holes.startswith(tool_turn * (e["turns"] - 1)) and (tool_turn * e["turns"]).startswith(holes), name


def test_trainer_logprobs_equal_the_engines_across_turns(run):
    """fp32 engine and actor (DESIGN invariant 3 over episodes): the sampled tokens' logprobs agree to 1e-4."""
    name, out = run
    worst = 0.0
    for (_, e), trainer in zip(rows(out), out["trainer_logprobs"]):
        for lp, mask, mine in zip(e["logprobs"], e["loss_mask"], trainer):
            if mask:
                worst = max(worst, abs(lp - mine))
    assert worst < 1e-4, f"{name}: engine vs trainer logprob gap {worst} on the sampled tokens"


def test_a_prompts_episodes_do_not_depend_on_the_rest_of_the_batch(run):
    """Prompt B's episodes run with prompt A beside them equal B's run alone with the same seed: every (sample, turn)
    has its own seed, so the process count (which decides what runs beside what) changes nothing."""
    name, out = run
    assert out["alone"] == [e["token_ids"] for e in out["episodes"][1]], name
    first = out["calls"][0]
    assert first["seeds"] == [1234, 1235, 5678, 5679] and first["n"] == 1


def test_the_per_episode_loop_on_the_running_engine_gives_the_turn_loops_episodes(run):
    """vLLM only (the hf engine keeps the turn loop): the episodes of [A, B] again, each turn added to the running
    engine as its episode's tool answered (open_session), equal the turn loop's token for token, loss mask and stop
    alike; the logprobs within float32 round-off of the same computation in another batch (the contexts are the
    same, only what runs beside them differs: the tiny model's values are O(1), float32's eps 1.2e-7, a few
    hundred additions per logit -> well under 1e-4)."""
    name, out = run
    if name != "vllm":
        pytest.skip(reason="the hf engine has no GenerationSession: its episodes run turn by turn")
    for turn_group, episode_group in zip(out["episodes"], out["per_episode"]):
        for a, b in zip(turn_group, episode_group):
            assert (a["token_ids"], a["loss_mask"], a["stop"], a["turns"]) == (b["token_ids"], b["loss_mask"], b["stop"], b["turns"])
            assert max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0) < 1e-4
    assert any(e["turns"] > 1 for group in out["episodes"] for e in group), "the episodes had tool turns"
