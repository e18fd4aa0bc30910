"""wandb as a metric sink: optional; asked for without the package, the run exits 2 before loading anything."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

from grpo_lib.config import load_config
from grpo_lib.config.checks import environment_problems

REPO = Path(__file__).resolve().parents[2]

FAKE_WANDB = '''
import json, os
class _Run:
    def __init__(self, path): self.path = path
    def log(self, metrics, step=None):
        with open(self.path, "a") as f: f.write(json.dumps({"step": step, **metrics}) + "\\n")
    def finish(self):
        with open(self.path, "a") as f: f.write("FINISH\\n")
def init(project=None, name=None, dir=None, id=None, resume=None, **kwargs):
    with open(os.path.join(dir, "fake_wandb_init.json"), "w") as f:
        json.dump({"project": project, "name": name, "id": id, "resume": resume}, f)
    return _Run(os.path.join(dir, "fake_wandb_log.jsonl"))
'''


def test_missing_wandb_is_a_config_problem(monkeypatch):
    cfg = load_config(REPO / "recipes/tiny_cpu.yaml", ["trainer.logger=['console','wandb']"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    (problem,) = environment_problems(cfg)
    assert "pip install wandb" in problem and "trainer.logger=[console]" in problem


def test_cli_without_wandb_exits_2_before_loading(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")  # uninstalled, wherever this runs
    proc = subprocess.run([sys.executable, "train_grpo.py", "recipes/tiny_cpu.yaml", "trainer.logger=['console','wandb']",
                           f"model.path={tmp_path / 'no_model'}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2
    assert "pip install wandb" in proc.stderr and "no_model" not in proc.stderr, proc.stderr  # stopped before the model


def test_cli_with_wandb_passes_the_check(tmp_path):
    """With a wandb module importable (a fake on PYTHONPATH) the run gets past the check: here to the missing model."""
    (tmp_path / "wandb.py").write_text(FAKE_WANDB)
    proc = subprocess.run([sys.executable, "train_grpo.py", "recipes/tiny_cpu.yaml", "trainer.logger=['console','wandb']",
                           f"model.path={tmp_path / 'no_model'}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2 and "pip install wandb" not in proc.stderr and "no_model" in proc.stderr, proc.stderr[-2000:]


def test_metric_logger_names_the_run_in_wandb_and_tensorboard(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")
    exec(FAKE_WANDB, fake.__dict__)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from grpo_lib.core.metrics import MetricLogger

    logger = MetricLogger(sinks=["wandb", "tensorboard"], log_dir=tmp_path, project_name="proj", experiment_name="exp1")
    logger.log(3, {"reward/mean": 0.5})
    logger.close()
    init = json.loads((tmp_path / "fake_wandb_init.json").read_text())
    assert {k: init[k] for k in ("project", "name", "resume")} == {"project": "proj", "name": "exp1", "resume": "allow"}
    rows = (tmp_path / "fake_wandb_log.jsonl").read_text().splitlines()
    assert json.loads(rows[0]) == {"step": 3, "reward/mean": 0.5} and rows[-1] == "FINISH"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("run/name/text_summary")]
    assert texts == ["proj/exp1"]


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")
    exec(FAKE_WANDB, fake.__dict__)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from grpo_lib.core.metrics import MetricLogger

    def run_id(resume_step: int) -> str:
        MetricLogger(sinks=["wandb"], log_dir=tmp_path, resume_step=resume_step).close()
        return json.loads((tmp_path / "fake_wandb_init.json").read_text())["id"]

    first = run_id(0)
    assert first and run_id(3) == first, "a resume must continue the same wandb run"
    assert run_id(0) != first, "a fresh run in the folder (nothing to resume) gets a new wandb run"
