"""Never lose a run: atomic checkpoints, exact resume after SIGKILL, clean stops, run folders that never mix,
non-finite steps skipped and counted (grpo_lib/checkpoints/checkpoint.py, grpo_lib/core/stopping.py, train_grpo.py).
More: tests/checkpoints/test_checkpoint_processes.py (2 processes, full disks, two machines, another process count) and
tests/checkpoints/test_checkpoint_damage.py (resume paths, damaged checkpoints).

Faults are injected from here, by tests/scripts/train_with_faults.py (monkeypatches installed before
train_grpo.main): `--signal` sends a real signal to the trainer at a chosen point of a chosen step (or a full disk's
ENOSPC), `--nan-steps` corrupts the loss of some steps.
Each run is the tiny model on CPU (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from grpo_lib.checkpoints.checkpoint import MARKER, POINTER, config_differences
from grpo_lib.core.metrics import open_jsonl_at
from tests.conftest import REPO, read_metrics, run_train
from tests.helpers.checkpoint_runs import (STEPS, assert_same_steps, checkpoint_args, folder_digest, hf_weights,
                                          run_killed)


@pytest.fixture(scope="module")
def base(tiny_model_dir, arith_data, tmp_path_factory):
    """Overrides of a 6-step run (tests/helpers/checkpoint_runs.py)."""
    return checkpoint_args(tiny_model_dir, arith_data, tmp_path_factory)


# ------------------------------------------------------------------------------------ exact resume after SIGKILL
@pytest.fixture(scope="module")
def straight_run(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run_train(base(out, "trainer.save_freq=-1"))
    return out


@pytest.mark.slow
def test_sigkill_between_checkpoint_files_then_resume_is_exact(base, straight_run, tmp_path):
    """Run B is SIGKILLed during step 4, in the middle of writing its checkpoint (weights + optimizer written, the
    rest not); the step-3 checkpoint stays loadable and resume_mode=auto continues from it to the same results."""
    out = tmp_path / "b"
    killed = run_killed(base(out, "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2"), ["--signal", "KILL save 4"],
                        tmp_path / "killed.log")
    assert killed.returncode == -9, f"the test hook did not kill the run: exit {killed.returncode}\n{killed.stderr[-3000:]}"
    assert not (out / "global_step_4").exists(), "a checkpoint cut short by a kill must not look like a checkpoint"
    partial = out / ".tmp_global_step_4"
    assert (partial / "dcp").is_dir() and not (partial / MARKER).exists(), sorted(p.name for p in partial.iterdir())
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_2", "global_step_3"], "max_ckpt_to_keep=2"
    assert all((out / f"global_step_{s}" / MARKER).is_file() for s in (2, 3))
    assert (out / POINTER).read_text().strip() == "3"
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4], "step 4 was logged before its save was killed"

    resumed = run_train(base(out, "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2"))
    assert "resumed from" in resumed.stderr and "global_step_3" in resumed.stderr, resumed.stderr[-2000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4, 5, 6], "metrics.jsonl must continue without duplicate steps"
    a_rows, b_rows = read_metrics(straight_run), read_metrics(out)
    assert any(abs(r["actor/pg_loss"]) > 1e-6 for r in a_rows), "the policy never moved: the test would prove nothing"
    assert_same_steps(a_rows, b_rows, [1, 2, 3, 4, 5, 6])
    a_final, b_final = hf_weights(straight_run / f"global_step_{STEPS}"), hf_weights(out / f"global_step_{STEPS}")
    assert a_final.keys() == b_final.keys()
    assert all(torch.equal(a_final[k], b_final[k]) for k in a_final), "final exports differ after kill + resume"
    assert not partial.exists(), "the leftover temporary checkpoint was not cleaned"
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_5", "global_step_6"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3, 4, 5, 6], "TensorBoard repeats the re-run steps"


# ------------------------------------------------------------------------------------ SIGTERM, used folders
@pytest.fixture(scope="module")
def sigterm_run(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("sigterm")
    proc = run_train(base(out, "trainer.save_freq=-1"), check=False, faults=["--signal", "TERM update 2"])
    return out, proc


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_0(sigterm_run):
    out, proc = sigterm_run
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "SIGTERM received" in proc.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line parses
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_2"]
    assert (out / "global_step_2" / MARKER).is_file() and (out / "global_step_2" / "actor" / "tokenizer.json").is_file()
    state = json.loads((out / "global_step_2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["actor_steps_done"] == 2 and state["sampler"]["position"] == 8


@pytest.mark.slow
def test_used_folder_with_resume_disabled_exits_2_untouched(base, sigterm_run):
    out, _ = sigterm_run
    before = folder_digest(out)
    start = time.perf_counter()
    proc = run_train(base(out, "trainer.resume_mode=disable"), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "already holds a run" in proc.stderr and "metrics.jsonl" in proc.stderr, proc.stderr
    assert time.perf_counter() - start < 60, "the refusal must come before the engine starts"
    assert folder_digest(out) == before, "a refused run changed the old run's files"


@pytest.mark.slow
def test_resume_with_a_changed_step_exits_2_listing_it(base, sigterm_run):
    out, _ = sigterm_run
    before = folder_digest(out)
    proc = run_train(base(out, "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "trainer.save_freq=3"), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.train_batch_size: 4 -> 8" in proc.stderr and "actor.ppo_mini_batch_size: 2 -> 4" in proc.stderr, proc.stderr
    assert "save_freq" not in proc.stderr, "a logging/saving key must be allowed to change"
    assert folder_digest(out) == before


# ------------------------------------------------------------------------------------ non-finite steps
@pytest.mark.slow
def test_nonfinite_updates_skipped_counted_then_exit_3(base, tmp_path):
    """NaN loss at steps 2, 4, 5 with max_bad_steps=2: 2 is skipped (weights unchanged), 3 trains, 4 and 5 in a row
    stop the run with exit 3; the step-4 checkpoint (saved after a skipped update) is the last and it loads."""
    out = tmp_path / "nan"
    proc = run_train(base(out, "trainer.save_freq=1", "trainer.max_bad_steps=2"), check=False, faults=["--nan-steps", "2,4,5"])
    assert proc.returncode == 3, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "trainer.max_bad_steps=2" in proc.stderr
    rows = read_metrics(out)
    assert [r["actor/skipped_nonfinite_steps"] for r in rows] == [0, 2, 0, 2, 2]  # two updates per step (2 mini-batches)
    w1, w2, w3 = (hf_weights(out / f"global_step_{s}") for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1), "the NaN step changed the weights"
    assert not all(torch.equal(w2[k], w3[k]) for k in w2), "the step after a skipped one must train"
    assert sorted(p.name for p in out.glob("global_step_*")) == [f"global_step_{s}" for s in (1, 2, 3, 4)]
    assert (out / POINTER).read_text().strip() == "4"
    # the last checkpoint loads: its DCP weights are finite and equal its HF export
    import torch.distributed.checkpoint as dcp
    w4 = hf_weights(out / "global_step_4")
    loaded = {f"model.{k}": torch.empty_like(v) for k, v in w4.items()}
    dcp.load({"model": {k.removeprefix("model."): v for k, v in loaded.items()}}, checkpoint_id=str(out / "global_step_4" / "dcp"))
    for k, v in loaded.items():
        assert torch.isfinite(v).all() and torch.equal(v, w4[k.removeprefix("model.")]), k


# ------------------------------------------------------------------------------------ cheap unit checks
def test_the_same_signal_twice_at_once_is_one_stop_request(capfd):
    """scancel signals every process and the launcher forwards its own copy: a trainer under `accelerate launch` gets
    SIGTERM twice within milliseconds. That is one request (finish the step, save), not the abort of a second one."""
    from grpo_lib.core import stopping

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stopping.install_stop_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # os.kill runs this process's handler before it returns
        assert stopping.stop_requested(), "still alive, and the stop is requested"
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        stopping._received.clear()
    err = capfd.readouterr().err
    assert "SIGTERM received: finishing this step" in err and "SIGTERM received again within 5 s: the same stop request" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("second", ["SIGTERM after the repeat window", "SIGINT at once"])
def test_a_second_stop_request_aborts_at_once(second):
    """The same signal after REPEAT_WINDOW_S (shortened to 0.5 s here), or another stop signal at any time, aborts."""
    late = second.startswith("SIGTERM")
    script = ("import os, signal, time\nfrom grpo_lib.core import stopping\nstopping.REPEAT_WINDOW_S = 0.5\n"
              "stopping.install_stop_handlers()\nos.kill(os.getpid(), signal.SIGTERM)\nassert stopping.stop_requested()\n"
              f"print('FIRST OK', flush=True)\ntime.sleep({0.6 if late else 0})\n"
              f"os.kill(os.getpid(), signal.{second.split()[0]})\ntime.sleep(5)\nprint('STILL ALIVE')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    expected = -signal.SIGTERM if late else -signal.SIGINT
    assert "FIRST OK" in proc.stdout and "STILL ALIVE" not in proc.stdout and proc.returncode == expected, \
        (proc.returncode, proc.stdout, proc.stderr)


def test_launcher_timeout_warning():
    from grpo_lib.core.stopping import launcher_timeout_warning

    assert launcher_timeout_warning({}) is None, "not under torch elastic: no launcher to kill us"
    assert "only 30 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT unset" in launcher_timeout_warning({"TORCHELASTIC_RUN_ID": "x"})
    assert "only 120 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120)" in \
        launcher_timeout_warning({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"})
    assert launcher_timeout_warning({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1800"}) is None


def test_config_differences_lists_step_keys_only():
    saved = {"data": {"train_batch_size": 8, "val_files": ["a"]}, "trainer": {"save_freq": 1, "seed": 1}}
    now = {"data": {"train_batch_size": 16, "val_files": ["b"]}, "trainer": {"save_freq": 5, "seed": 2, "new_key": 1}}
    assert config_differences(saved, now) == ["data.train_batch_size: 8 -> 16", "trainer.seed: 1 -> 2"]


# The hand-written list grpo_lib/checkpoints/checkpoint.py held before the keys were declared on the fields (config/schema.py,
# may_change_on_resume), kept once here: the declared set must be this list without its alias spellings
# (actor.log_prob_* are verl's older names of rollout.log_prob_*; a saved config never holds them).
HAND_LIST_BEFORE_METADATA = (
    "trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.save_hf", "trainer.max_ckpt_to_keep",
    "trainer.test_freq", "trainer.val_before_train", "trainer.logger", "trainer.default_local_dir", "trainer.resume_mode",
    "trainer.resume_from_path", "trainer.project_name", "trainer.experiment_name", "trainer.check_weight_sync", "trainer.weight_probe",
    "trainer.max_bad_steps", "trainer.balance_batch",
    "actor.ppo_micro_batch_size_per_gpu", "actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu",
    "actor.log_prob_micro_batch_size_per_gpu", "actor.log_prob_max_token_len_per_gpu",
    "ref.", "model.enable_gradient_checkpointing", "model.use_remove_padding",
    "rollout.gpu_memory_utilization", "rollout.kv_cache_memory_bytes", "rollout.free_cache_engine", "rollout.enforce_eager",
    "rollout.max_num_seqs", "rollout.tensor_model_parallel_size", "rollout.val_kwargs.",
    "data.val_files", "reward.num_workers", "reward.timeout_s", "reward.import_timeout_s", "trainer.discard_newer_checkpoints",
    "actor.fsdp_config.param_offload", "actor.fsdp_config.optimizer_offload", "rollout.update_weights_bucket_megabytes",
    "actor.ppo_micro_batch_size", "rollout.log_prob_micro_batch_size_per_gpu", "rollout.log_prob_micro_batch_size",
    "rollout.log_prob_use_dynamic_bsz", "rollout.log_prob_max_token_len_per_gpu", "trainer.n_gpus_per_node", "trainer.nnodes",
    "trainer.val_only", "trainer.val_generations_to_log", "reward.max_error_fraction",
    "trainer.tune_allocator", "actor.use_torch_compile", "rollout.hf_use_torch_compile",
    "ignored.",
    "rollout.enable_chunked_prefill", "rollout.max_num_batched_tokens", "rollout.engine_kwargs.",  # vLLM's scheduling / LLM() args
    # issue 44: how LoRA reaches the engine (the same weights served), the learned scorers' memory and batching keys
    "rollout.lora_mode", "reward_model.model.fsdp_config.param_offload", "reward_model.micro_batch_size_per_gpu",
    "reward_model.use_dynamic_bsz", "reward_model.forward_max_token_len_per_gpu", "judge.gpu_memory_utilization",
    "judge.kv_cache_memory_bytes",
)


def test_keys_that_may_change_on_resume_come_from_the_fields():
    import dataclasses

    from grpo_lib.checkpoints.checkpoint import MAY_CHANGE_ON_RESUME
    from grpo_lib.config import Config
    from grpo_lib.config.verl_keys import _canonical

    aliases = {"actor.log_prob_micro_batch_size_per_gpu", "actor.log_prob_max_token_len_per_gpu"}
    assert {_canonical(k) for k in aliases} == {"rollout.log_prob_micro_batch_size_per_gpu", "rollout.log_prob_max_token_len_per_gpu"}
    assert len(set(MAY_CHANGE_ON_RESUME)) == len(MAY_CHANGE_ON_RESUME)
    assert set(MAY_CHANGE_ON_RESUME) == set(HAND_LIST_BEFORE_METADATA) - aliases
    assert all(_canonical(k.rstrip(".")) == k.rstrip(".") for k in MAY_CHANGE_ON_RESUME), "an alias spelling is listed"
    saved = json.loads(json.dumps(dataclasses.asdict(Config())))  # what a checkpoint's trainer_state.json holds
    for key in MAY_CHANGE_ON_RESUME:  # each names a key (or, ending in ".", a section) that a saved config holds
        node = saved
        for part in key.rstrip(".").split("."):
            assert part in node, f"{key}: not a key of the saved config"
            node = node[part]


def test_cuda_rng_is_saved_for_this_process_device_only(monkeypatch):
    """Each process saves the RNG of its own CUDA device: restoring every visible device's state (get/set_rng_state_all)
    raised IndexError on a resume that sees fewer devices (one GPU per task under a scheduler)."""
    from grpo_lib.checkpoints import checkpoint

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: restored.append(state.tolist()))
    for name in ("get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: pytest.fail(f"torch.cuda.{name} touches every device"))
    state = checkpoint._rng_state()
    checkpoint._set_rng_state(state)
    assert restored == [[7]]


def test_an_old_checkpoint_that_cannot_be_removed_is_a_warning(tmp_path, monkeypatch, capsys):
    """Pruning runs after the new checkpoint is complete: a failure to delete an old one (permissions, NFS) warns
    instead of killing process 0 while the others wait in a barrier."""
    from grpo_lib.checkpoints import checkpoint

    for step in (1, 2, 3):
        (tmp_path / f"global_step_{step}").mkdir()
        (tmp_path / f"global_step_{step}" / MARKER).write_text(f"step {step}\n")

    def rmtree(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    checkpoint.prune(tmp_path, keep=1)
    err = capsys.readouterr().err
    assert "could not remove the old checkpoint" in err and "global_step_1" in err and "global_step_2" in err, err


def test_jsonl_cut_at_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 3, "val/acc": 1}\n{"st')
    open_jsonl_at(path, 2).close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    open_jsonl_at(path, 0).close()
    assert path.read_text() == ""
