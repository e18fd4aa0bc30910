"""Host memory at start (issue 19, defect 1): the model is read once, by process 0, and broadcast into the shards.

`tests/scripts/host_memory_worker.py` runs on 2 gloo processes and builds the actor and then the reference of a
random 73M-parameter Qwen3 (294 MB in float32) as the trainer does, after `perf.tune_allocator(loading=True)`.
Before the fix every process read the whole model (process 1 peaked at 1.25x its float32 size) and the tuned
allocator kept the freed copy resident (process 0 at 2.3x after set-up). The bounds, from what each process must hold:
- process 1 never holds the model: its shards (1/2 of it) plus one broadcast chunk (fsdp.FILL_CHUNK_BYTES) and, on CPU
  where the device is the host, the first forward's gathered units; below the full float32 size;
- after set-up every process holds its shards and at most one chunk's worth of heap left over: below one full copy.
The weights each process ends with are the file's, exactly (gathered and compared tensor by tensor).
Run: .venv/bin/python -m pytest tests/model/test_fsdp_host_memory.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from grpo_lib.core import perf
from grpo_lib.model import fsdp
from tests.conftest import launch
from tests.scripts import grad_case as case

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS from /proc/self (Linux)")

REPO = Path(__file__).resolve().parents[2]


def write_model(path: Path) -> int:
    """Random float32 Qwen3, 73.4M parameters (hidden 512, 22 layers, vocab 8192, tied): its float32 size in bytes.
    The embedding (root unit) is 6% of it and a layer 4%, as in Qwen3-4B (10% and 2.5%)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=22, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    model = Qwen3ForCausalLM(config).float()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()) * 4


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[list[dict], int]:
    root = tmp_path_factory.mktemp("host_memory")
    full_bytes = write_model(root / "model")
    tiny = case.write_tiny_model(root / "tiny")
    out = root / "out"
    out.mkdir()
    cmd = [REPO / "tests" / "scripts" / "host_memory_worker.py", root / "model", tiny, out]
    proc = launch(cmd, procs=2, accelerate=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} on 2 processes exited {proc.returncode}\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], full_bytes


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("part", ["actor", "ref"])
def test_process_1_never_holds_the_model(records, part):
    recs, full_bytes = records
    peak = recs[1][f"{part}_peak"]
    assert peak < full_bytes, f"{part}: process 1 peaked {peak / 2**20:.0f} MiB above its start, the model is {full_bytes / 2**20:.0f} MiB"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("part", ["actor", "ref"])
def test_after_set_up_every_process_holds_its_shards_not_a_copy(records, part):
    recs, full_bytes = records
    for rec in recs:
        after = rec[f"{part}_after"]
        assert after < full_bytes, f"{part}: process {rec['rank']} keeps {after / 2**20:.0f} MiB, a full copy is {full_bytes / 2**20:.0f}"
        assert after < rec["local_param_bytes"] + fsdp.FILL_CHUNK_BYTES, (
            f"{part}: process {rec['rank']} keeps {after / 2**20:.0f} MiB for {rec['local_param_bytes'] / 2**20:.0f} MiB of shards")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_broadcast_shards_hold_the_files_weights(records):
    recs, _ = records
    for rec in recs:
        assert rec["tuned"] and rec["sharded"], rec
        assert rec["weights_equal"] == {"actor": True, "reference": True}, rec


def test_training_allocator_setting_is_not_applied_on_gpu(monkeypatch):
    """On a GPU run the training setting (256 MiB mmap threshold: freed blocks stay resident) is not applied: no mallopt."""
    import ctypes

    def no_libc(*args, **kwargs):
        raise AssertionError("mallopt must not be called on a GPU run")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert perf.tune_allocator(on_gpu=True) is False
