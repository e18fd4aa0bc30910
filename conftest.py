"""pytest's root: puts the repository on sys.path (tests import grpo_lib, train_grpo and tests.*) and names the
markers of the two tiers: `make test-fast` runs neither marker, `make test` runs everything."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts the trainer (a subprocess, or a whole run in process) or a real engine")
    config.addinivalue_line("markers", "multiprocess: launches two or more processes (gloo, accelerate launch)")
