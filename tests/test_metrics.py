"""Metric sinks: what the console step line shows (grpo_lib/metrics.py)."""

from __future__ import annotations

from grpo_lib.metrics import MetricLogger


def test_console_line_shows_the_reward_error_fraction_only_when_above_0(tmp_path, capsys):
    """Up to reward.max_error_fraction of a step's responses may fail to score and train as 0 (issue 20 item 7): the step
    line says how many did, and stays as it was when none did."""
    logger = MetricLogger(sinks=["console"], log_dir=tmp_path)
    logger.log(1, {"reward/mean": 0.5, "reward/error_fraction": 0.25, "timing_s/step": 1.0})
    logger.log(2, {"reward/mean": 0.5, "reward/error_fraction": 0.0, "timing_s/step": 1.0})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 1: reward/mean=0.5 reward/error_fraction=0.25 timing_s/step=1",
                     "step 2: reward/mean=0.5 timing_s/step=1"], lines
