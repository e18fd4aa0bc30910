"""The CUDA attention paths of grpo_varlen on a GPU (issue 28 items 2, 5): `python scripts/gpu_attention_check.py`.

1. Shared prompts: the one-call path (`attention._shared_prefix_one_call`: each response's keys gathered after its
   prompt's, ONE torch varlen_attn call, bottom-right causal) against the per-continuation path (2 sdpa calls and 2 cats
   per response), bf16, at a Qwen3-4B layer's shape (32 query heads over 8 kv heads, head_dim 128; a 256-token prompt and
   8 responses of 64-512 tokens): values and gradients within bf16's rounding of each other, and both timed (forward +
   backward, ms per layer call; the one-call path also copies each response's prompt keys: its extra bytes are printed).
2. The start-up packing isolation check on a tiny Qwen3 on the GPU in bf16 through grpo_varlen (torch's varlen_attn and
   the shared-prompt call): the kernels a run uses.
Each check ends OK, FAIL or SKIP, never OK for what did not run: SKIP when this torch's varlen_attn does not bind
grpo_varlen's call (runs then take the per-continuation sdpa path, so there is no one-call path to check; the reason
is printed), FAIL when it binds but the kernel refuses the call at run time (a run would die in its first forward).
Without CUDA the whole check is one SKIP row. Prints one line per check and a last line
`gpu_attention_check: no failure (2 OK)` or `... FAILED <names> (...)`; exit 1 when a check FAILED,
else 0. `--verdict FILE` appends the rows to a verdict file of scripts/gpu_report.py (scripts/gpu_check.sh runs it so,
as its `attention` stage).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_report  # noqa: E402  (scripts/, beside this file)
import torch  # noqa: E402

from grpo_lib.model import attention  # noqa: E402


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def shared_prompt_check(device: torch.device = torch.device("cuda")) -> tuple[str, str]:
    """("OK" | "FAIL" | "SKIP", detail) of the one-call shared-prompt path against the per-continuation one."""
    kernel, why = attention.torch_varlen_attn()
    if kernel is None:
        return "SKIP", f"not run: {why} (runs take the per-continuation sdpa path)"
    g = torch.Generator(device=device).manual_seed(0)
    seg_lens = [256, 512, 64, 300, 128, 480, 96, 200, 384]
    continues = [-1] + [0] * 8
    n = sum(seg_lens)
    cu = torch.tensor([0, *torch.tensor(seg_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(1, 32, n, 128, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 8, n, 128, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True) for _ in range(2))
    kv_index, cu_k, max_k = attention.shared_prefix_kv_plan(seg_lens, continues)
    plan = dict(kv_index=kv_index.to(device), cu_q=cu.to(device), cu_k=cu_k.to(device), max_q=max(seg_lens), max_k=max_k)
    module = torch.nn.Module().train()

    def one():
        return attention._shared_prefix_one_call(q, k, v, **plan, scaling=None, kernel=kernel)

    def loop():
        return attention._shared_prefix_attention(module, q, k, v, cu, torch.tensor(continues), dropout=0.0, scaling=None,
                                                  sliding_window=None)[0]

    w = torch.randn(1, n, 32, 128, device=device, dtype=torch.bfloat16, generator=g)
    outs, grads = [], []
    for fn in (one, loop):
        try:
            out = fn()
            outs.append(out.float())
            grads.append([t.float() for t in torch.autograd.grad((out * w).sum(), (q, k, v))])
        except (RuntimeError, TypeError, ValueError) as exc:  # the kernel bound the call but refuses it: a run would die
            return "FAIL", f"{'one varlen_attn call' if fn is one else 'per-continuation path'} raised {exc!r}"[:400]
    # bf16 rounding of outputs of size O(1) and gradients summed over up to 768 keys: a few bf16 eps of each tensor's scale
    tol = 8 * torch.finfo(torch.bfloat16).eps
    worst = max([(outs[0] - outs[1]).abs().max().item() / max(outs[1].abs().max().item(), 1e-6)]
                + [(a - b).abs().max().item() / max(b.abs().max().item(), 1e-6) for a, b in zip(*grads)])
    fb = lambda fn: lambda: torch.autograd.grad((fn() * w).sum(), (q, k, v))  # noqa: E731
    t_one, t_loop = timed(fb(one)), timed(fb(loop))
    extra = (len(kv_index) - n) * 8 * 128 * 2 * 2 / 2**20  # the copied prompt keys and values, bf16
    ok = worst <= tol
    return "OK" if ok else "FAIL", (f"one call vs per continuation: worst relative difference {worst:.2g} (tolerance {tol:.2g}); "
                f"forward + backward {t_one:.2f} ms vs {t_loop:.2f} ms per layer ({t_loop / t_one:.2f}x); "
                f"the gathered prompt keys / values cost {extra:.1f} MiB per layer")


def isolation_check() -> tuple[str, str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grpo_lib.model.packing import check_packing_isolated, isolation_tolerance

    attention.register()
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
    config._attn_implementation = attention.VARLEN_NAME
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    try:
        check_packing_isolated(model, dtype=torch.bfloat16)
    except RuntimeError as exc:
        return "FAIL", str(exc)[:300]
    return "OK", (f"packed and shared-prompt rows isolated on {attention.describe(attention.VARLEN_NAME, torch.device('cuda'), torch.bfloat16)}"
                  f" (tolerance {isolation_tolerance(torch.bfloat16):g})")


CHECKS = {"attention: shared prompts": shared_prompt_check, "attention: isolation": isolation_check}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verdict", type=Path, help="append one row per check to this verdict file (gpu_report.py)")
    args = parser.parse_args(argv)

    def report(name: str, status: str, detail: str) -> None:
        print(f"gpu_attention_check: {name}: {status}: {detail}", flush=True)
        if args.verdict:
            gpu_report.add(args.verdict, name, status, detail)

    if not torch.cuda.is_available():
        report("attention", "SKIP", "no CUDA device: nothing to check (the CPU paths are tested by tests/model/test_attention.py)")
        return 0
    statuses = {}
    for name, check in CHECKS.items():
        try:
            status, detail = check()
        except Exception as exc:  # noqa: BLE001 (any crash of a check is its FAIL row, the next check still runs)
            status, detail = "FAIL", f"raised {exc!r}"[:400]
        report(name, status, detail)
        statuses[name] = status
    failed = [name for name, status in statuses.items() if status == "FAIL"]
    counts = ", ".join(f"{n} {s}" for s in ("OK", "SKIP", "FAIL") if (n := list(statuses.values()).count(s)))
    print(f"gpu_attention_check: {'FAILED ' + ', '.join(failed) if failed else 'no failure'} ({counts})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
