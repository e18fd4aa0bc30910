"""model: the policy and the frozen models beside it, on the training side of the GPUs.

    actor.py (load, shard, optimizer, the update)   reference.py (the frozen reference; LoRA: the actor, adapters off)
    teacher.py (the distillation teacher)          fsdp.py (FSDP2 sharding, mixed precision, offload)
    lora.py (PEFT adapters)                        weights.py (the weights a push sends, merged or not)
    logprobs.py (the one logprob function)         attention.py (attention implementations, varlen, shared prefixes)
    batching.py (token-budgeted mini / micro-batches)   packing.py (rows packed into one sequence, exactly)

May import: core, algorithms, config.
"""
