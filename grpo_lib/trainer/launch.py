"""The command line around the trainer (train_grpo.py's `main`): the checks that need no model (config, the engine's
settings against the installed library, the model and run folders: exit 2 in about a second), `--print-plan`, the
process group, the run lock agreed by every process, the resume plan and the checkpoint's files checked, then the
trainer's set-up and its run; returns the exit code. The trainer itself is train_grpo.py's `GRPOTrainer`, handed in.

    exit_code = launch.main(sys.argv[1:], trainer_class=GRPOTrainer, usage=__doc__)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpo_lib.config import ConfigError, load_config
from grpo_lib.config.checks import environment_problems, multi_turn_warnings, partial_rollout_warnings


class SetupError(RuntimeError):
    """A model folder or reward function that cannot be loaded (reported with exit code 2, before the engine starts)."""


def main(argv: list[str], *, trainer_class, usage: str) -> int:
    """The command line: checks that need no model (exit 2), then the run of a `trainer_class(cfg, world_size=,
    rank=, resume=)` (setup / train / close); returns the exit code. `usage` is printed for -h / --help."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    if "--print-plan" in argv:
        from grpo_lib.planning.plan import print_plan

        if "--measure" in argv:  # the training phase measured on fake tensors (imports torch, transformers)
            from grpo_lib.planning.measure import measure_lines

            return print_plan(argv, measure=measure_lines)
        return print_plan(argv)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(argv[0], argv[1:], world_size=world_size)
        from grpo_lib.rollout.engines import settings_problems  # the engine's settings against the installed library

        if problems := environment_problems(cfg) + settings_problems(cfg):
            raise ConfigError(problems)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from grpo_lib.core.preflight import check_model_folder, check_run_folder  # before anything heavy

    folder_problems = check_model_folder(cfg.model.path) + check_run_folder(cfg)  # weights complete; writable, room
    for key, path, on in (("reward_model.model.path", cfg.reward_model.model.path, cfg.reward_model.enable),
                          ("judge.model_path", cfg.judge.model_path, cfg.judge.enable)):
        folder_problems += check_model_folder(path, key) if on and path else []  # the models beside the policy too
    if folder_problems:
        print("error: " + "\n".join(folder_problems), file=sys.stderr)
        return 2
    from grpo_lib.core.stopping import launcher_timeout_warning

    if rank == 0 and (warning := launcher_timeout_warning()):  # accelerate launch would kill us before a stop saves
        print(warning, file=sys.stderr, flush=True)
    if rank == 0:
        for warning in multi_turn_warnings(cfg) + partial_rollout_warnings(cfg):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    if cfg.ignored and rank == 0:  # once, at start
        print("ignored verl keys (performance only, same math):\n" + "\n".join(f"  {k}: {why}" for k, why in cfg.ignored.items()),
              flush=True)

    from grpo_lib.core.perf import capture_torch_threads, tune_allocator

    if cfg.trainer.tune_allocator:  # before the model and engine load: what start-up frees goes back to the OS
        tune_allocator(loading=True)
    capture_torch_threads()  # before the engine drops torch to 1 thread: the actor's passes get these back
    from grpo_lib.core.distributed import gpu_visibility_problem, init_distributed

    if problem := gpu_visibility_problem():  # no GPU for this process: exit 2, not a crash or a silent CPU run
        print(f"error: {problem}", file=sys.stderr)
        return 2
    bridge = None
    if cfg.rollout.n_gpus_per_node > 0:  # one-step-off: the last processes run the engine (grpo_lib/trainer/split.py)
        from grpo_lib.core.bridge import init_split

        role, bridge = init_split(cfg.rollout.n_gpus_per_node)
        world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # the role's own group from here on
        if role == "engine":
            from grpo_lib.core.bridge import BridgeError
            from grpo_lib.trainer.split import engine_main

            try:
                return engine_main(cfg, bridge, world_size=world_size, rank=rank)
            except BridgeError as exc:  # the trainer is gone: the engine goes with it
                print(f"error: engine process {rank}: {exc}", file=sys.stderr)
                return 3
    else:
        init_distributed()
    try:
        return held_run(cfg, rank=rank, world_size=world_size, trainer_class=trainer_class, bridge=bridge)
    finally:  # every way out: the engine processes of a split run stop with the trainer
        if bridge is not None and not bridge.stopped:
            from grpo_lib.core.bridge import BridgeError

            try:
                bridge.send(("stop",))
            except BridgeError:  # gone already
                pass


def held_run(cfg, *, rank: int, world_size: int, trainer_class, bridge=None) -> int:
    """The run lock, the resume plan, then the run (`run_in_held_folder`); returns the exit code."""
    from grpo_lib.checkpoints import checkpoint
    from grpo_lib.checkpoints.lock import take_agreed_run_lock
    from grpo_lib.core.distributed import broadcast_object

    # one run at a time per folder: process 0 holds the lock for the run, every process agrees (all go on, or all exit 2)
    lock, refusal = take_agreed_run_lock(Path(cfg.trainer.default_local_dir), rank=rank, agree=broadcast_object)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        try:  # a folder holding another run, or a resume that would delete newer checkpoints: exit 2 now (read only)
            resume = checkpoint.plan_resume(cfg)
        except checkpoint.ResumeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return run_in_held_folder(cfg, resume, rank=rank, world_size=world_size, trainer_class=trainer_class, bridge=bridge)
    finally:  # every way out of the run; a kill leaves a stale lock that the next start takes over
        if lock is not None:
            lock.release()


def run_in_held_folder(cfg, resume, *, rank: int, world_size: int, trainer_class, bridge=None) -> int:
    """The run, once process 0 holds the run folder's lock: the folder is one for every process, the checkpoint's files
    are checked (a damaged one set aside), then set-up and training; returns the exit code."""
    from grpo_lib.checkpoints import checkpoint
    from grpo_lib.core.distributed import barrier
    from grpo_lib.core.perf import tune_allocator
    from grpo_lib.core.preflight import run_folder_not_shared
    from grpo_lib.rollout.data import DataError

    if problem := run_folder_not_shared(Path(cfg.trainer.default_local_dir), rank=rank, world_size=world_size):  # 2+ machines
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:  # every file of the checkpoint, on every process (a share each); a damaged one falls back (auto) or exits 2
        resume = checkpoint.verify_resume(cfg, resume, rank=rank, world_size=world_size)
    except checkpoint.ResumeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        checkpoint.prepare_run_folder(cfg, resume)
    barrier()
    trainer = trainer_class(cfg, world_size=world_size, rank=rank, resume=resume)
    trainer.bridge = bridge  # split roles: trainer process 0's line to the engine processes (None elsewhere)
    from grpo_lib.core.metrics import MetricWriteError

    try:
        try:
            trainer.setup()
        except (DataError, SetupError) as exc:  # bad data, model path or reward: a message naming it, not a traceback
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if cfg.trainer.tune_allocator:  # after set-up: freed activations stay in the heap for the CPU update
            import torch

            tune_allocator(on_gpu=torch.cuda.is_available())  # the device setup() chose
        return trainer.train()
    except MetricWriteError as exc:  # a full disk while setting up (the metric files open there)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        trainer.close()
