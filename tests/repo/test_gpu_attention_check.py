"""scripts/gpu_attention_check.py never reports OK for a check that did not run (issue 41 item 3), in-process with
stubs in place of the CUDA pieces: a torch whose varlen_attn refuses our call is a SKIP with the reason, a kernel that
binds but raises when called is a FAIL, and neither is OK."""

from __future__ import annotations

import contextlib
import io
import sys

import torch

from grpo_lib.model import attention
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_attention_check  # noqa: E402
import gpu_report  # noqa: E402

REFUSAL = "torch 2.11.0+cu130's varlen_attn does not take grpo_varlen's call (got an unexpected keyword argument 'enable_gqa')"


def test_a_refused_varlen_attn_is_a_skip_row_not_ok(tmp_path, monkeypatch):
    """torch's varlen_attn does not bind our call (the lent torch 2.11): the shared-prompt check did not run, so its row
    says SKIP with that reason; the verdict line counts it and the exit status is 0 (nothing failed). It said OK."""
    monkeypatch.setattr(attention, "torch_varlen_attn", lambda: (None, REFUSAL))
    status, detail = gpu_attention_check.shared_prompt_check()
    assert status == "SKIP" and REFUSAL in detail, (status, detail)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the isolation check stands in (it needs CUDA)
    monkeypatch.setitem(gpu_attention_check.CHECKS, "attention: isolation", lambda: ("OK", "isolated (stub)"))
    verdict = tmp_path / "verdict.tsv"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert gpu_attention_check.main(["--verdict", str(verdict)]) == 0
    rows = {name: (status, detail) for name, status, detail in gpu_report.read_verdict(verdict)}
    assert rows["attention: shared prompts"][0] == "SKIP" and REFUSAL in rows["attention: shared prompts"][1]
    assert "attention: shared prompts: SKIP" in out.getvalue() and "(1 OK, 1 SKIP)" in out.getvalue()
    line = gpu_report.verdict_line(gpu_report.read_verdict(verdict))
    assert line.startswith("gpu_check: no failure, but 1 SKIPPED") and line.endswith(": attention: shared prompts"), line


def test_a_kernel_that_binds_but_refuses_the_call_is_a_fail(monkeypatch):
    """varlen_attn binds our signature but raises when called (a GPU or head size it does not support): a run would
    die in its first forward, so the row FAILS with the kernel's error. Run on CPU tensors (the check's device)."""
    def refusing_kernel(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(attention, "torch_varlen_attn", lambda: (refusing_kernel, None))
    status, detail = gpu_attention_check.shared_prompt_check(torch.device("cpu"))
    assert status == "FAIL" and "Ampere" in detail and "one varlen_attn call raised" in detail, (status, detail)


def test_no_cuda_is_one_skip_row(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    verdict = tmp_path / "verdict.tsv"
    with contextlib.redirect_stdout(io.StringIO()):
        assert gpu_attention_check.main(["--verdict", str(verdict)]) == 0
    assert [row[:2] for row in gpu_report.read_verdict(verdict)] == [("attention", "SKIP")]
