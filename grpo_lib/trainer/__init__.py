"""trainer: the phases of one step that sit between the engine, the rewards and the actor, and the run's
command line around train_grpo.py's GRPOTrainer (the top layer).

    step.py (batch building, rewards, advantages, validation, timings)   rounds.py (rollout rounds, DAPO's group
    filter, the rollout metrics)   launch.py (the command line: config and folder checks, the run lock, resume, set-up)

May import: every layer below it.
"""
