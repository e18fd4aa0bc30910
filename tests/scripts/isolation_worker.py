"""Worker of tests/model/test_attention.py's 2-process start-up check (issue 28 item 2), one per process, launched by
`python -m accelerate.commands.launch --multi_gpu --num_processes 2 tests/scripts/isolation_worker.py MODEL OUT`.

Every process builds the actor of `grad_case.py`'s tiny model with packing on and bf16 compute (FSDP2 sharding with a
bf16 MixedPrecisionPolicy, fp32 masters), recording what the start-up packing check ran on: whether the parameters were
FSDP2 shards, the dtype of the logits it compared, the tolerance it used. Then the same with grpo_varlen made to leak
(packed sequences attend to each other): every process must raise, not only the one that saw it. Writes OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from grpo_lib.core.distributed import init_distributed  # noqa: E402
from grpo_lib.model import actor as actor_module  # noqa: E402
from grpo_lib.model import attention, packing  # noqa: E402
from tests.scripts import grad_case as case  # noqa: E402

BF16 = ("actor.fsdp_config.param_dtype=bfloat16",)


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    init_distributed()
    rank = dist.get_rank()
    seen: dict = {}
    check = packing.check_packing_isolated

    def recording_check(model, **kwargs):
        from torch.distributed.tensor import DTensor

        seen["sharded"] = any(isinstance(p, DTensor) for p in model.parameters())
        seen["dtype"] = str(kwargs.get("dtype"))
        forward = model.forward

        def spy(*args, **kw):
            result = forward(*args, **kw)
            seen.setdefault("logits_dtypes", set()).add(str(result.logits.dtype))
            return result

        model.forward = spy
        try:
            check(model, **kwargs)
        finally:
            del model.forward
        seen["atol"] = packing.isolation_tolerance(kwargs["dtype"])

    actor_module.check_packing_isolated = recording_check
    cfg = case.make_config(Path(model_dir), remove_padding=True, max_tokens=100, world_size=2, extra=BF16)
    actor = actor_module.Actor(cfg, device=torch.device("cpu"))
    seen["compute_dtype"] = str(actor.compute_dtype)
    seen["logits_dtypes"] = sorted(seen.get("logits_dtypes", ()))

    # A leak: packed rows run as one causal sequence (what a backend that ignores the boundaries does).
    actor_module.check_packing_isolated = check
    real = attention.varlen_attention_forward

    def leaky(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("cu_seq_lens_q", None)
        kwargs.pop(attention.CONTINUES_KWARG, None)
        return real(module, query, key, value, attention_mask, **kwargs)

    attention.varlen_attention_forward = leaky  # what attention.register() (called by the Actor) registers
    try:
        actor_module.Actor(cfg, device=torch.device("cpu"))
        seen["leak"] = "not caught"
    except RuntimeError as exc:
        seen["leak"] = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
