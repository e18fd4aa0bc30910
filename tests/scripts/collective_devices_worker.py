"""Worker of tests/model/test_fsdp_collective_devices.py (issue 41, defect 1), one per process, launched by
`python -m torch.distributed.run --nproc_per_node 2 tests/scripts/collective_devices_worker.py MODEL OUT`.

On GPUs with ref.fsdp_config.param_offload, process 0 reads the reference and `fully_shard` moves its buffers (Qwen3's
rotary `inv_freq`, `original_inv_freq`) to the GPU, while the other processes build it on meta and `to_empty` it into
host memory; a broadcast of a buffer then gets a CUDA tensor on process 0 and a CPU one elsewhere, and the
"cpu:gloo,cuda:nccl" group runs NCCL there and gloo here: a hang. The same situation on CPU:
- process 0's `fully_shard` puts the buffers it manages on torch's lazy device (another device type with storage, in
  every CPU build of torch), as FSDP2 puts them on the GPU, and halves them (a mark: every process must end up with
  process 0's values, not its own);
- every tensor collective of torch.distributed goes through scripts/gpu_collective_check.py's `Audit` (the GPU check's
  own): it first gathers the device types and dtypes of its tensors from every process over a side gloo group and
  raises on every process when they differ (where the real collective would hang).
Then it builds the reference of MODEL as the trainer does (`Reference`, shards in host memory) and scores one
batch with it, and writes OUT/rank{r}.json: the mismatches (with the error that stopped the build, if any), the
number of collectives checked, the buffers' devices and values after the build.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import gpu_collective_check as collectives  # noqa: E402
import torch  # noqa: E402
import torch._lazy.ts_backend  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp  # noqa: E402

from grpo_lib.core.distributed import init_distributed  # noqa: E402
from grpo_lib.model.reference import Reference  # noqa: E402
from tests.scripts import grad_case as case  # noqa: E402

def buffers_on_another_device_on_process_0(rank: int) -> None:
    """Process 0's `fully_shard` leaves the buffers it manages on the lazy device (halved), as FSDP2 moves them to the
    GPU there; the others' come from the meta build (`to_empty`)."""
    real = torch.distributed.fsdp.fully_shard

    def fully_shard(module, **kwargs):
        out = real(module, **kwargs)
        if rank == 0:
            for sub in module.modules():
                for key, buffer in sub._buffers.items():
                    if buffer is not None and buffer.device.type != "lazy":
                        sub._buffers[key] = (buffer * 0.5).to("lazy")
        return out

    torch.distributed.fsdp.fully_shard = fully_shard  # fsdp.shard imports it at call time


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    torch._lazy.ts_backend.init()
    init_distributed()
    rank = dist.get_rank()
    audit = collectives.Audit(dist.new_group(backend="gloo"))
    record = {"rank": rank, "checked": 0, "mismatches": [], "error": None}
    cfg = case.make_config(Path(model_dir), world_size=dist.get_world_size(), extra=("ref.fsdp_config.param_offload=true",))
    buffers_on_another_device_on_process_0(rank)
    audit.install()
    try:
        reference = Reference(cfg, device=torch.device("cpu"))
        ids = torch.randint(2, case.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))  # [2, 12], same everywhere
        with torch.no_grad():
            logprobs, _ = reference.policy(ids, torch.ones_like(ids), temperature=1.0)  # [2, 12]
        record["logprobs"] = logprobs.tolist()
        record["buffers"] = {name: {"device": b.device.type, "values": b.cpu().tolist()}
                             for name, b in reference.model.named_buffers()}
    except collectives.CollectiveMismatch as mismatch:
        record["mismatches"].append(str(mismatch))
    except RuntimeError:
        record["error"] = traceback.format_exc(limit=6)
    record["checked"] = sum(audit.counts.values()) - audit.unaudited
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
