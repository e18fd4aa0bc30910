"""Shared fixtures: a tiny Qwen3 model folder and synthetic GSM8K-format data, built offline once per session,
and a helper that runs train_grpo.py in a subprocess (each run owns its vLLM engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked_runs

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


def torchrun_records(script: str, *args: str, out_dir: Path, procs: int = 2, timeout: int = 300) -> list[dict]:
    """Launch tests/scripts/`script` on `procs` gloo processes (torch.distributed.run, its own port, one thread each)
    with `args`, fail with its stderr, and return each process's OUT/rank{r}.json record, in rank order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(free_port()),
           str(REPO / "tests" / "scripts" / script), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
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
# run: ~20 s against ~70 s with vLLM on a loaded 2-core machine). Used by tests/test_checkpoint.py,
# tests/test_data_train.py, tests/test_trust.py's reward / sampling / validation runs, tests/test_python_tool_demo.py,
# tests/test_algorithm_recipes.py's recipe runs, tests/test_teacher.py's distillation run, tests/test_multiprocess_train.py
# (2 processes train like 1) and tests/test_train_tools_e2e.py's tool failing on every call.
# Real vLLM stays where the engine is the subject, and each moved behaviour is still proven against it elsewhere:
# - exact resume after SIGKILL, the resumed weights pushed to vLLM: tests/test_train_tools_e2e.py (with tools) and
#   tests/test_engine_lifecycle.py (the resume's release / push / wake order);
# - the weight probe catching a stale parameter, in float32 and bf16: tests/test_trust.py (kept on vLLM);
# - rewards scored as vLLM's responses finish (the stream): tests/test_rewards_stream.py, tests/test_train_e2e.py;
# - 2 processes with one vLLM engine each training like 1: tests/test_lora_e2e.py, tests/test_train_tools_e2e.py (and
#   tensor parallel: tests/test_tensor_parallel_train.py); a tool's failures counted on vLLM's per-episode loop:
#   tests/test_train_tools_e2e.py's run with tools; the recipes' losses are the trainer's (tests/test_train_e2e.py
#   trains on vLLM); greedy vLLM generation (ReMax's baseline): tests/test_engines.py's token-for-token equality;
# - the lifecycle, TP, weight push, token equality, LoRA push and the demo: tests/test_engine*.py,
#   tests/test_tensor_parallel_train.py, tests/test_lora_e2e.py, tests/test_perf_train.py.
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
        # and serves them (tests/test_perf_train.py, with the weight-sync check), and `make demo` runs it.
        "rollout.enforce_eager=true",
    ]


def run_train(args: list[str], *, launcher: list[str] | None = None, timeout: int = 600, check: bool = True,
              env: dict[str, str] | None = None, faults: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run train_grpo.py (or `launcher + [train_grpo.py, ...]`) from the repo root, with extra `env`; fail with its output.
    With `faults` (e.g. ["--signal", "TERM update 2"]) the run goes through tests/scripts/train_with_faults.py."""
    script = [str(REPO / "tests" / "scripts" / "train_with_faults.py"), *faults, "--"] if faults else [str(REPO / "train_grpo.py")]
    cmd = (launcher or [sys.executable]) + [*script, *args]
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # one process: forked from the warm server (tests/forked_runs.py), unless the run sets a PYTHON* variable of its own
    # (PYTHONPATH with a sitecustomize acts at interpreter start: that needs a fresh interpreter)
    fresh = any(key.startswith("PYTHON") and key != "PYTHONUNBUFFERED" for key in (env or {}))
    if launcher is None and not fresh and forked_runs.enabled():
        proc = forked_runs.run_forked(cmd, cwd=REPO, env=run_env, timeout=timeout)
    else:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=run_env)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stderr tail ---\n{proc.stderr[-6000:]}\n--- stdout tail ---\n{proc.stdout[-3000:]}")
    return proc


def read_metrics(out_dir: Path) -> list[dict]:
    """Per-step rows of metrics.jsonl (the step-0 data summary excluded)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]
