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


def example(tokenizer, row: dict, answer: int) -> list[int]:
    """The token ids the policy's rollout of `row` answering `answer` has: chat prompt + response + eos."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["question"] + " " + GSM8K_INSTRUCTION}],
                                           add_generation_prompt=True, tokenize=False)
    text = prompt + render_answer(row["a"], row["op"], row["b"], answer) + tokenizer.eos_token
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def labelled(tokenizer, rows: list[dict], rng: random.Random) -> tuple[list[list[int]], list[float]]:
    """One example per row: right (label 1) or off by 1-3 (label 0), half each."""
    ids, labels = [], []
    for row in rows:
        right = rng.random() < 0.5
        answer = row["result"] if right else row["result"] + rng.choice([-3, -2, -1, 1, 2, 3])
        ids.append(example(tokenizer, row, answer))
        labels.append(1.0 if right else 0.0)
    return ids, labels


def scores(model, ids: list[list[int]], *, pad_id: int) -> torch.Tensor:
    """The head's output at each row's last token ([b]), right-padded rows (as the trainer reads a reward model)."""
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in ids])  # [b, T]
    mask = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()  # [b, T]
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [b, T, H]
    per_token = model.score(hidden)[..., 0]  # [b, T]
    return per_token[torch.arange(len(ids)), torch.tensor([len(x) - 1 for x in ids])]  # [b]


def make_tiny_reward_model(policy: str | Path, out: str | Path, *, steps: int = 400, batch_size: int = 64,
                           lr: float = 3e-3, seed: int = 0) -> tuple[Path, float]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", required=True, help="the tiny policy's folder (data_prep/tiny_model.py)")
    parser.add_argument("--out", required=True, help="folder to write the reward model to")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path, accuracy = make_tiny_reward_model(args.policy, args.out, steps=args.steps, seed=args.seed)
    print(f"wrote tiny reward model to {path} (held-out accuracy {accuracy:.3f})")


if __name__ == "__main__":
    main()
