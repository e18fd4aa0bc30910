"""Shared fixtures: a tiny Qwen3 model folder and synthetic GSM8K-format data, built offline once per session,
and a helper that runs train_grpo.py in a subprocess (each run owns its vLLM engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import forked_runs

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free right now on this machine (the rendezvous port of one launch)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(procs: int) -> list[str]:
    """`accelerate launch` of `procs` processes on this machine (gloo on CPU) on its own port; append the script and
    its arguments."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(procs), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())] + \
        (["--multi_gpu"] if procs > 1 else [])


def launch(cmd: list[str], *, procs: int, timeout: float = 600, env: dict[str, str] | None = None,
           accelerate: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch` (accelerate=False: `torch.distributed.run`) of `procs` processes running cmd = [SCRIPT, *args]
    from the repo root, one thread each, with extra `env`. The processes are forked from the warm server
    (tests/helpers/forked_runs.py: the launchers' environment, the first failure stops the others, outputs one after another in
    rank order, the first failure's exit status); GRPO_TEST_FORK=0, or an environment that needs a fresh interpreter
    (forked_runs.can_fork), runs the real launcher. Tests whose subject is the launcher itself (its
    signals, its exit summary) call accelerate_launch."""
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    run_env.pop("WORLD_SIZE", None)
    if forked_runs.can_fork(run_env):
        return forked_runs.launch([sys.executable, *map(str, cmd)], procs=procs, cwd=REPO, env=run_env, timeout=timeout,
                                  port=free_port(), accelerate=accelerate)
    launcher = accelerate_launch(procs) if accelerate else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(free_port())]
    return subprocess.run([*launcher, *map(str, cmd)], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=run_env)


def torchrun_records(script: str, *args: str, out_dir: Path, procs: int = 2, timeout: int = 300) -> list[dict]:
    """Launch tests/scripts/`script` on `procs` gloo processes (`launch`, torch.distributed.run's environment) with
    `args`, fail with its stderr, and return each process's OUT/rank{r}.json record, in rank order."""
    proc = launch([REPO / "tests" / "scripts" / script, *args], procs=procs, timeout=timeout, accelerate=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(procs)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from data_prep.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0, seed=0)


EOS_SCALE = 16.0  # p(<|im_end|>) after a chat prompt: 0.004 unscaled; at 16x about half the turns end within a few tokens


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its eos made likely (the <|im_end|> embedding row scaled by EOS_SCALE; tied embeddings, so
    its output row too): its turns end with its own <|im_end|> after a few tokens, as a chat model's do, which the
    multi-turn tests need (the random tiny model almost never stops)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("eos_model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] *= EOS_SCALE
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory) -> dict[str, Path]:
    from data_prep.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("arith"), train_size=64, test_size=8, seed=0)


def merge_overrides(*overrides: str) -> list[str]:
    """`key=value` overrides with a later one replacing an earlier one of the same key, in the first one's place.

    The trainer refuses a key given twice (exit 2), so a test's base settings and its own changes meet here:
    merge_overrides("rollout.n=4", "actor.lr=1e-3", "rollout.n=2") -> ["rollout.n=2", "actor.lr=1e-3"].
    """
    merged: dict[str, str] = {}
    for item in overrides:
        merged[item.split("=", 1)[0].lstrip("+")] = item
    return list(merged.values())


# The in-process engine for trainer runs whose subject is not the engine (resume, signals, full disks, data, rewards):
# rollout.name=hf generates with the actor's own transformers model, no vLLM import and no engine start (a tiny 3-step
# run: ~20 s against ~70 s with vLLM on a loaded 2-core machine). Used by tests/checkpoints/test_checkpoint.py,
# tests/train/test_data_train.py, tests/train/test_trust.py's reward / sampling / validation runs, tests/train/test_python_tool_demo.py,
# tests/train/test_algorithm_recipes.py's recipe runs, tests/model/test_teacher.py's distillation run, tests/train/test_multiprocess_train.py
# (2 processes train like 1) and tests/train/test_train_tools_e2e.py's tool failing on every call.
# Real vLLM stays where the engine is the subject, and each moved behaviour is still proven against it elsewhere:
# - exact resume after SIGKILL, the resumed weights pushed to vLLM: tests/train/test_train_tools_e2e.py (with tools) and
#   tests/rollout/test_engine_lifecycle.py (the resume's release / push / wake order);
# - the weight probe catching a stale parameter, in float32 and bf16: tests/train/test_trust.py (kept on vLLM);
# - rewards scored as vLLM's responses finish (the stream): tests/rewards/test_rewards_stream.py, tests/train/test_train_e2e.py;
# - 2 processes with one vLLM engine each training like 1: tests/train/test_lora_e2e.py, tests/train/test_train_tools_e2e.py (and
#   tensor parallel: tests/train/test_tensor_parallel_train.py); a tool's failures counted on vLLM's per-episode loop:
#   tests/train/test_train_tools_e2e.py's run with tools; the recipes' losses are the trainer's (tests/train/test_train_e2e.py
#   trains on vLLM); greedy vLLM generation (ReMax's baseline): tests/rollout/test_engines.py's token-for-token equality;
# - the lifecycle, TP, weight push, token equality, LoRA push and the demo: tests/test_engine*.py,
#   tests/train/test_tensor_parallel_train.py, tests/train/test_lora_e2e.py, tests/train/test_perf_train.py.
HF_ENGINE = "rollout.name=hf"


def tiny_overrides(model_dir: Path, data: dict[str, Path], out_dir: Path, *extra: str) -> list[str]:
    """Small, fast settings on top of recipes/tiny_cpu.yaml; `extra` overrides are added, replacing these where they
    set the same key (merge_overrides)."""
    return merge_overrides(*_tiny_base(model_dir, data, out_dir), *extra)


def _tiny_base(model_dir: Path, data: dict[str, Path], out_dir: Path) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        f"trainer.default_local_dir={out_dir}",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=4",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "reward.num_workers=1",
        # vLLM eager: its torch.compile costs ~5 CPU-s per engine start, a quarter of a tiny run, and the suite starts
        # ~150 engines. The compiled engine (the recipes' default) is covered where it matters: it takes pushed weights
        # and serves them (tests/train/test_perf_train.py, with the weight-sync check), and `make demo` runs it.
        "rollout.enforce_eager=true",
    ]


def run_script(cmd: list, *, procs: int | None = None, timeout: float = 600,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """cmd = [SCRIPT, *args] from the repo root with extra `env`, its output captured: one process forked from the
    warm server (tests/helpers/forked_runs.py), or a fresh interpreter when the run's environment changes what acts at
    interpreter start or import (forked_runs.can_fork) or GRPO_TEST_FORK=0; `procs` processes: `launch`."""
    if procs is not None:
        return launch(cmd, procs=procs, timeout=timeout, env={"PYTHONUNBUFFERED": "1", **(env or {})})
    full = [sys.executable, *map(str, cmd)]
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if forked_runs.can_fork(run_env):
        return forked_runs.run_forked(full, cwd=REPO, env=run_env, timeout=timeout)
    return subprocess.run(full, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=run_env)


def run_train(args: list[str], *, launcher: list[str] | None = None, procs: int | None = None, timeout: int = 600,
              check: bool = True, env: dict[str, str] | None = None, faults: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run train_grpo.py from the repo root with extra `env`, fail with its output: in one process or in `procs`
    processes (`run_script`), or as `launcher + [train_grpo.py, ...]` (a real launcher: the tests of its signals and
    its exit summary). With `faults` (e.g. ["--signal", "TERM update 2"]) the run goes through
    tests/scripts/train_with_faults.py."""
    script = [str(REPO / "tests" / "scripts" / "train_with_faults.py"), *faults, "--"] if faults else [str(REPO / "train_grpo.py")]
    cmd = (launcher or [sys.executable]) + [*script, *args]
    if launcher is None:
        proc = run_script([*script, *args], procs=procs, timeout=timeout, env=env)
    else:
        assert procs is None, "procs or launcher, not both"
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stderr tail ---\n{proc.stderr[-6000:]}\n--- stdout tail ---\n{proc.stdout[-3000:]}")
    return proc


def read_metrics(out_dir: Path) -> list[dict]:
    """Per-step rows of metrics.jsonl (the step-0 data summary excluded)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]
