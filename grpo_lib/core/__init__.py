"""core: the run's plumbing and shared vocabulary, below every other layer.

    names.py (the registries' names, torch-free)   types.py (the typed containers between phases)   dtypes.py
    seeds.py (per-sample seeds, TP shares)         distributed.py (process group, collectives)     perf.py (threads,
    allocator, phase memory)   stopping.py (SIGTERM / SIGINT agreed)   metrics.py (the metric table, reducer, sinks)
    preflight.py (model and run folder checks before anything heavy loads)   devices.py (pinned non-blocking copies)
    processes.py (a child process that dies with its parent)

May import: nothing of grpo_lib outside core (the standard library, torch, numpy).
"""
