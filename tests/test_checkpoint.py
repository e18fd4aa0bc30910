"""Never lose a run: atomic checkpoints, exact resume after SIGKILL, clean stops, run folders that never mix,
non-finite steps skipped and counted (grpo_lib/checkpoint.py, grpo_lib/stopping.py, train_grpo.py).

Faults are injected from here, by tests/scripts/train_with_faults.py (monkeypatches installed before
train_grpo.main): `--signal` sends a real signal to the trainer at a chosen point of a chosen step (or a full disk's
ENOSPC), `--nan-steps` corrupts the loss of some steps.
Each run is the tiny model with real vLLM on CPU (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_lib.checkpoint import MARKER, POINTER, config_differences
from grpo_lib.metrics import open_jsonl_at
from tests.conftest import HF_ENGINE, REPO, accelerate_launch, free_port, read_metrics, run_script, run_train, tiny_overrides

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varied, deterministic reward so advantages and the policy gradient are non-zero on a random model
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
'''
STEPS = 6


@pytest.fixture(scope="module")
def base(tiny_model_dir, arith_data, tmp_path_factory):
    """Overrides of a 6-step run (without the run folder), on the hf engine: this file's subject is the checkpoint,
    not the engine (tests/conftest.py HF_ENGINE says where vLLM still proves each behaviour)."""
    reward = tmp_path_factory.mktemp("reward") / "reward.py"
    reward.write_text(REWARD)

    def overrides(out: Path, *extra: str) -> list[str]:
        return ["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, f"reward.custom.path={reward}",
                "actor.lr=1e-3", "actor.ppo_mini_batch_size=2", f"trainer.total_training_steps={STEPS}",
                "trainer.val_before_train=false", "trainer.logger=[console,jsonl,tensorboard]", HF_ENGINE, *extra)]
    return overrides


def run_killed(args: list[str], faults: list[str], log: Path, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """A run that the test hook SIGKILLs (`faults`: arguments of tests/scripts/train_with_faults.py): output goes to
    files, not pipes (a pipe stays open while any reward worker it leaves behind lives, and run_train would wait for it)."""
    script = [str(REPO / "tests" / "scripts" / "train_with_faults.py"), *faults, "--"]
    if launcher is None:  # one process, forked (tests/conftest.py's run_script): its output goes to files anyway
        proc = run_script([*script, *args])
        log.write_text(proc.stdout + proc.stderr)
        return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), log.read_text())
    with open(log, "w") as fh:
        proc = subprocess.run([*(launcher or [sys.executable]), *script, *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), log.read_text())


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "actor" / "model.safetensors")


def assert_same_steps(a_rows: list[dict], b_rows: list[dict], steps: list[int]) -> None:
    a_by, b_by = {r["step"]: r for r in a_rows}, {r["step"]: r for r in b_rows}
    for step in steps:
        keys = sorted(k for k in a_by[step] if not k.startswith(("timing_s/", "memory/")))
        assert keys == sorted(k for k in b_by[step] if not k.startswith(("timing_s/", "memory/"))), f"step {step}: different metric keys"
        for k in keys:
            assert b_by[step][k] == pytest.approx(a_by[step][k], rel=1e-6, abs=1e-6), \
                f"step {step} {k}: straight run {a_by[step][k]} vs killed + resumed {b_by[step][k]}"


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


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
    from grpo_lib import stopping

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
    script = ("import os, signal, time\nfrom grpo_lib import stopping\nstopping.REPEAT_WINDOW_S = 0.5\n"
              "stopping.install_stop_handlers()\nos.kill(os.getpid(), signal.SIGTERM)\nassert stopping.stop_requested()\n"
              f"print('FIRST OK', flush=True)\ntime.sleep({0.6 if late else 0})\n"
              f"os.kill(os.getpid(), signal.{second.split()[0]})\ntime.sleep(5)\nprint('STILL ALIVE')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    expected = -signal.SIGTERM if late else -signal.SIGINT
    assert "FIRST OK" in proc.stdout and "STILL ALIVE" not in proc.stdout and proc.returncode == expected, \
        (proc.returncode, proc.stdout, proc.stderr)


def test_launcher_timeout_warning():
    from grpo_lib.stopping import launcher_timeout_warning

    assert launcher_timeout_warning({}) is None, "not under torch elastic: no launcher to kill us"
    assert "only 30 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT unset" in launcher_timeout_warning({"TORCHELASTIC_RUN_ID": "x"})
    assert "only 120 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120)" in \
        launcher_timeout_warning({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"})
    assert launcher_timeout_warning({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1800"}) is None


def test_config_differences_lists_step_keys_only():
    saved = {"data": {"train_batch_size": 8, "val_files": ["a"]}, "trainer": {"save_freq": 1, "seed": 1}}
    now = {"data": {"train_batch_size": 16, "val_files": ["b"]}, "trainer": {"save_freq": 5, "seed": 2, "new_key": 1}}
    assert config_differences(saved, now) == ["data.train_batch_size: 8 -> 16", "trainer.seed: 1 -> 2"]


# The hand-written list grpo_lib/checkpoint.py held before the keys were declared on the fields (config/schema.py,
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
)


def test_keys_that_may_change_on_resume_come_from_the_fields():
    import dataclasses

    from grpo_lib.checkpoint import MAY_CHANGE_ON_RESUME
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
    from grpo_lib import checkpoint

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
    from grpo_lib import checkpoint

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


@pytest.mark.multiprocess
def test_all_processes_agree_to_stop_when_one_gets_sigterm(tmp_path):
    cmd = [*accelerate_launch(2), str(REPO / "tests" / "scripts" / "stop_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"before": False, "after": True}, f"rank {rank}"



SIGNALLING_REWARD = '''
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the first call after the test wrote the pid file SIGTERMs the launcher named there and is still running when the
    # launcher forwards the signal: the case in which a reward forkserver killed by that signal loses calls in flight
    try:
        os.rename(PID_FILE, PID_FILE + ".taken")  # one call of all, in either process, claims it
    except FileNotFoundError:
        pass
    else:
        with open(PID_FILE + ".taken") as fh:
            os.kill(int(fh.read()), signal.SIGTERM)
        time.sleep(2)
    return float(len(solution_str) % 3 == 0) + 0.1 * solution_str.count("1")
'''


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_stops_both_processes_after_the_step_with_a_checkpoint(base, tmp_path):
    """Ctrl-C / SIGTERM to `accelerate launch` itself (its workers run in sessions of their own, so only the launcher
    gets it): torch elastic forwards it with os.killpg to each process's group, which holds the reward forkserver
    and workers too, and SIGKILLs them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT s. Once step 1 is logged, a reward call
    sends the launcher SIGTERM and is still running when the forwarded signal arrives. Both processes must finish
    the step, save it and exit without reward errors, and nothing may be left running."""
    import psutil

    out, log, pid_file, reward = tmp_path / "run", tmp_path / "launch.log", tmp_path / "launcher.pid", tmp_path / "reward.py"
    reward.write_text(SIGNALLING_REWARD.replace("PID_FILE", repr(str(pid_file))))
    cmd = [*accelerate_launch(2), str(REPO / "train_grpo.py"), *base(out, "trainer.save_freq=-1", "data.train_batch_size=2",
                                                                      "actor.ppo_mini_batch_size=2", f"reward.custom.path={reward}")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}
    with open(log, "w") as fh:  # a file, not a pipe: a leftover process would keep a pipe open
        launcher = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
    family: list = []
    try:
        deadline = time.monotonic() + 400
        while launcher.poll() is None and time.monotonic() < deadline and \
                not ((out / "metrics.jsonl").is_file() and '"step": 1,' in (out / "metrics.jsonl").read_text()):
            time.sleep(0.5)
        assert launcher.poll() is None, f"the run ended before step 1 was logged\n{log.read_text()[-3000:]}"
        family = psutil.Process(launcher.pid).children(recursive=True)
        assert any("forkserver" in " ".join(p.cmdline()) for p in family), "no reward forkserver: the test proves less"
        (tmp_path / "pid.tmp").write_text(str(launcher.pid))
        (tmp_path / "pid.tmp").rename(pid_file)  # whole, for the reward call that takes it
        code = launcher.wait(timeout=300)
        gone_by = time.monotonic() + 10
        while (left := [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) and time.monotonic() < gone_by:
            time.sleep(0.2)
    finally:  # never leave a run behind, whatever failed
        if launcher.poll() is None:
            launcher.kill()
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    text = log.read_text()
    context = f"launcher exit code {code} (torch elastic re-raises the signal after its workers exit)\n{text[-4000:]}"
    assert (tmp_path / "launcher.pid.taken").is_file(), f"no reward call signalled the launcher\n{context}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # every line parses
    last = max(r["step"] for r in rows)
    assert 1 < last < STEPS, context
    for rank in (0, 1):
        assert f"process {rank}: stopped after step {last}, saved {out / f'global_step_{last}'}" in text, f"rank {rank}\n{context}"
    assert sorted(p.name for p in out.glob("global_step_*")) == [f"global_step_{last}"], context
    assert (out / f"global_step_{last}" / MARKER).is_file() and (out / POINTER).read_text().strip() == str(last), context
    assert (rows[-1]["reward/errors"], rows[-1]["reward/timeouts"]) == (0, 0) and "reward worker process died" not in text, context
    assert text.count("gives the processes only 120 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120)") == 1, "rank 0 warns, once"
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}\n{context}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_sigkill_mid_step_then_resume_is_exact(base, three_steps_at, tmp_path):
    """2 processes (gloo, FSDP2-sharded actor and reference): the uninterrupted 3-step run of `three_steps_at`, and one
    where both processes are SIGKILLed right after step 3's update, resumed from the step-2 checkpoint (each process's
    DCP shard and RNG file); same metrics, same final weights."""
    straight, out = three_steps_at(2), tmp_path / "b"
    args = base(out, "trainer.total_training_steps=3", "trainer.save_freq=2", "actor.use_kl_loss=true")
    killed = run_killed(args, ["--signal", "KILL update 3"], tmp_path / "killed.log", launcher=accelerate_launch(2))
    assert killed.returncode != 0, "the test hook did not kill the run"
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_2"], killed.stdout[-3000:]
    assert sorted(p.name for p in (out / "global_step_2" / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    resumed = run_train(args, procs=2)  # the kill on the real launcher; the resume's processes forked
    assert "resumed from" in resumed.stderr, resumed.stderr[-2000:]
    a_rows, b_rows = read_metrics(straight), read_metrics(out)
    assert [r["step"] for r in b_rows] == [1, 2, 3]
    assert_same_steps(a_rows, b_rows, [1, 2, 3])
    assert b_rows[2]["actor/kl_loss"] != 0, "no KL term at step 3: the reference's resume would go unchecked"
    a_final, b_final = hf_weights(straight / "global_step_3"), hf_weights(out / "global_step_3")
    assert all(torch.equal(a_final[k], b_final[k]) for k in a_final), "final exports differ after kill + resume (2 processes)"


def test_plan_resume_without_checkpoint_and_incomplete_paths(tmp_path):
    from grpo_lib.checkpoint import ResumeError, plan_resume
    from grpo_lib.config import Config

    cfg = Config()
    cfg.trainer.default_local_dir = str(tmp_path)
    assert plan_resume(cfg).step == 0, "an empty folder starts fresh"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / ".tmp_global_step_1").mkdir()  # a save cut short by a kill
    assert plan_resume(cfg).step == 0, "a run killed before its first checkpoint starts again"
    (tmp_path / "global_step_1").mkdir()  # no COMPLETE marker: an older format, never resumed nor overwritten
    with pytest.raises(ResumeError, match="without a COMPLETE marker"):
        plan_resume(cfg)
    cfg.trainer.resume_mode = "disable"
    with pytest.raises(ResumeError, match="already holds a run"):
        plan_resume(cfg)
    cfg.trainer.resume_mode, cfg.trainer.resume_from_path = "resume_path", str(tmp_path / "global_step_1")
    with pytest.raises(ResumeError, match="not a complete checkpoint"):
        plan_resume(cfg)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_full_disk_during_a_save_on_one_process_stops_both_with_the_last_checkpoint_intact(base, tmp_path):
    """2 processes; process 1's checkpoint write of step 4 fails with ENOSPC (test hook). Both processes agree and
    exit 3 (none waits in a collective the other skipped), the partial folder is removed, global_step_2 stays
    complete and resumable, the metrics of steps 1-4 are kept, and the message names the intact checkpoint."""
    out = tmp_path / "run"
    full = run_killed(base(out, "trainer.save_freq=2"), ["--signal", "ENOSPC save 4 1"], tmp_path / "full.log",
                      launcher=accelerate_launch(2))
    log = (tmp_path / "full.log").read_text()
    assert full.returncode != 0 and "exitcode  : 3" in log, log[-3000:]
    assert "test hook: ENOSPC at save of step 4" in log
    assert "could not write the checkpoint of step 4" in log and "global_step_2, is intact" in log, log[-3000:]
    assert sorted(p.name for p in out.iterdir() if "global_step" in p.name) == ["global_step_2"]
    assert (out / "global_step_2" / MARKER).is_file() and (out / POINTER).read_text().strip() == "2"
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    resumed = run_train(base(out, "trainer.save_freq=2", "trainer.total_training_steps=3"))  # one process: DCP reshards
    assert "resumed from" in resumed.stderr and (out / "global_step_3" / MARKER).is_file(), resumed.stderr[-2000:]


@pytest.fixture(scope="module")
def full_disk_under_the_metrics(base, tmp_path_factory):
    """One 2-process run whose metrics.jsonl write of step 3 fails with ENOSPC on process 0 (the only process that writes
    metrics; test hook), saving every 2 steps: (run folder, combined log of both processes and the launcher)."""
    tmp = tmp_path_factory.mktemp("full_disk_metrics")
    out = tmp / "run"
    run_killed(base(out, "trainer.save_freq=2"), ["--signal", "ENOSPC metrics 3 0"], tmp / "run.log", launcher=accelerate_launch(2))
    return out, (tmp / "run.log").read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_full_disk_under_the_metrics_on_process_0_stops_both_processes_with_exit_3(full_disk_under_the_metrics):
    """Issue 20 item 3: the first write a full disk refuses is often metrics.jsonl or TensorBoard, not a checkpoint. Process
    0's write of step 3 fails; both processes learn it from the logger's agreement (neither waits in a collective the other
    skipped: the run ends, and each process prints the error, naming the folder and its free space) and exit 3."""
    out, log = full_disk_under_the_metrics
    assert "test hook: ENOSPC at metrics of step 3" in log, log[-3000:]
    assert "exitcode  : 3" in log, log[-3000:]
    # found in the text, not per line: the two processes share the log, and print() writes the text and its newline
    # separately (unbuffered), so one process's message can land before the other's newline
    errors = re.findall(r"error: could not write the metrics of step 3 in [^\n]*?to resume", log)
    assert len(errors) == 2, f"each process reports the failed write: {errors}\n{log[-3000:]}"
    assert all(f" in {out} (" in line and re.search(r"\d+\.\d\d GiB free there", line) for line in errors), errors


@pytest.mark.slow
@pytest.mark.multiprocess
def test_full_disk_under_the_metrics_saves_the_step_when_space_allows(full_disk_under_the_metrics):
    """Step 3's update was done when its metrics failed to write: the stop saves step 3 (the disk had room for it here),
    so nothing trained is lost; the metrics of steps 1-2 are kept and step 3's line is the one that was refused."""
    out, log = full_disk_under_the_metrics
    assert (out / "global_step_3" / MARKER).is_file() and (out / POINTER).read_text().strip() == "3", log[-3000:]
    assert f"saved the last completed step to {out / 'global_step_3'}" in log
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


