"""What a checkpoint folder is trusted with: a manifest of its files (sizes and checksums, checked before a resume) and
reading torch.distributed.checkpoint (DCP) without unpickling untrusted bytes. grpo_lib/checkpoints/checkpoint.py writes and
loads checkpoints with these; this module knows nothing of runs, configs or processes.

The manifest (`manifest.json` in each `global_step_N/`, written just before COMPLETE) lists every other file of the
checkpoint with its size in bytes and its CRC-32:

    {"format": 1, "checksum": "crc32",
     "files": {"dcp/__0_0.distcp": {"bytes": 2097152, "crc32": "5d6e2f1a"}, "trainer_state.json": {...}, ...}}

`checkpoint_problems` finds a missing, added, truncated or changed file, a `trainer_state.json` that does not parse,
and a `dcp/.metadata` that the restricted unpickler refuses; each process checksums its share of the files.

Without a manifest: where one is expected (the caller knows the folder's checkpoints carry them: a trainer that writes
manifests writes one before COMPLETE) its absence is itself the damage. A checkpoint from before manifests gets the
checks that need none: besides the two above, every DCP shard holds the bytes `.metadata` places in it (each entry's
offset + length within its file; DCP writes a shard's entries back to back, so the last one ends at the file's end)
and every process's RNG file loads (torch.load(weights_only=True), as the resume loads it). What only a checksum finds
(a flipped byte, an RNG file cut inside a tensor's data) stays unverifiable there; the caller says so.

Why CRC-32 and not sha256: the manifest detects damage (a truncated shard, a disk or copy that flipped bytes, a
half-synced file after a power cut), not tampering: whoever can rewrite a shard can rewrite the manifest beside it, so
a cryptographic hash buys nothing. Measured on this project's 2-core x86 machine (with SHA extensions), reading a
1 GiB file from the page cache: `file_checksum` (zlib.crc32) 5.6 GB/s, sha256 1.9 GB/s (in memory: 6.8 and 2.0 GB/s,
blake2b 1.35; sha256 is slower still on CPUs without SHA extensions, not measured here). A Qwen3-4B checkpoint (about
45 GiB with the export) then costs ~9 s of CRC-32 per save and per resume on one process (the processes split the
files) against ~25 s of sha256. Sizes catch every truncation; CRC-32 catches every burst of up to 32 flipped bits and
other random damage with probability 1 - 2**-32. zlib is in Python's standard library (xxhash is faster but is only
a transitive dependency here).

Trust boundary: loading a checkpoint never runs code from it. DCP's `.metadata` is a pickle, which torch's
FileSystemReader reads with `pickle.load`; here `_MetadataUnpickler` resolves only the DCP classes (and torch
types) a metadata file holds, so a crafted one (calling os.system, builtins.eval, ...) is refused with an error
naming the file. The non-tensor entries of the state (the optimizer's param_groups), which torch's
DefaultLoadPlanner loads with torch.load(weights_only=False), are loaded with weights_only=True; tensors,
RNG files and JSON were never a way to run code.
"""

from __future__ import annotations

import io
import json
import pickle
import zlib
from pathlib import Path

import torch

MARKER = "COMPLETE"  # written last: a folder without it is never loaded
MANIFEST = "manifest.json"
CHECKSUM = "crc32"
STATE = "trainer_state.json"
STATE_KEYS = ("step", "actor_steps_done", "scheduler", "sampler", "world_size", "config")


