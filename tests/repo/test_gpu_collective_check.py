"""scripts/gpu_collective_check.py's audit (gpu_check.sh's `collectives` stage, issue 41 item 2): on 2 gloo processes a
collective that both processes enter with tensors of one device type runs; one where a process passes a tensor on
another device type (process 0's reference buffers on CUDA against the others' on the host: the 4-GPU hang) raises on
both processes, naming the collective, each process's device and the caller, instead of hanging."""

from __future__ import annotations

import pytest

from tests.conftest import torchrun_records


@pytest.mark.multiprocess
def test_the_audit_passes_matching_collectives_and_names_a_device_mismatch(tmp_path):
    records = torchrun_records("collective_audit_worker.py", str(tmp_path), out_dir=tmp_path)
    for rec in records:
        assert rec["same"] == [1.0, 1.0, 1.0]  # the matching broadcast ran: process 0's values everywhere
        error = rec["error"]
        assert error is not None and error.startswith("dist.broadcast: the processes pass different tensors"), error
        assert "rank 0: ['cpu'] ['torch.float32']" in error and "rank 1: ['meta'] ['torch.float32']" in error, error
        assert "from collective_audit_worker.py:" in error  # the caller, outside torch
        assert rec["summary"].startswith("2 collectives audited"), rec["summary"]
