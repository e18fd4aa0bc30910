"""Worker of tests/model/test_lora.py's 2-process check, one per process, launched by
`python -m accelerate.commands.launch --multi_gpu --num_processes 2 tests/scripts/lora_worker.py MODEL BATCH OUT`.

Every process builds the LoRA actor on the fixed tiny model of `grad_case.py` (sharded with FSDP2 when the actor
shards), keeps its half of the fixed mini-batch's groups, runs 3 updates, and writes OUT/rank{r}.pt:
metrics of each update, the full adapter tensors and merged weights after them (gathered from the shards), whether
every base weight is bit-identical to the start and got no gradient, and the reference logprobs of its rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from grpo_lib.core.distributed import init_distributed  # noqa: E402
from grpo_lib.model import lora  # noqa: E402
from grpo_lib.model.actor import Actor  # noqa: E402
from grpo_lib.model.reference import AdapterDisabledReference  # noqa: E402
from tests.scripts import grad_case as case  # noqa: E402

SHARES = [["g0", "g1"], ["g2", "g3"]]
LORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.weight_decay=0.1")


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run(model_dir: Path, batch, world_size: int, rank: int) -> dict:
    """3 updates of the LoRA actor on this process's rows; what the test compares."""
    cfg = case.make_config(model_dir, remove_padding=True, max_tokens=100, world_size=world_size,
                           extra=LORA + ("model.enable_gradient_checkpointing=true",))
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    start = {n: local(p).detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    metrics = [actor.update(batch) for _ in range(3)]
    frozen = [(n, p) for n, p in actor.model.named_parameters() if not p.requires_grad]
    from torch.distributed.tensor import DTensor

    return dict(
        sharded=any(isinstance(p, DTensor) for p in actor.model.parameters()),
        metrics=metrics,
        adapter=lora.adapter_state(actor.model),
        merged={n: t.clone() for n, t in lora.merged_named_weights(actor.model)},
        base_unchanged=all(torch.equal(local(p), start[n]) for n, p in frozen),
        base_grads_none=all(p.grad is None for _, p in frozen),
        ref=AdapterDisabledReference(actor, cfg).compute_logprobs(batch),  # [b, T]
    )


def main(model_dir: str, batch_path: str, out: str) -> None:
    torch.set_num_threads(1)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full = torch.load(batch_path, weights_only=False)
    mine = full.select([i for i, g in enumerate(full.group_ids) if g in SHARES[rank]])
    torch.save(run(Path(model_dir), mine, world_size, rank), Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
