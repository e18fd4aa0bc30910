"""Metric sinks (console line, TensorBoard, metrics.jsonl) and the step progress bar.

Metric names are namespaced and documented once here:

| name | meaning |
|---|---|
| `reward/mean`, `reward/<fn>/mean` | weighted reward per response, and each reward function's raw mean (`reward/reward_model/mean`, `reward/judge/mean`: the learned scorers' raw scores) |
| `reward_model/truncated`, `judge/unparsed`, `judge/overlong` | counts per step: reward-model inputs cut to reward_model.max_length (re-rendered); judge texts without a score (scored 0, a sample logged); judge prompts longer than its context (scored 0) |
| `reward/accuracy` | fraction of responses whose accuracy reward is > 0 (exact answers) |
| `reward/errors`, `reward/timeouts` | responses whose reward function raised / timed out (scored 0) |
| `reward/error_fraction` | fraction of responses with a failed or timed-out reward call (over `reward.max_error_fraction` stops the run, exit 3) |
| `reward/greedy_baseline_mean` | remax: mean over responses of their prompt's greedy-response score (the baseline) |
| `critic/advantages_abs_mean` | mean over responses with loss tokens of the mean abs(A) over their loss tokens (a per-response estimator's abs(A_i)) |
| `critic/kl_in_reward` | with `algorithm.use_kl_in_reward`: mean over loss tokens of the KL estimate subtracted from the token rewards |
| `data/invalid_rows` | training + validation rows dropped for a missing / None / NaN / empty ground truth |
| `response/length_mean`, `response/length_max`, `response/clip_ratio` | tokens after the prompt (`response_mask`: a hole of the loss mask, e.g. a tool's output, counts); fraction cut at max_response_length |
| `actor/pg_loss`, `actor/kl_loss`, `actor/entropy` | mini-batch losses (global normalisation), averaged over updates |
| `actor/pg_clipfrac`, `actor/pg_clipfrac_lower`, `actor/ppo_kl` | PPO clip statistics (weighted by loss tokens, `loss_mask`) |
| `distillation/loss` | distillation only (`distillation.enabled`): the distillation term as it trains (global normalisation, before distillation_loss_coef; with use_policy_gradient the PPO surrogate of the advantage -divergence), averaged over updates |
| `distillation/kl_mean`, `distillation/loss_min`, `distillation/loss_max`, `distillation/abs_loss` | the per-token divergence student vs teacher (distillation_loss.loss_mode, before loss_max_clamp) over the loss tokens: mean, range (min / max over every process and update), mean of its absolute value (k1 can be negative) |
| `distillation/student_mass`, `distillation/teacher_mass` | forward_kl_topk: mean probability mass the student / the teacher puts on the teacher's top-k tokens (a teacher mass far below 1: topk too small) |
| `distillation/pg_clipfrac`, `distillation/pg_clipfrac_lower`, `distillation/ppo_kl` | use_policy_gradient: the distillation surrogate's clip statistics, as actor/pg_clipfrac |
| `actor/grad_norm`, `actor/lr` | before clipping; learning rate used by the step |
| `perf/packed`, `perf/shared_prefix`, `perf/real_token_fraction` | update: share of micro-batches packed (`model.use_remove_padding` packs one only when that computes < 90% of its padded block, `logprobs.choose_layout`); share packed with every prompt computed once for its rows (grpo_varlen); real tokens / tokens the forwards computed (1.0: no padding computed; above 1.0: shared prompts ran once for their responses) |
| `actor/skipped_nonfinite_steps` | optimizer updates of the step skipped on every process (non-finite loss or grad norm) |
| `batch/kept_groups`, `batch/dropped_groups`, `batch/gen_rounds` | DAPO dynamic sampling |
| `rollout/preemptions` | sequences the engine preempted (evicted for lack of KV cache, recomputed later) this step; warned when > 0 |
| `rollout/logprob_abs_diff_mean` | mean over loss tokens (`loss_mask`) of |engine sampling logprob - trainer logprob| before the update (logged when engine logprobs are requested: rollout_correction on, carry-over or one-step-off, or a bf16/fp16 engine or actor; tokens of the current weights only) |
| `episode/turns_mean`, `episode/turns_max` | multi-turn only: assistant turns (generations) per episode, mean over the step's episodes and the largest |
| `episode/tool_calls_mean` | multi-turn: tool calls answered per episode (well-formed or not; a call left unanswered by a turn limit is not counted) |
| `episode/stopped_turn_limit`, `episode/stopped_length` | multi-turn: fraction of episodes ended by max_assistant_turns / max_user_turns with a call unanswered, and by the data.max_response_length budget |
| `tools/invalid_calls`, `tools/errors`, `tools/timeouts` | multi-turn, counts per step: calls with malformed JSON, an unknown tool or arguments the schema refuses; tool methods that raised (or returned no text / number); tool methods stopped at rollout.multi_turn.tool_timeout_s |
| `tools/truncated_responses`, `tools/dropped_calls` | multi-turn, counts: responses cut to max_tool_response_length; calls past max_parallel_calls in one turn (not run) |
| `tools/abandoned` | multi-turn, count: calls of plain (sync) tool methods run in a thread (a stateful or unpicklable tool, `execute_in = "thread"`, create / calc_reward / release) left running at tool_timeout_s (a thread cannot be killed; 64 of one tool still running stop the run, exit 3); a timed-out call in a worker process is killed, not abandoned |
| `tools/reward_error_fraction` | multi-turn: fraction of episodes with a tool calc_reward that raised, timed out or returned no finite number (scored 0; over `reward.max_error_fraction` stops the run, exit 3) |
| `tools/<name>/calls`, `tools/<name>/failures`, `tools/<name>/reward_mean` | multi-turn, per tool: calls that reached it, those that raised or timed out (all of them failing stops the run, exit 3), its calc_reward mean over episodes |
| `timing_s/<phase>` | seconds of gen, gen_max (remax's greedy generation and its rewards), reward, ref, teacher (distillation's teacher pass), reward_model / judge (the learned scorers, inside reward), old_logprob, update, push, weight_probe, step; multi-turn: `timing_s/tools` (the tools' time generation did not hide, inside gen: per-episode loop the seconds the engine sat idle waiting for tools, turn loop every tool batch's wall time; both plus creates and calc_reward); `timing_s/reward_exposed`: the seconds spent waiting for rewards after generation (responses are scored as they finish, so this is the reward time generation did not hide; inside reward) |
| `memory/actor_params_mb` | MiB of actor parameters held by process 0 (its FSDP2 shard: about 1/N of the model) |
| `memory/gen_peak_mb`, `memory/update_peak_mb`, `memory/push_peak_mb` | largest process's peak memory in each phase of the step, measured from the phase's start (gen: generate + reward + release; update: everything while the engine sleeps; push: the weight push and wake): CUDA max allocated since `reset_peak_memory_stats`, less the engine's memory that sleep unmapped, on GPU; peak resident set (VmHWM, reset through /proc/self/clear_refs) on CPU (`grpo_lib/core/perf.py`) |
| `memory/peak_mb` | the largest of the step's three phase peaks |
| `memory/gen_reserved_mb`, `memory/update_reserved_mb`, `memory/push_reserved_mb` | CUDA only: the caching allocator's reserved peak in each phase, less the engine's unmapped sleep pool (reserved - allocated is fragmentation; largest process) |
| `memory/gen_device_free_mb`, `memory/update_device_free_mb`, `memory/push_device_free_mb` | CUDA only: the device's free MiB at each phase's end (`mem_get_info`, every allocator on it; smallest process) |
| `memory/sleep_residual_mb` | CUDA only: device MiB in use right after the engine's release that torch's allocator does not hold as live memory (the CUDA context, NCCL buffers, the engine's CUDA-graph pool and buffers outside its sleep pool; process 0) |
| `perf/collective_mb_per_update` | MiB process 0 all-gathered and reduce-scattered (FSDP2: each call's full buffer) per optimizer update of the step; actor.fsdp_config.keep_root_gathered / reshard_after_forward / defer_grad_reduce lower it |
| `debug/weight_sync_max_abs_diff` | largest engine - actor logprob difference over all engines after the push |
| `rollout/weight_probe_abs_diff`, `rollout/weight_probe_tolerance`, `rollout/weight_probe_ratio`, `rollout/weight_probe_noise` | the weights that generated this step's rollouts: mean over the weight probe's tokens of |engine - actor| logprob (largest over engines), its tolerance (3 x the largest difference of the run's first 3 probes, at least a floor tied to the compute dtype, within its bound; docs/GPU.md), their ratio (above 1 the run stops before the update, exit 3) and that noise (grpo_lib/rollout/weight_probe.py) |
| `rollout/carried_responses`, `rollout/resumed_responses`, `rollout/pool_groups` | carry-over (`rollout.partial_rollout`), counts: responses unfinished when the step's round stopped (carried to the next), carried responses resumed in it, groups in flight |
| `rollout/dropped_stale_responses`, `rollout/dropped_stale_tokens` | carry-over, counts: responses (and their tokens) dropped and started again because their oldest token would have been more than `max_staleness` versions old when trained |
| `rollout/staleness_<s>`, `rollout/staleness_max` | carry-over: share of the step's loss tokens sampled `s` weight versions before the weights being trained (s = 0 .. max_staleness); the largest age (one-step-off: always 1 after step 1) |
| `actor/stale_token_fraction`, `actor/behav_imp_weight_mean` | carry-over and one-step-off: share of loss tokens from older weights, and the mean decoupled-loss weight min(exp(proximal - behaviour), behav_imp_weight_cap) over them (docs/ALGORITHMS.md) |
| `timing_s/wait_engine`, `timing_s/engine_gen`, `timing_s/engine_idle`, `timing_s/overlap_share` | one-step-off (`rollout.n_gpus_per_node`): seconds the trainer waited for the engine's batch, the engine took to generate it, the engine waited for its go; the share (not seconds) of that generation hidden behind the trainer's work |
| `val/<data_source>/reward_mean`, `val/<data_source>/acc` | validation reward and accuracy per source |
| `val/<data_source>/mean@<n>`, `val/<data_source>/pass@<n>` | with `rollout.val_kwargs.n` > 1: mean accuracy of a prompt's n responses; fraction of prompts with one correct |
| `val/reward_mean`, `val/reward_errors` | validation reward over all sources; failed or timed-out reward calls |
| `val/<data_source>/overlong_penalty_mean` | with reward.overlong_buffer.enable: DAPO's overlong penalty per validation response (in reward_mean, not in acc, as verl's validation) |
| `val/episode/*`, `val/tools/*` | multi-turn: the episode/* and tools/* metrics above over the validation episodes |
| `memory/sleep_freed_mb`, `memory/wake_regained_mb`, ... | device MiB freed / taken by engine transitions (CUDA only; process 0) |
| `memory/device_free_mb` | free device MiB (`torch.cuda.mem_get_info`: the whole device, the engine's allocator too) after the step's last engine transition, the KV cache mapped (CUDA only; process 0) |

Only process 0 writes; the values given to `log` are already reduced across processes. Every process calls the
logger (`MetricLogger(...)`, `log`, `log_generations`) at the same points, and each of these ends with one agreement
(an all-reduce): a write that fails on process 0 (a full disk: ENOSPC from metrics.jsonl, TensorBoard's event file
or val_generations.jsonl) raises `MetricWriteError` on every process alike, naming the folder and its free space, so
no process is left waiting in a collective that process 0 never reaches. The trainer then saves the last completed
step if the disk allows and exits 3 (`GRPOTrainer.stop_run` in train_grpo.py).

A resumed run (`resume_step` > 0) continues the same files: metrics.jsonl keeps the lines up to the resumed
step and drops the rest (they came from steps that are computed again), and TensorBoard is opened with
`purge_step = resume_step + 1`, which hides the old events of the steps run again. A fresh run in a folder
that held an unfinished run without checkpoint (resume_mode=auto) replaces both.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

CONSOLE_KEYS = ("reward/mean", "reward/accuracy", "reward/error_fraction", "response/length_mean", "actor/pg_loss",
                "actor/kl_loss", "actor/entropy", "distillation/kl_mean", "actor/grad_norm", "timing_s/step")
CONSOLE_IF_NONZERO = ("reward/error_fraction",)  # shown only when > 0: up to reward.max_error_fraction of the responses
                                                 # may fail to score and train as 0, and the step line says so


def wandb_run_id(log_dir: Path, resume_step: int) -> str:
    """The wandb run id of this run folder: kept in `wandb_run_id.txt`, so a resumed run (resume_step > 0) logs into
    the same wandb run instead of starting a new one; a fresh run writes a new id. (wandb keeps the first value it
    got for a step: the steps after the checkpoint that a killed run had already logged are not replaced there;
    metrics.jsonl and TensorBoard are cut back to the checkpoint.)"""
    path = Path(log_dir) / "wandb_run_id.txt"
    if resume_step and path.is_file():
        return path.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:16]
    path.write_text(run_id + "\n")
    return run_id


class MetricWriteError(RuntimeError):
    """A metric sink could not write (a full disk, a folder gone read-only), raised on every process alike (exit 3)."""

    exit_code = 3


class MetricLogger:
    """The run's metric sinks (process 0 writes; every process calls every method: each ends with one agreement)."""

    def __init__(self, *, sinks: list[str], log_dir: str | Path, enabled: bool = True, total_steps: int | None = None,
                 project_name: str = "grpo", experiment_name: str = "run", resume_step: int = 0):
        self.enabled = enabled
        self.sinks = set(sinks)
        self.log_dir = Path(log_dir)
        self.writer = None
        self.wandb = None  # the wandb run when "wandb" is a sink (optional package, checked at config time)
        self.jsonl = None
        self.bar = None
        self.failure: tuple[str, OSError] | None = None  # (what was being written, the error) of the first failed write
        if enabled:
            with self.writing("the metric files (metrics.jsonl, tensorboard/)"):
                self._open(total_steps, project_name, experiment_name, resume_step)
        self.agree()

    def _open(self, total_steps, project_name, experiment_name, resume_step) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = self.log_dir / "tensorboard"
            self.writer = SummaryWriter(log_dir=str(tb_dir), purge_step=(resume_step + 1 if resume_step else 0) if tb_dir.exists() else None)
            if not resume_step:
                self.writer.add_text("run/name", f"{project_name}/{experiment_name}", 0)
        if "wandb" in self.sinks:
            import wandb

            self.wandb = wandb.init(project=project_name, name=experiment_name, dir=str(self.log_dir),
                                    id=wandb_run_id(self.log_dir, resume_step), resume="allow")
        if "jsonl" in self.sinks:
            self.jsonl = open_jsonl_at(self.log_dir / "metrics.jsonl", resume_step)
        if (self.log_dir / "val_generations.jsonl").exists():  # validation samples: cut at the same step
            open_jsonl_at(self.log_dir / "val_generations.jsonl", resume_step).close()
        if total_steps:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=resume_step, desc="steps", unit="step", dynamic_ncols=True)

    @contextmanager
    def writing(self, what: str):
        """Run a sink write; an OSError is kept (the first one) for `agree`, which raises it on every process."""
        try:
            yield
        except OSError as exc:
            self.failure = self.failure or (what, exc)

    def agree(self) -> None:
        """One all-reduce: did a write fail on any process? Then MetricWriteError on every process, naming the folder and
        its free space. The identity without a process group."""
        from grpo_lib.core.distributed import all_gather_object, all_reduce_max
        from grpo_lib.core.preflight import free_space_text

        if all_reduce_max(1.0 if self.failure is not None else 0.0) > 0:  # then every process takes this branch
            mine = None if self.failure is None else (self.failure[0], f"{type(self.failure[1]).__name__}: {self.failure[1]}")
            what, cause = next(f for f in all_gather_object(mine) if f is not None)  # the same on every process
            raise MetricWriteError(f"could not write {what} in {self.log_dir} ({cause}; {free_space_text(self.log_dir)} "
                                   "there). Free disk space, or point trainer.default_local_dir at a larger disk, and rerun "
                                   "the same command to resume")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one step's metrics to every sink (process 0), then agree (every process calls this)."""
        if self.enabled:
            with self.writing(f"the metrics of step {step}"):
                self._write(step, metrics)
        self.agree()

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()  # raises the event writer thread's error (tensorboard keeps it for the next call)
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if "console" in self.sinks:
            keys = [k for k in CONSOLE_KEYS if k in metrics and (k not in CONSOLE_IF_NONZERO or metrics[k] > 0)] or sorted(metrics)
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys)
            line = f"step {step}: {shown}"
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def log_generations(self, step: int, rows: list[dict]) -> None:
        """Append validation samples to val_generations.jsonl (one line per row, with its step) and add them to
        TensorBoard as one text summary (`val/generations`, a markdown table) at `step`; then agree (every process
        calls this)."""
        if self.enabled and rows:
            with self.writing(f"the validation samples of step {step} (val_generations.jsonl)"):
                self._write_generations(step, rows)
        self.agree()

    def _write_generations(self, step: int, rows: list[dict]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "val_generations.jsonl", "a") as handle:
            handle.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        if self.writer is not None:
            def cell(text) -> str:
                return str(text).replace("|", "\\|").replace("\n", "<br>")

            table = ["| data_source | prompt | response | ground truth | score |", "|---|---|---|---|---|"]
            table += [f"| {cell(r['data_source'])} | {cell(r['prompt'])} | {cell(r['response'])} | {cell(r['ground_truth'])} | "
                      f"{r['score']:.3g} |" for r in rows]
            self.writer.add_text("val/generations", "\n".join(table), step)
            self.writer.flush()

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        """Flush and close every sink (every way out of the run: a write that fails here is a warning, the run is over)."""
        import sys

        for sink in (self.writer, self.jsonl):
            if sink is not None:
                try:
                    sink.close()
                except OSError as exc:
                    print(f"warning: closing the metric files in {self.log_dir}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()


def open_jsonl_at(path: Path, resume_step: int):
    """Open metrics.jsonl for appending after the lines of steps <= resume_step (all lines dropped when 0).

    The kept lines are written to a temporary file that replaces the old one, so a kill here loses nothing; a
    last line cut short by a kill is dropped.
    """
    kept = []
    if path.exists() and resume_step > 0:
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if row["step"] <= resume_step:
                kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)
    return open(path, "a")
