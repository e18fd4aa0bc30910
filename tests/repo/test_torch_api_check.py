"""scripts/torch_api_check.py (issue 28 item 6): every torch name the code uses resolves AND every call binds the
installed function's real signature, so torch drift (the lent GPU's torch 2.11) is found in seconds, not mid-step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("torch_api_check", REPO / "scripts" / "torch_api_check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_the_code_binds_this_torch(capsys):
    assert check.main([]) == 0, capsys.readouterr().out
    assert "calls bind their signatures" in capsys.readouterr().out


def test_a_keyword_the_installed_torch_does_not_take_is_found(tmp_path, monkeypatch):
    source = tmp_path / "uses.py"
    source.write_text("import torch.nn.functional as F\nfrom torch.nn.attention.varlen import varlen_attn\n"
                      "F.pad(x, (1, 0), value=0)\nvarlen_attn(q, k, v, cu, cu, 4, 4, enable_gqa=True, no_such_flag=1)\n"
                      "varlen_attn(*qkv, cu, cu, 4, 4, scale=1.0)\n")
    monkeypatch.setattr(check, "REPO", tmp_path)
    calls = check.used_calls([source])
    assert ("torch.nn.functional.pad", 2, ("value",), False) in calls
    bad = ("torch.nn.attention.varlen.varlen_attn", 7, ("enable_gqa", "no_such_flag"), False)
    assert bad in calls and "no_such_flag" in check.bind_problem(*bad)
    assert check.bind_problem("torch.nn.functional.pad", 2, ("value",)) is None
    assert check.bind_problem("torch.nn.attention.varlen.varlen_attn", 4, ("scale",), True) is None  # *qkv: partial
    assert check.bind_problem("torch.nn.attention.varlen.varlen_attn", 4, ("scale",)) is not None  # too few without it


def test_a_name_the_code_guards_at_run_time_is_reported_not_failed(monkeypatch, capsys):
    """On the lent GPU's torch 2.11 `varlen_attn` may not take `enable_gqa`: grpo_varlen checks that itself and falls
    back to sdpa per sequence, so the check says GUARDED and passes; an unguarded name that does not bind still fails."""
    real = check.bind_problem

    def older_torch(name, *args):
        if name in ("torch.nn.attention.varlen.varlen_attn", "torch.nn.functional.pad"):
            return "got an unexpected keyword argument (an older torch)"
        return real(name, *args)

    monkeypatch.setattr(check, "bind_problem", older_torch)
    assert check.main([]) == 1  # F.pad is not guarded
    out = capsys.readouterr().out
    assert "GUARDED torch.nn.attention.varlen.varlen_attn" in out and "SIGNATURE torch.nn.functional.pad" in out
    assert "SIGNATURE torch.nn.attention.varlen.varlen_attn" not in out
    monkeypatch.setattr(check, "bind_problem", lambda name, *args: older_torch(name, *args) if "varlen" in name
                        else real(name, *args))
    assert check.main([]) == 0, capsys.readouterr().out
