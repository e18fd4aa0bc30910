"""Checkpoints that survive any kill, exact resume, and run folders that never mix two runs.

A run folder (`trainer.default_local_dir`) holds one run:

    metrics.jsonl, tensorboard/            the metrics (a resumed run continues them from its step)
    global_step_N/                         one complete checkpoint
        dcp/                               actor weights + optimizer state, torch.distributed.checkpoint
                                           (every process writes its own shard; FSDP2 DTensors stay sharded)
        rng/rank_R.pt                      each process's RNG states (torch, CUDA, python, numpy)
        trainer_state.json                 step, Actor.steps_done, LR scheduler, prompt sampler position,
                                           the process count and the resolved config (DAPO's generation
                                           rounds live inside one step; the sampler position covers
                                           the prompts they drew)
        actor/                             Hugging Face export (trainer.save_hf): loads in transformers / vLLM
        COMPLETE                           written last: a folder without it is never loaded
    latest_checkpointed_iteration.txt      the newest complete step (verl's name), updated after the rename

Atomic save: everything is written to `.tmp_global_step_N/`, the COMPLETE marker last, then the folder is
renamed to `global_step_N` and the pointer replaced; only then are the oldest checkpoints beyond
`trainer.max_ckpt_to_keep` deleted. A kill at any moment leaves the previous checkpoint as it was; the
next start deletes leftover `.tmp_*` folders.

Loads use torch.distributed.checkpoint's loader, `torch.load(weights_only=True)` and JSON only.
`torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict` work on a plain module and on an
FSDP2-sharded one alike, so the same code saves 1 or N processes (and resumes with a different count:
DCP reshards; exact equality is promised only for the same count).

Resume (`trainer.resume_mode`, verl's names): `auto` continues from the newest complete checkpoint in the run
folder (a fresh folder starts at step 0), `disable` refuses a folder that already holds a run (exit 2),
`resume_path` continues from `trainer.resume_from_path`. A config that changes what a step computes exits 2
listing the differences; the keys in `MAY_CHANGE_ON_RESUME` (speed, memory, logging, length of the run) may change:
the fields declared `may_change_on_resume` in grpo_lib/config/schema.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpo_lib.config.schema import resume_may_change_keys

MARKER = "COMPLETE"
POINTER = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")

# Keys that may differ between a checkpoint and the run resuming it: they change speed, memory, logging or how
# long the run goes, never what one step computes. Any other difference exits 2. (A prefix ends with ".".) Declared
# on the fields of grpo_lib/config/schema.py (`may_change_on_resume`), next to their docstrings.
MAY_CHANGE_ON_RESUME = resume_may_change_keys()


class ResumeError(ValueError):
    """A run folder or checkpoint that cannot be used as asked (exit code 2; the message says what to do)."""


@dataclass
class ResumePlan:
    """Where the run starts: step 0 (fresh) or the step of `path`, a complete checkpoint folder."""
    step: int = 0
    path: Path | None = None


# ------------------------------------------------------------------------------------------ the run folder
def complete_checkpoints(run_dir: Path) -> dict[int, Path]:
    """{step: folder} of the complete checkpoints in `run_dir` (those with the COMPLETE marker)."""
    found = {}
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / MARKER).is_file():
                found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def _previous_run_files(run_dir: Path) -> list[str]:
    """What in `run_dir` belongs to an earlier run: metrics, TensorBoard events, checkpoints (complete or not)."""
    if not run_dir.is_dir():
        return []
    names = [c.name for c in sorted(run_dir.iterdir())
             if c.name in ("metrics.jsonl", "val_generations.jsonl", "tensorboard", POINTER) or _STEP_DIR.match(c.name) or c.name.startswith(".tmp_global_step_")]
    return names


def checkpoint_step(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if not match:
        raise ResumeError(f"trainer.resume_from_path={str(path)!r}: expected a global_step_N checkpoint folder")
    return int(match.group(1))


def plan_resume(cfg) -> ResumePlan:
    """Decide where the run starts (cheap: reads the folder and one JSON file; call before anything heavy loads).

    Raises ResumeError when the folder holds another run and resume_mode is `disable`, when the checkpoint to
    resume is missing or incomplete, or when the config changed what a step computes.
    """
    t = cfg.trainer
    run_dir = Path(t.default_local_dir)
    previous = _previous_run_files(run_dir)
    if t.resume_mode == "disable":
        if previous:
            raise ResumeError(f"trainer.default_local_dir={str(run_dir)!r} already holds a run ({', '.join(previous)}) and "
                              "trainer.resume_mode=disable: choose a new folder, delete this one, or continue it with "
                              "trainer.resume_mode=auto. Nothing was changed.")
        return ResumePlan()
    if t.resume_mode == "resume_path":
        path = Path(t.resume_from_path)
        if not (path / MARKER).is_file():
            raise ResumeError(f"trainer.resume_from_path={str(path)!r} is not a complete checkpoint (no {MARKER} marker"
                              f"{'' if path.is_dir() else '; the folder does not exist'}): point it at a global_step_N folder "
                              "that has one")
        plan = ResumePlan(step=checkpoint_step(path), path=path)
    else:  # auto
        found = complete_checkpoints(run_dir)
        if not found:
            foreign = [n for n in previous if _STEP_DIR.match(n)]  # never written by save(): an older format or another tool
            if foreign:
                raise ResumeError(f"trainer.default_local_dir={str(run_dir)!r} holds {', '.join(foreign)} without a {MARKER} "
                                  "marker (not a checkpoint this trainer can resume, and not overwritten): move them away "
                                  "or choose another folder")
            if previous:
                print(f"warning: {run_dir} holds files of a run without a complete checkpoint ({', '.join(previous)}); "
                      "resume_mode=auto starts from step 0 and replaces its metrics", file=sys.stderr)
            return ResumePlan()
        step = max(found)
        plan = ResumePlan(step=step, path=found[step])
    check_config_unchanged(cfg, read_trainer_state(plan.path)["config"], plan.path)
    return plan


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key not in ("extra",):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved: dict, now: dict) -> list[str]:
    """Keys (dotted) whose values differ and that are not in MAY_CHANGE_ON_RESUME; keys missing on either side
    (a newer or older version of the code) are not compared.

    Example: saved {"data": {"train_batch_size": 8}}, now {"data": {"train_batch_size": 16}}
    -> ["data.train_batch_size: 8 -> 16"].
    """
    a, b = _flat(saved), _flat(now)
    may_change = lambda k: any(k == p or (p.endswith(".") and k.startswith(p)) for p in MAY_CHANGE_ON_RESUME)  # noqa: E731
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k] and not may_change(k)]


def check_config_unchanged(cfg, saved_config: dict, path: Path) -> None:
    diffs = config_differences(saved_config, json.loads(json.dumps(dataclasses.asdict(cfg))))
    if diffs:
        raise ResumeError(f"cannot resume from {path}: the config changes what a step computes:\n    " + "\n    ".join(diffs)
                          + "\n  Restore these values, or start a new run in another trainer.default_local_dir "
                          "(keys that only change speed, memory or logging may differ; see grpo_lib/checkpoint.py)")


def prepare_run_folder(cfg, plan: ResumePlan) -> None:
    """Process 0, before the metric logger opens: drop leftover temporary checkpoints and the checkpoints of
    steps after the one resumed (they belong to the abandoned continuation). Metrics are cut by MetricLogger."""
    run_dir = Path(cfg.trainer.default_local_dir)
    if not run_dir.is_dir():
        return
    for child in run_dir.iterdir():
        if child.name.startswith(".tmp_global_step_") or child.name.startswith(".old_global_step_"):
            shutil.rmtree(child, ignore_errors=True)
    for step, folder in complete_checkpoints(run_dir).items():
        if step > plan.step:
            print(f"removing {folder}: it comes after the resumed step {plan.step}", file=sys.stderr)
            shutil.rmtree(folder)
    if plan.step > 0:
        _write_pointer(run_dir, plan.step)


# ------------------------------------------------------------------------------------------ save
def _rng_state() -> dict:
    np_state = np.random.get_state()
    # CUDA: this process's own device only (every process saves its own file). Not get_rng_state_all(): a resume
    # that sees fewer devices (one GPU per task under a scheduler) could not restore the others (IndexError).
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "python": json.dumps(random.getstate()),
            "numpy": {"key": np_state[0], "state": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])}}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and isinstance(state["cuda"], torch.Tensor):
        torch.cuda.set_rng_state(state["cuda"])
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_pointer(run_dir: Path, step: int) -> None:
    tmp = run_dir / f".{POINTER}.tmp"
    tmp.write_text(f"{step}\n")
    os.replace(tmp, run_dir / POINTER)


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a folder that went read-only): the partial folder is removed,
    the previous checkpoint is untouched, and the run stops with exit code 3 (the same on every process)."""

    exit_code = 3


