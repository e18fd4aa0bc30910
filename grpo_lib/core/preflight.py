"""Checks a run can pass before anything heavy loads: a local model folder is complete, the run folder is writable and
holds one checkpoint.

    problems = check_model_folder(cfg.model.path) + check_run_folder(cfg)   # [] or one message per problem, each
                                                                            # naming its key or file and the fix

`train_grpo.py` calls these right after the config loads (exit code 2 on any problem), before the tokenizer,
the data or the engine. Only the standard library is imported here (huggingface_hub's cache lookup only for a hub
name), so a bad folder fails in about a second. With several processes, `run_folder_not_shared` then checks, once the
process group is up, that every process sees the same run folder (probe files; exit 2 otherwise).

A local model folder must hold a readable config.json and its weights: every shard that model.safetensors.index.json
(or pytorch_model.bin.index.json) lists, else at least one *.safetensors or pytorch_model*.bin file. Each safetensors
file's header must parse and the file must be at least as long as the header says (8 + header length + the end of the
last tensor's data_offsets): a download cut short fails here, naming the file, instead of inside vLLM after the engine
started. A hub name is left to the download, as transformers and vLLM fetch what is missing.

The size of one checkpoint is estimated from the model folder without loading it: the parameter count is read
from the safetensors headers (8-byte length + JSON of dtype/shape per tensor), then

    checkpoint bytes = params x 12 (fp32 weights + AdamW's two fp32 moments) + the HF export (the model's size on disk:
                       the export keeps the dtype the model was saved in, `Actor.export_dtype`)

Example: Qwen2.5-0.5B (494 M params, 0.99 GB of bf16 safetensors) -> 494e6 x 12 + 0.99e9 = about 6.9 GB.
Without safetensors files the count is assumed from the files' size at 2 bytes per parameter (bf16).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

TRAIN_STATE_BYTES_PER_PARAM = 12  # fp32 master weights (4) + AdamW exp_avg (4) + exp_avg_sq (4)
GiB = 1024**3


def safetensors_header(path: Path, *, check_size: bool = True) -> dict:
    """The tensor entries of one .safetensors header (the tensor data is not read); ValueError saying what is wrong
    when the file is too short, its header is not JSON, or (`check_size`) the file ends before the tensor data the
    header declares.

    Format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]},
    "__metadata__": {...}}, then the data; offsets count from the data's start. Example: N = 100 and a last tensor
    ending at 4000 need a file of at least 8 + 100 + 4000 bytes.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"it is {size} bytes, shorter than the 8-byte header length every safetensors file starts with")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ValueError(f"it is cut short inside its header ({size} bytes; the header alone takes {8 + header_len})")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in tensors.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and isinstance(entry.get("data_offsets"), list)
                and len(entry["data_offsets"]) == 2 and all(isinstance(n, int) for n in entry["shape"] + entry["data_offsets"])):
            raise ValueError(f"its header entry of tensor {name!r} has no integer shape / data_offsets")
    data_end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
    if check_size and size < 8 + header_len + data_end:
        raise ValueError(f"it is truncated: {size} bytes, but its header declares {8 + header_len + data_end} "
                         f"(8 + {header_len} header + {data_end} tensor data)")
    return tensors


def _safetensors_params(path: Path) -> int:
    """Parameter count from one .safetensors header (the tensor data is not read)."""
    return sum(math.prod(t["shape"]) for t in safetensors_header(path, check_size=False).values())


