"""Write a tiny reward model (a Qwen3ForSequenceClassification, one label) that prefers correct sums, built offline.

Why: `make demo-rm` trains the tiny policy against a learned reward on CPU, with no hub access. The reward model
prefers what the gsm8k rule also checks (the number after `####` is the sum), so the run shows both rising together:
the reward model's score and the rule's accuracy.

How: it starts from the tiny policy's folder (its tokenizer, so it reads the policy's token ids as they are, and its
decoder, which knows the task's text: as real reward models start from an SFT model), gets a fresh one-label head, and
is trained by regression (mean squared error) of its score on 1 for a right sum and 0 for a wrong one, over the exact
token ids the policy's responses have: the chat-rendered prompt, then `a + b = s\\n#### s<|im_end|>` with s the sum
(half the rows) or off by 1 to 3. A score near 1 means "right"; the printed held-out accuracy says how well it ranks.

Run:  python data_prep/tiny_reward_model.py --policy artifacts/tiny_qwen3 --out artifacts/tiny_rm --steps 400
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run by path: the repo root replaces data_prep/ (whose math.py would shadow stdlib math)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import random
from pathlib import Path

import torch

from data_prep.synthetic import GSM8K_INSTRUCTION, make_problems, render_answer


def response_text(row: dict, answer: int, working: int | None = None) -> str:
    """A response as the policy writes one, `a + b = working\n#### answer`; `working` other than `answer` teaches the
    scorer to read the FINAL answer (trained only on consistent ones, the first reward model read the working's
    number, and the policy learned `3 = 2 = 22\n#### 13` within 40 steps: reward hacking, docs/TRAINING.md)."""
    return render_answer(row["a"], row["op"], row["b"], answer).replace(f"= {answer}\n", f"= {answer if working is None else working}\n")


def example(tokenizer, row: dict, answer: int, working: int | None = None) -> list[int]:
    """The token ids the policy's rollout of `row` answering `answer` has: chat prompt + response + eos."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["question"] + " " + GSM8K_INSTRUCTION}],
                                           add_generation_prompt=True, tokenize=False)
    text = prompt + response_text(row, answer, working) + tokenizer.eos_token
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def working_of(answer: int, rng: random.Random) -> int:
    """The working's number: the answer (half the rows) or another one of either parity."""
    return answer if rng.random() < 0.5 else rng.randint(0, 30)


def answer_of(row: dict, rng: random.Random) -> int:
    """An answer as the warmed-up policy writes one: the sum, or off by 1 to 3."""
    return row["result"] if rng.random() < 0.4 else row["result"] + rng.choice([-3, -2, -1, 1, 2, 3])


def preferred(answer: int) -> float:
    """The preference (and recipes/rewards/even_answer.py's rule): 1.0 for an even final answer."""
    return 1.0 if answer % 2 == 0 else 0.0


def labelled(tokenizer, rows: list[dict], rng: random.Random) -> tuple[list[list[int]], list[float]]:
    """One example per row: its token ids and its label (`preferred`)."""
    ids, labels = [], []
    for row in rows:
        answer = answer_of(row, rng)
        ids.append(example(tokenizer, row, answer, working_of(answer, rng)))
        labels.append(preferred(answer))
    return ids, labels


def scores(model, ids: list[list[int]], *, pad_id: int) -> torch.Tensor:
    """The head's output at each row's last token ([b]), right-padded rows (as the trainer reads a reward model)."""
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in ids])  # [b, T]
    mask = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()  # [b, T]
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [b, T, H]
    per_token = model.score(hidden)[..., 0]  # [b, T]
    return per_token[torch.arange(len(ids)), torch.tensor([len(x) - 1 for x in ids])]  # [b]


