"""LoRA weight push into vLLM: merged (base + scaled B A, every weight) vs adapter-only (rollout.lora_mode=adapter).

Not a test: `python bench/bench_lora_push.py` prints a table and writes (or replaces) its section of
bench/results_lora_push_cpu.md. About 2 minutes on 2 idle CPU cores.

What it measures, in ONE process per model (the two engines side by side, pushes alternated A/B so a burst of load on the
shared machine hits both): the bytes one push hands the engine (merged: every weight in the engine's dtype; adapter: the
float32 A and B tensors) and the wall seconds of `prepare_for_generation(actor.engine_weights())` from a released engine
(gathering, the transfer, vLLM's load, the prefix-cache reset), the median of --repeats pushes each. Models: the tiny
demo model (data_prep/tiny_model.py, 0.2M parameters) and the random 42M-parameter Qwen3 of bench/bench_update.py
(hidden 512, 8 layers, vocab 32k), LoRA rank 16 on all-linear, float32 on CPU. Each push's engine logprobs are checked
against the other mode's (< 1e-4) so a fast wrong push cannot win. The projection for Qwen3-4B (rank 16 and 64, bf16
engine) is the plan's arithmetic (`grpo_lib.planning.memory.push_bytes`; --print-plan prints it for a LoRA recipe).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from bench_update import machine, write_model  # noqa: E402
from grpo_lib.config import load_config  # noqa: E402
from grpo_lib.model import lora  # noqa: E402
from grpo_lib.model.actor import Actor  # noqa: E402
from grpo_lib.planning.memory import model_sizes, push_bytes  # noqa: E402
from grpo_lib.rollout.engines.vllm import VLLMEngine  # noqa: E402

MIB = 2**20
SECTION = "# LoRA push: merged vs adapter-only (CPU)"


def measure(model_dir: Path, *, rank: int, repeats: int) -> dict:
    cfg = load_config(REPO / "recipes/tiny_cpu.yaml", [f"model.path={model_dir}", f"model.lora_rank={rank}",
                                                        f"model.lora_alpha={2 * rank}", "rollout.lora_mode=adapter",
                                                        "data.max_prompt_length=64", "rollout.kv_cache_memory_bytes=67108864"])
    torch.manual_seed(0)
    actor = Actor(cfg, device=torch.device("cpu"))
    with torch.no_grad():  # a trained-looking adapter (B away from 0), so both engines serve something other than the base
        for name, p in actor.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    merged_cfg = copy.deepcopy(cfg)
    merged_cfg.rollout.lora_mode = "merged"
    engines = {"adapter": VLLMEngine.from_config(cfg, on_cpu=True, world_size=1),
               "merged": VLLMEngine.from_config(merged_cfg, on_cpu=True, world_size=1)}
    payload = {"adapter": lambda: actor.engine_weights(), "merged": lambda: lora.merged_named_weights(actor.model)}
    seconds = {mode: [] for mode in engines}
    for _ in range(repeats):
        for mode, engine in engines.items():
            engine.release()
            start = time.perf_counter()
            engine.prepare_for_generation(payload[mode](), version=1)
            seconds[mode].append(time.perf_counter() - start)
    seq = [list(range(5, 45))]
    diff = max(abs(a - b) for a, b in zip(engines["adapter"].score_logprobs(seq)[0][1:], engines["merged"].score_logprobs(seq)[0][1:]))
    assert diff < 1e-4, f"the two pushes serve different weights (max logprob difference {diff})"
    adapter = actor.engine_weights()
    merged = sum(t.numel() * 4 for _, t in lora.merged_named_weights(actor.model))  # float32 engine on CPU
    params = sum(p.numel() for p in actor.model.parameters() if not p.requires_grad)
    return {"params": params, "merged_bytes": merged, "adapter_bytes": adapter.nbytes,
            "merged_s": statistics.median(seconds["merged"]), "adapter_s": statistics.median(seconds["adapter"]),
            "logprob_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tiny", default=str(REPO / "artifacts/tiny_qwen3"), help="the tiny demo model (make demo builds it)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mid = Path(tmp) / "mid"
        write_model(mid, hidden=512, layers=8, vocab=32000)
        for name, path in (("tiny (data_prep/tiny_model.py)", Path(args.tiny)), ("42M (bench_update.py)", mid)):
            rows.append((name, measure(path, rank=args.rank, repeats=args.repeats)))
    qwen = model_sizes(json.loads((REPO / "tests/data/qwen3_4b_config.json").read_text()))
    projection = []
    for rank in (16, 64):
        cfg = load_config(REPO / "recipes/qwen3_4b_gsm8k_lora.yaml", [f"model.lora_rank={rank}"], world_size=4)
        projection.append((rank, push_bytes(cfg, qwen)))
    lines = [SECTION, "", f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {machine()} by `python bench/bench_lora_push.py` "
             f"(rank {args.rank}, all-linear, float32 engine, median of {args.repeats} pushes per mode, alternated in one process).", "",
             "| model | base params | merged push | adapter push | bytes ratio | merged s | adapter s | time ratio | logprob diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['params'] / 1e6:.2f}M | {r['merged_bytes'] / MIB:.2f} MiB | {r['adapter_bytes'] / MIB:.3f} MiB | "
                     f"{r['merged_bytes'] / r['adapter_bytes']:.0f}x | {r['merged_s'] * 1e3:.1f} ms | {r['adapter_s'] * 1e3:.1f} ms | "
                     f"{r['merged_s'] / r['adapter_s']:.1f}x | {r['logprob_diff']:.1e} |")
    lines += ["", "Projected for Qwen3-4B (bf16 engine; the plan's `push_bytes`, printed by --print-plan for a LoRA recipe):", "",
              "| rank | merged push | adapter push | ratio |", "|---|---|---|---|"]
    for rank, b in projection:
        lines.append(f"| {rank} | {b['merged'] / 2**30:.2f} GiB | {b['adapter'] / MIB:.0f} MiB | {b['merged'] / b['adapter']:.0f}x |")
    lines += ["", "The seconds on a GPU are not measured here (no GPU was lent): a merged push there gathers, casts and copies "
              "the whole model each step; the adapter push copies the adapter and vLLM activates it into its stacked LoRA "
              "buffers. Not measured here either: the serving cost (vLLM computes base + adapter, two small matmuls per "
              "targeted layer, instead of the merged weight)."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = REPO / "bench" / "results_lora_push_cpu.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