def check_model_folder(model_path: str, key: str = "model.path") -> list[str]:
    """Problems of a local model folder (see the module docstring), each naming the file and the fix; [] for a hub name
    or a path that is not a folder (the tokenizer load reports those). `key`: the config key that names it."""
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        return []
    fix = (f"download or copy the model again (huggingface-cli download NAME --local-dir FOLDER), or point {key} at "
           "a complete Hugging Face model folder")
    where = f"{key}={model_path!r}"
    problems = []
    config = folder / "config.json"
    if not config.is_file():
        problems.append(f"{where} has no config.json, so it is not a Hugging Face model folder: {fix}")
    else:
        try:
            if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            problems.append(f"{where}: {config} cannot be read as JSON ({exc}): {fix}")
    weights: list[Path] = []
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if not index.is_file():
            continue
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{where}: {index} cannot be read (a JSON object with a weight_map expected; {exc!r}): {fix}")
            continue
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            problems.append(f"{where}: {index_name} lists {len(shards)} weight files and {len(missing)} are missing "
                            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): {fix}")
        weights += [folder / name for name in shards if name not in missing]
    if not weights:
        weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
        if not weights and not problems:
            problems.append(f"{where} holds no weights (no *.safetensors, no pytorch_model*.bin; files: "
                            f"{sorted(f.name for f in folder.iterdir())[:8]}): {fix}")
    for path in sorted(set(weights)):
        if path.suffix == ".safetensors":
            try:
                safetensors_header(path)
            except (OSError, ValueError) as exc:
                problems.append(f"{where}: weight file {path} is damaged: {exc}; {fix}")
        elif path.stat().st_size == 0:
            problems.append(f"{where}: weight file {path} is empty (0 bytes); {fix}")
    return problems


def hub_snapshot(model_path: str) -> Path | None:
    """The downloaded snapshot folder of hub model `model_path` (its main revision, as transformers would load it)
    in the Hugging Face cache, or None (not downloaded, or not a hub name)."""
    from huggingface_hub import try_to_load_from_cache  # ~0.15 s: only when model.path is not a local folder
    from huggingface_hub.errors import HFValidationError

    try:  # HF_HUB_CACHE read now, not at huggingface_hub's import
        found = try_to_load_from_cache(model_path, "config.json", cache_dir=os.environ.get("HF_HUB_CACHE"))
    except HFValidationError:  # not a repo id (a missing local path such as /data/model)
        return None
    return Path(found).parent if isinstance(found, str) else None