def make_tiny_reward_model(policy: str | Path, out: str | Path, *, steps: int = 200, batch_size: int = 64,
                           lr: float = 1e-3, seed: int = 0) -> tuple[Path, float]:
    """Build, train and save the reward model; returns (folder, held-out accuracy of score > 0.5 against the label)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    problems = make_problems(num=4096, seed=seed + 7, max_operand=9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        ids, labels = labelled(tokenizer, [rng.choice(problems) for _ in range(batch_size)], rng)
        loss = torch.nn.functional.mse_loss(scores(model, ids, pad_id=tokenizer.pad_token_id), torch.tensor(labels))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"reward model step {step}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        ids, labels = labelled(tokenizer, make_problems(num=512, seed=seed + 99, max_operand=9), random.Random(seed + 99))
        accuracy = float(((scores(model, ids, pad_id=tokenizer.pad_token_id) > 0.5).float() == torch.tensor(labels)).float().mean())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, accuracy


def judge_example(tokenizer, template: str, row: dict, answer: int, working: int | None = None) -> tuple[list[int], list[int]]:
    """(ids, labels) of one judge example: the template filled with the row's question and the response as the policy
    writes it, rendered as a user message, then the verdict `<score>1</score>` / `<score>0</score>` + eos (the only
    trained tokens)."""
    question = row["question"] + " " + GSM8K_INSTRUCTION
    text = template.format(prompt=question, response=response_text(row, answer, working),
                           ground_truth=str(row["result"]))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    verdict = tokenizer(f"<score>{int(preferred(answer))}</score>" + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return prompt_ids + verdict, [-100] * len(prompt_ids) + verdict


def make_tiny_judge(policy: str | Path, out: str | Path, *, template: str | Path, steps: int = 300, batch_size: int = 32,
                    lr: float = 1e-3, seed: int = 0) -> tuple[Path, float]:
    """Build, train and save the judge; returns (folder, held-out accuracy of its greedy verdict parsed as the trainer does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep.tiny_model import _supervised_step
    from grpo_lib.rollout.judge import last_number_in_tag

    torch.manual_seed(seed)
    rng = random.Random(seed)
    text = Path(template).read_text(encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    problems = make_problems(num=4096, seed=seed + 7, max_operand=9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        pairs = []
        for row in (rng.choice(problems) for _ in range(batch_size)):
            answer = answer_of(row, rng)
            pairs.append(judge_example(tokenizer, text, row, answer, working_of(answer, rng)))
        loss = _supervised_step(model, optimizer, [p[0] for p in pairs], [p[1] for p in pairs], pad_id=tokenizer.pad_token_id)
        if step % 100 == 0 or step == steps - 1:
            print(f"judge step {step}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    right, held_out, check_rng = 0, make_problems(num=64, seed=seed + 99, max_operand=9), random.Random(seed + 99)
    with torch.no_grad():
        for row in held_out:
            answer = answer_of(row, check_rng)
            ids, labels = judge_example(tokenizer, text, row, answer, working_of(answer, check_rng))
            prompt = ids[:next(i for i, x in enumerate(labels) if x != -100)]
            out_ids = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)[0, len(prompt):]
            right += last_number_in_tag(tokenizer.decode(out_ids, skip_special_tokens=True)) == preferred(answer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out, right / len(held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", required=True, help="the tiny policy's folder (data_prep/tiny_model.py)")
    parser.add_argument("--out", required=True, help="folder to write the reward model to")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge", action="store_true", help="build the generative judge instead (needs --template)")
    parser.add_argument("--template", default=None, help="the judge's prompt template (judge.prompt_template)")
    args = parser.parse_args()
    if args.judge:
        path, accuracy = make_tiny_judge(args.policy, args.out, template=args.template, steps=args.steps, seed=args.seed)
        print(f"wrote tiny judge to {path} (held-out accuracy {accuracy:.3f})")
    else:
        path, accuracy = make_tiny_reward_model(args.policy, args.out, steps=args.steps, seed=args.seed)
        print(f"wrote tiny reward model to {path} (held-out accuracy {accuracy:.3f})")


if __name__ == "__main__":
    main()
