"""Checks a run can pass before anything heavy loads: the run folder is writable and holds one checkpoint.

    problems = check_run_folder(cfg)   # [] or one message per problem, each naming its key and the fix

`train_grpo.py` calls this right after the config loads (exit code 2 on any problem), before the tokenizer,
the data or the engine. Only the standard library is imported here (huggingface_hub's cache lookup only for a hub
name), so a bad folder fails in about a second.

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


def _safetensors_params(path: Path) -> int:
    """Parameter count from one .safetensors header (the tensor data is not read)."""
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


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
        return sum(_safetensors_params(f) for f in tensors), sum(f.stat().st_size for f in tensors)
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


if __name__ == "__main__":  # python -m grpo_lib.preflight MODEL_DIR: print the checkpoint estimate
    import sys

    found = model_size(sys.argv[1])
    if found is None:
        print(f"{sys.argv[1]}: no local weights found")
    else:
        print(f"{found[0] / 1e6:.1f} M params, {found[1] / GiB:.2f} GiB on disk, one checkpoint about "
              f"{checkpoint_bytes(*found) / GiB:.2f} GiB ({os.path.abspath(sys.argv[1])})")
