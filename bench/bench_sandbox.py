"""Per-call cost of the Python tool's sandbox: start to result for `print(1)` (and a small numeric job), through the
same PythonTool the trainer builds. Run after waiting for an idle CPU; results go in bench/results_sandbox_cpu.md.

    .venv/bin/python bench/bench_sandbox.py --calls 30
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_lib.tools.base import ToolSchema  # noqa: E402
from grpo_lib.tools.builtin import PythonTool  # noqa: E402

SCHEMA = ToolSchema({"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    started = time.perf_counter()
    tool = PythonTool({}, SCHEMA)
    print(f"build (layers probed once): {time.perf_counter() - started:.3f} s")
    for name, code in (("print(1)", "print(1)"), ("sum of squares", "print(sum(i * i for i in range(100000)))")):
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            text, _, _ = tool.execute("bench", {"code": code})
            times.append(time.perf_counter() - t0)
            assert text.strip() and not text.startswith("Error"), text
        times.sort()
        print(f"{name:16s} n={len(times)} min {times[0] * 1e3:.1f} ms  median {statistics.median(times) * 1e3:.1f} ms  "
              f"max {times[-1] * 1e3:.1f} ms")
    print(platform.processor() or platform.machine(), platform.release())


if __name__ == "__main__":
    main()
