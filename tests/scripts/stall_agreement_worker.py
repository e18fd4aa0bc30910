"""Worker of tests/rollout/test_episodes.py's tool-stall agreement check (issue 30 item 6), one per process, launched by
`python -m torch.distributed.run --nproc_per_node 2 tests/scripts/stall_agreement_worker.py MODEL OUT`.

Two data-parallel processes (no tensor parallelism) each generate their own episodes with the scripted engine. The tool
blocks the event loop on process 1 only (time.sleep in an `async def`, past timeout + stall grace): process 1's turn
raises ToolStallError. Every process must then raise it from `EpisodeRunner.generate` (process 0 too, whose tools
answered), and both must still meet in the next collective; before the agreement process 0 went on into the step's
next collective and waited there for a process that had stopped. Writes OUT/rank{r}.json.
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

from grpo_lib.core import distributed as D  # noqa: E402
from grpo_lib.tools.base import BaseTool  # noqa: E402
from grpo_lib.tools.calls import ToolStallError  # noqa: E402
from tests.scripts.episode_case import ScriptedEngine, call, calls_then_answer, make_prompts, make_runner, schema  # noqa: E402


class StallsOnProcessOne(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        if dist.get_rank() == 1:
            time.sleep(1.5)  # blocks the loop past 0.2 s + 0.3 s: no timeout can fire, the turn stalls
        return "42", 0.0, {}


def main(model_dir: str, out: str) -> None:
    D.init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = make_runner(tokenizer, {"lookup": StallsOnProcessOne({}, schema("lookup", key="string"))}, timeout_s=0.2)
    runner.toolbox.stall_grace_s = 0.3
    engine = ScriptedEngine(tokenizer, calls_then_answer(call("lookup", key="x")))
    prompts = make_prompts(runner, ["a?", "b?"])
    raised = None
    try:
        runner.generate(engine, prompts, n=1, max_tokens=300, seeds=[7, 11], temperature=1.0, logprobs=True)
    except ToolStallError as error:
        raised = str(error)
    after = D.all_reduce_sum(1.0)  # both processes still in step: this collective completes
    runner.toolbox.close()
    Path(out, f"rank{D.rank()}.json").write_text(json.dumps({"raised": raised, "after": after}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
