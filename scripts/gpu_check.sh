#!/usr/bin/env bash
# GPU smoke check of the sharded actor (not run in CI; needs a CUDA machine with the requirements.txt install).
#
#   scripts/gpu_check.sh            # N = every visible GPU
#   N=2 scripts/gpu_check.sh        # N processes / GPUs
#
# What it does: builds the tiny model and synthetic data (offline), runs 3 steps of recipes/tiny_cpu.yaml under
# `accelerate launch --num_processes N` (FSDP2 actor and reference, bf16 compute with fp32 master
# weights, colocated engine per process, weight-sync check after every push) with its own accelerate config (a
# default config in ~/.cache/huggingface/accelerate is not read), and, with vLLM and an even N, again with
# rollout.tensor_model_parallel_size=2 (the 4-GPU recipe's layout: pairs of processes form one engine). Per run:
#   - peak memory of each GPU the run uses (nvidia-smi --id, sampled every 0.5 s) and each rank's sharding line;
#   - the weight-sync error of every step (largest |engine - actor| logprob over all engines);
#   - every memory/* metric of metrics.jsonl (the actor's; the engine's sleep/wake memory where it logs it).
# With vLLM not importable it passes rollout.name=hf (the Hugging Face fallback engine). tests/test_gpu_check_script.py
# runs this script on CPU as on the lent GPU image (vllm blocked, a stand-in nvidia-smi), so only CUDA and the vLLM /
# TP-2 branch (whose training tests/test_tensor_parallel_train.py covers) are not run by it.
# Exit code: non-zero if training fails, or a weight-sync error exceeds WEIGHT_SYNC_TOL (default 5e-2: the engine
# and the actor both compute in bf16 on GPU, so their logprobs agree to ~1e-2, not to CPU's 1e-5).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
N=${N:-$($PY -c "import torch; print(torch.cuda.device_count())")}
TOL=${WEIGHT_SYNC_TOL:-5e-2}
[ "$N" -ge 1 ] || { echo "gpu_check: no CUDA device visible" >&2; exit 1; }
MISSING=$($PY -c "import importlib.util as u; print(' '.join(m for m in ['torch', 'accelerate', 'transformers', 'tokenizers', 'safetensors', 'yaml', 'pandas', 'pyarrow', 'tqdm'] if u.find_spec(m) is None))")
[ -z "$MISSING" ] || { echo "gpu_check: missing python packages: $MISSING (pip install -r requirements.txt, or just these)" >&2; exit 1; }
WORK=${WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
echo "gpu_check: $N GPU(s), work dir $WORK"

$PY data_prep/tiny_model.py --out "$WORK/model" --warmup-steps 0 >/dev/null
$PY data_prep/synthetic.py --out "$WORK/data" --train-size 256 --test-size 16 >/dev/null
ENGINE=()
$PY -c "import vllm" 2>/dev/null || { echo "gpu_check: vllm not importable, using rollout.name=hf"; ENGINE=(rollout.name=hf); }

IDS=$(seq -s, 0 $((N - 1)))  # physical GPUs the run uses (nvidia-smi ignores CUDA_VISIBLE_DEVICES)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && IDS=$(echo "$CUDA_VISIBLE_DEVICES" | cut -d, -f1-"$N")
KIND=MULTI_GPU; [ "$N" -eq 1 ] && KIND=NO
printf '%s\n' "compute_environment: LOCAL_MACHINE" "distributed_type: $KIND" "num_machines: 1" "machine_rank: 0" \
  "num_processes: $N" "gpu_ids: all" "mixed_precision: 'no'" "rdzv_backend: static" "same_network: true" "use_cpu: false" \
  "main_training_function: main" > "$WORK/accelerate.yaml"

# run_check NAME [key=value ...]: 3 steps into $WORK/NAME; prints its report; returns non-zero on failure
run_check() {
  local name=$1 out="$WORK/$1" status
  shift
  mkdir -p "$out"
  echo "== run $name: $*"
  nvidia-smi --id="$IDS" --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$out/smi.csv" &
  SMI=$!
  set +e
  $PY -m accelerate.commands.launch --config_file "$WORK/accelerate.yaml" \
    train_grpo.py recipes/tiny_cpu.yaml model.path="$WORK/model" \
    data.train_files="[$WORK/data/train.parquet]" data.val_files="[$WORK/data/test.parquet]" \
    trainer.default_local_dir="$out/run" trainer.total_training_steps=3 trainer.test_freq=-1 trainer.val_before_train=false \
    trainer.check_weight_sync=true trainer.logger="[console,jsonl]" data.train_batch_size=$((4 * N)) \
    actor.ppo_mini_batch_size=$((4 * N)) rollout.n=4 rollout.gpu_memory_utilization=0.3 rollout.kv_cache_memory_bytes=null \
    "${ENGINE[@]}" "$@" 2>&1 | tee "$out/train.log"
  status=${PIPESTATUS[0]}
  set -e
  kill $SMI 2>/dev/null || true
  echo
  echo "== $name: start-up sharding lines"
  grep -E "\] (actor|reference):" "$out/train.log" || true
  echo "== $name: peak memory per GPU (nvidia-smi, MiB, whole process incl. the engine)"
  awk -F', ' '{ if ($2 > peak[$1]) peak[$1] = $2 } END { for (g in peak) printf "GPU %s: %d MiB\n", g, peak[g] }' "$out/smi.csv" | sort
  [ "$status" -eq 0 ] || { echo "gpu_check: $name: training exited $status" >&2; return "$status"; }
  echo "== $name: per step: weight-sync error and memory/* metrics (metrics.jsonl)"
  $PY - "$out/run/metrics.jsonl" "$TOL" "$name" <<'PYEOF'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"timing_s/step"' in line]
worst = 0.0
for r in rows:
    err = r.get("debug/weight_sync_max_abs_diff", float("nan"))
    worst = max(worst, err) if not math.isnan(err) else float("inf")
    mem = "  ".join(f"{k}={v:.1f}" for k, v in sorted(r.items()) if k.startswith("memory/"))
    print(f"step {r['step']}: weight_sync_max_abs_diff={err:.3g}  {mem}")
ok = len(rows) == 3 and worst <= float(sys.argv[2])
print(f"gpu_check: {sys.argv[3]}: {'OK' if ok else 'FAILED'} (3 steps expected, got {len(rows)}; worst weight-sync error "
      f"{worst:.3g}, tolerance {sys.argv[2]})")
sys.exit(0 if ok else 1)
PYEOF
}

trap 'kill ${SMI:-} 2>/dev/null || true' EXIT
run_check tp1
if [ ${#ENGINE[@]} -eq 0 ] && [ $((N % 2)) -eq 0 ]; then
  run_check tp2 rollout.tensor_model_parallel_size=2
fi
echo "gpu_check: OK"
