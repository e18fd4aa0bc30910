"""Sync tool calls in killable worker processes (grpo_lib/tools/workers.py, the placements of grpo_lib/tools/calls.py;
issue 30 item 6): a timed-out CPU-bound or sleeping call is killed with its worker, so no thread, process or CPU of
the trainer is left behind (before, each one ran on in an abandoned thread: a CPU-bound one slowed the trainer 10x
after 24 timeouts, a sleeping one leaked 82 threads)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from grpo_lib.tools.base import BaseTool, ToolSchema
from grpo_lib.tools.builtin import CalculatorTool
from grpo_lib.tools.calls import ToolBox
from grpo_lib.tools.config import ToolConfigError
from grpo_lib.tools.hermes import ToolCall


def schema(name: str) -> ToolSchema:
    return ToolSchema({"type": "function", "function": {"name": name, "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}})


def box_of(*tools, timeout_s=5.0, **kwargs) -> ToolBox:
    return ToolBox({t.name: t for t in tools}, timeout_s=timeout_s, max_response_chars=500, truncate_side="left", **kwargs)


class Spins(BaseTool):
    """CPU-bound: spins for 20 s (ends by itself, so a runtime that fails to kill it cannot spin the suite forever)."""

    def execute(self, instance_id, parameters, **kwargs):
        end = time.monotonic() + 20
        while time.monotonic() < end:
            pass
        return "late"


class Naps(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        time.sleep(20)
        return "late"


class Echo(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        print("a tool's own print goes to stderr, not into the reply")
        return f"echo {parameters['x']} from {os.getpid()}", 0.5, {}


class Dies(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        os._exit(7)


def _children() -> list[int]:
    """Live (not zombie) child processes of this process."""
    me, out = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[1] == me and stat[0] != "Z":  # fields after the name: state, ppid
            out.append(int(pid))
    return out


def _tasks() -> set[int]:
    """Thread ids (tids) of this process."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _cpu_s(tids) -> float:
    """CPU seconds (user + system) used so far by those of this process's threads that are not in `tids` (the threads
    started since `tids` was taken; threads other tests of this process left behind are not counted)."""
    ticks = 0
    for tid in _tasks() - set(tids):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def _new_threads(before: set) -> int:
    return len(set(threading.enumerate()) - before)


def _settled(count, bound: int, seconds: float = 5.0) -> int:
    """count() once it is <= bound (a killed worker's reaper thread ends just after the reap), or after `seconds`."""
    deadline = time.monotonic() + seconds
    while count() > bound and time.monotonic() < deadline:
        time.sleep(0.02)
    return count()


def test_cpu_bound_calls_that_time_out_leave_no_process_thread_or_cpu_behind():
    box = box_of(Spins({}, schema("spin")), Echo({}, schema("echo")), timeout_s=0.5)
    try:
        assert box.placements == {"spin": "process", "echo": "process"}
        threads, children, tids = set(threading.enumerate()), set(_children()), _tasks()
        for i in range(4):
            [spin] = box.run([("e", ToolCall("spin", {"x": str(i)}))])
            assert (spin.kind, spin.text, spin.abandoned) == ("timeout", "Error: spin did not answer within 0.5 s.", False)
        [echo] = box.run([("e", ToolCall("echo", {"x": "1"}))])  # the box still answers
        assert echo.kind == "ok" and echo.text.startswith("echo 1 from "), echo
        assert box._pool.killed == 4 and box._pool.started == 5  # one worker killed per timeout, a fresh one after each
        # what is left: the echo worker, idle; no spinning worker and no abandoned thread
        assert len(set(_children()) - children) <= 1, _children()
        assert _settled(lambda: _new_threads(threads), 1) <= 1  # the idle worker's reaper (asyncio's child watcher)
        # an abandoned spinning thread would hold the GIL and burn ~1 CPU second per second of this window (measured:
        # 1.0 s for one such call run in a thread instead, on this 2-core machine)
        before = _cpu_s(tids)
        time.sleep(1.0)
        assert _cpu_s(tids) - before < 0.25, "CPU still used by this process after the calls were answered"
    finally:
        box.close()
    assert set(_children()) <= children, "close kills and reaps the idle worker"


def test_sleeping_calls_that_time_out_leak_no_thread():
    box = box_of(Naps({}, schema("nap")), timeout_s=0.2)
    try:
        assert box.placements == {"nap": "process"}
        threads, children = set(threading.enumerate()), set(_children())
        for _ in range(4):  # 16 timeouts: in threads, 16 sleepers would still run
            outs = box.run([(f"e{j}", ToolCall("nap", {"x": "1"})) for j in range(4)])
            assert [(o.kind, o.abandoned) for o in outs] == [("timeout", False)] * 4
            assert _settled(lambda: _new_threads(threads), 4) <= 4, "a reaper per live worker at most"
        assert box._pool.killed == 16 and box.abandoned_running == {"nap": 0}
        assert _settled(lambda: _new_threads(threads), 0) == 0  # every worker killed and reaped: no reaper left
        assert set(_children()) <= children
    finally:
        box.close()


