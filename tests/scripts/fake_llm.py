"""A recording stand-in for `vllm.LLM`, and a runner of train_grpo.main with it (in-process or under a launcher).

`FakeLLM` records every raw engine call (start, sleep, wake_up, reload_weights, reset_prefix_cache, generate with
its requests and seeds) in `FakeLLM.events`; `grpo_lib.rollout.engines.base.empty_trainer_cache` is wrapped to record
"empty_cache" in the same list, and the actor's `load_params` / `offload` / forward passes record "actor_on_device" /
"actor_on_host" / "actor_forward", so a test sees the exact order the GPU would see. The engine's own state machine
is NOT faked: `VLLMEngine` runs as is, only its `llm` is this fake, and its lifecycle is told that it frees memory
(as on a GPU with rollout.free_cache_engine).

Generation is deterministic per sample seed (the seed of sample k is the request's seed + k, vLLM's rule).
Training requests (n > 1; validation in these tests has n = 1) alternate: odd calls give every sample of a prompt the same text (all groups
uninformative), even calls make sample 0 of each prompt differ, so a DAPO run takes exactly 2 rounds per step.

Run under a launcher: `python tests/scripts/fake_llm.py OUT_DIR RECIPE key=value ...` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


class FakeLLM:
    events: list = []
    starts = 0

    def __init__(self, **kwargs):
        from transformers import AutoTokenizer

        type(self).starts += 1
        self.kwargs = kwargs
        self.tokenizer = AutoTokenizer.from_pretrained(kwargs["model"])
        self.train_calls = 0
        import torch

        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))  # read by push_weights
        self.events.append(("start", kwargs["tensor_parallel_size"], kwargs["seed"]))

    def get_tokenizer(self):
        return self.tokenizer

    def sleep(self, level):
        self.events.append(("sleep", level))

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tuple(tags) if tags else None))

    def collective_rpc(self, method, kwargs=None):
        self.events.append((method, sum(1 for _ in kwargs["weights_iterator"])))  # consumes the streamed buckets

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))

    def get_metrics(self):  # vLLM's Prometheus metrics (rollout/preemptions reads vllm:num_preemptions): none here
        return []

    def generate(self, requests, params, use_tqdm=False):
        if not isinstance(params, list):  # score_logprobs: one params for all
            self.events.append(("score", [r["prompt_token_ids"] for r in requests]))
            return [SimpleNamespace(prompt_logprobs=[None] + [{t: SimpleNamespace(logprob=-1.0)} for t in r["prompt_token_ids"][1:]])
                    for r in requests]
        train = params[0].n > 1
        self.train_calls += train
        self.events.append(("generate", [r["prompt_token_ids"] for r in requests],
                            [(p.n, p.temperature, p.top_p, p.top_k, p.seed) for p in params]))
        outputs = []
        for r, p in zip(requests, params):
            completions = []
            for k in range(p.n):
                rng = random.Random(p.seed + k if p.seed is not None else 0)
                tokens = [rng.randrange(10, 60) for _ in range(rng.randrange(2, 6))]
                if train:  # odd calls: every sample alike (uninformative group); even calls: sample 0 differs
                    text = "same" if self.train_calls % 2 == 1 else ("0" if k == 0 else "1")
                else:
                    text = str(rng.randrange(3))
                completions.append(SimpleNamespace(token_ids=tokens, text=text, finish_reason="length",
                                                   logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in tokens] if p.logprobs == 0 else None))
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs


def install(monkeypatch=None):
    """Make train_grpo build a VLLMEngine over FakeLLM with real sleep, and record empty_cache; returns FakeLLM."""
    from grpo_lib.rollout import engines
    from grpo_lib.rollout.engines import base
    from grpo_lib.rollout.engines.vllm import VLLMEngine

    FakeLLM.events, FakeLLM.starts = [], 0
    real_build, real_empty = engines.build_engine, base.empty_trainer_cache

    def build_engine(cfg, *, on_cpu, world_size):
        engine = VLLMEngine(model_path=cfg.model.path, cfg=cfg.rollout, max_model_len=64, seed=cfg.trainer.seed,
                            on_cpu=on_cpu, world_size=world_size, llm_factory=FakeLLM)
        engine.lifecycle.frees_memory = cfg.rollout.free_cache_engine  # as on a GPU
        return engine

    def empty_trainer_cache():
        FakeLLM.events.append(("empty_cache",))
        real_empty()

    from grpo_lib.model.actor import Actor

    real_load, real_offload = Actor.load_params, Actor.offload

    def load_params(actor):  # the actor's shards must be on the device from here (a no-op move on CPU)
        FakeLLM.events.append(("actor_on_device",))
        real_load(actor)

    def offload(actor):  # ... and may rest on the host from here (with param_offload)
        FakeLLM.events.append(("actor_on_host",))
        real_offload(actor)

    from grpo_lib.model.fsdp import LogprobModel

    real_forward = LogprobModel.forward

    def forward(policy, *args, **kwargs):  # a forward of the actor (or of the reference, when one is built)
        FakeLLM.events.append(("actor_forward",))
        return real_forward(policy, *args, **kwargs)

    setter = monkeypatch.setattr if monkeypatch is not None else lambda obj, name, value: setattr(obj, name, value)
    setter(engines, "build_engine", build_engine)
    setter(base, "empty_trainer_cache", empty_trainer_cache)
    setter(Actor, "load_params", load_params)
    setter(Actor, "offload", offload)
    setter(LogprobModel, "forward", forward)
    assert real_build is not None
    return FakeLLM


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out_dir = Path(sys.argv[1])
    fake = install()
    import train_grpo

    code = train_grpo.main(sys.argv[2:])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"code": code, "starts": fake.starts, "events": fake.events}))
    sys.exit(code)
