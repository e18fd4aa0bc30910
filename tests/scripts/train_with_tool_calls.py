"""train_grpo.py with a model that calls a tool in every turn, for the multi-turn end-to-end test
(tests/train/test_train_tools_e2e.py):

    python tests/scripts/train_with_tool_calls.py TOOL_NAME JSON_ARGUMENTS [FAULTS] -- RECIPE.yaml [key=value ...]

The random tiny model never writes `<tool_call>` text, so the hermes parser is replaced (a monkeypatch installed
before `train_grpo.main(argv)`, as tests/scripts/train_with_faults.py installs its faults) by one that reads every
assistant turn as one call of TOOL_NAME with JSON_ARGUMENTS; rollout.multi_turn.max_assistant_turns ends the episodes.
Everything else is the product's own path: tool config loading, the episode loop, engines, rewards, the update.
FAULTS are tests/scripts/train_with_faults.py's (`--signal "KILL update 3"`, `--nan-steps ...`), installed the same way.
With STALL_GRACE_S in the environment, the tool box waits that long past tool_timeout_s for a turn's calls before it
aborts the step (the product's 30 s, grpo_lib/tools/calls.py STALL_GRACE_S, would make the stall test wait 30 s).
Reward workers import this file as `__mp_main__` (grpo_lib/rewards/pool.py): its top level stays imports only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(argv: list[str]) -> int:
    name, arguments = argv[0], json.loads(argv[1])
    import train_grpo  # first, as `python train_grpo.py` does: it sets the environment defaults before vllm loads

    import os

    import grpo_lib.rollout.episodes as episodes
    import grpo_lib.tools.calls as calls
    from grpo_lib.tools.hermes import ToolCall
    from tests.scripts.train_with_faults import install

    episodes.parse_tool_calls = lambda text: [ToolCall(name, dict(arguments))]
    if "STALL_GRACE_S" in os.environ:  # the tool boxes built from here on wait this long (grpo_lib/tools/calls.py)
        calls.STALL_GRACE_S = float(os.environ["STALL_GRACE_S"])
    return train_grpo.main(install(argv[2:]))  # the faults before `--` (none: nothing installed), then train_grpo's arguments


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "grpo_lib.core.distributed" in sys.modules:
        from grpo_lib.core.distributed import close_distributed

        close_distributed()
    sys.exit(code)
