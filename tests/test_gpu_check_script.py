"""scripts/gpu_check.sh is prepared for the day a GPU is lent: run it here, on CPU, as it would run on a GPU image
without vLLM (vllm made unimportable, so it picks rollout.name=hf), with a stand-in nvidia-smi. Everything but CUDA
itself is exercised: data and model build, the accelerate launch, the metric parsing and the tolerance check."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

FAKE_SMI = """#!/usr/bin/env bash
# stand-in for gpu_check.sh's `nvidia-smi --query-gpu=index,memory.used ... -lms 500`: one sample per 0.5 s until killed;
# any other query (accelerate's launcher asks for the GPU names) fails, as nvidia-smi does without a driver
case "$*" in *index,memory.used*) while true; do echo "0, 1234"; sleep 0.5; done ;; *) exit 9 ;; esac
"""


def test_gpu_check_script_runs_end_to_end_with_the_hf_engine(tmp_path):
    bin_dir, blocker = tmp_path / "bin", tmp_path / "no_vllm"
    bin_dir.mkdir()
    blocker.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    env = {**os.environ, "N": "2", "WORK": str(tmp_path / "work"), "PY": sys.executable, "PYTHONPATH": str(blocker),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "vllm not importable, using rollout.name=hf" in out
    assert "GPU 0: 1234 MiB" in out
    assert "[rank 0] actor: FSDP2 over 2 process(es)" in out and "[rank 1] actor: FSDP2 over 2 process(es)" in out
    assert "gpu_check: OK (3 steps expected, got 3;" in out, out[-3000:]
    assert out.count("weight_sync_max_abs_diff=") == 3
