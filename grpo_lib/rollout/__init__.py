"""rollout: from dataset rows to scored episodes on the engines, and the weights the engines serve.

    data.py (parquet rows -> prompts, the resumable sampler)   engines/ (vLLM and hf behind one protocol)
    episodes.py (the per-episode multi-turn loop with tools)   validation.py (validation metrics and samples)
    weight_sync.py (pushes with versions)                      weight_probe.py (proof of what the engine serves)
    judge.py (the generative judge on its own vLLM engine)     engines/vllm_lora.py (adapter-only LoRA pushes)

May import: core, algorithms, rewards, tools.
"""
