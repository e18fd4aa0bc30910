"""Worker of tests/repo/test_gpu_collective_check.py, one per process: `python -m torch.distributed.run --nproc_per_node 2
tests/scripts/collective_audit_worker.py OUT`. Installs scripts/gpu_collective_check.py's audit on a "cpu:gloo" group,
makes one broadcast both processes pass a CPU tensor to, then one where process 1 passes a tensor on another device
type (meta, standing for process 0's CUDA buffer against a host one: the hang of issue 41 item 1), and writes
OUT/rank{r}.json: the first broadcast's result and the second one's error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_collective_check as check  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("cpu:gloo")
    rank = dist.get_rank()
    audit = check.Audit(dist.new_group(backend="gloo"))
    audit.install()
    same = torch.full((3,), float(rank + 1))
    dist.broadcast(same, src=0)
    other = torch.zeros(3) if rank == 0 else torch.zeros(3, device="meta")
    try:
        dist.broadcast(other, src=0)
        error = None
    except check.CollectiveMismatch as exc:
        error = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"same": same.tolist(), "error": error, "summary": audit.summary()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
