"""Build one engine (vllm or hf) on the tiny model and write what it generates: rank{r}.json in OUT_DIR.

    python tests/scripts/engine_generate.py ENGINE MODEL_DIR OUT_DIR [TP]
    accelerate launch --multi_gpu --num_processes 2 tests/scripts/engine_generate.py vllm MODEL_DIR OUT_DIR 2

Prompts are fixed random token ids (a random tiny model answers a chat prompt with one repeated token; random
prompts give varied greedy continuations). Written: greedy tokens, seeded samples (n=3) with their logprobs,
the engine's logprobs of one sequence (directly and carried by a generate call), the n-children seed rule (vLLM),
the Protocol check, and greedy tokens
again after pushing perturbed weights (the same perturbation in every engine, seeded).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from grpo_lib.config import RolloutConfig  # noqa: E402
from grpo_lib.core.distributed import init_distributed  # noqa: E402
from grpo_lib.core.types import ScoreRequest  # noqa: E402
from grpo_lib.rollout.engines.base import RolloutEngine  # noqa: E402
from grpo_lib.rollout.engines.vllm import VLLMEngine  # noqa: E402


def main(engine_name: str, model_dir: str, out_dir: str, tp: int) -> None:
    init_distributed()
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cfg = RolloutConfig(kv_cache_memory_bytes=32 * 2**20, enforce_eager=True, tensor_model_parallel_size=tp, max_num_seqs=8)
    if engine_name == "hf":
        from grpo_lib.rollout.engines.hf import HFEngine

        engine = HFEngine(model_path=model_dir, cfg=cfg, on_cpu=True)
    else:
        engine = VLLMEngine(model_path=model_dir, cfg=cfg, max_model_len=96, seed=0, on_cpu=True, world_size=world_size)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 250, (int(length),), generator=g).tolist() for length in (5, 9, 12, 7, 16, 3)]
    out = {"protocol": isinstance(engine, RolloutEngine)}
    if tp > 1:  # vLLM's CPU TP all-reduce: shared memory when the ranks agreed on its name, else torch.distributed
        from vllm.distributed.parallel_state import get_tp_group

        out["tp_communicator"] = type(get_tp_group().device_communicator.dist_module).__name__
    greedy = engine.generate(prompts, n=1, temperature=0.0, max_tokens=20)
    out["greedy"] = [group[0].token_ids for group in greedy]
    sampled = engine.generate(prompts[:3], n=3, temperature=1.0, max_tokens=12, seeds=[101, 202, 303])
    out["sampled"] = [[s.token_ids for s in group] for group in sampled]
    out["sampled_logprobs"] = [[s.logprobs for s in group] for group in sampled]
    out["sampled_rescored"] = engine.score_logprobs([prompts[0] + sampled[0][0].token_ids])[0][len(prompts[0]):]
    child = engine.generate(prompts[:1], n=1, temperature=1.0, max_tokens=12, seeds=[102])
    # the same calls with on_finished (the reward stream's path; vLLM steps its engine itself): same results, each
    # response reported once, as the Generation returned; with limits 4 / 12 / 8 the short ones are reported first
    reports: list = []
    streamed = engine.generate(prompts[:3], n=3, temperature=1.0, max_tokens=12, seeds=[101, 202, 303],
                               on_finished=reports.append)
    out["streamed_sampled"] = [[s.token_ids for s in group] for group in streamed]
    out["streamed_logprobs"] = [[s.logprobs for s in group] for group in streamed]
    out["streamed_greedy"] = [g[0].token_ids for g in engine.generate(prompts, n=1, temperature=0.0, max_tokens=20,
                                                                        on_finished=lambda finished: None)]
    flat = [(i, k, g) for finished in reports for i, k, g in finished]
    out["reported_once"] = sorted((i, k) for i, k, _ in flat) == [(i, k) for i in range(3) for k in range(3)]
    out["reported_as_returned"] = all(g == streamed[i][k] for i, k, g in flat)
    out["report_calls"] = len(reports)
    reports.clear()
    engine.generate(prompts[:3], n=1, temperature=1.0, max_tokens=[4, 12, 8], seeds=[1, 2, 3], on_finished=reports.append)
    out["report_lengths"] = [len(g.token_ids) for finished in reports for _, _, g in finished]
    out["child_rule"] = child[0][0].token_ids == sampled[0][1].token_ids
    # a ScoreRequest (the weight probe) scored by the generate call that carries it, which returns what it returns
    # without it
    scored = [prompts[4] + [7, 8, 9], prompts[1]]
    out["direct_scores"] = engine.score_logprobs(scored)
    for path, kwargs in (("plain", {}), ("streamed", {"on_finished": lambda finished: None})):
        request = ScoreRequest([list(s) for s in scored])
        again = engine.generate(prompts[:3], n=3, temperature=1.0, max_tokens=12, seeds=[101, 202, 303], score=request, **kwargs)
        out[f"carried_{path}_scores"] = request.scores
        out[f"carried_{path}_version"] = request.weight_version
        out[f"carried_{path}_sampled"] = [[s.token_ids for s in group] for group in again]
    # stop (carry-over): after the 5th engine step the unfinished responses come back as far as they got; the
    # limits 3 / 12 / 8 let one finish first. The full call's responses are what the stopped one continued.
    steps = []
    limits = [3, 12, 8]
    stopped = engine.generate(prompts[:3], n=2, temperature=1.0, max_tokens=limits, seeds=[11, 22, 33],
                              stop=lambda: steps.append(1) or len(steps) >= 5)
    full = engine.generate(prompts[:3], n=2, temperature=1.0, max_tokens=limits, seeds=[11, 22, 33])
    out["stopped"] = [[[s.token_ids, s.logprobs, s.finish_reason, s.text] for s in group] for group in stopped]
    out["stopped_full"] = [[[s.token_ids, s.logprobs, s.finish_reason, s.text] for s in group] for group in full]
    out["stop_asked"] = len(steps)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    noise = torch.Generator().manual_seed(1)
    weights = [(name, t + 0.05 * torch.randn(t.shape, generator=noise)) for name, t in model.state_dict().items()]
    out["version_before_push"] = engine.weight_version
    engine.release()
    engine.prepare_for_generation(weights, version=7)
    out["version_after_push"] = engine.weight_version
    out["greedy_after_push"] = [group[0].token_ids for group in engine.generate(prompts, n=1, temperature=0.0, max_tokens=20)]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1)
