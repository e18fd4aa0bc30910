"""Multi-turn episodes with a real engine (vllm or hf) on the tiny fp32 model; writes what happened to OUT_DIR/out.json.

    python tests/scripts/episode_engine.py ENGINE MODEL_DIR OUT_DIR

The random tiny model never writes a tool call, so the hermes parser is replaced here (a monkeypatch, in this test
process only) by one that reads every turn as a call of the `echo` tool; rollout.multi_turn.max_assistant_turns=3
ends each episode. The model folder given has its eos made likely (tests/rollout/test_episodes_engines.py), so turns end
with the model's own <|im_end|> after a few tokens. Written: every engine call (contexts, seeds, sampled ids and
their logprobs, max_tokens), the episodes of prompts [A, B] (n=2), the episodes of [B] alone with B's seed, (vLLM) the
episodes of [A, B] again by the per-episode loop on the running engine (open_session), and the trainer's logprobs (Actor.compute_logprobs, fp32, at the rollout temperature) of the episode batch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

import grpo_lib.rollout.episodes as episodes_module  # noqa: E402
from grpo_lib.config import load_config  # noqa: E402
from grpo_lib.tools.hermes import ToolCall  # noqa: E402
from grpo_lib.trainer.step import build_rollout_batch  # noqa: E402
from tests.scripts.episode_case import EchoTool, make_prompts, make_runner, schema  # noqa: E402

TEMPERATURE, MAX_RESPONSE = 0.9, 160  # a tool turn of the tiny template is ~40 tokens


class Recording:
    """The engine, with every generate call's requests and outputs written down."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, **kwargs):
        out = self.engine.generate(prompt_ids, **kwargs)
        self.calls.append({"prompts": [list(p) for p in prompt_ids], "seeds": kwargs["seeds"], "max_tokens": kwargs["max_tokens"],
                           "n": kwargs["n"], "sampled": [g[0].token_ids for g in out], "logprobs": [g[0].logprobs for g in out]})
        return out


def main(engine_name: str, model_dir: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=float32", "data.train_files=[unused.parquet]",
                             "data.max_prompt_length=400", f"data.max_response_length={MAX_RESPONSE}", "data.train_batch_size=2",
                             "actor.ppo_mini_batch_size=2", "rollout.n=2", f"rollout.temperature={TEMPERATURE}",
                             f"rollout.name={engine_name}", "rollout.kv_cache_memory_bytes=33554432", "rollout.max_num_seqs=8",
                             "rollout.enforce_eager=true", "actor.ppo_micro_batch_size_per_gpu=4",
                             "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=unused.yaml"])
    from grpo_lib.rollout.engines import build_engine

    engine = Recording(build_engine(cfg, on_cpu=True, world_size=1))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    episodes_module.parse_tool_calls = lambda text: [ToolCall("echo", {"text": "ok"})]  # every turn calls echo
    runner = make_runner(tokenizer, {"echo": EchoTool({}, schema("echo", text="string"))}, max_assistant_turns=3)
    sampling = dict(temperature=TEMPERATURE, max_tokens=MAX_RESPONSE, top_p=1.0, top_k=-1, logprobs=True)
    prompts = make_prompts(runner, ["What is 1 + 1?", "What is 6 * 7?"])
    groups = runner.generate(engine, prompts, n=2, seeds=[1234, 5678], **sampling)
    calls_both = len(engine.calls)
    [alone] = runner.generate(engine, make_prompts(runner, ["What is 6 * 7?"]), n=2, seeds=[5678], **sampling)
    per_episode = None
    if hasattr(engine.engine, "open_session"):  # vLLM: the per-episode loop on the running engine, same prompts and seeds
        heard, calls_before = [], len(engine.calls)
        per_episode = runner.generate(engine.engine, prompts, n=2, seeds=[1234, 5678], **sampling,
                                      on_finished=lambda finished: heard.extend((i, k) for i, k, _ in finished))
        assert len(engine.calls) == calls_before, "the per-episode loop made no generate call"
        assert sorted(heard) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    runner.toolbox.close()
    batch = build_rollout_batch(prompts, groups, pad_id=tokenizer.pad_token_id)
    from grpo_lib.model.actor import Actor

    actor = Actor(cfg, device=torch.device("cpu"))
    trainer_lp = actor.compute_logprobs(batch)  # [B, T]
    out = {
        "calls": engine.calls[:calls_both],
        "prompt_ids": prompts.prompt_ids,
        "episodes": [[{"token_ids": g.token_ids, "loss_mask": g.loss_mask, "logprobs": g.logprobs, "stop": g.episode.stop,
                       "turns": g.episode.assistant_turns} for g in group] for group in groups],
        "alone": [g.token_ids for g in alone],
        "per_episode": None if per_episode is None else [[{"token_ids": g.token_ids, "loss_mask": g.loss_mask, "logprobs": g.logprobs,
                                                            "stop": g.episode.stop, "turns": g.episode.assistant_turns}
                                                           for g in group] for group in per_episode],
        "trainer_logprobs": [trainer_lp[i][batch.response_mask[i] > 0].tolist() for i in range(len(batch))],
        "holes": [tokenizer.decode([t for t, m in zip(g.token_ids, g.loss_mask) if not m]) for group in groups for g in group],
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "out.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