# ------------------------------------------------------------------------------------ two machines, simulated
def two_machines(args: list[str], tmp: Path, name: str, *, cwds: tuple[Path, Path] = (REPO, REPO)) -> tuple[list[int], str]:
    """Two `accelerate launch` launchers on this host, `--num_machines 2 --machine_rank 0/1`, one process each, meeting at
    127.0.0.1 (gloo), as two machines run the same command; each runs in its own working directory. Returns both
    launchers' exit codes and their logs, joined."""
    port = str(free_port())
    logs = [tmp / f"{name}_machine{r}.log" for r in (0, 1)]
    procs = []
    for machine_rank, (cwd, log) in enumerate(zip(cwds, logs)):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "2",
               "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "train_grpo.py"), *args]
        with open(log, "w") as fh:
            procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}))
    codes = [proc.wait(timeout=600) for proc in procs]
    return codes, "\n".join(f"--- machine {r} ---\n{log.read_text()}" for r, log in enumerate(logs))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_machines_simulated_train_checkpoint_and_resume_one_run(base, tmp_path):
    """Issue 20: two launchers as two machines of one process each (machine ranks 0 and 1 on the loopback address) train
    2 steps and save; the same two commands again with 3 steps resume the checkpoint on both machines and add step 3."""
    out = tmp_path / "run"
    args = lambda steps: [str(REPO / "recipes" / "tiny_cpu.yaml"),  # noqa: E731  (cwd-independent)
                          *base(out, "trainer.save_freq=2", f"trainer.total_training_steps={steps}")[1:]]
    codes, log = two_machines(args(2), tmp_path, "train")
    assert codes == [0, 0], log[-4000:]
    assert (out / "global_step_2" / MARKER).is_file() and [r["step"] for r in read_metrics(out)] == [1, 2]
    state = json.loads((out / "global_step_2" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and sorted(p.name for p in (out / "global_step_2" / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    codes, log = two_machines(args(3), tmp_path, "resume")
    assert codes == [0, 0], log[-4000:]
    assert log.count(f"resumed from {out / 'global_step_2'} (step 2 of 3)") == 2, "both machines resume the checkpoint"
    assert (out / "global_step_3" / MARKER).is_file() and [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_run_folder_not_shared_between_machines_exits_2_at_start(base, tmp_path):
    """The two machines' run folder is `run`, a relative path, and each launcher runs in its own working directory: the
    same path is two folders, as `outputs/run` on each machine's local disk is (no patch: the probe files really are
    invisible to the other process). Both processes exit 2 at start, before the engine, naming the folder and what each
    process saw; neither folder gets a checkpoint or metrics."""
    homes = (tmp_path / "machine0", tmp_path / "machine1")
    for home in homes:
        home.mkdir()
    args = [str(REPO / "recipes" / "tiny_cpu.yaml"), *base(Path("run"), "trainer.save_freq=2", "trainer.total_training_steps=2")[1:]]
    codes, log = two_machines(args, tmp_path, "not_shared", cwds=homes)
    assert all(code != 0 for code in codes) and log.count("exitcode  : 2") == 2, log[-4000:]
    errors = [line for line in log.splitlines() if line.startswith("error: trainer.default_local_dir='run' is not one folder shared")]
    assert len(errors) == 2, log[-4000:]
    assert "process 0 (host " in errors[0] and "sees the probe files of processes [0] only" in errors[0], errors[0]
    assert "process 1 (host " in errors[0] and "sees the probe files of processes [1] only" in errors[0], errors[0]
    assert "Starting to load model" not in log, "the check comes before the engine"
    for home in homes:
        assert sorted(p.name for p in (home / "run").iterdir()) == [], "probe files removed, nothing else written"


# ------------------------------------------------------------------------------------ another process count
# The metrics tests/test_multiprocess_train.py compares between 1 and 2 processes, with its tolerance: rtol 1e-4 covers
# the float reordering of sums over 1 vs 2 processes (the rollouts and the gradients do not depend on the count).
PROCESS_COUNT_KEYS = ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


@pytest.fixture(scope="module")
def three_steps_at(base, tmp_path_factory):
    """{process count: run folder} of uninterrupted 3-step runs that save at steps 2 and 3 (with a KL term, so the
    reference's resume is compared too); built once per count."""
    runs: dict[int, Path] = {}

    def run(procs: int) -> Path:
        if procs not in runs:
            out = tmp_path_factory.mktemp(f"three_steps_{procs}p")
            run_train(base(out, "trainer.total_training_steps=3", "trainer.save_freq=2", "actor.use_kl_loss=true"),
                      procs=procs)
            runs[procs] = out
        return runs[procs]
    return run


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)], ids=["2->1", "1->2"])
def test_resume_on_another_process_count_continues_the_run(base, three_steps_at, tmp_path, saved, resumed):
    """A checkpoint of step 2 written by `saved` processes resumes at `resumed` processes (into a fresh run folder with
    resume_mode=resume_path) and its step 3 equals step 3 of the run that wrote the checkpoint, within the 1-vs-2-process
    tolerance. Exact in principle: both step 3s start from the same saved state (weights, optimizer, scheduler, sampler)
    and draw the same samples (per-sample seeds), so they differ only by the order of the sums of 1 vs 2 processes; the
    uninterrupted run at the resuming count is compared too (its step-2 state differs by that reordering only)."""
    source = three_steps_at(saved)
    out = tmp_path / "resumed"
    proc = run_train(base(out, "trainer.total_training_steps=3", "trainer.save_freq=2", "actor.use_kl_loss=true",
                          "trainer.resume_mode=resume_path", f"trainer.resume_from_path={source / 'global_step_2'}"),
                     procs=resumed)
    assert "resumed from" in proc.stderr, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [3], "the resumed run logs its own step only"
    for reference in (source, three_steps_at(resumed)):
        expected = {r["step"]: r for r in read_metrics(reference)}[3]
        assert any(abs(expected[k]) > 1e-6 for k in ("actor/pg_loss", "actor/kl_loss")), "nothing moved: the test proves nothing"
        for key in PROCESS_COUNT_KEYS:
            assert rows[0][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), \
                f"step 3 {key}: resumed at {resumed} process(es) from {saved} {rows[0][key]} vs {reference.name} {expected[key]}"
    state = json.loads((out / "global_step_3" / "trainer_state.json").read_text())
    assert state["world_size"] == resumed and sorted(p.name for p in (out / "global_step_3" / "rng").iterdir()) == \
        [f"rank_{r}.pt" for r in range(resumed)]


# ------------------------------------------------------------------------------------ one run per folder, damage
# train_grpo.main(argv) in this process up to GRPOTrainer.setup (recorded, not run), over real checkpoints written by
# checkpoint.save for a tiny module (tests/tiny_checkpoint.py) with the config of the same command line: the folder
# rules, the checks of every file and the fallback all happen before setup, so before the engine.
def resume_args(model: Path, data: dict, out: Path, *extra: str) -> list[str]:
    return ["recipes/tiny_cpu.yaml", *tiny_overrides(model, data, out, *extra)]


def checkpoints_of(args: list[str], out: Path, steps) -> None:
    """The checkpoints of `steps` in `out` (metrics.jsonl with a line per step), recording the config of `args`."""
    from grpo_lib.config import load_config
    from tests.tiny_checkpoint import save_tiny

    for step in steps:
        save_tiny(out, step, seed=step, cfg=load_config(args[0], args[1:]))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(max(steps) + 1)))


