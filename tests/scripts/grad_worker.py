"""Worker of tests/model/test_multiprocess.py, one per process, launched by
`python -m accelerate.commands.launch --multi_gpu --num_processes 2 tests/scripts/grad_worker.py MODEL BATCH OUT`.

Every process loads the same model and the same saved mini-batch, keeps its share of the groups, runs
`Actor.accumulate_gradients` (gradients all-reduced over processes) for each case below and writes
OUT/rank{r}/{case}.pt: {"grads": {name: tensor}, "metrics": {...}, "forwards": decoder forwards, ...}.
The test compares these with the 1-process full-batch gradients.

Cases (groups g0..g3 of the fixed batch; g1 and g3 hold the most tokens):
- even/*: process r gets half the groups, for each loss_agg_mode, fixed micro-batches (padded) and a token
  budget (packed); holes-even/*: the same on the batch with loss-mask holes (`grad_case.with_holes`);
- lopsided: process 0 gets 3 groups, process 1 one group, 1 trajectory per micro-batch: process 1 runs dummy
  micro-batches to match process 0's count, in the update and in the old-logprob pass;
- balanced: process 0 starts with g1 and g3 (141 tokens), process 1 with g0 and g2 (86 tokens);
  `balance_across_ranks` moves groups, then the update runs under a token budget with packing;
- distill-*: the distillation term (tests/model/test_distillation_invariance.py's DISTILL_CASES) on the lopsided share;
- collectives-*: the even share under each actor.fsdp_config choice of COLLECTIVE_CHOICES, with the bytes of every
  all-gather and reduce-scatter (`fsdp.count_collectives`); unit_bytes.pt: one all-gather of each unit alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from grpo_lib.algorithms import LOSS_AGG_MODES  # noqa: E402
from grpo_lib.core.distributed import init_distributed  # noqa: E402
from grpo_lib.model import fsdp  # noqa: E402
from grpo_lib.model.actor import Actor  # noqa: E402
from grpo_lib.model.batching import balance_across_ranks  # noqa: E402
from tests.scripts import grad_case as case  # noqa: E402

SHARES = {  # case kind -> groups of each process
    "even": [["g0", "g1"], ["g2", "g3"]],
    "lopsided": [["g0", "g1", "g2"], ["g3"]],
    "balanced": [["g1", "g3"], ["g0", "g2"]],
}
EVEN_SETTINGS = {"fixed1-padded": dict(micro_batch_size=1), "budget60-packed": dict(max_tokens=case.LONGEST, remove_padding=True)}
# actor.fsdp_config choices of the update's collectives (fsdp.mini_batch_collectives); "default" is the config default.
COLLECTIVE_CHOICES = {
    "per-micro-batch": ("actor.fsdp_config.keep_root_gathered=false",),
    "default": (),
    "no-reshard-after-forward": ("actor.fsdp_config.reshard_after_forward=false",),
    "defer-root": ("actor.fsdp_config.defer_grad_reduce=root",),
    "defer-all": ("actor.fsdp_config.defer_grad_reduce=all",),
    "all-three": ("actor.fsdp_config.reshard_after_forward=false", "actor.fsdp_config.defer_grad_reduce=all"),
}


def main(model_dir: str, batch_path: str, out: str) -> None:
    torch.set_num_threads(1)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out_dir = Path(out) / f"rank{rank}"
    out_dir.mkdir(parents=True, exist_ok=True)
    full = torch.load(batch_path, weights_only=False)
    actor = Actor(case.make_config(Path(model_dir), world_size=world_size), device=torch.device("cpu"))
    forwards = [0]
    actor.model.get_decoder().register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))

    def run(name: str, batch, **config) -> None:
        actor.cfg = case.make_config(Path(model_dir), world_size=world_size, **config)
        actor.model.zero_grad(set_to_none=True)
        forwards[0] = 0
        actor.collective_bytes.update(all_gather=0, reduce_scatter=0)
        metrics = actor.accumulate_gradients(batch)
        collectives = dict(actor.collective_bytes)
        record = {"grads": case.grads_of(actor.model), "metrics": metrics, "forwards": forwards[0], "rows": len(batch),
                  "collectives": collectives,
                  "group_ids": list(dict.fromkeys(batch.group_ids)), "tokens": sum(batch.seq_lens),
                  "sharded": all(isinstance(p, DTensor) for p in actor.model.parameters())}
        if name == "lopsided":
            forwards[0] = 0
            record["logprobs"] = actor.compute_logprobs(batch)  # [b, T] this process's rows
            record["logprob_forwards"] = forwards[0]
        torch.save(record, out_dir / f"{name}.pt")

    holed = case.with_holes(full)
    mine = lambda kind, batch=full: batch.select(case.group_rows(batch, SHARES[kind][rank]))  # noqa: E731
    for mode in LOSS_AGG_MODES:
        for setting, micro in EVEN_SETTINGS.items():
            run(f"even-{mode}-{setting}", mine("even"), loss_agg_mode=mode, **micro)
            run(f"holes-even-{mode}-{setting}", mine("even", holed), loss_agg_mode=mode, **micro)
    for choice, extra in COLLECTIVE_CHOICES.items():
        for setting, micro in EVEN_SETTINGS.items():
            run(f"collectives-{choice}-{setting}", mine("even"), extra=extra, **micro)
    for loss in case.LOSS_OVERRIDES:  # every other policy loss, on the holed batch, packed under the smallest budget
        mode, extra = case.loss_case(loss)
        run(f"loss-{loss}", mine("even", holed), loss_agg_mode=mode, extra=extra, **EVEN_SETTINGS["budget60-packed"])
    # Bytes of one all-gather of each unit (FSDPModule.unshard of the unit alone), for the byte counts' formulas.
    unit_bytes = {}
    for unit_name, unit in [("root", actor.policy), *((f"layer{i}", m) for i, m in enumerate(fsdp.decoder_layers(actor.model)))]:
        before = actor.collective_bytes["all_gather"]
        unit.unshard()
        unit.reshard()
        unit_bytes[unit_name] = actor.collective_bytes["all_gather"] - before
    torch.save(unit_bytes, out_dir / "unit_bytes.pt")
    run("lopsided", mine("lopsided"), micro_batch_size=1)
    run("balanced", balance_across_ranks(mine("balanced")), max_tokens=case.LONGEST, remove_padding=True)
    # the distillation term (tests/model/test_distillation_invariance.py's teacher scores), lopsided: process 1 runs dummies
    from tests.model.test_distillation_invariance import DISTILL_CASES, distill_extra, teacher_scores

    distilled = full.select(list(range(len(full))))
    teacher_scores(distilled)
    for name, extra in DISTILL_CASES.items():
        for setting, micro in {"fixed1": dict(micro_batch_size=1), "budget60-packed": EVEN_SETTINGS["budget60-packed"]}.items():
            run(f"distill-{name}-{setting}", mine("lopsided", distilled), extra=distill_extra(Path(model_dir), *extra), **micro)
    (out_dir / "done.json").write_text(json.dumps({"rank": rank, "world_size": world_size, "pid": os.getpid()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
