"""The two engines behind one interface: transformers (`rollout.name: hf`) generates what vLLM generates.

Each engine runs in its own process (tests/scripts/engine_generate.py) on the tiny fp32 model: greedy tokens
must be equal token for token, before and after a weight push, and a tensor-parallel vLLM engine over 2 processes
must generate what one process does (and starts while another run's CPU TP shared memory holds vLLM's names); both
satisfy the RolloutEngine protocol; sample k
of a request is seeded with seed + k in both; sampled-token logprobs equal the engine's own rescoring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from grpo_lib.rollout.engines.vllm import SHM_DIR, SHM_PREFIX, cpu_shm_names_of_this_run, remove_stale_shm
from tests.conftest import REPO, run_script

pytestmark = pytest.mark.slow  # tiers: conftest.py

SCRIPT = str(REPO / "tests" / "scripts" / "engine_generate.py")


def run_engine(name: str, model_dir, out_dir) -> list[dict]:
    """name: vllm, hf, or vllm_tp2 (2 gloo processes, one tensor-parallel vLLM engine over both)."""
    cmd = [SCRIPT, name.removesuffix("_tp2"), str(model_dir), str(out_dir)]
    proc = run_script([*cmd, "2"], procs=2, timeout=900) if name.endswith("_tp2") else run_script(cmd, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"{name} engine script exited {proc.returncode}\n{proc.stderr[-5000:]}")
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


# vLLM's own names for a CPU TP-2 group's shared memory under external_launcher (grpo_lib/rollout/engines/vllm.py docstring):
# another run alive, or a SIGKILLed one, holds them; vLLM alone then fails with "create shm ... errno: 17".
VLLM_SHM_NAMES = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1"]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def outputs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    out = {name: run_engine(name, tiny_model_dir, root / name) for name in ("vllm", "hf")}
    held = [SHM_DIR / n for n in VLLM_SHM_NAMES if not (SHM_DIR / n).exists()]
    stale = SHM_DIR / f"{SHM_PREFIX}{dead_pid()}-tp:0-[0-1]-cpushm_0"
    for path in [*held, stale]:
        path.touch()
    os.utime(stale, (0, 0))  # made long ago (younger segments are kept: remove_stale_shm)
    try:
        out["vllm_tp2"] = run_engine("vllm_tp2", tiny_model_dir, root / "vllm_tp2")
    finally:
        for path in held:
            path.unlink(missing_ok=True)
    out["stale_shm_left"] = stale.exists()
    stale.unlink(missing_ok=True)
    return out


def test_hf_greedy_equals_vllm_token_for_token(outputs):
    (v,), (h,) = outputs["vllm"], outputs["hf"]
    assert len({tuple(t) for t in v["greedy"]}) > 1, "every prompt got the same continuation: the comparison would prove little"
    assert h["greedy"] == v["greedy"]
    assert v["greedy_after_push"] != v["greedy"], "the pushed weights did not change vLLM's output"
    assert h["greedy_after_push"] == v["greedy_after_push"], "after the same push the engines disagree"


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_engine_contract(outputs, name):
    (out,) = outputs[name]
    assert out["protocol"], f"{name} engine does not satisfy grpo_lib.rollout.engines.base.RolloutEngine"
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


def test_tp2_starts_next_to_another_runs_shared_memory(outputs):
    """vLLM's default segment names were taken while the TP-2 engine started (fixture): it used this run's own, and
    removed the segment a dead run left behind."""
    assert len(outputs["vllm_tp2"]) == 2
    assert all(out["tp_communicator"] == "_CPUSHMDistributed" for out in outputs["vllm_tp2"]), \
        "the TP group fell back to torch.distributed: its ranks disagreed on the shared-memory name"
    assert not outputs["stale_shm_left"], "the segment of a run whose rank 0 is gone was not removed"


def test_cpu_shm_names_carry_the_run_prefix(monkeypatch):
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what the CPU worker sets under external_launcher
    group = SimpleNamespace(unique_name="tp:0", ranks=[2, 3])
    assert _CPUSHMDistributed.make_group_name(group) == "//-tp:0-[2-3]-cpushm"
    with cpu_shm_names_of_this_run("grpo123"):
        assert _CPUSHMDistributed.make_group_name(group) == "grpo123-tp:0-[2-3]-cpushm"
    assert _CPUSHMDistributed.make_group_name(group) == "//-tp:0-[2-3]-cpushm", "vLLM's own naming was not restored"


def test_only_dead_runs_segments_are_removed(tmp_path):
    """Segments of a dead rank 0 made over a minute ago go; a live pid's, a just-made one's (a run starting in another
    PID namespace may look dead) and other programs' stay."""
    live, dead, dead_young = os.getpid(), dead_pid(), dead_pid()
    names = [f"{SHM_PREFIX}{live}-tp:0-[0-1]-cpushm_0", f"{SHM_PREFIX}{dead}-tp:0-[0-1]-cpushm_0",
             f"{SHM_PREFIX}{dead}-tp:0-[0-1]-cpushm_1", f"{SHM_PREFIX}{dead_young}-tp:0-[0-1]-cpushm_0",
             "-tp:0-[0-1]-cpushm_0", "psm_1234"]
    for name in names:
        (tmp_path / name).touch()
        if not name.startswith(f"{SHM_PREFIX}{dead_young}-"):
            os.utime(tmp_path / name, (0, 0))
    assert sorted(remove_stale_shm(tmp_path)) == sorted(names[1:3])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[0], *names[3:]])


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_a_score_request_comes_back_from_the_generate_call_that_carried_it_and_changes_nothing(outputs, name):
    """generate(..., score=ScoreRequest) (the weight probe's path, every step): vLLM scores the sequences inside the
    call (one more prompt-logprob request in the batch, plain and streamed), the hf engine after its responses in the
    same call; the call fills the request with scores equal to score_logprobs' (a prefill batched with other requests:
    fp32 matmuls of other shapes, so within the logprob-rescoring bound above, not bitwise) and the version it served,
    and the generated tokens equal those of the same call without it."""
    (out,) = outputs[name]
    for path in ("plain", "streamed"):
        assert out[f"carried_{path}_scores"] is not None, f"{path}: the generate call did not fill the request"
        for got, want in zip(out[f"carried_{path}_scores"], out["direct_scores"], strict=True):
            assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (path, got, want)
        assert out[f"carried_{path}_sampled"] == out["sampled"], f"{path}: the carried scores changed what was generated"
        assert out[f"carried_{path}_version"] == 0, "the engine's weights as built: version 0"


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_the_engine_reports_the_version_of_its_last_push(outputs, name):
    (out,) = outputs[name]
    assert (out["version_before_push"], out["version_after_push"]) == (0, 7)


@pytest.mark.parametrize("name", ["vllm", "hf", "vllm_tp2"])
def test_a_stopped_call_returns_each_unfinished_response_as_far_as_it_got(outputs, name):
    """generate(stop=...) (carry-over): a response that finished before the stop is the full call's; an unfinished one
    is a prefix of the full call's response, with the same logprobs, finish reason "abort"."""
    for out in outputs[name]:
        assert out["stop_asked"] == 5, "stop is asked after every engine step until it says True"
        aborted = 0
        for group, full_group in zip(out["stopped"], out["stopped_full"]):
            for (ids, lps, reason, _text), (full_ids, full_lps, full_reason, full_text) in zip(group, full_group):
                if reason == "abort":
                    aborted += 1
                    assert 0 < len(ids) < len(full_ids) and ids == full_ids[:len(ids)]
                    assert lps == pytest.approx(full_lps[:len(ids)], abs=1e-6)
                else:
                    assert (ids, reason) == (full_ids, full_reason)
        assert 0 < aborted < 6, f"{aborted} of 6 responses aborted: the stop must land mid-call"