def main_until_setup(monkeypatch, args: list[str]):
    """(exit code and output of train_grpo.main(args), the ResumePlan setup was given or None if it was not reached)."""
    import train_grpo
    from tests.cli import run_main

    plans = []
    monkeypatch.setattr(train_grpo.GRPOTrainer, "setup", lambda self: plans.append(self.resume))
    monkeypatch.setattr(train_grpo.GRPOTrainer, "train", lambda self: 0)
    result = run_main(monkeypatch, *args, setup=True)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result, (plans[0] if plans else None)


def test_resume_path_from_another_run_folder_into_a_used_one_exits_2_untouched(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """Issue 20, item 2: run A's checkpoint as resume_from_path with a run folder holding run B deleted B's global_step_3
    and kept B's metrics under the new run. A run folder holds one run: exit 2, nothing touched; an empty folder works."""
    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    checkpoints_of(resume_args(tiny_model_dir, arith_data, a), a, [2])
    checkpoints_of(resume_args(tiny_model_dir, arith_data, b), b, [3])
    before = folder_digest(b)
    from_a = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={a / 'global_step_2'}"]
    result, plan = main_until_setup(monkeypatch, resume_args(tiny_model_dir, arith_data, b, *from_a))
    assert result.returncode == 2 and plan is None, result.stderr[-3000:]
    for needle in ("a run folder holds one run", "in an empty folder", f"trainer.default_local_dir={a}", "global_step_3",
                   "Nothing was changed"):
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    assert folder_digest(b) == before, "a refused resume changed the other run's folder"

    result, plan = main_until_setup(monkeypatch, resume_args(tiny_model_dir, arith_data, empty, *from_a))
    assert result.returncode == 0 and plan.step == 2 and plan.path == a / "global_step_2", result.stderr[-3000:]
    assert not (empty / POINTER).exists(), "the pointer names a checkpoint of this folder only"


def test_resume_path_to_an_older_step_deletes_newer_checkpoints_only_when_told(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """Issue 20, item 2: within one folder, resume_path to an older step (a typo) silently deleted every newer
    checkpoint. Now it exits 2 naming them and the key; with trainer.discard_newer_checkpoints=true they go."""
    out = tmp_path / "run"
    checkpoints_of(resume_args(tiny_model_dir, arith_data, out), out, [1, 2, 3])
    before = folder_digest(out)
    older = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'global_step_1'}"]
    result, plan = main_until_setup(monkeypatch, resume_args(tiny_model_dir, arith_data, out, *older))
    assert result.returncode == 2 and plan is None, result.stderr[-3000:]
    for needle in ("global_step_2, global_step_3", "trainer.discard_newer_checkpoints=true", "Nothing was changed"):
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    assert folder_digest(out) == before

    result, plan = main_until_setup(monkeypatch, resume_args(tiny_model_dir, arith_data, out, *older,
                                                             "trainer.discard_newer_checkpoints=true"))
    assert result.returncode == 0 and plan.step == 1, result.stderr[-3000:]
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_1"] and (out / POINTER).read_text().strip() == "1"
    assert "removing" in result.stderr and "trainer.discard_newer_checkpoints=true" in result.stderr


def _crafted_metadata_with_a_matching_manifest(folder: Path, ran: Path) -> None:
    """What an attacker who can write the checkpoint does: a .metadata that runs a command, the manifest updated."""
    import pickle

    from grpo_lib.checkpoint_integrity import MANIFEST, file_checksum

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["dcp/.metadata"] = {"bytes": (folder / "dcp" / ".metadata").stat().st_size,
                                          "crc32": file_checksum(folder / "dcp" / ".metadata")}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


NEWEST_DAMAGE = {  # the cases (a truncated shard or RNG file, garbage trainer_state.json) and a crafted .metadata
    "truncated dcp shard": (lambda f, ran: _truncate(next((f / "dcp").glob("*.distcp"))), ".distcp: "),
    "truncated rng/rank_0.pt": (lambda f, ran: _truncate(f / "rng" / "rank_0.pt"), "rng/rank_0.pt: "),
    "garbage trainer_state.json": (lambda f, ran: (f / "trainer_state.json").write_text("garbage"), "trainer_state.json: "),
    "crafted dcp/.metadata": (_crafted_metadata_with_a_matching_manifest, "dcp/.metadata: UnsafeCheckpointError"),
}


@pytest.mark.parametrize("damage", list(NEWEST_DAMAGE))
def test_a_damaged_newest_checkpoint_is_reported_and_auto_falls_back(tiny_model_dir, arith_data, tmp_path, monkeypatch, damage):
    """Issue 20, item 4: a corrupt but COMPLETE newest checkpoint blocked every resume (a traceback, after the engine
    started, naming no folder). Now its files are checked before setup: it is reported by path and file, set aside as
    damaged_global_step_2 (not deleted), and the run resumes from global_step_1, saying so."""
    out, ran = tmp_path / "run", tmp_path / "ran"
    args = resume_args(tiny_model_dir, arith_data, out)
    checkpoints_of(args, out, [1, 2])
    action, needle = NEWEST_DAMAGE[damage]
    action(out / "global_step_2", ran)
    result, plan = main_until_setup(monkeypatch, args)
    assert result.returncode == 0 and plan is not None, result.stderr[-3000:]
    assert (plan.step, plan.path) == (1, out / "global_step_1"), "resumed the damaged checkpoint"
    assert f"the checkpoint {out / 'global_step_2'} is damaged" in result.stderr and needle in result.stderr, result.stderr
    assert f"falling back to {out / 'global_step_1'}" in result.stderr
    assert (out / "damaged_global_step_2" / MARKER).is_file() and not (out / "global_step_2").exists()
    assert (out / POINTER).read_text().strip() == "1"
    assert not ran.exists(), "the crafted metadata ran its code"

    result, plan = main_until_setup(monkeypatch, args)  # the next start resumes global_step_1 at once
    assert plan.step == 1 and " is damaged" not in result.stderr, result.stderr


def test_no_good_checkpoint_left_exits_2_naming_each_and_changes_nothing(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """Decision (issue 20, item 4): when every checkpoint is damaged, auto does not restart from step 0 over the run's
    metrics: it exits 2 naming each folder and its problems, and says how to start again (move them away)."""
    out = tmp_path / "run"
    args = resume_args(tiny_model_dir, arith_data, out)
    checkpoints_of(args, out, [1, 2])
    _truncate(out / "global_step_1" / "rng" / "rank_0.pt")
    (out / "global_step_2" / "trainer_state.json").write_text("{")
    before = folder_digest(out)
    result, plan = main_until_setup(monkeypatch, args)
    assert result.returncode == 2 and plan is None, result.stderr[-3000:]
    for needle in (f"every checkpoint in {out} is damaged", f"{out / 'global_step_1'}:", "rng/rank_0.pt",
                   f"{out / 'global_step_2'}:", "trainer_state.json", "move them out of the folder"):
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    assert folder_digest(out) == before


def test_a_damaged_resume_path_exits_2_naming_the_file(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    checkpoints_of(resume_args(tiny_model_dir, arith_data, out), out, [1, 2])
    _truncate(next((out / "global_step_2" / "dcp").glob("*.distcp")))
    result, plan = main_until_setup(monkeypatch, resume_args(tiny_model_dir, arith_data, out, "trainer.resume_mode=resume_path",
                                                             f"trainer.resume_from_path={out / 'global_step_2'}"))
    assert result.returncode == 2 and plan is None, result.stderr[-3000:]
    assert f"trainer.resume_from_path='{out / 'global_step_2'}' is damaged" in result.stderr and ".distcp: " in result.stderr
    assert (out / "global_step_2").is_dir(), "a named checkpoint is never set aside"


def test_a_checkpoint_from_before_manifests_resumes_with_a_warning(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    """Decision (issue 20, item 4): a checkpoint written before the manifest existed is resumed, with a warning that
    its checksums cannot be verified (the checks that need no manifest still run: issue 31's below)."""
    from grpo_lib.checkpoint_integrity import MANIFEST

    out = tmp_path / "run"
    args = resume_args(tiny_model_dir, arith_data, out)
    checkpoints_of(args, out, [1, 2])
    for step in (1, 2):  # a whole folder from before manifests
        (out / f"global_step_{step}" / MANIFEST).unlink()
    result, plan = main_until_setup(monkeypatch, args)
    assert result.returncode == 0 and plan.step == 2, result.stderr[-3000:]
    assert "written before checkpoints had a manifest" in result.stderr and "checksums cannot be checked" in result.stderr
    assert "sizes checked against DCP's metadata" in result.stderr, result.stderr


MISSING_MANIFEST = {  # issue 31 item 2: the newest checkpoint loses its manifest (alone, or with a truncated file too)
    "manifest deleted": lambda f: None,
    "manifest deleted, RNG file truncated": lambda f: _truncate(f / "rng" / "rank_0.pt"),
    "manifest deleted, DCP shard truncated": lambda f: _truncate(next((f / "dcp").glob("*.distcp"))),
}


@pytest.mark.parametrize("damage", list(MISSING_MANIFEST))
def test_a_checkpoint_that_lost_its_manifest_is_damaged_and_auto_falls_back(tiny_model_dir, arith_data, tmp_path,
                                                                            monkeypatch, damage):
    """Issue 31 item 2: a COMPLETE checkpoint whose manifest.json was deleted was "resumed unverified" (and with a
    truncated file died in torch's PytorchStreamReader after the engine started). Where an older checkpoint of the
    folder has a manifest, this one was written by a trainer that writes them (before COMPLETE): it is damaged, set
    aside like a truncated one, and the run resumes the previous good checkpoint."""
    from grpo_lib.checkpoint_integrity import MANIFEST

    out = tmp_path / "run"
    args = resume_args(tiny_model_dir, arith_data, out)
    checkpoints_of(args, out, [1, 2])
    (out / "global_step_2" / MANIFEST).unlink()
    MISSING_MANIFEST[damage](out / "global_step_2")
    result, plan = main_until_setup(monkeypatch, args)
    assert result.returncode == 0 and plan is not None, result.stderr[-3000:]
    assert (plan.step, plan.path) == (1, out / "global_step_1"), "resumed the checkpoint without its manifest"
    assert f"the checkpoint {out / 'global_step_2'} is damaged" in result.stderr and f"{MANIFEST}: missing" in result.stderr
    assert f"falling back to {out / 'global_step_1'}" in result.stderr and "unverified" not in result.stderr
    assert (out / "damaged_global_step_2" / MARKER).is_file() and not (out / "global_step_2").exists()


def test_a_checkpoint_from_before_manifests_with_a_truncated_shard_is_damaged(tiny_model_dir, arith_data, tmp_path,
                                                                              monkeypatch):
    """Issue 31 item 2: no manifest anywhere (a folder from before them), the newest checkpoint's DCP shard one byte
    short: the sizes DCP's metadata gives find it before the engine starts; the older one is resumed."""
    from grpo_lib.checkpoint_integrity import MANIFEST

    out = tmp_path / "run"
    args = resume_args(tiny_model_dir, arith_data, out)
    checkpoints_of(args, out, [1, 2])
    for step in (1, 2):
        (out / f"global_step_{step}" / MANIFEST).unlink()
    shard = next((out / "global_step_2" / "dcp").glob("*.distcp"))
    whole = shard.stat().st_size
    os.truncate(shard, whole - 1)
    result, plan = main_until_setup(monkeypatch, args)
    assert result.returncode == 0 and plan.step == 1, result.stderr[-3000:]
    assert f"dcp/{shard.name}: {whole - 1} bytes, DCP's metadata places data up to byte {whole} " in result.stderr
    assert (out / "damaged_global_step_2").is_dir()


@pytest.mark.slow
def test_a_newest_checkpoint_without_its_manifest_falls_back_and_continues_exactly(base, three_steps_at, tmp_path):
    """Issue 31 item 2, the whole run: global_step_3 of an uninterrupted 3-step run loses its manifest.json (step 2's
    keeps its own); rerunning the same command sets it aside, resumes global_step_2 and trains step 3 again to the
    same metrics and the same weights."""
    from grpo_lib.checkpoint_integrity import MANIFEST

    source = three_steps_at(1)
    out = tmp_path / "run"
    shutil.copytree(source, out)
    (out / "global_step_3" / MANIFEST).unlink()
    proc = run_train(base(out, "trainer.total_training_steps=3", "trainer.save_freq=2", "actor.use_kl_loss=true"),
                     procs=1)
    assert f"the checkpoint {out / 'global_step_3'} is damaged" in proc.stderr and f"{MANIFEST}: missing" in proc.stderr, \
        proc.stderr[-3000:]
    assert f"resumed from {out / 'global_step_2'}" in proc.stderr, proc.stderr[-3000:]
    assert_same_steps(read_metrics(source), read_metrics(out), [1, 2, 3])
    a_final, b_final = hf_weights(source / "global_step_3"), hf_weights(out / "global_step_3")
    assert all(torch.equal(a_final[k], b_final[k]) for k in a_final), "step 3 trained again differs"
    assert (out / "damaged_global_step_3").is_dir() and (out / "global_step_3" / MANIFEST).is_file()


@pytest.mark.slow
def test_a_truncated_shard_in_the_newest_checkpoint_falls_back_and_continues_exactly(base, three_steps_at, tmp_path):
    """The whole run: global_step_3 of an uninterrupted 3-step run gets a truncated DCP shard; rerunning the same
    command reports it, resumes global_step_2 and trains step 3 again to the same metrics and the same weights."""
    source = three_steps_at(1)
    out = tmp_path / "run"
    shutil.copytree(source, out)
    shard = next((out / "global_step_3" / "dcp").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 1)
    proc = run_train(base(out, "trainer.total_training_steps=3", "trainer.save_freq=2", "actor.use_kl_loss=true"),
                     procs=1)
    assert f"the checkpoint {out / 'global_step_3'} is damaged" in proc.stderr and shard.name in proc.stderr, proc.stderr[-3000:]
    assert f"resumed from {out / 'global_step_2'}" in proc.stderr, proc.stderr[-3000:]
    assert_same_steps(read_metrics(source), read_metrics(out), [1, 2, 3])
    a_final, b_final = hf_weights(source / "global_step_3"), hf_weights(out / "global_step_3")
    assert all(torch.equal(a_final[k], b_final[k]) for k in a_final), "step 3 trained again differs"
    assert (out / "damaged_global_step_3").is_dir()