def save(cfg, *, step: int, actor, sampler_state: dict, export_hf, rank: int, world_size: int) -> Path:
    """Write the checkpoint of `step` atomically (call on every process); returns its folder.

    `sampler_state` is the prompt sampler's position after step `step` (`PromptSampler.state_dict()`).
    `export_hf(folder)` writes the Hugging Face export (called on every process: the shards are gathered with
    it; process 0 writes). A write that fails on any process (OSError: no space left, permissions) raises
    SaveError on every process: the processes agree after each stage whose writes are local, so none of them is
    left waiting in a collective the others skipped.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from grpo_lib.distributed import all_reduce_max, barrier

    run_dir = Path(cfg.trainer.default_local_dir)
    final, tmp = run_dir / f"global_step_{step}", run_dir / f".tmp_global_step_{step}"
    failure: list[BaseException] = []

    def attempt(write) -> None:
        if not failure:
            try:
                write()
            except (OSError, CheckpointException) as exc:
                failure.append(exc)

    def agree() -> None:  # one all-reduce: did any process fail so far?
        if all_reduce_max(1.0 if failure else 0.0) > 0:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoint stays
            raise SaveError(_save_failure_message(run_dir, step, failure[0] if failure else None))

    def start() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)

    def sharded_state() -> None:  # DCP raises on every process when any process's write fails
        model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")

    def trainer_state() -> None:
        state = {"step": step, "actor_steps_done": actor.steps_done, "scheduler": actor.scheduler.state_dict(),
                 "sampler": sampler_state, "world_size": world_size, "config": dataclasses.asdict(cfg)}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))

    def publish() -> None:  # COMPLETE last, then the rename, then the pointer
        (tmp / MARKER).write_text(f"step {step}\n")
        _fsync(tmp / MARKER)
        if final.exists():  # the same step saved again (a stop right after a resume): swap, never delete first
            old = run_dir / f".old_global_step_{step}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync(run_dir)
        _write_pointer(run_dir, step)

    if rank == 0:
        attempt(start)
    agree()
    attempt(sharded_state)
    if cfg.trainer.save_hf:
        agree()  # the export gathers shards: every process enters it, or none
        attempt(lambda: export_hf(tmp / "actor"))
    if rank == 0:
        attempt(trainer_state)
    agree()  # every process's files are written
    if rank == 0:
        attempt(publish)
    agree()
    if rank == 0 and cfg.trainer.max_ckpt_to_keep is not None:
        prune(run_dir, cfg.trainer.max_ckpt_to_keep)
    barrier()
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints. The new one is complete already, so a folder that
    cannot be removed (permissions, a file held open on NFS) is a warning, not a failed run."""
    for folder in list(complete_checkpoints(run_dir).values())[:-keep]:
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            print(f"warning: trainer.max_ckpt_to_keep={keep}: could not remove the old checkpoint {folder} ({exc}); "
                  "remove it by hand", file=sys.stderr)