def model_size(model_path: str) -> tuple[int, int] | None:
    """(parameter count, bytes on disk) of a local model folder, or of a hub model's downloaded snapshot; None if
    neither has weights (a hub model not downloaded yet: the check is then skipped)."""
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        folder = hub_snapshot(model_path)
    if folder is None:
        return None
    tensors = sorted(folder.glob("*.safetensors"))
    if tensors:
        try:
            params = sum(_safetensors_params(f) for f in tensors)
        except (OSError, ValueError):  # a damaged header: check_model_folder names the file; no estimate without it
            return None
        return params, sum(f.stat().st_size for f in tensors)
    weights = [f for pattern in ("*.bin", "*.pt", "*.pth") for f in folder.glob(pattern)]
    disk_bytes = sum(f.stat().st_size for f in weights)
    return (disk_bytes // 2, disk_bytes) if disk_bytes else None


def checkpoint_bytes(params: int, export_bytes: int) -> int:
    """Estimated bytes of one checkpoint: training state (12 bytes/param) + the Hugging Face export."""
    return params * TRAIN_STATE_BYTES_PER_PARAM + export_bytes


def _writable(folder: Path) -> str | None:
    """None if `folder` exists (created if needed) and a file can be written in it, else the reason."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_probe_", delete=True) as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def free_space_text(folder: Path) -> str:
    """The free space of `folder`'s disk as a phrase for an error message: "1.25 GiB free" (or "free space unknown")."""
    try:
        return f"{shutil.disk_usage(folder).free / GiB:.2f} GiB free"
    except OSError:
        return "free space unknown"


def check_run_folder(cfg) -> list[str]:
    """Problems with trainer.default_local_dir: not creatable / writable, or less free disk than one checkpoint."""
    folder = Path(cfg.trainer.default_local_dir).expanduser()
    reason = _writable(folder)
    if reason is not None:
        return [f"trainer.default_local_dir={str(folder)!r} cannot be written ({reason}); choose a folder you can write, "
                "for example trainer.default_local_dir=outputs/run"]
    size = model_size(cfg.model.path)
    if size is None:
        return []  # a hub model not downloaded yet, or no weights: model.path is checked when the tokenizer loads
    params, export_bytes = size
    need = checkpoint_bytes(params, export_bytes)
    free = shutil.disk_usage(folder).free
    if free < need:
        return [f"trainer.default_local_dir={str(folder)!r} has {free / GiB:.2f} GiB free, less than one checkpoint of "
                f"model.path={cfg.model.path!r}: about {need / GiB:.2f} GiB ({params / 1e6:.1f} M parameters x "
                f"{TRAIN_STATE_BYTES_PER_PARAM} bytes of fp32 weights + AdamW moments, plus the {export_bytes / GiB:.2f} GiB "
                "Hugging Face export). Free disk space or point trainer.default_local_dir at a larger disk"]
    return []


SHARED_PROBE_WAIT_S = 5.0  # how long a process looks for the others' probe files (a network file system may lag)


def run_folder_not_shared(folder: Path, *, rank: int, world_size: int, wait_s: float = SHARED_PROBE_WAIT_S) -> str | None:
    """With several processes (call on every one, after the process group starts): is `folder` one folder that every
    process sees? Each process writes a probe file into it and looks for every other process's, for up to `wait_s`
    seconds; then they compare what they saw (one gather). None when each saw all; else the message of an exit 2, the
    same on every process.

    Several machines need trainer.default_local_dir on a file system they all mount at the same path: every process
    writes its checkpoint shard and RNG file there and process 0 reads them back (the manifest, the resume). A folder on
    each machine's own disk would otherwise fail at the first save, or resume each machine from a different step.
    Example: two machines with a local `outputs/run` each -> "process 0 (host a) sees the probe files of processes
    [0] only; process 1 (host b) sees [1] only".
    """
    import socket
    import time
    import uuid

    from grpo_lib.core.distributed import all_gather_object, barrier, broadcast_object

    if world_size == 1:
        return None
    token = broadcast_object(uuid.uuid4().hex[:12])  # one name for this start: old probe files never count
    probe = lambda r: folder / f".shared_probe_{token}_rank_{r}"  # noqa: E731
    try:
        probe(rank).write_text(f"{socket.gethostname()}\n")
    except OSError:
        pass  # seen as missing by every process below (check_run_folder already tested that the folder is writable)
    barrier()  # every process has written its probe
    deadline = time.monotonic() + wait_s
    while True:
        seen = [r for r in range(world_size) if probe(r).is_file()]
        if len(seen) == world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    views = all_gather_object((socket.gethostname(), seen))  # every process has looked
    probe(rank).unlink(missing_ok=True)
    partial = [(r, host, seen) for r, (host, seen) in enumerate(views) if len(seen) < world_size]
    if not partial:
        return None
    saw = "; ".join(f"process {r} (host {host}) sees the probe files of processes {seen} only" for r, host, seen in partial)
    return (f"trainer.default_local_dir={str(folder)!r} is not one folder shared by all {world_size} processes: each wrote a "
            f"probe file into it, and {saw}. Every process writes its checkpoint shard there and process 0 reads them all "
            "back, so on several machines the run folder must be on a file system every machine mounts at the same path "
            "(NFS, Lustre, ...); a relative path is relative to each machine's working directory")


if __name__ == "__main__":  # python -m grpo_lib.core.preflight MODEL_DIR: print the checkpoint estimate
    import sys

    found = model_size(sys.argv[1])
    if found is None:
        print(f"{sys.argv[1]}: no local weights found")
    else:
        print(f"{found[0] / 1e6:.1f} M params, {found[1] / GiB:.2f} GiB on disk, one checkpoint about "
              f"{checkpoint_bytes(*found) / GiB:.2f} GiB ({os.path.abspath(sys.argv[1])})")
