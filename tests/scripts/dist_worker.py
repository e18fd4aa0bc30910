"""Worker of tests/core/test_distributed.py: every helper of grpo_lib.core.distributed on a group built by
`init_distributed()` exactly as on GPU minus NCCL (backend "cpu:gloo"). Launched with
`python -m torch.distributed.run --nproc_per_node 2 tests/scripts/dist_worker.py OUT`; writes OUT/rank{r}.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402

from grpo_lib.core import distributed as D  # noqa: E402


def main(out: str) -> None:
    D.init_distributed()
    r = D.rank()
    record = {
        "backend": str(dist.get_backend_config()),
        "is_on": D.is_on(), "has_group": D.has_group(), "world_size": D.world_size(), "rank": r,
        "sum": D.all_reduce_sum(r + 1.5),  # 1.5 + 2.5
        "min": D.all_reduce_min(10 - r),  # 10, 9
        "max": D.all_reduce_max(10 - r),
        "gathered": D.all_gather_object({"rank": r, "items": list(range(r + 1))}),
        "broadcast": D.broadcast_object(f"from rank {r}", src=1),
    }
    record.update(reduction(r))
    D.barrier()
    Path(out, f"rank{r}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def reduction(r: int) -> dict:
    """40 metrics of every kind through one `Reduction` (counting the all-reduces) against one helper call per number."""
    calls, real = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        values = {f"m{i}": (r + 1) * 0.1 * (i + 1) / 3 for i in range(40)}  # not exactly representable: rounding shows
        kinds = ["sum", "max", "min", "mean"]
        packed = D.Reduction()
        packed.count("tokens", 7 + r)
        for i, (k, v) in enumerate(values.items()):
            kind = kinds[i % 4]
            packed.mean(k, v, over="tokens") if kind == "mean" else getattr(packed, kind)(k, v)
        got = packed.reduce()
        packed_calls = len(calls)
        helper = {"sum": D.all_reduce_sum, "max": D.all_reduce_max, "min": D.all_reduce_min}
        tokens = D.all_reduce_sum(7 + r)
        expected = {k: D.all_reduce_sum(v) / tokens if kinds[i % 4] == "mean" else helper[kinds[i % 4]](v)
                    for i, (k, v) in enumerate(values.items())}
    finally:
        dist.all_reduce = real
    return {"reduction_equal": got == expected and sorted(got) == sorted(expected), "reduction_calls": calls[:packed_calls],
            "helper_calls": len(calls) - packed_calls}


if __name__ == "__main__":
    main(sys.argv[1])