def _save_failure_message(run_dir: Path, step: int, exc: BaseException | None) -> str:
    newest = complete_checkpoints(run_dir) if run_dir.is_dir() else {}
    last = f"the last complete checkpoint, {list(newest.values())[-1]}, is intact: rerun the same command to resume from it" \
        if newest else "no earlier checkpoint exists"
    try:
        free = f"{shutil.disk_usage(run_dir).free / 2**30:.2f} GiB free"
    except OSError:
        free = "free space unknown"
    cause = f"{type(exc).__name__}: {exc}" if exc is not None else "a write failed on another process"
    return (f"could not write the checkpoint of step {step} in {run_dir} ({cause}; {free} there). The partial folder "
            f"was removed and {last}. Free disk space (or lower trainer.max_ckpt_to_keep, or point "
            "trainer.default_local_dir at a larger disk)")


# ------------------------------------------------------------------------------------------ load
def read_trainer_state(path: Path) -> dict:
    if not (path / MARKER).is_file():
        raise ResumeError(f"{path} is not a complete checkpoint (no {MARKER} marker): it was cut short; resume from an earlier one")
    return json.loads((path / "trainer_state.json").read_text())


def load(path: Path, *, actor, sampler, rank: int) -> dict:
    """Restore actor weights + optimizer, scheduler, Actor.steps_done, sampler position and this process's RNG
    states from the complete checkpoint `path` (call on every process); returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = read_trainer_state(path)
    model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    set_state_dict(actor.model, actor.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.steps_done = int(state["actor_steps_done"])
    sampler.load_state_dict(state["sampler"])
    rng_file = path / "rng" / f"rank_{rank}.pt"
    if rng_file.is_file():  # absent when resuming with more processes than were saved: seeds of the step still match
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state
