"""train_grpo.py with faults injected, for the kill / resume / full-disk / NaN / stale-weights tests (tests/checkpoints/test_checkpoint.py, tests/train/test_trust.py):

    python tests/scripts/train_with_faults.py [--signal "SIGNAL POINT STEP [RANK]"] [--nan-steps 2,4,5] [--push-skips NAME] -- RECIPE.yaml [key=value ...]

also as the script of `accelerate launch` (every process installs the same faults). The faults are monkeypatches on
grpo_lib functions, installed before `train_grpo.main(argv)` runs exactly as `python train_grpo.py` runs it (then
`close_distributed()` and its exit code); the product code reads no test setting.

- `--signal "SIGNAL POINT STEP [RANK]"`: send SIGNAL (KILL, TERM, INT) to this process, or raise the OSError of a
  full disk (ENOSPC), when the run reaches POINT of step STEP, on every process or only on process RANK. Points:
  `update`: right after the actor update of that step (`Actor.update` returned; its metrics are not logged yet);
  `save`: in the middle of that step's checkpoint (`checkpoint.save`), right after DCP wrote the sharded weights and
  optimizer: the RNG files, trainer_state.json and COMPLETE are not written. Example: `--signal "KILL save 4"`.
  `generate`: at the start of the engine's STEP-th generate call (split roles: the engine process's step STEP).
  `metrics`, `tensorboard`, `generations`: inside the write of that sink while the metric logger writes step STEP
  (metrics.jsonl's line; TensorBoard's event record, in its writer thread, which the next flush re-raises;
  val_generations.jsonl's rows). Only process 0 writes them. Example: `--signal "ENOSPC metrics 3 0"`.
- `--nan-steps 2,4,5`: the actor's loss is multiplied by NaN on those steps (counted by `Actor.steps_done + 1`), so
  their updates must be skipped.
- `--push-skips NAME`: every weight push leaves out the parameter NAME (`Actor.named_weights` without it; the HF export
  and the checkpoint keep it): the engine serves a stale copy of it, the bug the weight probe must catch.

In-process tests install the same faults with pytest's monkeypatch, e.g.
`nan_loss_on_steps({2}, setattr=monkeypatch.setattr)`, which undoes them after the test.
Reward workers import this file as `__mp_main__` (grpo_lib/rewards/pool.py): its top level stays imports only.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def fault_action(name: str) -> Callable[[str, int], None]:
    """What a `--signal` fault does at (point, step): a real signal to this process, or ENOSPC raised there."""
    def act(point: str, step: int) -> None:
        if name == "ENOSPC":  # a full disk: the write fails with the error a full disk gives
            print(f"test hook: ENOSPC at {point} of step {step}", file=sys.stderr, flush=True)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "test hook")
        print(f"test hook: SIG{name} at {point} of step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    return act


def fault_after_update(at_step: int, action: Callable[[str, int], None], *, setattr=setattr) -> None:
    """`action("update", at_step)` right after the actor update of step `at_step`: the `at_step`-th `Actor.update`
    call of the run (`steps_done`, which a resumed actor restores from its checkpoint)."""
    from grpo_lib.model.actor import Actor

    update = Actor.update

    @functools.wraps(update)
    def update_then_fault(self, *args, **kwargs):
        metrics = update(self, *args, **kwargs)
        if self.steps_done == at_step:
            action("update", at_step)
        return metrics

    setattr(Actor, "update", update_then_fault)


def fault_in_save(at_step: int, action: Callable[[str, int], None], *, setattr=setattr) -> None:
    """`action("save", at_step)` inside the checkpoint of step `at_step`, right after `dcp.save` wrote this process's
    shard of the weights and optimizer state (checkpoint.save's first stage of local writes)."""
    import torch.distributed.checkpoint as dcp

    from grpo_lib.checkpoints import checkpoint

    save, dcp_save = checkpoint.save, dcp.save
    saving: list[int] = []  # the step of the checkpoint being written, while checkpoint.save runs

    @functools.wraps(save)
    def save_noting_step(cfg, *, step: int, **kwargs):
        saving[:] = [step]
        try:
            return save(cfg, step=step, **kwargs)
        finally:
            saving.clear()

    @functools.wraps(dcp_save)
    def dcp_save_then_fault(*args, **kwargs):
        result = dcp_save(*args, **kwargs)
        if saving == [at_step]:
            action("save", at_step)
        return result

    setattr(checkpoint, "save", save_noting_step)
    setattr(dcp, "save", dcp_save_then_fault)


class _FailingFile:
    """A file object whose writes run `action` (the fault) and otherwise pass through to `inner`."""

    def __init__(self, inner, action: Callable[[], None]):
        self.inner, self.action = inner, action

    def write(self, *args):
        self.action()
        return self.inner.write(*args)

    def writelines(self, *args):
        self.action()
        return self.inner.writelines(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.inner.close()


def fault_in_metrics(sink: str, at_step: int, action: Callable[[str, int], None], *, setattr=setattr) -> None:
    """`action(sink, at_step)` inside the write of one metric sink while `MetricLogger` writes step `at_step`:
    `metrics` (metrics.jsonl's line), `tensorboard` (the event file's record, written by TensorBoard's writer thread:
    its error surfaces at the logger's flush, as a full disk's does) or `generations` (val_generations.jsonl)."""
    from tensorboard.summary.writer import record_writer

    from grpo_lib.core import metrics

    log, log_generations, record_write = metrics.MetricLogger.log, metrics.MetricLogger.log_generations, record_writer.RecordWriter.write
    writing: list[int] = []  # the step being written, while the logger writes it

    @functools.wraps(log)
    def log_with_fault(self, step, values):
        writing[:] = [step]
        jsonl = self.jsonl
        if sink == "metrics" and step == at_step and jsonl is not None:
            self.jsonl = _FailingFile(jsonl, lambda: action(sink, step))
        try:
            return log(self, step, values)
        finally:
            self.jsonl = jsonl
            writing.clear()

    @functools.wraps(log_generations)
    def log_generations_with_fault(self, step, rows):
        if sink != "generations" or step != at_step:
            return log_generations(self, step, rows)
        vars(metrics)["open"] = lambda *a, **k: _FailingFile(open(*a, **k), lambda: action(sink, step))  # shadows the builtin
        try:
            return log_generations(self, step, rows)
        finally:
            del vars(metrics)["open"]  # the builtin again

    @functools.wraps(record_write)
    def record_write_with_fault(self, data):
        if sink == "tensorboard" and writing == [at_step]:
            action(sink, at_step)
        return record_write(self, data)

    setattr(metrics.MetricLogger, "log", log_with_fault)
    setattr(metrics.MetricLogger, "log_generations", log_generations_with_fault)
    setattr(record_writer.RecordWriter, "write", record_write_with_fault)


def nan_loss_on_steps(steps: set[int], *, setattr=setattr) -> None:
    """Every micro-batch loss of the steps in `steps` (1-based, `Actor.steps_done + 1`) times NaN, its metrics as computed."""
    from grpo_lib.model.actor import Actor

    micro_batch_loss = Actor.micro_batch_loss

    @functools.wraps(micro_batch_loss)
    def corrupted(self, *args, **kwargs):
        loss, *rest = micro_batch_loss(self, *args, **kwargs)
        if self.steps_done + 1 in steps:
            loss = loss * float("nan")
        return (loss, *rest)

    setattr(Actor, "micro_batch_loss", corrupted)


def push_skips(name: str, *, setattr=setattr) -> None:
    """Every push (`Actor.named_weights`, which only the push reads) without the parameter `name`."""
    from grpo_lib.model.actor import Actor

    named_weights = Actor.named_weights

    @functools.wraps(named_weights)
    def without(self):
        found = False
        for weight_name, tensor in named_weights(self):
            if weight_name == name:
                found = True
                continue
            yield weight_name, tensor
        assert found, f"--push-skips {name}: the push has no such parameter"

    setattr(Actor, "named_weights", without)


def fault_in_generate(at_call: int, action: Callable[[str, int], None], *, setattr=setattr) -> None:
    """`action("generate", at_call)` at the start of the engine's `at_call`-th generate call (1-based) in this process:
    with split roles (rollout.n_gpus_per_node) the engine process's generation of step `at_call` when validation is off."""
    from grpo_lib.rollout import engines

    build = engines.build_engine

    @functools.wraps(build)
    def build_then_fault(*args, **kwargs):
        engine = build(*args, **kwargs)
        generate, calls = engine.generate, []

        def generate_with_fault(*a, **k):
            calls.append(1)
            if len(calls) == at_call:
                action("generate", at_call)
            return generate(*a, **k)

        engine.generate = generate_with_fault
        return engine

    setattr(engines, "build_engine", build_then_fault)


POINTS = {"update": fault_after_update, "save": fault_in_save, "generate": fault_in_generate,
          **{sink: functools.partial(fault_in_metrics, sink) for sink in ("metrics", "tensorboard", "generations")}}


def install(argv: list[str]) -> list[str]:
    """Install the faults named before `--` in `argv`; return the arguments after it (train_grpo's)."""
    assert "--" in argv, f"usage: {Path(__file__).name} [--signal SPEC] [--nan-steps LIST] -- RECIPE.yaml [key=value ...]; got {argv}"
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog=Path(__file__).name)
    parser.add_argument("--signal", help='"SIGNAL POINT STEP [RANK]": SIGNAL in KILL, TERM, INT, ENOSPC; POINT in update, save, generate, metrics, tensorboard, generations')
    parser.add_argument("--nan-steps", default="", help="comma-separated steps whose loss is NaN")
    parser.add_argument("--push-skips", default=None, help="a parameter name every weight push leaves out")
    args = parser.parse_args(argv[:split])
    if args.signal:
        name, point, step, *only_rank = args.signal.split()
        assert point in POINTS, f"--signal {args.signal!r}: point {point!r} is not one of {sorted(POINTS)}"
        if not only_rank or int(only_rank[0]) == int(os.environ.get("RANK", "0")):
            POINTS[point](int(step), fault_action(name))
    if steps := {int(s) for s in args.nan_steps.split(",") if s.strip()}:
        nan_loss_on_steps(steps)
    if args.push_skips:
        push_skips(args.push_skips)
    return argv[split + 1:]


if __name__ == "__main__":
    import train_grpo  # first, as `python train_grpo.py` does: it sets the environment defaults before vllm loads

    train_argv = install(sys.argv[1:])
    code = train_grpo.main(train_argv)
    if "grpo_lib.core.distributed" in sys.modules:  # as train_grpo's __main__ block: every process leaves the group
        from grpo_lib.core.distributed import close_distributed

        close_distributed()
    sys.exit(code)
