"""Resume paths and damaged checkpoints, decided before the engine starts: train_grpo.main(argv) in this process up to
GRPOTrainer.setup over real checkpoints of a tiny module (tests/helpers/checkpoint_runs.py): a resume_path from another
run folder, an older step, truncated shards, garbage trainer state, a crafted .metadata, a lost manifest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from grpo_lib.checkpoints.checkpoint import MARKER, POINTER
from tests.helpers.checkpoint_runs import (checkpoints_of, folder_digest, main_until_setup, resume_args)


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

    from grpo_lib.checkpoints.integrity import MANIFEST, file_checksum

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
    from grpo_lib.checkpoints.integrity import MANIFEST

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
    from grpo_lib.checkpoints.integrity import MANIFEST

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
    from grpo_lib.checkpoints.integrity import MANIFEST

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
