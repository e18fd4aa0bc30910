"""Tools a model calls during a multi-turn episode (`rollout.multi_turn`): verl's tool interface and config format.

    base.py     the tool interface (verl's method names: create / execute / calc_reward / release) and ToolResponse
    config.py   loading verl's tool-config YAML into tool objects (ToolConfigError names the file and the entry)
    builtin.py  the built-in tools: a calculator and verl's gsm8k answer check
    hermes.py   reading `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` out of an assistant turn
    calls.py    running the calls of a turn: per-call timeouts, argument checks, truncation, the text the model sees

The episode loop that uses them is grpo_lib/episodes.py.
"""
