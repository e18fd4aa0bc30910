"""Metric sinks (console line, TensorBoard, metrics.jsonl) and the step progress bar.

Metric names are namespaced and documented once here:

| name | meaning |
|---|---|
| `reward/mean`, `reward/<fn>/mean` | weighted reward per response, and each reward function's raw mean |
| `reward/accuracy` | fraction of responses whose accuracy reward is > 0 (exact answers) |
| `reward/errors`, `reward/timeouts` | responses whose reward function raised / timed out (scored 0) |
| `reward/error_fraction` | fraction of responses with a failed or timed-out reward call (over `reward.max_error_fraction` stops the run, exit 3) |
| `data/invalid_rows` | training + validation rows dropped for a missing / None / NaN / empty ground truth |
| `response/length_mean`, `response/length_max`, `response/clip_ratio` | response tokens; fraction cut at max_response_length |
| `actor/pg_loss`, `actor/kl_loss`, `actor/entropy` | mini-batch losses (global normalisation), averaged over updates |
| `actor/pg_clipfrac`, `actor/pg_clipfrac_lower`, `actor/ppo_kl` | PPO clip statistics (token-weighted) |
| `actor/grad_norm`, `actor/lr` | before clipping; learning rate used by the step |
| `batch/kept_groups`, `batch/dropped_groups`, `batch/gen_rounds` | DAPO dynamic sampling |
| `rollout/preemptions` | sequences the engine preempted (evicted for lack of KV cache, recomputed later) this step; warned when > 0 |
| `rollout/logprob_abs_diff_mean` | mean over response tokens of |engine sampling logprob - trainer logprob| before the update (logged when engine logprobs are requested: rollout_correction on, or a bf16/fp16 engine or actor) |
| `timing_s/<phase>` | seconds of gen, reward, ref, old_logprob, update, push, step |
| `memory/actor_params_mb` | MiB of actor parameters held by process 0 (its FSDP2 shard: about 1/N of the model) |
| `memory/peak_mb` | largest process's peak memory so far: CUDA max allocated on GPU, peak resident set (VmHWM) on CPU |
| `debug/weight_sync_max_abs_diff` | largest engine - actor logprob difference over all engines after the push |
| `val/<data_source>/reward_mean`, `val/<data_source>/acc` | validation reward and accuracy per source |
| `val/<data_source>/mean@<n>`, `val/<data_source>/pass@<n>` | with `rollout.val_kwargs.n` > 1: mean accuracy of a prompt's n responses; fraction of prompts with one correct |
| `val/reward_mean`, `val/reward_errors` | validation reward over all sources; failed or timed-out reward calls |

Only process 0 writes; the values given to `log` are already reduced across processes.
"""

from __future__ import annotations

import json
from pathlib import Path

CONSOLE_KEYS = ("reward/mean", "reward/accuracy", "response/length_mean", "actor/pg_loss", "actor/kl_loss",
                "actor/entropy", "actor/grad_norm", "timing_s/step")


class MetricLogger:
    def __init__(self, *, sinks: list[str], log_dir: str | Path, enabled: bool = True, total_steps: int | None = None,
                 project_name: str = "grpo", experiment_name: str = "run"):
        self.enabled = enabled
        self.sinks = set(sinks)
        self.log_dir = Path(log_dir)
        self.writer = None
        self.wandb = None  # the wandb run when "wandb" is a sink (optional package, checked at config time)
        self.jsonl = None
        self.bar = None
        if not enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))
            self.writer.add_text("run/name", f"{project_name}/{experiment_name}", 0)
        if "wandb" in self.sinks:
            import wandb

            self.wandb = wandb.init(project=project_name, name=experiment_name, dir=str(self.log_dir))
        if "jsonl" in self.sinks:
            self.jsonl = open(self.log_dir / "metrics.jsonl", "a")
        if total_steps:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="steps", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if "console" in self.sinks:
            keys = [k for k in CONSOLE_KEYS if k in metrics] or sorted(metrics)
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys)
            line = f"step {step}: {shown}"
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def log_generations(self, step: int, rows: list[dict]) -> None:
        """Append validation samples to val_generations.jsonl (one line per row, with its step) and add them to
        TensorBoard as one text summary (`val/generations`, a markdown table) at `step`."""
        if not self.enabled or not rows:
            return
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
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.bar is not None:
            self.bar.close()
