"""The number of processes is a memory knob only: 2 processes (gloo, FSDP2-sharded actor and reference, one engine
each) train exactly like 1.

Per-request sampling seeds make the samples independent of which process runs a prompt, and every loss is
normalised by the global token / sequence counts, so the metrics of both runs agree step by step, with fixed
padded micro-batches and with packed token-budget micro-batches. Also checked on the 2-process run: the actor
is sharded (start-up line, half the parameter bytes), both engines score like the gathered actor after every
push, and the Hugging Face export gathered from the shards equals the 1-process one.

The runs generate on the in-process hf engine (the subject is the trainer's sharding and normalisation, not the
engine); 2 processes with one vLLM engine each train like 1 in tests/train/test_lora_e2e.py and tests/train/test_train_tools_e2e.py
(and under tensor parallelism in tests/train/test_tensor_parallel_train.py), where each engine's weights are checked after
every push.
"""

from __future__ import annotations


import pytest
from safetensors.torch import load_file

from tests.conftest import HF_ENGINE, read_metrics, run_train, tiny_overrides
from tests.helpers.tolerances import adamw_flip_bound, assert_close_after_adamw

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # tiers: conftest.py

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied, deterministic reward so advantages and the policy gradient are non-zero on a random model
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
'''

SETTINGS = {
    # 6 prompts in mini-batches of 4: the last one holds 2 (verl's split), 1 group per process
    "fixed-padded-uneven-mini-batches": ["actor.ppo_micro_batch_size_per_gpu=3", "data.train_batch_size=6", "actor.ppo_mini_batch_size=4"],
    "budget-packed": ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=120", "model.use_remove_padding=true"],
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_two_processes_match_one(tiny_model_dir, arith_data, tmp_path, setting):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    runs, logs = {}, {}
    for procs in (1, 2):
        out = tmp_path / f"p{procs}"
        overrides = tiny_overrides(
            tiny_model_dir, arith_data, out,
            f"reward.custom.path={reward}", "actor.use_kl_loss=true", "actor.lr=1e-3", "actor.ppo_mini_batch_size=2",
            "trainer.check_weight_sync=true", HF_ENGINE, *SETTINGS[setting],
        )
        logs[procs] = run_train(["recipes/tiny_cpu.yaml", *overrides], procs=procs).stdout
        runs[procs] = read_metrics(out)
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 3
    for r in range(2):
        assert f"[rank {r}] actor: FSDP2 over 2 process(es)" in logs[2], f"rank {r} did not shard the actor:\n{logs[2][-3000:]}"
        assert f"[rank {r}] reference: FSDP2 over 2 process(es)" in logs[2]
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in one), "the policy loss never moved: the test would prove nothing"
    for a, b in zip(one, two):
        for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), f"step {a['step']} {key}: 1 process {a[key]} vs 2 {b[key]}"
        assert b["debug/weight_sync_max_abs_diff"] < 1e-4, "an engine does not serve the gathered actor's weights"
        assert b["memory/actor_params_mb"] == pytest.approx(a["memory/actor_params_mb"] / 2, rel=0.05), "not half the parameters"
        assert b["memory/peak_mb"] > 0
    exported = {procs: load_file(tmp_path / f"p{procs}" / "global_step_3" / "actor" / "model.safetensors") for procs in (1, 2)}
    assert exported[1].keys() == exported[2].keys()
    # Weights after AdamW steps (3 steps x train_batch_size / ppo_mini_batch_size updates, lr 1e-3, weight decay 0.01,
    # actor.weight_decay's default): round-off relative to each tensor's scale, except a few elements whose gradient is
    # within round-off of zero (tests/helpers/tolerances.py).
    prompts, mini = int(setting_value(setting, "data.train_batch_size", 4)), int(setting_value(setting, "actor.ppo_mini_batch_size", 2))
    updates = 3 * -(-prompts // mini)  # the last mini-batch may be smaller (verl's split)
    for name, tensor in exported[1].items():
        bound = adamw_flip_bound(lr=1e-3, optimizer_steps=updates, weight_decay=0.01, weight_scale=float(tensor.abs().max()))
        assert_close_after_adamw(exported[2][name], tensor, flip_bound=bound, name=f"export {name}")


def setting_value(setting: str, key: str, default):
    """The value SETTINGS[setting] gives `key` (it overrides the test's own), else `default`."""
    values = dict(item.split("=", 1) for item in SETTINGS[setting])
    return values.get(key, default)
