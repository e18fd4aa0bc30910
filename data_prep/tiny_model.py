"""Write a tiny Qwen3-architecture model folder that loads like a hub checkpoint, built fully offline.

Why: the demo and the tests must run on a CPU machine with no hub access, with the same loading code as
a real run (AutoModelForCausalLM, AutoTokenizer, vLLM). The folder holds:

- a byte-level BPE tokenizer trained with the `tokenizers` library on the synthetic arithmetic corpus,
  with a Qwen-style chat template (tools and tool messages too), `<|im_end|>` as eos and `<|endoftext|>` as pad;
- a Qwen3ForCausalLM with head_dim 32 (vLLM's CPU attention rejects 16), saved with save_pretrained.

Optionally it warms the model up (`--warmup-steps`) by supervised training on the synthetic task with
*noisy* answers: the correct sum with probability `--warmup-correct-prob`, a nearby wrong sum otherwise.
The warmed-up model samples the right answer about that often, as a real base model "sometimes knows",
so GRPO has signal from the first step and a visible curve within minutes on 2 cores.

Run:  python data_prep/tiny_model.py --out artifacts/tiny_qwen3 --warmup-steps 300

With `--tool-config` (a tool config YAML, e.g. recipes/tool_config/calculator_tool_config.yaml) it builds the tiny
TOOL model instead (`make demo-tool`; a separate folder, the default build above is unchanged): the tokenizer is
trained on the tool prompts too, and the warm-up uses the multi-turn tool prompts of data_prep/synthetic.py --tool
(system prompt, tools= schemas): a `--tool-warmup-fraction` of its episodes calls the calculator with the right
expression, reads the tool's response (loss-masked, as in training) and copies the sum into `#### N`; the others
answer directly with noisy sums. GRPO then has two ways to the reward, and the tool one is reliable:

      python data_prep/tiny_model.py --out artifacts/tiny_qwen3_tool --tool-config recipes/tool_config/calculator_tool_config.yaml \
          --tool-warmup-fraction 0.5 --warmup-steps 600

The tool's kind comes from its schema's argument: `expression` (the calculator: `{"expression": "3 + 4"}`, response
"7") or `code` (the Python tool of recipes/tool_config/tiny_python_tool_config.yaml, `make demo-python-tool`:
`{"code": "print(3 + 4)"}`, response "7\\n", what PythonTool answers for that code); the system prompt is
data_prep/synthetic.py's for that tool (`--tool python`), so the warm-up prompts are the training prompts.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run by path: the repo root replaces data_prep/ (whose math.py would shadow stdlib math)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from data_prep.synthetic import GSM8K_INSTRUCTION, TOOLS, make_problems, render_answer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A Qwen2.5-style template, short enough for the tiny model's context (transformers renders with trim_blocks: a newline
# right after a {% tag %} is written as {{ '\\n' }}). Without `tools=` it renders every message as
# <|im_start|>role\ncontent<|im_end|>\n (what the tiny model has always seen). With `tools=` the system message lists
# the tools' JSON schemas and says how to call them; tool messages render as Qwen's do: consecutive ones share one
# user turn, each inside <tool_response> tags; an assistant message's `tool_calls` render as <tool_call> blocks.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\nCall a tool as <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] %}{% set call = call['function'] if call['function'] else call %}"
    "<tool_call>{\"name\": \"{{ call['name'] }}\", \"arguments\": {{ call['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: list[str], *, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus`; digits stay single tokens so numbers tokenize uniformly.

    Example: "12 + 7" -> ["1", "2", "Ġ+", "Ġ", "7"] (roughly; the merges depend on the corpus).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, *, hidden_size: int, num_layers: int, seed: int) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 whose vocabulary matches `tokenizer` (vocab rounded up to 64)."""
    torch.manual_seed(seed)
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return Qwen3ForCausalLM(config)


