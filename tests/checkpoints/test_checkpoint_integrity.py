"""A checkpoint's manifest finds every kind of damage, and loading a checkpoint runs no code from it
(grpo_lib/checkpoints/integrity.py, through grpo_lib/checkpoints/checkpoint.py's save and load).

Checkpoints here are real ones written by `checkpoint.save` in this process for a tiny module with AdamW
(tests/helpers/tiny_checkpoint.py: no trainer, no engine): the same DCP shards, RNG file, trainer_state.json and manifest a
run writes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from grpo_lib.checkpoints import checkpoint
from grpo_lib.checkpoints.integrity import (MANIFEST, UnsafeCheckpointError, checkpoint_problems, file_checksum, listing,
                                           safe_dcp_loaders, share)
from tests.helpers.tiny_checkpoint import RecordingSampler, TinyActor, save_tiny


def evil_pickle(command: str) -> bytes:
    """A pickle that runs `command` in a shell when unpickled (os.system), as a crafted `.metadata` would."""
    class Evil:
        def __reduce__(self):
            return os.system, (command,)
    return pickle.dumps(Evil())


def test_file_checksum_and_share_examples(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    assert file_checksum(tmp_path / "f") == "352441c2"  # CRC-32 of b"abc", zlib.crc32(b"abc") == 0x352441c2
    assert file_checksum(tmp_path / "f", chunk_bytes=1) == "352441c2", "chunks continue the CRC"
    files = [("a", 5), ("b", 9), ("c", 1), ("d", 7)]
    assert share(files, 0, 2) == [("b", 9), ("a", 5)] and share(files, 1, 2) == [("d", 7), ("c", 1)]


def test_save_writes_a_manifest_of_every_file(tmp_path):
    folder = save_tiny(tmp_path, 2)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["checksum"] == "crc32"
    on_disk = dict(listing(folder))
    assert set(manifest["files"]) == set(on_disk) and {"dcp/.metadata", "rng/rank_0.pt", "trainer_state.json",
                                                       "actor/model.safetensors"} <= set(on_disk)
    assert any(rel.endswith(".distcp") for rel in on_disk)
    for rel, entry in manifest["files"].items():
        assert entry == {"bytes": on_disk[rel], "crc32": file_checksum(folder / rel)}, rel
    assert checkpoint_problems(folder, step=2) == []
    for rank in (0, 1, 2):  # three processes: each checksums its share, together all files
        assert checkpoint_problems(folder, step=2, rank=rank, world_size=3) == []


def _shard(folder: Path) -> Path:
    return next((folder / "dcp").glob("*.distcp"))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {  # name -> (damage the folder, a needle of the problem line)
    "truncated DCP shard": (lambda f: os.truncate(_shard(f), _shard(f).stat().st_size // 2), "bytes, the manifest says"),
    "flipped byte in a shard": (lambda f: _flip_last_byte(_shard(f)), "crc32"),
    "truncated RNG file": (lambda f: os.truncate(f / "rng" / "rank_0.pt", 10), "rng/rank_0.pt: 10 bytes"),
    "garbage trainer_state.json": (lambda f: (f / "trainer_state.json").write_text("{garbage"), "trainer_state.json: JSONDecodeError"),
    "missing export file": (lambda f: (f / "actor" / "model.safetensors").unlink(), "actor/model.safetensors: missing"),
    "file added": (lambda f: (f / "dcp" / "__9_0.distcp").write_bytes(b"x"), "dcp/__9_0.distcp: not in the manifest"),
    "garbage manifest": (lambda f: (f / MANIFEST).write_text("[1, 2"), "manifest.json: not a manifest"),
    "garbage .metadata": (lambda f: (f / "dcp" / ".metadata").write_bytes(b"\x80\x04garbage"), "dcp/.metadata:"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_kind_of_damage_is_found_on_any_process_count(tmp_path, damage):
    folder = save_tiny(tmp_path, 2)
    action, needle = DAMAGE[damage]
    action(folder)
    one = checkpoint_problems(folder, step=2)
    assert any(needle in line for line in one), one
    two = sorted({line for rank in (0, 1) for line in checkpoint_problems(folder, step=2, rank=rank, world_size=2)})
    assert two == sorted(set(one)), "two processes together find what one finds"


def test_an_unreadable_file_is_a_problem_not_a_crash(tmp_path, monkeypatch):
    """An I/O error while checksumming (a failing disk, permissions) makes the checkpoint damaged; the resume goes on."""
    import errno

    from grpo_lib.checkpoints import integrity

    folder = save_tiny(tmp_path, 2)
    checksum = integrity.file_checksum

    def failing(path, **kwargs):
        if path.name == "model.safetensors":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return checksum(path, **kwargs)

    monkeypatch.setattr(integrity, "file_checksum", failing)
    assert [line.split(" (")[0] for line in checkpoint_problems(folder, step=2)] == ["actor/model.safetensors: unreadable"]


def test_checkpoint_without_manifest_gets_the_checks_that_need_none(tmp_path):
    """Written before manifests existed: accepted (the resume warns, tests/checkpoints/test_checkpoint.py), but a garbage
    trainer_state.json or .metadata is still found."""
    folder = save_tiny(tmp_path, 2)
    (folder / MANIFEST).unlink()
    assert checkpoint_problems(folder, step=2) == []
    (folder / "trainer_state.json").write_text("{garbage")
    assert [line.split(":")[0] for line in checkpoint_problems(folder, step=2)] == ["trainer_state.json"]


# issue 31 item 2: a checkpoint without its manifest
OLD_DAMAGE = {  # damage a checkpoint from before manifests can still show -> a needle of the problem line
    "truncated DCP shard": (lambda f: os.truncate(_shard(f), _shard(f).stat().st_size - 1),
                            "bytes, DCP's metadata places data up to byte"),
    "missing DCP shard": (lambda f: _shard(f).unlink(), ".distcp: missing (DCP's metadata places data in it"),
    "truncated RNG file": (lambda f: os.truncate(f / "rng" / "rank_0.pt", 10), "rng/rank_0.pt: does not load"),
    "missing RNG file": (lambda f: (f / "rng" / "rank_0.pt").unlink(), "rng/rank_0.pt: missing (trainer_state.json says 1"),
}


@pytest.mark.parametrize("damage", list(OLD_DAMAGE))
def test_without_a_manifest_shard_sizes_are_checked_against_dcps_offsets(tmp_path, damage):
    """No manifest (a checkpoint from before manifests): every DCP shard must hold the bytes `.metadata` places in it
    (its entries' offset + length; DCP writes them back to back, so the last entry ends at the file's end: the tiny
    checkpoint's one shard is exactly that long) and each process's RNG file must load; one byte short is damage."""
    folder = save_tiny(tmp_path, 2)
    (folder / MANIFEST).unlink()
    assert checkpoint_problems(folder, step=2) == [], "an intact checkpoint passes the checks that need no manifest"
    action, needle = OLD_DAMAGE[damage]
    action(folder)
    problems = checkpoint_problems(folder, step=2)
    assert any(needle in line for line in problems), problems


def test_a_missing_manifest_where_one_is_expected_is_damage(tmp_path):
    """In a folder whose checkpoints carry manifests, a checkpoint without one was not written before manifests
    existed (save writes it before COMPLETE): its files cannot be trusted, whatever the cheap checks say."""
    folder = save_tiny(tmp_path, 2)
    (folder / MANIFEST).unlink()
    problems = checkpoint_problems(folder, step=2, manifest_expected=True)
    assert len(problems) == 1 and problems[0].startswith(f"{MANIFEST}: missing"), problems
    assert checkpoint_problems(save_tiny(tmp_path, 3), step=3, manifest_expected=True) == []


# ------------------------------------------------------------------------------------------ no code from a checkpoint
@pytest.mark.parametrize("payload", ["os.system", "builtins.eval"])
def test_crafted_dcp_metadata_is_refused_naming_the_file_and_runs_nothing(tmp_path, payload):
    """torch's FileSystemReader pickle.loads `.metadata`: a crafted one ran its command when the checkpoint loaded.
    checkpoint.load refuses it before anything runs, naming the file; the resume's check reports it too."""
    folder = save_tiny(tmp_path, 2)
    ran = tmp_path / "ran"
    if payload == "os.system":
        crafted = evil_pickle(f"touch {ran}")
    else:  # builtins.eval of an expression that writes the file
        class Evil:
            def __reduce__(self):
                return eval, (f"open({str(ran)!r}, 'w').close()",)
        crafted = pickle.dumps(Evil())
    (folder / "dcp" / ".metadata").write_bytes(crafted)
    with pytest.raises(pickle.UnpicklingError, match=r"\.metadata: refused to unpickle it: it asks for (posix|os|builtins)\.(system|eval)"):
        checkpoint.load(folder, actor=TinyActor(2), sampler=RecordingSampler(), rank=0)
    assert not ran.exists(), "the crafted metadata ran its code"
    assert any("dcp/.metadata: UnsafeCheckpointError" in line for line in checkpoint_problems(folder, step=2))
    assert not ran.exists()


def test_a_real_checkpoint_loads_exactly_through_the_restricted_reader(tmp_path):
    saved_actor_seed = 3
    folder = save_tiny(tmp_path, 2, seed=saved_actor_seed)
    reference, actor, sampler = TinyActor(saved_actor_seed), TinyActor(7), RecordingSampler()
    assert not torch.equal(actor.model[0].weight, reference.model[0].weight)
    state = checkpoint.load(folder, actor=actor, sampler=sampler, rank=0)
    assert state["step"] == 2 and sampler.state == {"position": 8} and actor.steps_done == saved_actor_seed
    for (name, a), b in zip(actor.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.equal(a, b), name
    for group_a, group_b in zip(actor.optimizer.param_groups, reference.optimizer.param_groups):
        assert {k: v for k, v in group_a.items() if k != "params"} == {k: v for k, v in group_b.items() if k != "params"}
    for pa, pb in zip(actor.model.parameters(), reference.model.parameters()):
        sa, sb = actor.optimizer.state[pa], reference.optimizer.state[pb]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert actor.scheduler.state_dict()["last_epoch"] == reference.scheduler.state_dict()["last_epoch"]


def test_non_tensor_entries_load_with_weights_only(tmp_path):
    """DCP stores non-tensor values as torch.save'd bytes and torch's DefaultLoadPlanner loads them with
    torch.load(weights_only=False): a crafted entry runs its code there (checked first, so the test proves something);
    the planner checkpoint.load uses refuses it."""
    import torch.distributed.checkpoint as dcp

    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    dcp.save({"lr": 0.5, "evil": Evil()}, checkpoint_id=str(tmp_path / "dcp"))
    dcp.load({"lr": 0.0, "evil": 0}, checkpoint_id=str(tmp_path / "dcp"))
    assert ran.exists(), "torch's own planner did not run it: the test would prove nothing"
    ran.unlink()
    reader, planner = safe_dcp_loaders(tmp_path / "dcp")
    with pytest.raises(BaseException, match=r"'evil' does not load with torch.load\(weights_only=True\)"):  # DCP wraps it
        dcp.load({"lr": 0.0, "evil": 0}, storage_reader=reader, planner=planner)
    assert not ran.exists()
    state = {"lr": 0.0}
    reader, planner = safe_dcp_loaders(tmp_path / "dcp")
    planner.allow_partial_load = True  # only "lr": the crafted entry is not read, and the plain one loads
    dcp.load(state, storage_reader=reader, planner=planner)
    assert state == {"lr": 0.5}


def test_the_restricted_unpickler_refuses_before_calling():
    from grpo_lib.checkpoints.integrity import _MetadataUnpickler

    assert issubclass(UnsafeCheckpointError, pickle.UnpicklingError), "callers that catch UnpicklingError catch it"
    with pytest.raises(UnsafeCheckpointError, match=r"^x/\.metadata: refused"):
        _MetadataUnpickler(io.BytesIO(evil_pickle("true")), path=Path("x/.metadata")).load()
