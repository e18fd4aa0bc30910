"""Tools a model calls during a multi-turn episode (`rollout.multi_turn`): verl's tool interface and config format.

    base.py     the tool interface (verl's method names: create / execute / calc_reward / release) and ToolResponse
    config.py   loading verl's tool-config YAML into tool objects (ToolConfigError names the file and the entry)
    functions.py  verl's function tools (rollout.multi_turn.function_tool_path): @function_tool functions as tools
    builtin.py  the built-in tools: a calculator, verl's gsm8k answer check, the sandboxed Python code tool
    sandbox.py  running untrusted Python in a bubblewrap container per call (inside it: sandbox_child.py)
    hermes.py   reading `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` out of an assistant turn
    calls.py    running the calls of a turn: per-call timeouts, argument checks, truncation, the text the model sees;
                what a tool raises, blocks on or leaves running, bounded
    workers.py  killable worker processes that run sync tools' execute (a call past its timeout is killed)

The episode loop that uses them is grpo_lib/rollout/episodes.py. May import: rewards (the gsm8k answer check), core
(a worker that dies with its parent), the
standard library; no torch.
"""