def warm_up(model, tokenizer, *, steps: int, correct_prob: float, seed: int, lr: float = 3e-3, batch_size: int = 64) -> float:
    """Supervised training on noisy synthetic answers; returns the last loss (response tokens only)."""
    rng = random.Random(seed)
    problems = make_problems(num=4096, seed=seed, max_operand=9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        rows = [rng.choice(problems) for _ in range(batch_size)]
        ids, labels = [], []
        for row in rows:
            answer = row["result"]
            if rng.random() >= correct_prob:
                answer = answer + rng.choice([-3, -2, -1, 1, 2, 3])
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": row["question"] + " " + GSM8K_INSTRUCTION}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            response_ids = tokenizer(render_answer(row["a"], row["op"], row["b"], answer) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            ids.append(prompt_ids + response_ids)
            labels.append([-100] * len(prompt_ids) + response_ids)
        loss = _supervised_step(model, optimizer, ids, labels, pad_id=tokenizer.pad_token_id)
        if step % 100 == 0 or step == steps - 1:
            print(f"warmup step {step}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    return float(loss.item())


def _supervised_step(model, optimizer, ids: list[list[int]], labels: list[list[int]], *, pad_id: int) -> torch.Tensor:
    """One AdamW step of next-token loss on `labels` (-100: not trained) over right-padded `ids`; returns the loss."""
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in ids])  # [batch, width]
    label_ids = torch.tensor([x + [-100] * (width - len(x)) for x in labels])  # [batch, width]
    attention_mask = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()  # [batch, width]
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=label_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def load_tool_schemas(tool_config: str | Path) -> list[dict]:
    """The tool config's schemas exactly as the trainer passes them to the chat template's `tools=`."""
    from grpo_lib.tools.calls import ToolBox
    from grpo_lib.tools.config import load_tools

    box = ToolBox(load_tools(str(tool_config)), timeout_s=1.0, max_response_chars=256, truncate_side="middle")
    try:
        return box.schemas
    finally:
        box.close()


def tool_kind(schemas: list[dict]) -> str:
    """Which of data_prep/synthetic.py's TOOLS the (single) tool of `schemas` is, by its argument: `expression` ->
    "calculator", `code` -> "python"; ValueError naming the schema otherwise."""
    function = schemas[0]["function"]
    properties = (function.get("parameters") or {}).get("properties") or {}
    kind = "python" if "code" in properties else "calculator" if "expression" in properties else None
    if len(schemas) != 1 or kind is None or TOOLS[kind][0] != function["name"]:
        raise ValueError(f"the tiny tool model warms up on one tool named {TOOLS['calculator'][0]!r} (argument "
                         f"`expression`) or {TOOLS['python'][0]!r} (argument `code`); the tool config has "
                         f"{[(s['function']['name'], sorted(properties)) for s in schemas]}")
    return kind


def tool_call_text(a: int, b: int, kind: str = "calculator") -> str:
    """The tool call of one problem, hermes format. Example: (3, 4) ->
    '<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>'; (3, 4, "python") ->
    '<tool_call>{"name": "python", "arguments": {"code": "print(3 + 4)"}}</tool_call>'."""
    arguments = {"code": f"print({a} + {b})"} if kind == "python" else {"expression": f"{a} + {b}"}
    return "<tool_call>" + json.dumps({"name": TOOLS[kind][0], "arguments": arguments}) + "</tool_call>"


def tool_response_text(result: int, kind: str = "calculator") -> str:
    """What the tool answers for the call of tool_call_text: "7" (calculator), "7\\n" (python: what print writes)."""
    return f"{result}\n" if kind == "python" else str(result)


def tool_episode_texts(tokenizer, schemas: list[dict], row: dict, *, use_tool: bool, answer: int) -> list[tuple[str, bool]]:
    """One warm-up episode as (text, trained) pieces, laid out as the episode loop lays out tokens: the prompt (the
    data's system + user messages, tools=), then either [the call, <|im_end|>], the template's tool turn (not trained:
    loss_mask 0 in training), [the answer copying the tool's sum, <|im_end|>]; or [a direct answer with `answer`].
    """
    kind = tool_kind(schemas)
    name, system_prompt = TOOLS[kind]
    messages = [{"role": "system", "content": system_prompt.format(tool=name)},
                {"role": "user", "content": row["question"] + " " + GSM8K_INSTRUCTION}]
    eos = tokenizer.eos_token
    prompt = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
    if not use_tool:
        return [(prompt, False), (render_answer(row["a"], row["op"], row["b"], answer) + eos, True)]
    call = tool_call_text(row["a"], row["b"], kind)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": call},
                                                     {"role": "tool", "content": tool_response_text(row["result"], kind)}],
                                         tools=schemas, add_generation_prompt=True, tokenize=False)
    tool_turn = full[len(prompt) + len(call):]  # "<|im_end|>\n<|im_start|>user\n<tool_response>..." to the next turn
    assert tool_turn.startswith(eos), f"the template ends an assistant turn with {tool_turn[:20]!r}, not {eos!r}"
    return [(prompt, False), (call + eos, True), (tool_turn[len(eos):], False),
            (render_answer(row["a"], row["op"], row["b"], row["result"]) + eos, True)]


