"""Measure one actor update's peak memory on CPU and print it beside the memory plan's training phase.

Run as a fresh process (peak RSS is per process): `python tests/scripts/plan_memory_case.py OUT_DIR`.
A random 43M-parameter Qwen3 (hidden 512, 8 layers, vocab 32000) in float32, one mini-batch of 4 trajectories
of 256 tokens (one 1024-token micro-batch), no KL, no gradient checkpointing. Prints `PLAN <bytes> MEASURED <bytes>`:
the plan's training phase (1 process, float32 compute, no engine) and VmHWM minus the RSS before the model loaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from grpo_lib.config import load_config  # noqa: E402
from grpo_lib.core.types import RolloutBatch  # noqa: E402
from grpo_lib.planning.memory import memory_plan, model_sizes  # noqa: E402


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main(out: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    Qwen3ForCausalLM(config).float().save_pretrained(out / "model")
    del config
    cfg = load_config(None, [f"model.path={out / 'model'}", "model.dtype=float32", "data.train_files=[unused.parquet]",
                             "data.max_prompt_length=128", "data.max_response_length=128", "data.train_batch_size=2",
                             "actor.ppo_mini_batch_size=2", "rollout.n=2", "actor.use_dynamic_bsz=true",
                             "actor.ppo_max_token_len_per_gpu=1024", "actor.use_kl_loss=false"])
    rows, width = 4, 256
    ids = torch.randint(2, 32000, (rows, width))  # [B, T]
    response_mask = torch.zeros(rows, width)  # [B, T]
    response_mask[:, 128:] = 1.0
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones(rows, width, dtype=torch.long), response_mask=response_mask,
                         loss_mask=response_mask,
                         rollout_logprobs=-torch.rand(rows, width) * response_mask, group_ids=["a", "a", "b", "b"],
                         response_texts=[""] * rows, data_sources=["x"] * rows, ground_truths=[None] * rows,
                         extra_infos=[{} for _ in range(rows)], truncated=torch.zeros(rows, dtype=torch.bool),
                         scores=torch.zeros(rows), advantages=torch.randn(rows, 1) * response_mask)

    from grpo_lib.model.actor import Actor

    before = rss_kib("VmRSS") * 1024
    actor = Actor(cfg, device=torch.device("cpu"))
    actor.update(batch)
    measured = rss_kib("VmHWM") * 1024 - before
    sizes = model_sizes(json.loads((out / "model" / "config.json").read_text()))
    plan = memory_plan(cfg, sizes, world_size=1, gpu_bytes=0, compute_bytes=4, master_bytes=4, with_engine=False)
    print(f"PLAN {plan['training phase']:.0f} MEASURED {measured:.0f} PARAMS {sizes.params} "
          f"ACTUAL_PARAMS {sum(p.numel() for p in actor.model.parameters())}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
