"""Every process passes tensors of one device type to a collective (issue 41, defect 1; docs/DESIGN.md invariant 10).

On GPUs, building the reference (or the teacher) with ref.fsdp_config.param_offload hung: process 0's buffers stood on
the GPU (FSDP2's `fully_shard` moved them there), the others' in host memory (the meta build's `to_empty`), and the
buffer broadcast ran NCCL on process 0 and gloo on the others. `tests/scripts/collective_devices_worker.py` makes the
same situation on 2 gloo processes (process 0's buffers on torch's lazy device) and checks every tensor collective's
device types across the processes before it runs.
Run: .venv/bin/python -m pytest tests/model/test_fsdp_collective_devices.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import launch
from tests.scripts import grad_case as case

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("collective_devices")
    model = case.write_tiny_model(root / "model")
    out = root / "out"
    out.mkdir()
    cmd = [REPO / "tests" / "scripts" / "collective_devices_worker.py", model, out]
    proc = launch(cmd, procs=2, accelerate=False, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} on 2 processes exited {proc.returncode}\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch's lazy device (TorchScript backend)")
def test_reference_build_passes_one_device_type_to_every_collective(records):
    for rec in records:
        assert not rec["mismatches"] and rec["error"] is None, (
            f"process {rec['rank']}: collectives with tensors on different device types: {rec['mismatches']}\n{rec['error']}")
        assert rec["checked"] > 0, "no collective went through the check: the test would prove nothing"


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch's lazy device (TorchScript backend)")
def test_every_process_holds_process_0s_buffers_on_the_compute_device(records):
    """The buffers end on the compute device (the CPU here) on every process, holding process 0's values (halved by the
    worker on process 0 only: a process that kept its own would differ), and the processes score a batch alike."""
    first, second = records
    assert first["buffers"], "the reference has no buffers: the test would prove nothing"
    for rec in records:
        assert {b["device"] for b in rec["buffers"].values()} == {"cpu"}, rec["buffers"]
    for name, buffer in first["buffers"].items():
        assert second["buffers"][name]["values"] == buffer["values"], f"{name}: process 1 does not hold process 0's values"
    assert second["logprobs"] == first["logprobs"]
