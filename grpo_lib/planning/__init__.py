"""planning: what a recipe will need before anything loads.

    plan.py (the batch arithmetic and --print-plan)   memory.py (the memory plan per GPU, host memory, auto budgets)
    measure.py (the training phase measured on fake tensors, --print-plan --measure)

May import: every layer below it (core, algorithms, rollout's engine settings, config, model).
"""
