"""2-process worker for tests/checkpoints/test_checkpoint.py: only process 1 gets SIGTERM; both must agree to stop.

Launched with `accelerate launch --multi_gpu --num_processes 2 tests/scripts/stop_worker.py OUT`; writes
OUT/rank{R}.json = {"before": stop_requested() before any signal, "after": ... after process 1's SIGTERM}.
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from grpo_lib.core.distributed import barrier, close_distributed, init_distributed  # noqa: E402
from grpo_lib.core.stopping import install_stop_handlers, stop_requested  # noqa: E402

init_distributed()
rank = int(os.environ["RANK"])
install_stop_handlers()
before = stop_requested()
if rank == 1:
    os.kill(os.getpid(), signal.SIGTERM)
barrier()
after = stop_requested()
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after}))
barrier()
close_distributed()
