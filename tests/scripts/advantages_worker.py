"""Worker of tests/algorithms/test_advantages.py: `step.compute_advantages` on 2 processes (gloo), each holding half the groups,
for the estimators whose statistics span the batch (reinforce++'s whitening, GPG's alpha). Launched with
`python -m torch.distributed.run --nproc_per_node 2 tests/scripts/advantages_worker.py OUT`; writes OUT/rank{r}.json
(estimator -> this process's advantages)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402

from grpo_lib.core import distributed as D  # noqa: E402
from tests.algorithms.test_advantages import BATCH_ESTIMATORS, advantages_of_rows  # noqa: E402


def main(out: str) -> None:
    D.init_distributed()
    r = D.rank()
    rows = [0, 1, 2, 3] if r == 0 else [4, 5, 6, 7]  # whole groups of 2 on each process
    record = {name: advantages_of_rows(name, rows, out).tolist() for name in BATCH_ESTIMATORS}
    D.barrier()
    Path(out, f"rank{r}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