def test_a_worker_that_dies_is_that_calls_error_and_the_next_call_gets_a_fresh_one():
    box = box_of(Dies({}, schema("die")), Echo({}, schema("echo")))
    try:
        died, echo = box.run([("e", ToolCall("die", {"x": "1"})), ("e", ToolCall("echo", {"x": "1"}))])
        assert died.kind == "error" and died.text == "Error: die failed: its worker process exited (status 7) during the call"
        assert (echo.kind, echo.step_reward) == ("ok", 0.5) and echo.text.startswith("echo 1 from ")
        assert int(echo.text.rsplit(" ", 1)[1]) != os.getpid(), "execute ran in a worker, not in this process"
        [again] = box.run([("e", ToolCall("die", {"x": "2"}))])
        assert again.kind == "error" and "exited (status 7)" in again.text
    finally:
        box.close()


class Raises(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        raise SystemExit(3)


def test_a_base_exception_in_a_worker_is_an_error_observation_and_the_worker_lives_on():
    box = box_of(Raises({}, schema("bad")))
    try:
        first, second = box.run([("e", ToolCall("bad", {"x": "1"}))]), box.run([("e", ToolCall("bad", {"x": "2"}))])
        assert [o.text for o in first + second] == ["Error: bad failed: SystemExit: 3"] * 2
        assert box._pool.started == 1, "the worker caught it: no restart"
    finally:
        box.close()


class Stateful(BaseTool):
    def create(self, instance_id=None, **kwargs):
        return instance_id

    def execute(self, instance_id, parameters, **kwargs):
        return "x"


class Unpicklable(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.lock = threading.Lock()

    def execute(self, instance_id, parameters, **kwargs):
        return "x"


class AsyncTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "x"


class ForcedProcess(Unpicklable):
    execute_in = "process"


class ForcedThread(Echo):
    execute_in = "thread"


def test_where_each_kind_of_tool_runs():
    from grpo_lib.tools.builtin import Gsm8kTool

    tools = [Stateful({}, schema("stateful")), Unpicklable({}, schema("lock")), AsyncTool({}, schema("async")),
             ForcedThread({}, schema("forced")), CalculatorTool({}, schema("calc")), Gsm8kTool({}, schema("gsm8k")),
             Echo({}, schema("echo"))]
    box = box_of(*tools)
    try:
        assert box.placements == {"stateful": "thread", "lock": "thread", "async": "loop", "forced": "thread",
                                  "calc": "thread", "gsm8k": "thread", "echo": "process"}
        [forced] = box.run([("e", ToolCall("forced", {"x": "1"}))])
        assert forced.text == f"echo 1 from {os.getpid()}", "execute_in = 'thread' runs in this process"
    finally:
        box.close()
    with pytest.raises(ToolConfigError, match=r"tool lock: execute_in = 'process', but the tool cannot be pickled .*"
                                              r"set execute_in = 'thread'"):
        box_of(ForcedProcess({}, schema("lock")))



def test_a_worker_dies_with_a_trainer_that_dies_mid_call(tmp_path):
    """The trainer killed (or exiting without close) while a call spins: its worker must not spin on as an orphan."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = (
        "import os, sys, threading, time\n"
        f"sys.path[:0] = [{str(repo)!r}, {str(repo / 'tests' / 'tools')!r}]\n"
        "from test_tools_workers import Spins, box_of, schema, ToolCall, _children\n"
        "box = box_of(Spins({}, schema('spin')), timeout_s=60)\n"
        "threading.Thread(target=lambda: box.run([('e', ToolCall('spin', {'x': '1'}))]), daemon=True).start()\n"
        "deadline = time.monotonic() + 60\n"
        "while not _children() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print(*_children(), flush=True)\n"
        "os._exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    [worker] = [int(p) for p in proc.stdout.split()]
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        alive = "grpo_lib.tools.workers" in open(f"/proc/{worker}/cmdline").read()  # not a reused pid
    except OSError:  # gone
        alive = False
    assert not alive, f"worker {worker} outlived its trainer ({proc.stderr[-2000:]})"


def test_a_worker_starts_whatever_the_trainer_s_working_directory(tmp_path, monkeypatch):
    """`python /path/to/train_grpo.py` run from another folder: the worker (`python -m grpo_lib.tools.workers`) still
    finds grpo_lib (before, it imported it from the working directory only, and every call was an error)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    box = box_of(Echo({}, schema("echo")))
    try:
        [echo] = box.run([("e", ToolCall("echo", {"x": "1"}))])
        assert echo.kind == "ok" and echo.text.startswith("echo 1 from "), echo.text
    finally:
        box.close()


def test_the_turn_bound_counts_the_calls_already_waiting_for_a_worker(monkeypatch):
    """The per-episode loop runs one batch per episode on one pool: a batch behind 16 calls already taken (of other
    episodes) waits a wave for a worker, and its bound says so (before, each batch counted only its own calls, and a
    healthy run could stop as stalled)."""
    box = box_of(Echo({}, schema("echo")), timeout_s=5.0, max_workers=16, worker_start_timeout_s=7.0)
    bounds = []
    monkeypatch.setattr(box, "_run_all", lambda jobs, bound_s=None: (bounds.append(bound_s), [job.close() for job in jobs])[1])
    try:
        box.run([("e", ToolCall("echo", {"x": "1"}))])
        box._pool.outstanding = 16  # 16 calls of other episodes taken by the pool and not yet answered
        box.run([("e", ToolCall("echo", {"x": "1"}))])
        assert bounds == [1 * 5.0 + 1 * 7.0 + box.stall_grace_s, 2 * 5.0 + 2 * 7.0 + box.stall_grace_s], bounds
    finally:
        box._pool.outstanding = 0
        box.close()
