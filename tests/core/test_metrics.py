"""Metric sinks: what the console step line shows (grpo_lib/core/metrics.py)."""

from __future__ import annotations

import json
import re

import pytest

from grpo_lib.core.metrics import MetricLogger, MetricWriteError


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


# ------------------------------------------------------------------------------------ a full disk under a sink
@pytest.mark.parametrize("sink", ["metrics", "tensorboard", "generations"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # TensorBoard's writer thread dies of it
def test_a_full_disk_under_any_sink_raises_one_error_naming_the_folder_and_its_free_space(tmp_path, monkeypatch, sink):
    """ENOSPC inside one sink's write (tests/scripts/train_with_faults.py's hook, as the 2-process run installs it) is not
    a traceback from inside the sink: the logger raises MetricWriteError (exit 3) naming what it wrote, the folder and
    its free space. Without a process group the agreement is the identity; tests/checkpoints/test_checkpoint.py runs it on 2."""
    from tests.scripts.train_with_faults import fault_action, fault_in_metrics

    fault_in_metrics(sink, 2, fault_action("ENOSPC"), setattr=monkeypatch.setattr)
    logger = MetricLogger(sinks=["jsonl", "tensorboard"], log_dir=tmp_path)
    logger.log(1, {"reward/mean": 0.5})
    logger.log_generations(1, [ROW])
    with pytest.raises(MetricWriteError) as raised:
        logger.log(2, {"reward/mean": 0.25})
        logger.log_generations(2, [ROW])
    logger.close()  # after a failed write: flushes what it can, raises nothing
    message = str(raised.value)
    what = {"generations": "the validation samples of step 2 (val_generations.jsonl)", "metrics": "the metrics of step 2",
            "tensorboard": "the metrics of step 2"}[sink]
    assert message.startswith(f"could not write {what} in {tmp_path} (OSError: [Errno 28] No space left on device"), message
    assert re.search(r"; \d+\.\d\d GiB free there\)", message), message
    assert raised.value.exit_code == 3
    steps_written = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps_written == ([1, 2] if sink == "generations" else [1]), "TensorBoard is written before metrics.jsonl"


ROW = {"data_source": "d", "prompt": "p", "response": "r", "ground_truth": "g", "score": 1.0}
