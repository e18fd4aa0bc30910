"""GRPO training, top to bottom: `python train_grpo.py RECIPE.yaml [key=value ...]`.

Also `accelerate launch train_grpo.py RECIPE.yaml ...`. Each process owns its share of the prompts, one
colocated engine (vLLM or hf) and the actor. `GRPOTrainer` below owns the run (setup -> step -> validate -> save
-> close, as torchtune's recipe classes do); `GRPOTrainer.step` holds the step order of docs/DESIGN.md:

    prompts -> generate (rollout.n per prompt) -> reward -> weight probe -> engine sleeps -> reference logprobs (if KL)
    -> teacher logprobs (if distillation) -> old logprobs (if several updates) -> advantages (group-relative) -> update (mini/micro-batches)
    -> push weights to the engine (it wakes with them) -> log / validate / checkpoint / stop?

Config problems, and a run folder that holds another run (or is in use by one: the run lock), exit with code 2 before
anything heavy loads.
A run resumes from its newest complete checkpoint whose files all check out (trainer.resume_mode=auto; a damaged one
is reported and skipped before the engine starts). SIGTERM / SIGINT finish the step, save and exit 0
(grpo_lib/checkpoints/checkpoint.py, grpo_lib/core/stopping.py).
`--print-plan` prints the batch arithmetic, the resolved defaults and a memory plan per GPU without loading a
model (grpo_lib/planning/plan.py; flags --num-processes N, --gpu-memory-gb G, --model-config FILE). It exits 0 when every part
of the plan was computed and it fits, 2 on a config or flag problem, 4 when the peak per GPU does not fit in
--gpu-memory-gb, 5 when the plan has no memory part (no config.json of the model reachable: pass --model-config FILE),
so a script can gate on it.
Exit codes: 0 done (or stopped cleanly); 2 a config, data, model or run-folder problem, found before anything heavy
loads (or, multi-turn, a chat template that cannot extend an episode mid-run); 3 the run stopped because its results
could not be trusted (rewards failing, a tool failing on every call of a step, the engine not serving the actor's
weights, found before the step's update (trainer.weight_probe), see `GRPOTrainer.stop_run`; or trainer.max_bad_steps consecutive
non-finite updates), or could not be written (a full disk under the metrics or a checkpoint).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # vLLM's own environment: grpo_lib/rollout/engines/vllm_settings.py

from grpo_lib.config.checks import needs_old_logprobs  # noqa: E402  (light imports first: config errors exit fast)
from grpo_lib.trainer import launch  # noqa: E402
from grpo_lib.trainer.launch import SetupError  # noqa: E402

if TYPE_CHECKING:  # the run parts' types: heavy imports (torch, transformers, vLLM's engine), for readers and checkers only
    import torch
    from transformers import PreTrainedTokenizerBase

    from grpo_lib.checkpoints.checkpoint import ResumePlan
    from grpo_lib.config import Config
    from grpo_lib.core.metrics import MetricLogger
    from grpo_lib.model.actor import Actor
    from grpo_lib.model.reference import AdapterDisabledReference, Reference
    from grpo_lib.model.teacher import Teacher
    from grpo_lib.rewards.scorer import RewardScorer
    from grpo_lib.rollout.data import PromptDataset, PromptSampler
    from grpo_lib.rollout.engines.base import RolloutEngine
    from grpo_lib.rollout.episodes import EpisodeRunner
    from grpo_lib.rollout.weight_sync import WeightSync
    from grpo_lib.trainer.pipelines import CarryOver
    from grpo_lib.trainer.split import OneStepOff


@contextmanager
def timed(timings: dict, name: str):
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


@dataclass
class RunParts:
    """What a set-up run is made of (built once by `GRPOTrainer.setup`)."""

    tokenizer: PreTrainedTokenizerBase  # of model.path
    train: PromptDataset
    val: PromptDataset | None  # None: no data.val_files
    sampler: PromptSampler  # over `train` (resumable)
    total_steps: int
    engine: RolloutEngine  # ready (weights + cache on the device) after setup
    actor: Actor
    reference: Reference | AdapterDisabledReference | None  # a frozen copy (LoRA: the actor, adapters off); None: no KL
    scorer: RewardScorer
    logger: MetricLogger
    device: torch.device
    sync: WeightSync  # the engine's weights pushed with a version and proven (the weight probe: trainer.weight_probe)
    episodes: EpisodeRunner | None = None  # with rollout.multi_turn.enable
    teacher: Teacher | None = None  # with distillation.enabled
    # rollout.partial_rollout: responses in flight across steps; rollout.n_gpus_per_node: the engine a step ahead on its
    # own processes (grpo_lib/trainer/pipelines.py); None: the synchronous round
    pipeline: CarryOver | OneStepOff | None = None


class GRPOTrainer:
    """One run on this process: `setup()` builds the parts (and loads the checkpoint to resume), `train()` runs the
    steps and returns the exit code, `close()` stops the reward workers and flushes the metrics."""

    def __init__(self, cfg: Config, *, world_size: int, rank: int, resume: ResumePlan):
        self.cfg, self.world_size, self.rank, self.resume = cfg, world_size, rank, resume
        self.parts: RunParts | None = None
        self.bridge = None  # split roles (rollout.n_gpus_per_node): process 0's line to the engine processes (launch sets it)
        self.updated = False  # the current step's update ran (run_steps: an abort after it saves the step)

    # -- setup ----------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Tokenizer, tools (multi-turn), data, reward scorer (before the engine: a bad reward file or tool config fails in
        seconds), engine, actor, reference, metric logger; then the checkpoint of `resume`, loaded while the engine is released
        (its device memory free for the AdamW state), and the engine woken with the resumed weights. Raises DataError / SetupError for exit code 2."""
        import torch
        from transformers import AutoTokenizer

        from grpo_lib.checkpoints import checkpoint
        from grpo_lib.core import dtypes
        from grpo_lib.core.metrics import MetricLogger
        from grpo_lib.core.perf import freeze_static_heap
        from grpo_lib.model.actor import Actor
        from grpo_lib.model.lora import check_lora_setup
        from grpo_lib.model.reference import make_reference
        from grpo_lib.planning.memory import auto_budget_notes
        from grpo_lib.rewards import RewardScorer, registered_sources
        from grpo_lib.rollout.data import PromptSampler, load_prompts
        from grpo_lib.rollout.episodes import EpisodeRunner, TemplateError
        from grpo_lib.rollout.weight_probe import WeightProbe
        from grpo_lib.rollout.weight_sync import WeightSync
        from grpo_lib.tools.config import ToolConfigError
        from grpo_lib.trainer import pipelines, scorers

        import copy

        # The trainer's own copy of the config: `auto` token budgets need this device's size and are resolved into it
        # below; the config handed in stays as load_config resolved it (nothing writes to it after that).
        self.cfg = cfg = copy.deepcopy(self.cfg)
        rank = self.rank
        torch.manual_seed(cfg.trainer.seed)
        device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise SetupError(f"model.path={cfg.model.path!r}: cannot load a tokenizer from it ({exc}); "
                             "point it at a Hugging Face model folder or hub name") from exc
        try:  # the episode loop and its tools: None unless rollout.multi_turn.enable
            episodes = EpisodeRunner.from_config(cfg, tokenizer=tokenizer)
        except (ToolConfigError, TemplateError) as exc:
            raise SetupError(f"rollout.multi_turn.enable: {exc}" if isinstance(exc, TemplateError) else str(exc)) from exc
        tools = episodes.toolbox.schemas if episodes is not None else None  # the prompts list them (verl's dataset does)
        if episodes is not None and rank == 0:  # what contains the model's code (the Python tool's sandbox layers)
            episodes.toolbox.record_isolation(cfg.trainer.default_local_dir)
        with ExitStack() as undo:  # a failed setup stops what it started (tool threads, reward workers)
            if episodes is not None:
                undo.callback(episodes.toolbox.close)
            keep = scorers.keeps_messages(cfg)  # the reward model re-renders responses as text, or the judge quotes prompts
            train = load_prompts(cfg.data.train_files, tokenizer, cfg.data, tools=tools, keep_messages=keep)
            val = load_prompts(cfg.data.val_files, tokenizer, cfg.data, tools=tools, keep_messages=keep) if cfg.data.val_files else None
            sampler = PromptSampler(len(train), batch_size=cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
            try:
                scorer = RewardScorer.from_config(cfg)
            except (ValueError, OSError, ImportError, AttributeError) as exc:
                raise SetupError(f"reward setup: {exc}") from exc
            undo.callback(scorer.close)
            if cfg.reward.custom.path is None and scorer.rule_sources is None:  # with a model scorer: it scores those rows
                unknown = sorted(set(train.data_sources + (val.data_sources if val else [])) - set(registered_sources()))
                if unknown:
                    raise SetupError(f"data_source {unknown} in {cfg.data.train_files + cfg.data.val_files} has no built-in reward; "
                                     f"registered: {registered_sources()}. Set reward.custom.path to a verl-style compute_score file")
            lora_problems = check_lora_setup(cfg)  # needs the model's structure (meta build), before the engine
            if lora_problems:
                raise SetupError("; ".join(lora_problems))
            total_steps = cfg.trainer.total_training_steps if cfg.trainer.total_training_steps is not None \
                else cfg.trainer.total_epochs * sampler.batches_per_epoch
            gpu_bytes = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None  # the plan's GPU size
            for note in auto_budget_notes(cfg, world_size=self.world_size, gpu_bytes=gpu_bytes):  # `auto`: the largest that fit
                if rank == 0:
                    print(note, file=sys.stderr)
            # the teacher, the reward model, the judge: their tokenizers and their fit, checked before any load
            if found := scorers.problems(cfg, tokenizer, world_size=self.world_size, gpu_bytes=gpu_bytes):
                raise SetupError("; ".join(found))
            # ready, holding model.path's weights; on CPU its KV cache sized for this run's batch (the engine's own value)
            # (split roles, rollout.n_gpus_per_node: the engine processes, seen from here)
            engine = pipelines.engine_for(cfg, bridge=self.bridge, tokenizer=tokenizer, on_cpu=device.type == "cpu",
                                          world_size=self.world_size, rank=rank)
            actor = Actor(cfg, device=device)
            need_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
            reference = make_reference(actor) if need_ref else None  # a frozen copy; with LoRA the actor with adapters off
            # the distillation teacher; the reward model and the judge join the rule scorer
            teacher = scorers.build(cfg, scorer, device=device, tokenizer=tokenizer, on_cpu=device.type == "cpu")
            probe = WeightProbe(train.prompt_ids[0], dtypes=(dtypes.torch_dtype(cfg.rollout.dtype, device), actor.compute_dtype)) \
                if cfg.trainer.weight_probe else None  # after every push: does the engine serve the actor's weights?
            logger = MetricLogger(sinks=cfg.trainer.logger, log_dir=cfg.trainer.default_local_dir, enabled=rank == 0,
                                  total_steps=total_steps, project_name=cfg.trainer.project_name,
                                  experiment_name=cfg.trainer.experiment_name, resume_step=self.resume.step)
            undo.pop_all()  # set up: the run owns them now (close() stops them)
        self.parts = RunParts(tokenizer=tokenizer, train=train, val=val, sampler=sampler, total_steps=total_steps, engine=engine,
                              actor=actor, reference=reference, scorer=scorer, logger=logger, device=device, episodes=episodes,
                              sync=WeightSync(engine, probe, version=self.resume.step), teacher=teacher)
        if self.resume.step == 0:  # a resumed run's metrics.jsonl has this line already
            logger.log(0, {"data/train_prompts": len(train), "data/filtered_overlong": train.num_filtered,
                           "data/truncated": train.num_truncated,
                           "data/invalid_rows": train.num_invalid + (val.num_invalid if val else 0)})
        freeze_static_heap()  # the run's long-lived objects leave the garbage collector's scans (grpo_lib/core/perf.py)
        # The engine read model.path alone: a resume's weights, or the adapters of model.lora_adapter_path, are pushed
        # to it. A resume loads with the engine asleep: loading creates the AdamW state (and DCP's read buffers) on the
        # device, which next to the engine's share is the run's peak; then the engine wakes with the weights, the
        # order of a step's push.
        push = self.resume.path is not None or cfg.model.lora_adapter_path is not None
        if push:
            engine.release()
        if self.resume.path is not None:
            checkpoint.load(self.resume.path, actor=actor, sampler=sampler, rank=rank)
        self.parts.sync.expect(actor)  # the weights the engine serves from here on: step 1's generation proves it serves them
        actor.offload()  # with param/optimizer offload the actor rests on the host (the loaded AdamW state before a wake)
        if push:  # the resumed step's weights are its version (a fresh run's adapters: version 0, as model.path's)
            self.parts.sync.push(actor, version=self.resume.step)
        self.parts.pipeline = pipelines.build(cfg, engine, train, sampler, tokenizer=tokenizer, world_size=self.world_size,
                                              rank=rank, total_steps=total_steps, resume=self.resume)  # after the push
        if self.resume.path is not None:
            print(f"resumed from {self.resume.path} (step {self.resume.step} of {total_steps})", file=sys.stderr)
            if episodes is not None and rank == 0:  # a tool's state is no part of a checkpoint
                print("note: the resumed episodes match the uninterrupted run's only if the tools keep no state across "
                      "episodes (each episode's state under its instance_id, dropped at release) and answer the same "
                      "call the same way", file=sys.stderr)

    # -- the run --------------------------------------------------------------------------------------

    def train(self) -> int:
        """`run_steps`; a metrics write that fails (a full disk: MetricWriteError, raised on every process alike) saves
        the last completed step if the disk allows and returns exit code 3."""
        from grpo_lib.core.metrics import MetricWriteError

        self.completed = (self.resume.step, self.parts.sampler.state_dict(), False)  # (step, sampler position, mid-step?)
        try:
            return self.run_steps()
        except MetricWriteError as error:
            last_step, sampler_state, mid_step = self.completed
            carry_state, sampler_state = self.aborted_state(sampler_state) if mid_step else (None, sampler_state)
            return self.stop_run(error, last_step=last_step, sampler_state=sampler_state, carry_state=carry_state)

    def run_steps(self) -> int:
        """Validation before training (if asked), then steps resume.step + 1 .. total_steps; returns the exit code.
        Each step is logged; validation and checkpoints follow their frequencies; a stop signal ends the run after the
        step with a checkpoint; trainer.max_bad_steps consecutive non-finite updates end it with exit code 3."""
        from grpo_lib.checkpoints import checkpoint
        from grpo_lib.core.stopping import install_stop_handlers, stop_requested
        from grpo_lib.rollout.weight_probe import mismatch
        from grpo_lib.trainer import step as S

        cfg, p = self.cfg, self.parts
        try:  # a validation that cannot finish (tools that never return: exit 3) saves nothing: no step ran yet
            if cfg.trainer.val_only:  # validate and exit: no step, no checkpoint
                self.validate(self.resume.step)
                return 0
            if cfg.trainer.val_before_train and p.val is not None and self.resume.step == 0:
                self.validate(0)
        except S.RunAborted as error:
            return self.stop_run(error, last_step=self.resume.step, sampler_state=p.sampler.state_dict())
        install_stop_handlers()  # first SIGTERM / SIGINT: finish the step, save, exit 0
        bad_steps = 0  # consecutive steps with a skipped (non-finite) update
        for step in range(self.resume.step + 1, p.total_steps + 1):
            sampler_before = p.sampler.state_dict()  # a step aborted below is saved as not having drawn its prompts
            self.completed = (step - 1, sampler_before, True)  # what a stop on a failed metrics write saves (train)
            self.updated = False  # set once the step's update ran (one-step-off: the engine may fail in the push after it)
            try:
                metrics = self.step(step)
            except S.RunAborted as error:  # raised on every process alike (from reduced numbers)
                if self.updated:  # after the update (the split engine gone in the push): the step is done, save it
                    sampler_after = p.pipeline.sampler_to_save(p.sampler) if p.pipeline else p.sampler.state_dict()
                    self.completed = (step, sampler_after, False)  # what a failed metrics write below saves
                    p.logger.log(step, getattr(error, "metrics", {}))
                    p.logger.advance()
                    return self.stop_run(error, last_step=step, sampler_state=sampler_after)
                carry_state, sampler_state = self.aborted_state(sampler_before)
                return self.stop_run(error, last_step=step - 1, sampler_state=sampler_state, carry_state=carry_state)
            self.completed = (step, p.sampler.state_dict(), False)
            # 8. log / validate / checkpoint / stop
            p.logger.log(step, metrics)
            p.logger.advance()
            if (error := mismatch(metrics, step=step, final_push=True)) is not None:  # the last push's probe (step)
                return self.stop_run(error, last_step=step, sampler_state=p.sampler.state_dict())
            bad_steps = bad_steps + 1 if metrics["actor/skipped_nonfinite_steps"] > 0 else 0  # equal on every process
            if bad_steps >= cfg.trainer.max_bad_steps:
                print(f"error: {bad_steps} consecutive steps (up to step {step}) had a non-finite loss or gradient norm "
                      f"(trainer.max_bad_steps={cfg.trainer.max_bad_steps}): the run diverged, stopping. The last checkpoint is "
                      "intact; check actor/grad_norm in metrics.jsonl, the data and actor.lr", file=sys.stderr)
                return 3
            if cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0 and p.val is not None:
                try:
                    self.validate(step)
                except S.RunAborted as error:  # on every process alike: the completed step is saved, exit 3 (or 2)
                    return self.stop_run(error, last_step=step, sampler_state=p.sampler.state_dict())
            stopping = stop_requested()  # agreed by all processes
            if (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0) or step == p.total_steps or stopping:
                try:
                    saved = self.save(step)
                except checkpoint.SaveError as error:  # a full disk: the previous checkpoint stays resumable
                    print(f"error: {error}", file=sys.stderr)
                    return error.exit_code
            if stopping:  # every process says so: under a launcher, each one's own proof that it finished and saved
                print(f"process {self.rank}: stopped after step {step}, saved {saved}; resume with the same command", file=sys.stderr)
                break
        return 0

    def step(self, step: int) -> dict[str, float]:
        """One training step in docs/DESIGN.md's order; returns its metrics. Raises step.RunAborted (before any update)
        when the rollouts cannot be trusted (rewards, tools, the engine's weights) or DAPO finds no usable group; the
        step's generation metrics are logged then."""
        from grpo_lib.core.perf import PhaseMemory
        from grpo_lib.trainer import step as S

        cfg, actor = self.cfg, self.parts.actor
        timings: dict[str, float] = {}
        memory = PhaseMemory(self.parts.device)  # memory/{gen,update,push}_peak_mb: each phase's own high-water mark
        with timed(timings, "step"):
            memory.begin("gen")
            batch, gen_metrics = self.rollouts(step, timings)  # 1-3. prompts -> generate -> reward; the engine sleeps after
            memory.begin("update")  # everything while the engine sleeps: balance, reference / old logprobs, the update
            if cfg.trainer.balance_batch:  # whole groups move between processes, mini-batch by mini-batch
                batch = S.balance_batch(actor, batch)
            plan = actor.plan_step(batch)  # the step's mini-batches and micro-batches, decided once for steps 5 and 7
            self.score_logprobs(batch, plan, timings)  # 4-5. reference / teacher / old logprobs, where the config needs them
            adv_metrics = S.compute_advantages(cfg, batch)  # 6. advantages (after 4-5: KL-in-reward needs their logprobs)
            with timed(timings, "update"):  # 7. update, then the push: the engine serves the new weights
                train_metrics = actor.update(batch, plan)
            train_metrics.update(self.push_weights(step, batch, {**gen_metrics, **adv_metrics, **train_metrics}, timings, memory))
        # the engine's memory/* counters (rollout/preemptions, counted per generation round, is in gen_metrics)
        return {**gen_metrics, **adv_metrics, **train_metrics, **S.reduce_timings(timings),
                **self.parts.engine.pop_metrics("memory/"), **memory.metrics()}

    def rollouts(self, step: int, timings: dict[str, float]):
        """Steps 1-3: the step's rollouts and their checks -> (RolloutBatch, generation metrics), the engine released
        (rollout.free_cache_engine: its KV cache and weights make room for the update). Rewards or a tool failing on
        every call of the step raise step.RunAborted (exit 3), as `collect_rollouts` does for the engine's weights; the
        metrics gathered so far are logged first."""
        from grpo_lib.trainer import step as S

        cfg, p, metrics = self.cfg, self.parts, {}
        try:
            batch = self.collect_rollouts(step, timings, into=metrics)
            p.engine.release()
            S.check_reward_errors(cfg, metrics, step=step, samples=p.scorer.last_error_samples)
            if p.episodes is not None:
                S.check_tool_errors(metrics, p.episodes.tool_names, step=step, max_error_fraction=cfg.reward.max_error_fraction)
        except S.RunAborted:
            if metrics:
                p.logger.log(step, metrics)
            raise
        return batch, metrics

    def score_logprobs(self, batch, plan, timings: dict[str, float]) -> None:
        """Steps 4-5, into `batch`: the reference's logprobs (a KL term), the teacher's (distillation: the teacher_*
        fields), the actor's old logprobs (more than one update in the step, or KL in reward), cut as `plan` says."""
        p = self.parts
        if p.reference is not None:
            with timed(timings, "ref"):
                batch.ref_logprobs = p.reference.compute_logprobs(batch)
        if p.teacher is not None:
            with timed(timings, "teacher"):
                p.teacher.score(batch)
        if needs_old_logprobs(self.cfg):
            with timed(timings, "old_logprob"):
                batch.old_logprobs = p.actor.compute_logprobs(batch, plan)

    def push_weights(self, step: int, batch, step_metrics: dict[str, float], timings: dict[str, float], memory) -> dict[str, float]:
        """The push after step `step`'s update (grpo_lib/rollout/weight_sync.py): the probe's logprobs of the weights about to be
        pushed, then wake weights -> push as version `step` -> actor.offload -> wake KV cache. The last step's probe is
        scored now (no generation follows; run_steps checks it) and trainer.check_weight_sync's debug pass runs here.
        `step_metrics`: the step's metrics so far; a RunAborted here (the split engine gone) carries them (`metrics`):
        the step trained, run_steps logs and saves it."""
        from grpo_lib.trainer import step as S

        self.updated = True
        if self.parts.pipeline is not None:
            self.parts.pipeline.step_done()  # the step's batch is trained: nothing to give back
        try:
            return self._push(step, batch, step_metrics, timings, memory)
        except S.RunAborted as error:
            error.metrics = step_metrics
            raise

    def _push(self, step: int, batch, gen_metrics: dict[str, float], timings: dict[str, float], memory) -> dict[str, float]:
        from grpo_lib.rollout.weight_probe import worse_probe

        p = self.parts
        metrics = p.pipeline.before_push() if p.pipeline is not None else {}  # one-step-off: the next batch first
        p.sync.expect(p.actor, timings=timings)
        memory.begin("push")
        p.sync.push(p.actor, version=step, timings=timings)
        memory.end()
        if step == p.total_steps or (p.pipeline is not None and p.pipeline.proves_every_push):
            metrics.update(worse_probe(gen_metrics, p.sync.check_last_push(timings=timings)))
        if self.cfg.trainer.check_weight_sync:  # the actor's shards come back for it, then leave again
            metrics["debug/weight_sync_max_abs_diff"] = p.sync.full_check(p.actor, batch)
        return metrics

    def collect_rollouts(self, step: int, timings: dict[str, float], *, into: dict[str, float]):
        """The step's rollouts (rounds.collect_rollouts; their metrics go `into`) with the weight probe riding in their
        first generate call, then `WeightSync.check` (rollout/weight_probe_* `into`), also when collecting gives up (DAPO
        found no usable group), where the weights may be the cause: other weights than the pushed ones raise
        step.RunAborted (exit 3) before anything trains on the rollouts. A chat template that cannot extend an episode
        is RunAborted with exit code 2, tool calls that never returned with exit code 3 (`rounds.episode_errors_abort`)."""
        from grpo_lib.trainer import rounds
        from grpo_lib.trainer import step as S

        p, batch, gave_up = self.parts, None, None
        if p.pipeline is not None and p.pipeline.collect is not None:  # one-step-off: generated while the last step trained
            batch, metrics = p.pipeline.collect(step, p.scorer, timings)
            into.update(metrics)
            return batch
        request = p.sync.request()  # the probe's tokens, scored by the generate call that carries them
        with rounds.episode_errors_abort(f"step {step}"):
            try:
                batch, metrics = rounds.collect_rollouts(self.cfg, p.engine, p.scorer, p.train, p.sampler, step=step,
                                                         world_size=self.world_size, rank=self.rank, timings=timings,
                                                         episodes=p.episodes, score_request=request,
                                                         carry=p.pipeline.pool if p.pipeline is not None else None)
                into.update(metrics)
            except S.RunAborted as error:
                gave_up = error
        probe_metrics, error = p.sync.check(request, batch, step=step, timings=timings)
        into.update(probe_metrics)
        if error is not None:
            raise S.RunAborted(str(error), exit_code=error.exit_code) from gave_up
        if gave_up is not None:
            raise gave_up
        return batch

    def validate(self, step: int) -> None:
        """Validate (rollout.val_kwargs), log the metrics at `step` and the val_generations_to_log samples. Tool calls
        that never return (agreed by every process) or a chat template that cannot extend an episode raise
        step.RunAborted (exit 3 / 2), as in a step (`rounds.episode_errors_abort`)."""
        from grpo_lib.trainer import rounds

        p = self.parts
        with rounds.episode_errors_abort(f"validation at step {step}"):
            metrics, rows = rounds.validate(self.cfg, p.engine, p.scorer, p.val, world_size=self.world_size, rank=self.rank,
                                            step=step, tokenizer=p.tokenizer, episodes=p.episodes)
        p.logger.log(step, metrics)
        p.logger.log_generations(step, rows)

    def save(self, step: int, sampler_state: dict | None = None, carry_state: dict | None = None) -> Path:
        """A resumable checkpoint of `step` (grpo_lib/checkpoints/checkpoint.py; every process calls it); the actor rests on the host
        afterwards (the export gathered the shards onto the device; the next generation needs that memory). The sampler's
        position and the carried responses are taken now unless given (a stop after an aborted step: from before it)."""
        from grpo_lib.checkpoints import checkpoint

        p = self.parts
        if carry_state is None and p.pipeline is not None:
            carry_state = p.pipeline.state()
        path = checkpoint.save(self.cfg, step=step, actor=p.actor, sampler_state=sampler_state or p.sampler.state_dict(),
                               rank=self.rank, world_size=self.world_size, export_hf=lambda path: p.actor.save_hf(path, p.tokenizer),
                               carry_state=carry_state)
        p.actor.offload()
        return path

    def stop_run(self, error, *, last_step: int, sampler_state: dict, carry_state: dict | None = None) -> int:
        """Stop a run whose results cannot be trusted: report, checkpoint the last completed step, return the exit code.

        Saves step `last_step` unless it is saved already (trainer.save_freq, or the resumed step); nothing is saved
        before the first completed step. The checkpoint holds `sampler_state`, the prompt sampler's position after
        `last_step` (from before an aborted step: a resume, after fixing the reward, starts with the prompts that step
        drew). A save that does not fit (a full disk) leaves the previous checkpoint as it was.
        """
        from grpo_lib.checkpoints.checkpoint import MARKER, SaveError

        print(f"error: {error}", file=sys.stderr)
        saved_already = (Path(self.cfg.trainer.default_local_dir) / f"global_step_{last_step}" / MARKER).is_file()
        if last_step >= 1 and not saved_already:
            try:
                print(f"saved the last completed step to {self.save(last_step, sampler_state, carry_state)}", file=sys.stderr)
            except SaveError as save_error:
                print(f"error: {save_error}", file=sys.stderr)
        return error.exit_code

    def aborted_state(self, sampler_before: dict) -> tuple[dict | None, dict]:
        """(pipeline state, sampler position) a checkpoint of the step before an aborted one holds, losing nothing of the
        aborted step (`pipelines` says how each pipeline gives it back); without one, `sampler_before`: the step's
        prompts are drawn again on resume."""
        p = self.parts
        return p.pipeline.abort(sampler_before) if p.pipeline is not None else (None, sampler_before)

    def close(self) -> None:
        """Every way out of the run: the engine processes stopped (split roles), reward workers stopped, metrics flushed."""
        if self.parts is not None:
            if self.parts.pipeline is not None:
                self.parts.pipeline.close()
            self.parts.scorer.close()
            self.parts.logger.close()
            if self.parts.episodes is not None:
                self.parts.episodes.toolbox.close()


def main(argv: list[str]) -> int:
    """The command line (grpo_lib/trainer/launch.py: the checks that need no model, the run lock, resume), then
    `GRPOTrainer`'s setup, run and close; returns the exit code."""
    return launch.main(argv, trainer_class=GRPOTrainer, usage=__doc__)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "grpo_lib.core.distributed" in sys.modules:  # a process group exists only past the config checks (no torch before)
        from grpo_lib.core.distributed import close_distributed

        close_distributed()  # every process leaves the group before exit (a clean launcher report on every path)
    sys.exit(code)
