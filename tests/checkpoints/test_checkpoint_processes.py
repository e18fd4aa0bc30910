"""Checkpoints across processes and machines: every process stops on one's SIGTERM, a launcher's SIGTERM, SIGKILL of 2
processes mid-step then an exact resume, a full disk on one process, two simulated machines, a resume on another
process count, and a damaged newest checkpoint whose fallback continues exactly (tests/helpers/checkpoint_runs.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_lib.checkpoints.checkpoint import MARKER, POINTER
from tests.conftest import REPO, accelerate_launch, free_port, read_metrics, run_train
from tests.helpers.checkpoint_runs import (STEPS, assert_same_steps, checkpoint_args, hf_weights,
                                          run_killed)


@pytest.fixture(scope="module")
def base(tiny_model_dir, arith_data, tmp_path_factory):
    """Overrides of a 6-step run (tests/helpers/checkpoint_runs.py)."""
    return checkpoint_args(tiny_model_dir, arith_data, tmp_path_factory)


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
    from grpo_lib.checkpoints.checkpoint import ResumeError, plan_resume
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
# The metrics tests/train/test_multiprocess_train.py compares between 1 and 2 processes, with its tolerance: rtol 1e-4 covers
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


# ------------------------------------------------------------------------------------ a damaged newest checkpoint

@pytest.mark.slow
def test_a_newest_checkpoint_without_its_manifest_falls_back_and_continues_exactly(base, three_steps_at, tmp_path):
    """Issue 31 item 2, the whole run: global_step_3 of an uninterrupted 3-step run loses its manifest.json (step 2's
    keeps its own); rerunning the same command sets it aside, resumes global_step_2 and trains step 3 again to the
    same metrics and the same weights."""
    from grpo_lib.checkpoints.integrity import MANIFEST

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
