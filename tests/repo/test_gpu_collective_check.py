"""scripts/gpu_collective_check.py's audit (gpu_check.sh's `collectives` stage, issue 41 item 2): on 2 gloo processes a
collective that both processes enter with tensors of one device type runs; one where a process passes a tensor on
another device type (process 0's reference buffers on CUDA against the others' on the host: the 4-GPU hang) raises on
both processes, naming the collective, each process's device and the caller, instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, torchrun_records


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_worker_dies_with_its_parent(tmp_path):
    """torch elastic starts its workers in sessions of their own, so the stage's timeout (a signal to its process
    group) reaches only torchrun: the worker asks the kernel to SIGKILL it when its parent goes (die_with_parent).
    Here a parent starts the worker in a new session, as torch elastic does, and is SIGKILLed: the worker goes too."""
    worker = ("import sys, time; sys.path.insert(0, sys.argv[1]); import gpu_collective_check as check; "
              "assert check.die_with_parent(); print('ready', flush=True); time.sleep(120)")
    parent_code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
                   "start_new_session=True); print(p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code, worker, str(REPO / "scripts")], stdout=subprocess.PIPE,
                              text=True)
    try:
        pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"  # the worker's line, on the pipe it inherited
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the worker outlived its parent")


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
