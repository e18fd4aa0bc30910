"""pytest's root: puts the repository on sys.path (tests import grpo_lib, train_grpo and tests.*) and names the
markers of the two tiers: `make test-fast` runs neither marker, `make test` runs everything (in two phases: all but
`wallclock` on parallel workers, then the `wallclock` tests alone, so a neighbour's load cannot break their bounds)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts the trainer (a subprocess, or a whole run in process) or a real engine")
    config.addinivalue_line("markers", "multiprocess: launches two or more processes (gloo, accelerate launch)")
    config.addinivalue_line("markers", "wallclock: asserts a wall-clock bound of a few seconds; `make test` runs these alone")


# Rough cost of a test for ordering only: a multiprocess launch, a trainer or engine start, an in-process test.
_COST = {"multiprocess": 3.0, "slow": 1.0}
_IN_PROCESS_COST = 0.02


def pytest_collection_modifyitems(config, items):
    """Costliest test files first, each file's tests in their own order. `make test`'s workers take whole files
    (`--dist loadfile`) in this order, so the long files start early and the short ones fill in at the end (a long
    file started last kept one worker busy for minutes while the other had nothing left)."""
    cost: dict[str, float] = {}
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        cost[item.fspath.strpath] = cost.get(item.fspath.strpath, 0.0) + \
            max((c for name, c in _COST.items() if name in marks), default=_IN_PROCESS_COST)
    items.sort(key=lambda item: -cost[item.fspath.strpath])  # stable: a file's tests keep their order
