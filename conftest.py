"""pytest's root: puts the repository on sys.path (tests import grpo_lib, train_grpo and tests.*) and names the
markers of the two tiers: `make test-fast` runs neither marker, `make test` runs everything (in two phases: all but
`wallclock` on parallel workers, then the `wallclock` tests alone, so a neighbour's load cannot break their bounds)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts the trainer (a subprocess, or a whole run in process) or a real engine")
    config.addinivalue_line("markers", "multiprocess: launches two or more processes (gloo, accelerate launch)")
    config.addinivalue_line("markers", "wallclock: asserts a wall-clock bound of a few seconds; `make test` runs these alone")
