"""Worker of tests/model/test_fsdp_host_memory.py, one per process, launched by
`python -m torch.distributed.run --nproc_per_node 2 tests/scripts/host_memory_worker.py MODEL TINY_MODEL OUT`.

Builds the actor and then the reference of MODEL as the trainer does (after `perf.tune_allocator(loading=True)`,
which train_grpo.py applies before the model loads when trainer.tune_allocator is on, its default), and writes
OUT/rank{r}.json with this process's resident memory, in bytes, measured around each build:
- `{part}_peak`: the high-water mark of the resident set during the build, above the resident set before it
  (VmHWM after the build, reset to the current RSS by writing "5" to /proc/self/clear_refs before it);
- `{part}_after`: the resident set after the build, above the one before it (VmRSS).
Then it checks that every gathered weight equals the file's (`weights_equal`) and the shards are DTensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from grpo_lib.core.distributed import init_distributed  # noqa: E402
from grpo_lib.core.perf import tune_allocator  # noqa: E402
from grpo_lib.model import fsdp  # noqa: E402
from grpo_lib.model.actor import Actor  # noqa: E402
from grpo_lib.model.reference import Reference  # noqa: E402
from tests.scripts import grad_case as case  # noqa: E402


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{key} not in /proc/self/status")


def measured(build):
    """(result of build(), peak RSS above the start, RSS after above the start), in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    before = status_bytes("VmRSS")
    result = build()
    return result, status_bytes("VmHWM") - before, status_bytes("VmRSS") - before


def main(model_dir: str, tiny_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    tuned = tune_allocator(loading=True)  # what train_grpo.py does first (trainer.tune_allocator defaults to on)
    init_distributed()
    rank = dist.get_rank()
    cfg = case.make_config(Path(model_dir), world_size=dist.get_world_size(), extra=("ref.fsdp_config.param_offload=true",))
    # One-time costs outside the measured builds (imports of the model code, FSDP's and gloo's set-up): the same
    # builds of TINY_MODEL (tests/scripts/grad_case.py's) first.
    tiny = case.make_config(Path(tiny_dir), world_size=dist.get_world_size())
    Actor(tiny, device=torch.device("cpu")), Reference(tiny, device=torch.device("cpu"))
    actor, actor_peak, actor_after = measured(lambda: Actor(cfg, device=torch.device("cpu")))
    reference, ref_peak, ref_after = measured(lambda: Reference(cfg, device=torch.device("cpu")))
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        file_names = set(f.keys())
        weights_equal = {}
        for part, model in (("actor", actor.model), ("reference", reference.model)):
            same = True
            for name, tensor in fsdp.gathered_state(model):  # one full tensor at a time, on every process
                if name in file_names:
                    same = same and torch.equal(tensor, f.get_tensor(name))
            weights_equal[part] = same
    record = dict(rank=rank, tuned=tuned, actor_peak=actor_peak, actor_after=actor_after, ref_peak=ref_peak, ref_after=ref_after,
                  weights_equal=weights_equal, sharded=all(isinstance(p, DTensor) for p in actor.model.parameters()),
                  local_param_bytes=fsdp.local_bytes(actor.model.parameters()))
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