# ------------------------------------------------------------------------------------------ the manifest
def file_checksum(path: Path, *, chunk_bytes: int = 16 * 2**20) -> str:
    """zlib's CRC-32 of a file's bytes as 8 hex digits, read in 16 MiB chunks. Example: a file of b"abc" -> "352441c2"."""
    crc, buffer = 0, bytearray(chunk_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def listing(folder: Path) -> list[tuple[str, int]]:
    """(relative path, bytes) of every file under `folder` but the manifest and the COMPLETE marker, sorted by path."""
    files = ((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*"))
    return sorted((rel, p.stat().st_size) for rel, p in files if rel not in (MANIFEST, MARKER) and p.is_file())


def share(files: list[tuple[str, int]], rank: int, world_size: int) -> list[tuple[str, int]]:
    """The files process `rank` checksums: dealt round-robin, largest first, so each process reads about as much.

    Example: sizes a=5, b=9, c=1, d=7 over 2 processes -> rank 0 gets [b, a], rank 1 gets [d, c].
    """
    return sorted(files, key=lambda f: (-f[1], f[0]))[rank::world_size]


def write_manifest(folder: Path, files: list[tuple[str, int]], sums: dict[str, str]) -> None:
    """Write `folder`/manifest.json from `listing(folder)` and each file's `file_checksum`."""
    unsummed = sorted({rel for rel, _ in files} - sums.keys())
    assert not unsummed, f"files without a checksum: {unsummed}"
    manifest = {"format": 1, "checksum": CHECKSUM, "files": {rel: {"bytes": size, CHECKSUM: sums[rel]} for rel, size in files}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def checkpoint_problems(path: Path, *, step: int, rank: int = 0, world_size: int = 1,
                        manifest_expected: bool = False) -> list[str]:
    """What is wrong with the complete checkpoint `path` of `step`, one line per problem, paths relative to it ([]:
    nothing). Each of the `world_size` processes calls it and checksums its `share` of the files; the cheap checks run on
    every process: trainer_state.json parses and holds `step`, dcp/.metadata passes the restricted unpickler, every
    file is listed in the manifest with its size, none is missing.

    Without a manifest: a problem when `manifest_expected` (the folder's checkpoints carry them); else (written before
    manifests existed) the cheap checks and `unlisted_problems`; the caller says its checksums are unverified.
    Example line: "dcp/__0_0.distcp: 1024 bytes, the manifest says 2097152".
    """
    problems = []
    state = None
    try:
        state = json.loads((path / STATE).read_text())
        if not isinstance(state, dict) or state.get("step") != step:
            problems.append(f"{STATE}: does not hold step {step}")
        else:
            problems += [f"{STATE}: no {key!r}" for key in STATE_KEYS if key not in state]
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError and UnicodeDecodeError
        problems.append(f"{STATE}: {type(exc).__name__}: {exc}")
    metadata = None
    try:
        metadata = read_dcp_metadata(path / "dcp" / ".metadata")
    except Exception as exc:  # noqa: BLE001  damaged bytes fail anywhere inside unpickling: every failure is a finding
        problems.append(f"dcp/.metadata: {type(exc).__name__}: {exc}")
    if not (path / MANIFEST).is_file():
        if manifest_expected:
            return problems + [f"{MANIFEST}: missing, while the folder's other checkpoints have one (a save writes it "
                               f"before {MARKER}): its files cannot be trusted"]
        return problems + unlisted_problems(path, metadata, state if isinstance(state, dict) else None)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest["checksum"] != CHECKSUM:
            raise ValueError(f"checksum {manifest['checksum']!r}, this trainer checks {CHECKSUM}")
        listed = {rel: (int(entry["bytes"]), str(entry[CHECKSUM])) for rel, entry in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return problems + [f"{MANIFEST}: not a manifest this trainer wrote ({type(exc).__name__}: {exc})"]
    try:
        on_disk = dict(listing(path))
    except OSError as exc:
        return problems + [f"cannot list its files ({type(exc).__name__}: {exc})"]
    problems += [f"{rel}: not in the manifest (the save did not write it)" for rel in sorted(on_disk.keys() - listed.keys())]
    whole = []  # files of the listed size: their checksums are compared
    for rel, (size, _) in sorted(listed.items()):
        if rel not in on_disk:
            problems.append(f"{rel}: missing (the manifest lists {size} bytes)")
        elif on_disk[rel] != size:
            problems.append(f"{rel}: {on_disk[rel]} bytes, the manifest says {size}")
        else:
            whole.append((rel, size))
    for rel, _ in share(whole, rank, world_size):
        try:
            found = file_checksum(path / rel)
        except OSError as exc:  # permissions, an I/O error of the disk
            problems.append(f"{rel}: unreadable ({type(exc).__name__}: {exc})")
            continue
        if found != listed[rel][1]:
            problems.append(f"{rel}: {CHECKSUM} {found}, the manifest says {listed[rel][1]} (its bytes changed after the save)")
    return problems


def unlisted_problems(path: Path, metadata, state: dict | None) -> list[str]:
    """The checks of a checkpoint without a manifest that read no checksum: each DCP shard at least as long as the data
    `metadata` (DCP's, None: unreadable, reported already) places in it, and each process's RNG file (`state`'s
    world_size of them) present and loading with torch.load(weights_only=True).

    Example: a shard whose entries end at byte 42265 cut to 42264 bytes -> ["dcp/__0_0.distcp: 42264 bytes, DCP's
    metadata places data up to byte 42265 (cut short)"].
    """
    problems = []
    ends: dict[str, int] = {}  # shard file -> the end of the last entry DCP placed in it
    for info in (metadata.storage_data.values() if metadata is not None and isinstance(metadata.storage_data, dict) else []):
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        shard = path / "dcp" / rel
        if not shard.is_file():
            problems.append(f"dcp/{rel}: missing (DCP's metadata places data in it up to byte {end})")
        elif (size := shard.stat().st_size) < end:
            problems.append(f"dcp/{rel}: {size} bytes, DCP's metadata places data up to byte {end} (cut short)")
    world_size = state.get("world_size") if state is not None else None
    for r in range(world_size if isinstance(world_size, int) else 0):
        rng = path / "rng" / f"rank_{r}.pt"
        if not rng.is_file():
            problems.append(f"rng/rank_{r}.pt: missing ({STATE} says {world_size} processes saved)")
            continue
        try:
            torch.load(rng, weights_only=True)
        except Exception as exc:  # noqa: BLE001  a damaged zip fails in torch's reader with various errors
            problems.append(f"rng/rank_{r}.pt: does not load ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
    return problems


# ------------------------------------------------------------------------------------------ DCP without pickle's trust
# The only globals a `.metadata` written by torch 2.13's FileSystemWriter refers to: read from
# torch/distributed/checkpoint/metadata.py and filesystem.py, and confirmed by recording find_class while loading saved
# checkpoints (a plain module and FSDP2-sharded ones, fp32 and bf16). Torch's dtypes are allowed by `find_class` itself.
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where one entry lies: (shard file, offset, length)
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch.layout pickles: a lookup among torch's layouts by name, no more
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file whose pickle asks for something a DCP metadata file never holds (damaged, or crafted to run code)."""


class _MetadataUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only `_DCP_GLOBALS` and torch's dtypes. A pickle runs code only through the callables
    it imports, so one that asks for anything else (os.system, builtins.eval, ...) is refused before it can call it."""

    def __init__(self, fh, *, path: Path):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refused to unpickle it: it asks for {module}.{name}, which a torch.distributed.checkpoint "
            "metadata file never holds (a damaged or crafted file that could run code). Restore the checkpoint from a "
            "copy or resume from another one")


def read_dcp_metadata(path: Path):
    """DCP's `Metadata` read from `path` (a checkpoint's `dcp/.metadata`) with the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _MetadataUnpickler(io.BytesIO(Path(path).read_bytes()), path=path).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def safe_dcp_loaders(dcp_dir: Path):
    """(storage_reader, planner) for `dcp.load` of the DCP folder `dcp_dir` that unpickle nothing untrusted.

    torch's FileSystemReader.read_metadata calls pickle.load on `.metadata`: the reader here uses the restricted
    unpickler. torch's DefaultLoadPlanner.load_bytes loads the non-tensor entries (the optimizer's param_groups:
    floats, bools, tuples, lists of names) with torch.load(weights_only=False): the planner here uses weights_only=True.
    Tensors torch already reads with weights_only=True.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RestrictedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # FileSystemReader.read_metadata with the restricted unpickler
            metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:  # DefaultLoadPlanner.load_bytes with weights_only=True
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(f"{dcp_dir}: the entry {read_item.dest_index.fqn!r} does not load with "
                                            f"torch.load(weights_only=True): {exc}") from exc
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return RestrictedReader(dcp_dir), WeightsOnlyPlanner()