def build_tool_tokenizer(corpus: list[str], problems: list[dict], schemas: list[dict]) -> PreTrainedTokenizerFast:
    """The tool model's tokenizer: `build_tokenizer` on `corpus` plus 500 tool episodes of `problems` (their prompts
    with the tool schemas, calls, tool turns and answers), so the tool header and calls tokenize as in training."""
    renderer = build_tokenizer(corpus)  # only renders the chat template for the corpus
    episodes = ["".join(text for text, _ in tool_episode_texts(renderer, schemas, p, use_tool=k % 2 == 0, answer=p["result"]))
                for k, p in enumerate(problems[:500])]
    return build_tokenizer(corpus + episodes, vocab_size=512)


def warm_up_tool(model, tokenizer, schemas: list[dict], *, steps: int, correct_prob: float, tool_fraction: float,
                 max_operand: int, seed: int, lr: float = 3e-3, batch_size: int = 64) -> float:
    """`warm_up` on multi-turn tool episodes: `tool_fraction` of them call the tool (always the right expression or code,
    the answer copied from its response), the rest answer directly, right with `correct_prob`. Returns the last loss."""
    rng = random.Random(seed)
    problems = make_problems(num=4096, seed=seed, max_operand=max_operand)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        ids, labels = [], []
        for row in (rng.choice(problems) for _ in range(batch_size)):
            use_tool = rng.random() < tool_fraction
            answer = row["result"] if rng.random() < correct_prob else row["result"] + rng.choice([-3, -2, -1, 1, 2, 3])
            seq, lab = [], []
            for text, trained in tool_episode_texts(tokenizer, schemas, row, use_tool=use_tool, answer=answer):
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                seq += piece
                lab += piece if trained else [-100] * len(piece)
            ids.append(seq)
            labels.append(lab)
        loss = _supervised_step(model, optimizer, ids, labels, pad_id=tokenizer.pad_token_id)
        if step % 100 == 0 or step == steps - 1:
            print(f"tool warmup step {step}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    return float(loss.item())


def make_tiny_model(
    out: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    warmup_steps: int = 0,
    warmup_correct_prob: float = 0.3,
    seed: int = 0,
    tool_config: str | Path | None = None,
    tool_warmup_fraction: float = 0.3,
    max_operand: int = 9,
) -> Path:
    """Build tokenizer + model and save both to `out`; returns the folder. With `tool_config`, the tool model (module
    docstring): tokenizer corpus with the tool episodes too, warm-up on them (`tool_warmup_fraction`, `max_operand`)."""
    out = Path(out)
    problems = make_problems(num=2000, seed=seed + 1, max_operand=99)
    corpus = [p["question"] + " " + GSM8K_INSTRUCTION + "\n" + p["answer"] for p in problems]
    if tool_config is None:
        tokenizer = build_tokenizer(corpus)
    else:
        schemas = load_tool_schemas(tool_config)
        tokenizer = build_tool_tokenizer(corpus, problems, schemas)
    model = build_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    if warmup_steps > 0 and tool_config is not None:
        warm_up_tool(model, tokenizer, schemas, steps=warmup_steps, correct_prob=warmup_correct_prob,
                     tool_fraction=tool_warmup_fraction, max_operand=max_operand, seed=seed)
    elif warmup_steps > 0:
        warm_up(model, tokenizer, steps=warmup_steps, correct_prob=warmup_correct_prob, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write the model to")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=0, help="supervised steps on noisy answers (0: random model)")
    parser.add_argument("--warmup-correct-prob", type=float, default=0.3, help="fraction of warm-up answers that are right")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-config", default=None, help="build the tool model: warm up on multi-turn episodes with "
                        "this tool config's calculator or Python tool (module docstring)")
    parser.add_argument("--tool-warmup-fraction", type=float, default=0.3, help="with --tool-config: fraction of warm-up "
                        "episodes that call the tool")
    parser.add_argument("--max-operand", type=int, default=9, help="with --tool-config: largest operand of the warm-up sums")
    args = parser.parse_args()
    path = make_tiny_model(
        args.out,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        warmup_steps=args.warmup_steps,
        warmup_correct_prob=args.warmup_correct_prob,
        seed=args.seed,
        tool_config=args.tool_config,
        tool_warmup_fraction=args.tool_warmup_fraction,
        max_operand=args.max_operand,
    )
    print(f"wrote tiny model to {path}")


if __name__ == "__main__":
    main()
