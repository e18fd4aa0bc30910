"""A true-size, randomly initialised model trained for a few steps with the seed recipe's budgets, for scripts/gpu_check.sh.

    python scripts/gpu_big_run.py --config tests/data/qwen3_4b_config.json --tokenizer TINY_MODEL_DIR --data DATA_DIR \
        --out DIR [--steps 2] [--response-tokens 256] [--shrink] [--print-overrides] [key=value ...]

1. Builds the model from the architecture's config.json alone (no download): random weights, bfloat16 safetensors in
   DIR/model, with the tiny model's tokenizer (its ids are a subset of the model's vocabulary; eos / pad ids are the
   tokenizer's). On a GPU the weights are initialised on the device (seconds for 4B parameters).
   `--shrink` keeps the architecture's kind but makes it tiny (2 layers, hidden 64, the tokenizer's vocabulary): the CPU
   path of gpu_check.sh, where a 4B model would not fit.
2. Runs recipes/qwen3_4b_gsm8k.yaml on this process (1 GPU, the hf engine, its 1024-token prompts and token budgets,
   KL to the reference) with a small batch for `--steps` steps through train_grpo's own GRPOTrainer (setup, step, log),
   without the checkpoint at the end that a full run writes (45 GiB for Qwen3-4B: not the point here). Responses are
   capped at `--response-tokens` (256; data.max_response_length): random weights never emit EOS, so every sample
   decodes to the cap, and the hf engine's 1024 steps per sample would take most of a 10-minute check. 16 responses of
   ~300 tokens still fill the recipe's 3000-token micro-batch budget, the memory peak the plan is checked against
   (the plan is printed for the same overrides: `--print-overrides`).
3. Writes DIR/run/metrics.jsonl (every step's metrics, memory/{gen,update,push}_peak_mb among them) and DIR/big.json:
   parameters, mean prompt tokens, trajectories per step, build and setup seconds, the device's name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = REPO / "recipes" / "qwen3_4b_gsm8k.yaml"
SHRUNK = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_window_layers": 2}


def build_model(config_file: Path, tokenizer_dir: Path, out: Path, *, shrink: bool, device) -> int:
    """Random-init model of `config_file` saved to `out` (bf16 safetensors + the tokenizer); returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_json = json.loads(config_file.read_text())
    if shrink:
        config_json.update(SHRUNK, vocab_size=len(tokenizer))
    config_json.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json, indent=1))
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copy(out / "config.json", out / "architecture.json")  # what --print-plan --model-config reads
    params = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():  # the 8 GiB this copy held go back to the device before the run measures its phases
        torch.cuda.empty_cache()
    return params


def overrides(model_dir: Path, data_dir: Path, run_dir: Path, steps: int, response_tokens: int) -> list[str]:
    """The seed recipe on one process with the hf engine and a batch small enough for a few minutes' check."""
    return [f"model.path={model_dir}", f"data.max_response_length={response_tokens}",
            f"data.train_files=[{data_dir / 'train.parquet'}]", f"data.val_files=[{data_dir / 'test.parquet'}]",
            f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.n_gpus_per_node=1", "rollout.tensor_model_parallel_size=1",
            "rollout.name=hf", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
            "trainer.logger=[console,jsonl]", "reward.num_workers=0"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--response-tokens", type=int, default=256, help="data.max_response_length of the run")
    parser.add_argument("--shrink", action="store_true")
    parser.add_argument("--print-overrides", action="store_true", help="print the run's overrides, one a line, and exit")
    args, extra = parser.parse_known_args(argv)
    run_overrides = overrides(args.out / "model", args.data, args.out / "run", args.steps, args.response_tokens) + extra
    if args.print_overrides:  # what --print-plan / plan_measure take for the same run (scripts/gpu_check.sh)
        print("\n".join(run_overrides))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    import train_grpo
    from grpo_lib.checkpoints import checkpoint
    from grpo_lib.config import load_config
    from grpo_lib.core.distributed import init_distributed
    from grpo_lib.core.perf import capture_torch_threads, tune_allocator

    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    params = build_model(args.config, args.tokenizer, args.out / "model", shrink=args.shrink, device=device)
    build_s = time.perf_counter() - start
    print(f"gpu_big_run: built {params / 1e9:.2f}B random parameters in {build_s:.0f} s ({args.out / 'model'})", flush=True)
    cfg = load_config(RECIPE, run_overrides, world_size=1)
    if cfg.trainer.tune_allocator:
        tune_allocator()
    capture_torch_threads()
    init_distributed()
    resume = checkpoint.plan_resume(cfg)
    checkpoint.prepare_run_folder(cfg, resume)
    trainer = train_grpo.GRPOTrainer(cfg, world_size=1, rank=0, resume=resume)
    start = time.perf_counter()
    try:
        trainer.setup()
        setup_s = time.perf_counter() - start
        for step in range(1, args.steps + 1):
            metrics = trainer.step(step)
            trainer.parts.logger.log(step, metrics)
            trainer.parts.logger.advance()
        prompts = trainer.parts.train.prompt_ids
    finally:
        trainer.close()
    info = {"params": params, "build_s": build_s, "setup_s": setup_s, "steps": args.steps,
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "trajectories_per_step": cfg.data.train_batch_size * cfg.rollout.n, "ppo_epochs": cfg.actor.ppo_epochs,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "overrides": run_overrides}
    (args.out / "big.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "grpo_lib.core.distributed" in sys.modules:
        from grpo_lib.core.distributed import close_distributed

        close_distributed()
    sys.exit(code)
