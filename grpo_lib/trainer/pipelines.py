"""The step's rollouts beyond the synchronous round, behind one interface for `GRPOTrainer` (train_grpo.py): carry-over on
the same GPUs (`CarryOver`, over grpo_lib/rollout/carry.py's pool) or one-step-off on split processes
(grpo_lib/trainer/split.py's `OneStepOff`). Each answers the same calls, so the trainer asks `parts.pipeline` and
never which one it is:

    collect          None: the step's rollouts come from rounds.collect_rollouts (over `pool`); else a call that
                     returns them (batch, metrics)
    pool             the carry-over pool rounds.collect_rollouts draws from (None for one-step-off)
    before_push()    metrics of what comes first in the push phase (one-step-off: the next batch received)
    proves_every_push  the weight probe is scored after every push (no generate call carries it)
    step_done()      the step's batch is trained: an abort after this gives nothing back
    abort(sampler_before) -> (state, sampler)  a checkpoint of the step before an aborted one loses nothing of it
    sampler_to_save(sampler)  the sampler position a checkpoint holds beside `state()` (a draw whose batch never came
                     is drawn again)
    state()          the JSON a checkpoint holds (global_step_N/carry/)
    close()          every way out of the run

`build` makes the run's pipeline (None without either) and restores it from the checkpoint being resumed.
"""

from __future__ import annotations

import sys

from grpo_lib.rollout.carry import CarryPool
from grpo_lib.trainer.launch import SetupError
from grpo_lib.trainer.split import OneStepOff


class CarryOver:
    """rollout.partial_rollout through the trainer: the pool, its checkpoint state and the undo of an aborted step."""

    collect = None  # the rounds draw from `pool`
    proves_every_push = False  # the step's first generate call carries the probe

    def __init__(self, pool: CarryPool):
        self.pool = pool

    def before_push(self) -> dict[str, float]:
        return {}

    def step_done(self) -> None:
        self.pool.step_done()

    def abort(self, sampler_before: dict) -> tuple[dict, dict]:
        """The step undone (its draw, its round's tokens, maybe of unproven weights, its take): the pool and
        `sampler_before` as they were; the resume replays the step with the same seeds."""
        self.pool.undo_step()
        return self.pool.state_dict(), sampler_before

    def sampler_to_save(self, sampler) -> dict:
        return sampler.state_dict()

    def state(self) -> dict:
        return self.pool.state_dict()

    def close(self) -> None:
        pass

    def load(self, path, *, rank: int) -> None:
        """The carried responses of the checkpoint `path`; one without them (saved with carry-over off, or a one-step-off
        batch) leaves the pool to fill afresh. Saved on another layout: SetupError (exit 2) on every process (a process
        past the saved count reads process 0's file, which names the layout)."""
        from grpo_lib.checkpoints.checkpoint import read_carry_state

        state = read_carry_state(path, rank)
        if state is None and (path / "carry").is_dir():
            state = read_carry_state(path, 0)
        if state is not None and state.get("split"):
            if rank == 0:
                print(f"note: {path / 'carry'} holds a one-step-off batch, not carried responses: the pool starts empty "
                      "(that batch's prompts are skipped)", file=sys.stderr)
            return
        if state is not None:
            try:
                self.pool.load_state_dict(state, where=str(path / "carry"))
            except ValueError as error:
                raise SetupError(str(error)) from error


def build(cfg, engine, dataset, sampler, *, tokenizer, world_size: int, rank: int, total_steps: int,
          resume) -> CarryOver | OneStepOff | None:
    """The run's pipeline, restored from `resume.path`'s checkpoint when there is one; one-step-off asks the engine for
    the first batch now (call it after the set-up push: the engine serves the resumed weights)."""
    from grpo_lib.checkpoints.checkpoint import read_carry_state

    if cfg.rollout.partial_rollout.enable:
        pool = CarryPool(cfg, world_size=world_size, rank=rank,
                         decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        pipeline = CarryOver(pool)
        if resume.path is not None:
            pipeline.load(resume.path, rank=rank)
        return pipeline
    if cfg.rollout.n_gpus_per_node > 0:
        pipeline = OneStepOff(cfg, engine, dataset, sampler, world_size=world_size, rank=rank, total_steps=total_steps)
        saved = read_carry_state(resume.path, 0) if resume.path is not None else None
        pipeline.start(resume.step, saved if saved and saved.get("split") else None)
        return pipeline
    return None


def engine_for(cfg, *, bridge, tokenizer, on_cpu: bool, world_size: int, rank: int):
    """The run's engine: built in this process, or with split roles the engine processes seen from the trainer
    (`split.RemoteEngine`; the trainer's own shares then take no tensor parallelism)."""
    if cfg.rollout.n_gpus_per_node > 0:
        from grpo_lib.trainer.split import RemoteEngine

        cfg.rollout.tensor_model_parallel_size = 1  # the engine's TP is its own
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        return RemoteEngine(cfg, bridge, pad_id=pad_id, world_size=world_size, rank=rank)
    from grpo_lib.rollout.engines import build_engine

    return build_engine(cfg, on_cpu=on_cpu, world_size=world_size)
