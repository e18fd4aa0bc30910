"""Checkpoints that survive any kill, exact resume, and run folders that never mix two runs.

A run folder (`trainer.default_local_dir`) holds one run:

    metrics.jsonl, tensorboard/            the metrics (a resumed run continues them from its step)
    global_step_N/                         one complete checkpoint
        dcp/                               actor weights + optimizer state, torch.distributed.checkpoint
                                           (every process writes its own shard; FSDP2 DTensors stay sharded)
        rng/rank_R.pt                      each process's RNG states (torch, CUDA, python, numpy)
        carry/rank_R.json                  rollout.partial_rollout: each process's responses in flight (the pool)
        trainer_state.json                 step, Actor.steps_done, LR scheduler, prompt sampler position,
                                           the process count and the resolved config (DAPO's generation
                                           rounds live inside one step; the sampler position covers
                                           the prompts they drew)
        actor/                             Hugging Face export (trainer.save_hf): loads in transformers / vLLM
        manifest.json                      every other file's relative path, size and CRC-32
        COMPLETE                           written last: a folder without it is never loaded
    damaged_global_step_N/                 a damaged checkpoint a resume skipped (set aside, never deleted)
    latest_checkpointed_iteration.txt      the newest complete step (verl's name), updated after the rename
    .run.lock                              held by the run's process 0 while it runs (grpo_lib/checkpoints/lock.py)

Atomic save: everything is written to `.tmp_global_step_N/`, then every process checksums a share of the files and
process 0 writes the manifest, then the COMPLETE marker; then the folder is renamed to `global_step_N` and the pointer
replaced; only then are the oldest checkpoints beyond `trainer.max_ckpt_to_keep` deleted. A kill at any moment leaves
the previous checkpoint as it was; the next start deletes leftover `.tmp_*` folders.

Resume (`trainer.resume_mode`, verl's names): `auto` continues from the newest complete checkpoint in the run
folder (a fresh folder starts at step 0), `disable` refuses a folder that already holds a run (exit 2),
`resume_path` continues from `trainer.resume_from_path`. Two steps, both before the engine starts:
`plan_resume` (the folder alone, before the process group) and `verify_resume` (every file, after it).

- A run folder holds one run: `resume_path` to a checkpoint of another folder needs an empty run folder (or that
  checkpoint's own folder); within one folder, a step with newer complete checkpoints is resumed only with
  `trainer.discard_newer_checkpoints=true`, which deletes them. Otherwise exit 2, nothing touched. Nothing newer
  than the resumed step is ever deleted without that key.
- Every file of the chosen checkpoint is checked against its manifest (size, CRC-32; grpo_lib/checkpoints/integrity.py
  says why CRC-32), `trainer_state.json` must parse and `dcp/.metadata` must pass the restricted unpickler. With
  `auto`, a damaged checkpoint is reported by path with its problems, renamed `damaged_global_step_N`, and the next
  older complete checkpoint is tried; when none is left the run exits 2 naming them all and changes nothing (it does
  not silently restart from step 0: a user who wants that moves them away). With `resume_path` a damaged checkpoint
  exits 2. A checkpoint without manifest.json is damaged when an older checkpoint of its folder has one (that trainer
  writes one before every COMPLETE: `manifest_expected`); otherwise it was written before manifests existed and is
  resumed with a warning after the checks that need no manifest (DCP shard sizes against DCP's metadata offsets, the
  RNG files load; checksums cannot be checked).
- A config that changes what a step computes exits 2 listing the differences; the keys in `MAY_CHANGE_ON_RESUME`
  (speed, memory, logging, length of the run) may change: the fields declared `may_change_on_resume` in
  grpo_lib/config/schema.py.
- Another process count: `get_state_dict / set_state_dict` work on a plain module and on an FSDP2-sharded one
  alike and DCP reshards, trainer_state's process count only says which RNG files exist, the prompt sampler's
  position is global, and no step draws from the global RNGs; so a checkpoint of W processes resumes at any count and
  continues within the float reordering of a different count (tests/checkpoints/test_checkpoint.py, 2 -> 1 and 1 -> 2).

Trust boundary: a checkpoint is data. Loads read JSON, `torch.load(weights_only=True)` (RNG files, DCP's tensors and
its non-tensor entries) and DCP's `.metadata` pickle through an unpickler that resolves only DCP's own classes; a
crafted checkpoint cannot run code (grpo_lib/checkpoints/integrity.py). The manifest detects damage, not tampering.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grpo_lib.checkpoints.integrity import (CHECKSUM, MANIFEST, MARKER, STATE, checkpoint_problems, file_checksum, listing,
                                           read_dcp_metadata, safe_dcp_loaders, share, write_manifest)
from grpo_lib.config.schema import resume_may_change_keys

POINTER = "latest_checkpointed_iteration.txt"
DAMAGED_PREFIX = "damaged_"  # a damaged checkpoint that a resume skipped, set aside (never deleted)
_STEP_DIR = re.compile(r"^global_step_(\d+)$")

# Keys that may differ between a checkpoint and the run resuming it: they change speed, memory, logging or how
# long the run goes, never what one step computes. Any other difference exits 2. (A prefix ends with ".".) Declared
# on the fields of grpo_lib/config/schema.py (`may_change_on_resume`), next to their docstrings.
MAY_CHANGE_ON_RESUME = resume_may_change_keys()


class ResumeError(ValueError):
    """A run folder or checkpoint that cannot be used as asked (exit code 2; the message says what to do)."""


@dataclass
class ResumePlan:
    """Where the run starts: step 0 (fresh) or the step of `path`, a complete checkpoint folder.

    `plan_resume` fills `fallbacks` (auto: the older complete checkpoints, newest first, tried in turn when `path` is
    damaged) and `discard` (the newer checkpoints the user asked to delete: trainer.discard_newer_checkpoints);
    `verify_resume` settles `path` and lists the damaged checkpoints it skipped in `damaged` (moved aside, never deleted).
    """
    step: int = 0
    path: Path | None = None
    fallbacks: list[Path] = field(default_factory=list)
    discard: list[Path] = field(default_factory=list)
    damaged: list[Path] = field(default_factory=list)


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
    """What in `run_dir` belongs to an earlier run: metrics, TensorBoard events, checkpoints (complete, cut short by a
    kill, or set aside as damaged)."""
    if not run_dir.is_dir():
        return []
    names = [c.name for c in sorted(run_dir.iterdir())
             if c.name in ("metrics.jsonl", "val_generations.jsonl", "tensorboard", POINTER) or _STEP_DIR.match(c.name)
             or c.name.startswith((".tmp_global_step_", DAMAGED_PREFIX))]
    return names


def checkpoint_step(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if not match:
        raise ResumeError(f"trainer.resume_from_path={str(path)!r}: expected a global_step_N checkpoint folder")
    return int(match.group(1))


def plan_resume(cfg) -> ResumePlan:
    """Decide where the run starts from the folder alone (cheap: no file of a checkpoint is read; every process calls it
    before anything heavy loads; `verify_resume` then checks the checkpoint's files and the config).

    Raises ResumeError (exit 2, nothing touched) when the folder holds another run and resume_mode is `disable`; when
    resume_path names a checkpoint that is missing or incomplete, or one of another run folder while this one already
    holds a run (a run folder holds one run); when resume_path names a step of this folder that has newer complete
    checkpoints and trainer.discard_newer_checkpoints is false; when auto finds step folders this trainer never wrote.
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
        return _plan_resume_path(Path(t.resume_from_path), run_dir, previous, discard_newer=t.discard_newer_checkpoints)
    found = complete_checkpoints(run_dir)  # auto
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
    newest_first = [found[s] for s in sorted(found, reverse=True)]
    return ResumePlan(step=max(found), path=newest_first[0], fallbacks=newest_first[1:])


def _plan_resume_path(path: Path, run_dir: Path, previous: list[str], *, discard_newer: bool) -> ResumePlan:
    if not (path / MARKER).is_file():
        raise ResumeError(f"trainer.resume_from_path={str(path)!r} is not a complete checkpoint (no {MARKER} marker"
                          f"{'' if path.is_dir() else '; the folder does not exist'}): point it at a global_step_N folder "
                          "that has one")
    step = checkpoint_step(path)
    if path.resolve().parent != run_dir.resolve():  # a checkpoint of another run folder
        if previous:
            own = complete_checkpoints(run_dir)
            continue_here = (f"; if {run_dir} is the continuation you started from that checkpoint, resume its newest "
                             f"checkpoint (global_step_{max(own)}) with trainer.resume_mode=auto" if own else
                             f"; {run_dir} has no complete checkpoint of its own, so if it is a continuation of that "
                             "checkpoint cut short before its first save, delete it and rerun")
            raise ResumeError(
                f"trainer.resume_from_path={str(path)!r} belongs to the run in {path.resolve().parent}, but "
                f"trainer.default_local_dir={str(run_dir)!r} already holds another run ({', '.join(previous)}): a run "
                "folder holds one run. Start the new run from that checkpoint in an empty folder (a new "
                f"trainer.default_local_dir), or continue that run in its own folder (trainer.default_local_dir="
                f"{path.resolve().parent}){continue_here}. Nothing was changed.")
        return ResumePlan(step=step, path=path)
    newer = [folder for s, folder in complete_checkpoints(run_dir).items() if s > step]
    if newer and not discard_newer:
        raise ResumeError(
            f"trainer.resume_from_path={str(path)!r} is step {step} of {run_dir}, which has newer checkpoints "
            f"({', '.join(f.name for f in newer)}): continuing from step {step} would delete them and the metrics after "
            f"step {step}. To do that, add trainer.discard_newer_checkpoints=true; to continue from the newest, use "
            "trainer.resume_mode=auto. Nothing was changed.")
    return ResumePlan(step=step, path=path, discard=newer)


def verify_resume(cfg, plan: ResumePlan, *, rank: int, world_size: int) -> ResumePlan:
    """Check every file of the checkpoint `plan` resumes before anything heavy loads (every process, after the process
    group starts: each checksums its share of the files); with resume_mode=auto a damaged one is reported by path and
    the next older complete checkpoint is tried; then the config is compared with the chosen checkpoint's.

    Returns the plan to run (`damaged`: the checkpoints skipped). Raises ResumeError (exit 2, nothing touched) on every
    process alike when the checkpoint named by resume_path is damaged, when every checkpoint of the folder is, or when
    the config changed what a step computes.
    """
    from grpo_lib.core.distributed import all_gather_object

    if plan.path is None:
        return plan
    damaged: list[tuple[Path, list[str]]] = []
    for path in [plan.path, *plan.fallbacks]:
        start = time.perf_counter()
        shares = all_gather_object(checkpoint_problems(path, step=checkpoint_step(path), rank=rank, world_size=world_size,
                                                       manifest_expected=manifest_expected(path)))
        problems = sorted({problem for share in shares for problem in share})
        if not problems:
            break
        damaged.append((path, problems))
        if rank == 0:
            print(f"warning: the checkpoint {path} is damaged:\n    " + "\n    ".join(problems), file=sys.stderr)
    else:
        report = "\n".join(f"  {path}:\n    " + "\n    ".join(problems) for path, problems in damaged)
        if cfg.trainer.resume_mode == "resume_path":
            raise ResumeError(f"trainer.resume_from_path={str(plan.path)!r} is damaged and cannot be resumed:\n{report}\n"
                              "Point trainer.resume_from_path at another checkpoint, or restore this one from a copy.")
        raise ResumeError(f"every checkpoint in {cfg.trainer.default_local_dir} is damaged; nothing was changed:\n{report}\n"
                          "Restore them from a copy; or, to start this run again from step 0, move them out of the folder "
                          "(or choose another trainer.default_local_dir).")
    if rank == 0:
        if not (path / MANIFEST).is_file():
            print(f"warning: {path} was written before checkpoints had a manifest ({MANIFEST}): its DCP shards' "
                  "sizes checked against DCP's metadata and its RNG files load, but the checksums cannot be checked (a flipped byte would go unnoticed); resuming from it (the next checkpoint "
                  "will have a manifest)", file=sys.stderr)
        else:
            print(f"verified {path} (every file's size and {CHECKSUM}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        if damaged:
            print(f"falling back to {path}, the newest complete checkpoint that is not damaged: the steps after "
                  f"{checkpoint_step(path)} run again (their metrics are replaced)", file=sys.stderr)
    check_config_unchanged(cfg, read_trainer_state(path)["config"], path)
    return ResumePlan(step=checkpoint_step(path), path=path, discard=plan.discard, damaged=[p for p, _ in damaged])


def manifest_expected(path: Path) -> bool:
    """Must the complete checkpoint `path` have a manifest? Yes when an older complete checkpoint of its folder has one:
    the trainer that wrote that one writes a manifest before every COMPLETE, so a newer checkpoint without it is damaged
    (a file lost), not old. A folder from before manifests, or its checkpoints older than the first with one (a run
    that continued after an upgrade), are resumed with the checks that need none."""
    step = checkpoint_step(path)
    return any((other / MANIFEST).is_file() for s, other in complete_checkpoints(path.parent).items() if s < step)


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
                          "(keys that only change speed, memory or logging may differ; see grpo_lib/checkpoints/checkpoint.py)")


def prepare_run_folder(cfg, plan: ResumePlan) -> None:
    """Process 0, before the metric logger opens: drop leftover temporary checkpoints, set the damaged checkpoints that
    `verify_resume` skipped aside (renamed `damaged_global_step_N`, kept for the user), and delete the newer checkpoints
    the user asked to discard (trainer.discard_newer_checkpoints). Metrics after the resumed step are cut by
    MetricLogger."""
    run_dir = Path(cfg.trainer.default_local_dir)
    if not run_dir.is_dir():
        return
    for child in run_dir.iterdir():
        if child.name.startswith(".tmp_global_step_") or child.name.startswith(".old_global_step_"):
            shutil.rmtree(child, ignore_errors=True)
    for folder in plan.damaged:
        aside = run_dir / f"{DAMAGED_PREFIX}{folder.name}"
        for n in itertools.count(2):
            if not aside.exists():
                break
            aside = run_dir / f"{DAMAGED_PREFIX}{folder.name}.{n}"
        os.replace(folder, aside)
        print(f"moved the damaged checkpoint {folder} to {aside} (not resumable; delete it once you no longer need it)",
              file=sys.stderr)
    for folder in plan.discard:
        print(f"removing {folder}: it comes after the resumed step {plan.step} (trainer.discard_newer_checkpoints=true)",
              file=sys.stderr)
        shutil.rmtree(folder)
    newer = [f.name for s, f in complete_checkpoints(run_dir).items() if s > plan.step]
    assert not newer, f"checkpoints newer than the resumed step {plan.step} are left in {run_dir}: {newer} (plan_resume must refuse)"
    if plan.path is not None and plan.path.resolve().parent == run_dir.resolve():
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


def save(cfg, *, step: int, actor, sampler_state: dict, export_hf, rank: int, world_size: int,
         carry_state: dict | None = None) -> Path:
    """Write the checkpoint of `step` atomically (call on every process); returns its folder.

    `sampler_state` is the prompt sampler's position after step `step` (`PromptSampler.state_dict()`); `carry_state`
    this process's carried responses after it (`CarryPool.state_dict()`, rollout.partial_rollout; None: none kept).
    `export_hf(folder)` writes the Hugging Face export (called on every process: the shards are gathered with
    it; process 0 writes). A write that fails on any process (OSError: no space left, permissions) raises
    SaveError on every process: the processes agree after each stage whose writes are local, so none of them is
    left waiting in a collective the others skipped. Once every file is written, each process checksums its share of
    them and process 0 writes the manifest; COMPLETE follows it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from grpo_lib.core.distributed import all_gather_object, all_reduce_max, barrier, broadcast_object

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
        if carry_state is not None:
            (tmp / "carry").mkdir(exist_ok=True)
            (tmp / "carry" / f"rank_{rank}.json").write_text(json.dumps(carry_state))

    def trainer_state() -> None:
        state = {"step": step, "actor_steps_done": actor.steps_done, "scheduler": actor.scheduler.state_dict(),
                 "sampler": sampler_state, "world_size": world_size, "config": dataclasses.asdict(cfg)}
        (tmp / STATE).write_text(json.dumps(state, indent=1))

    def publish() -> None:  # COMPLETE last (after the manifest), then the rename, then the pointer
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
    files: list[tuple[str, int]] = []
    if rank == 0:
        attempt(lambda: files.extend(listing(tmp)))
    files = broadcast_object(files)  # what process 0 sees (the folder is shared): every process checksums its share
    sums: dict[str, str] = {}
    attempt(lambda: sums.update({rel: file_checksum(tmp / rel) for rel, _ in share(files, rank, world_size)}))
    shares = all_gather_object(sums)
    agree()  # every share is checksummed
    if rank == 0:
        attempt(lambda: write_manifest(tmp, files, {rel: crc for part in shares for rel, crc in part.items()}))
    agree()
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
def read_carry_state(path: Path, rank: int) -> dict | None:
    """This process's carried responses in the checkpoint `path` (`save`'s carry_state), or None when it holds none
    (saved without rollout.partial_rollout, or by fewer processes)."""
    file = path / "carry" / f"rank_{rank}.json"
    return json.loads(file.read_text()) if file.is_file() else None


def read_trainer_state(path: Path) -> dict:
    if not (path / MARKER).is_file():
        raise ResumeError(f"{path} is not a complete checkpoint (no {MARKER} marker): it was cut short; resume from an earlier one")
    return json.loads((path / STATE).read_text())


def load(path: Path, *, actor, sampler, rank: int) -> dict:
    """Restore actor weights + optimizer, scheduler, Actor.steps_done, sampler position and this process's RNG
    states from the complete checkpoint `path` (call on every process, after `verify_resume` checked it); returns the
    trainer state. Reads DCP through `safe_dcp_loaders`, the RNG files with torch.load(weights_only=True) and JSON:
    nothing in a checkpoint can run code.

    On another process count DCP reshards the weights and optimizer state; a process with no RNG file of its own
    (more processes than were saved) keeps the RNG trainer.seed gave it: no step draws from the global RNGs (samples
    have their own seeds, grpo_lib/core/seeds.py; the mini-batch shuffle its own generator), so the run continues the same.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = read_trainer_state(path)
    model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
    read_dcp_metadata(path / "dcp" / ".metadata")  # refused here with its own message (inside dcp.load it comes wrapped)
    reader, planner = safe_dcp_loaders(path / "dcp")
    dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=reader, planner=planner)
    set_state_dict(actor.model, actor.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.steps_done = int(state["actor_steps_done"])
    sampler.load_state_dict(state["sampler"])
    if rank < int(state["world_size"]):  # the checkpoint holds this process's RNG file (the manifest checked it is whole)
        _set_rng_state(torch.load(path / "rng" / f"rank_{rank}.pt", weights_only=True))
    return state
