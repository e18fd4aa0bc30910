"""Sample seeds and tensor-parallel prompt shares: who generates what, independent of the topology.

Tensor parallelism (`rollout.tensor_model_parallel_size` = t): processes g*t .. g*t+t-1 form one engine whose
layers all-reduce, so they must submit identical requests. Process r trains on the strided share of the round's
global prompts (positions r, r + W, r + 2W, ...); a TP group submits the union of its members' shares (every
member computes it without communication, `tp_group_share`) and each member keeps its own part.

Seeds (`sample_seed`): one per sample, derived from (trainer.seed, purpose, step, round, prompt position in the
round's global batch, sample index), so no two samples of a run share a seed and neither the process count nor
the TP size changes what is generated. vLLM seeds the n children of a request seed, seed + 1, ...: the seed of
sample k of a prompt is exactly the prompt's seed + k, so one request with n children is used; the hf engine follows
the same rule, and so does the vLLM engine where it submits one request per sample (n=1, seed + k: vLLM's own child
requests) to hear of each response as it finishes (`generate(on_finished=...)`).

Multi-turn episodes (`turn_seed`): turn t of a sample is one request of its own (n=1), seeded from the sample's seed
and t only, so it neither depends on the topology nor on which other samples are still running; turn 0 uses the
sample's seed itself, so an episode's first turn is exactly the single-turn response of that sample.
"""

from __future__ import annotations

import hashlib

SEED_PURPOSES = {"train": 0, "val": 1, "greedy": 2}  # greedy: remax's baseline responses (seeds unused by greedy decoding)
_STEP_BITS, _ROUND_BITS, _SAMPLE_BITS = 21, 10, 28  # 2M steps, 1024 rounds, 268M samples per round
_SEED_MODULUS = 2**62


def sample_seed(trainer_seed: int, *, purpose: str, step: int, round: int, prompt_index: int, n: int) -> int:
    """Seed of sample 0 of one prompt; sample k's seed is this + k (vLLM's rule for the n children of a request).

    The counter (purpose, step, round, prompt_index * n + k) is packed into disjoint bit fields, so it is unique
    per sample within a run; adding a key derived from trainer.seed (mod 2**62, a bijection) keeps it unique and
    makes runs with different seeds differ. Example: sample_seed(1, purpose="train", step=1, round=1,
    prompt_index=3, n=4) and the same prompt's sample 1 is that + 1; prompt 4's sample 0 is that + 4.
    """
    assert 0 <= step < 2**_STEP_BITS and 0 <= round < 2**_ROUND_BITS, f"step {step} / round {round} outside the seed layout"
    assert 0 <= (prompt_index + 1) * n <= 2**_SAMPLE_BITS, f"prompt {prompt_index} x n={n} outside the seed layout"
    counter = ((SEED_PURPOSES[purpose] << _STEP_BITS | step) << _ROUND_BITS | round) << _SAMPLE_BITS | prompt_index * n
    key = int.from_bytes(hashlib.blake2b(str(trainer_seed).encode(), digest_size=8).digest(), "little")
    return (key + counter) % _SEED_MODULUS


def turn_seed(sample_seed: int, turn: int) -> int:
    """Seed of turn `turn` (0-based) of the episode whose sample seed is `sample_seed`.

    Turn 0 is the sample seed (the first turn is the single-turn sample); a later turn hashes (sample seed, turn) into
    [0, 2**62), so its seed is fixed by the sample and the turn alone. A hashed seed equals another seed of the run only
    by a 2**-62 chance per pair (the sample seeds themselves are unique by construction). Example: turn_seed(s, 0) == s;
    turn_seed(s, 1) != turn_seed(s + 1, 1).
    """
    assert turn >= 0, f"turn {turn} < 0"
    if turn == 0:
        return sample_seed
    digest = hashlib.blake2b(f"{sample_seed}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_MODULUS


def carry_seed(sample_seed: int, request: int) -> int:
    """Seed of request `request` (>= 1) of a carried response (grpo_lib/rollout/carry.py: resumed, or started again
    after a staleness drop) whose first request used `sample_seed`: fixed by the sample and the request count alone,
    hashed into [0, 2**62) apart from the turn seeds. Example: carry_seed(s, 1) != carry_seed(s, 2) != turn_seed(s, 1)."""
    assert request >= 1, f"request {request} < 1: the first request uses the sample seed itself"
    digest = hashlib.blake2b(f"{sample_seed}:carry:{request}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_MODULUS


def tp_group_share(num_prompts: int, *, world_size: int, rank: int, tp_size: int) -> tuple[list[int], list[int]]:
    """(positions the TP group of `rank` submits, indices into that list this rank keeps).

    Process r trains on positions r, r + W, ... of the global batch; the group (ranks g*t .. g*t+t-1) submits the
    sorted union of its members' shares. Example: 8 prompts, W=4, t=2, rank 1: the group {0, 1} submits
    [0, 1, 4, 5]; rank 1 keeps indices [1, 3] (positions 1 and 5), rank 0 keeps [0, 2].
    """
    first = rank // tp_size * tp_size
    members = range(first, first + tp_size)
    submit = [i for i in range(num_prompts) if i % world_size in members]
    keep = [j for j, i in enumerate(submit) if i % world_size == rank]
    return submit, keep
