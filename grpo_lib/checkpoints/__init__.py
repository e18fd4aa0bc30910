"""checkpoints: a run that is never lost.

    checkpoint.py (save, resume plan, load: DCP shards, the sampler, metrics)   integrity.py (digests, verification)
    lock.py (one run per folder)

May import: core, config.
"""
