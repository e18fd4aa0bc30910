"""Real checkpoints without a trainer: `checkpoint.save` of a tiny module with AdamW, in the test process.

They hold what a run's checkpoint holds (DCP shards and metadata, rng/rank_0.pt, trainer_state.json with the config,
a stand-in Hugging Face export, the manifest, COMPLETE), in milliseconds, so the resume rules and the damage checks
are tested without starting an engine (tests/checkpoints/test_checkpoint.py, tests/checkpoints/test_checkpoint_integrity.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_lib.checkpoints import checkpoint
from grpo_lib.config import Config


class TinyActor:
    """What checkpoint.save / load touch of grpo_lib.model.actor.Actor: model, optimizer (with state), scheduler, steps_done."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, betas=(0.8, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.model(torch.randn(2, 4)).square().sum().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.steps_done = seed


class RecordingSampler:
    """Stands in for data.PromptSampler in checkpoint.load: keeps the state it is given."""

    def __init__(self):
        self.state = None

    def load_state_dict(self, state):
        self.state = state


def save_tiny(run_dir: Path, step: int, *, seed: int = 1, cfg: Config | None = None) -> Path:
    """global_step_`step` of a TinyActor in `run_dir` (cfg: the config it records; default Config()), written by
    checkpoint.save on one process; the HF export is a 4 KiB stand-in file."""
    cfg = cfg or Config()
    cfg.trainer.default_local_dir = str(run_dir)

    def export(folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 16)

    return checkpoint.save(cfg, step=step, actor=TinyActor(seed), sampler_state={"position": 4 * step}, export_hf=export,
                           rank=0, world_size=1)
