"""scripts/gpu_check.sh is prepared for the day a GPU is lent: run it here, on CPU, as it would run on the lent GPU
image (no vLLM there: vllm made unimportable, so it picks rollout.name=hf), with a stand-in nvidia-smi and a broken
default accelerate config in HOME that must not be read. Everything but CUDA itself is exercised: data and model
build, the accelerate launch of 2 processes, the metric parsing and the tolerance check. With vLLM installed the script
also runs the tensor-parallel-2 layout (the same `run_check` with one more key); that layout's training is tested by
tests/test_tensor_parallel_train.py, so this test runs only what the script alone covers (one run, ~10 s)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # tiers: conftest.py

FAKE_SMI = """#!/usr/bin/env bash
# stand-in for gpu_check.sh's `nvidia-smi --query-gpu=index,memory.used ... -lms 500`: one sample per 0.5 s until killed;
# any other query (accelerate's launcher asks for the GPU names) fails, as nvidia-smi does without a driver
case "$*" in *index,memory.used*) echo "$*" >> "$WORK/../smi_args.txt"; while true; do echo "0, 1234"; sleep 0.5; done ;; *) exit 9 ;; esac
"""


def test_gpu_check_script_runs_end_to_end(tmp_path):
    """As on a GPU image without vLLM: one run of 2 processes, tensor parallel 1, the hf engine."""
    bin_dir, blocker = tmp_path / "bin", tmp_path / "no_vllm"
    bin_dir.mkdir()
    blocker.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    home = tmp_path / "home"  # a user's default accelerate config that would break the launch: must not be read
    (home / ".cache" / "huggingface" / "accelerate").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml").write_text("distributed_type: DEEPSPEED\ngpu_ids: '0'\n")
    env = {**os.environ, "N": "2", "WORK": str(tmp_path / "work"), "PY": sys.executable, "HOME": str(home),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HOME", None)
    env["PYTHONPATH"] = str(blocker)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "vllm not importable, using rollout.name=hf" in out
    assert "GPU 0: 1234 MiB" in out and "--id=0,1" in (tmp_path / "smi_args.txt").read_text()
    assert "[rank 0] actor: FSDP2 over 2 process(es)" in out and "[rank 1] actor: FSDP2 over 2 process(es)" in out
    assert "gpu_check: tp1: OK (3 steps expected, got 3;" in out, out[-3000:]
    assert "== run tp2" not in out, "the TP-2 layout needs vLLM (the hf engine has no TP)"
    assert out.count("weight_sync_max_abs_diff=") == 3
    assert proc.stdout.rstrip().endswith("gpu_check: OK"), proc.stdout[-500:]
