"""Worker of tests/rollout/test_episodes.py's tensor-parallel tools check (issue 28 item 7), one per process, launched by
`python -m torch.distributed.run --nproc_per_node 2 tests/scripts/tp_tools_worker.py MODEL OUT`.

Both processes form one tensor-parallel group of 2 and play the same scripted engine (a TP group's engines answer
identical requests identically). The tool sleeps past the 0.3 s timeout on process 1 only. With the group's leader
running the tools (`distributed.group_leader_call(2)`, what `EpisodeRunner.from_config` uses) both processes must end
with identical episodes; each process running its own tools (the call of a run without TP) gives process 1 another
context, the failure the leader prevents. Writes OUT/rank{r}.json: both runs' episodes and how often the tool ran.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from grpo_lib.core.distributed import group_leader_call, init_distributed  # noqa: E402
from grpo_lib.tools.base import BaseTool  # noqa: E402
from tests.scripts.episode_case import ScriptedEngine, call, calls_then_answer, make_prompts, make_runner, schema  # noqa: E402

RAN: list[int] = []


class SlowOnProcessOne(BaseTool):
    execute_in = "thread"  # it reads this process's rank and records into RAN: a worker process has neither

    def execute(self, instance_id, parameters, **kwargs):
        RAN.append(dist.get_rank())
        if dist.get_rank() == 1:
            time.sleep(1.0)  # past the 0.3 s timeout: this process alone would read the timeout text
        return "42", 0.0, {}


def episodes(tokenizer, leader_call) -> list:
    runner = make_runner(tokenizer, {"lookup": SlowOnProcessOne({}, schema("lookup", key="string"))}, timeout_s=0.3)
    runner.leader_call = leader_call or (lambda fn: fn())
    engine = ScriptedEngine(tokenizer, calls_then_answer(call("lookup", key="x"), call("lookup", key="y")))
    prompts = make_prompts(runner, ["a?", "b?"])
    groups = runner.generate(engine, prompts, n=2, max_tokens=300, seeds=[7, 11], temperature=1.0, logprobs=True)
    runner.toolbox.close()
    return [[g.token_ids, g.loss_mask, g.episode.calls, g.episode.failures] for group in groups for g in group]


def main(model_dir: str, out: str) -> None:
    init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    led = episodes(tokenizer, group_leader_call(2))
    ran_led = list(RAN)
    alone = episodes(tokenizer, None)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"led": led, "alone": alone, "ran_led": ran_led}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
