#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (budget: under 9 minutes on one H200), run first thing.
#
#   scripts/gpu_wheels.sh           # beforehand, on a machine with network: the missing pure-Python wheels into .whl/
#   scripts/gpu_check.sh            # on the GPU machine, from the checkout root (N = every visible GPU)
#   N=2 scripts/gpu_check.sh        # N processes / GPUs for the tiny runs
#   STAGES="env tiny" scripts/gpu_check.sh   # only some stages (names below)
#
# For the lent machine as it is: Python 3.12, a CUDA torch (2.11 there), transformers, accelerate, peft, pandas,
# pyarrow, pyyaml, tensorboard, safetensors, tokenizers; no vllm, datasets or math-verify, no network. The wheels of
# .whl/ are installed with `pip install --target` into a clean folder of the work dir (PYTHONPATH), never into the
# machine's Python. Without vLLM every run uses rollout.name=hf. Stages, each a row of the verdict table at the end:
#   env      python / torch / CUDA / GPU (an old driver is named as such: CUDA 13 builds need R580+), packages, the
#            .whl/ install (one MATH answer scored with the installed math-verify), every torch API the code names
#            (scripts/torch_api_check.py)
#   tiny     3 steps of recipes/tiny_cpu.yaml on N GPUs under accelerate launch (FSDP2, bf16 compute, fp32 master
#            weights, the hf engine), the weight-sync check after every push (within WEIGHT_SYNC_TOL, default 5e-2:
#            engine and actor both compute in bf16 on GPU); with vLLM and an even N again with tensor parallel 2
#   attention  scripts/gpu_attention_check.py: grpo_varlen's shared prompts in one varlen_attn call against the
#            per-continuation path (bf16 values and gradients, both timed at a Qwen3-4B layer's shape), and the start-up
#            packing isolation check on the GPU in bf16
#   packed   3 steps with model.use_remove_padding=true and bf16 compute on a warmed tiny model (its responses stop at
#            spread lengths): packed and shared-prompt micro-batches (perf/shared_prefix > 0 required), the isolation
#            check on the sharded policy, the weight probe's ratios (rollout/weight_probe_ratio) printed; WARM_MODEL=DIR
#            uses a model folder of that kind instead of warming one up (~20 s on CPU)
#   lora     recipes/tiny_cpu_lora.yaml, bf16 compute, 2 steps (adapters only, merged push), weight sync checked
#   resume   2 steps saving a DCP checkpoint each step, then the same command to 3 steps: resumes from step 2 on CUDA
#   gputest  the suite's GPU-only tests (pytest from .whl/): the offload of shards to the host and back
#   big      a true-size random-init Qwen3-4B (tests/data/qwen3_4b_config.json, no download) for BIG_STEPS (2) steps
#            with the seed recipe's lengths (scripts/gpu_big_run.py): peak memory per phase against the 1-process
#            plan (--print-plan; and --measure where plan.py has it), step time, tokens/s, MFU; BIG_ARGS="key=value ..."
#            overrides it (e.g. data.max_response_length=128 for a CPU run)
# CPU: every stage runs as it would on the GPU image (tests/test_gpu_check_script.py runs `env tiny` with vllm
# blocked); BIG_SHRINK=1 (the default without CUDA) builds the same architecture shrunk, since 4B parameters with
# AdamW do not fit a laptop. Exit code: non-zero when any row of the verdict table FAILED.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
TOL=${WEIGHT_SYNC_TOL:-5e-2}
STAGES=${STAGES:-env attention tiny packed lora resume gputest big}
WORK=${WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$WORK"
VERDICT="$WORK/verdict.tsv"
: > "$VERDICT"
START=$SECONDS
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$VERDICT"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
finish() {
  row "total" INFO "$((SECONDS - START)) s wall, work dir $WORK"
  $PY scripts/gpu_report.py table "$VERDICT"
  exit $?
}

# -- env: before anything runs --------------------------------------------------------------------------------------
$PY -c "import sys; assert sys.version_info >= (3, 11), sys.version" 2>/dev/null \
  || { row "env: python" FAIL "$($PY --version 2>&1): needs Python >= 3.11"; finish; }
MISSING=$($PY -c "import importlib.util as u; print(' '.join(m for m in ['torch', 'accelerate', 'transformers', 'tokenizers', 'safetensors', 'yaml', 'pandas', 'pyarrow', 'tqdm', 'peft'] if u.find_spec(m) is None))")
[ -z "$MISSING" ] || { row "env: packages" FAIL "missing python packages: $MISSING (pip install -r requirements.txt, or just these)"; finish; }
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then  # the wheels of scripts/gpu_wheels.sh, into a clean folder
  SITE="$WORK/site"
  rm -rf "$SITE"
  if $PY -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl > "$WORK/pip.log" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    row "env: wheels" OK "$(ls "$WHEELS"/*.whl | wc -l) wheels of $WHEELS/ installed with pip --target into $SITE"
  else
    row "env: wheels" FAIL "pip install --target $SITE $WHEELS/*.whl failed: $(tail -2 "$WORK/pip.log" | tr '\n' ' ')"
  fi
else
  row "env: wheels" INFO "no .whl/ (run scripts/gpu_wheels.sh on a machine with network): the MATH reward and the GPU tests are skipped"
fi
# GPUs: torch's count, or why a machine with NVIDIA GPUs shows none (the message train_grpo.py gives: an old driver)
GPU_INFO=$($PY - <<'PYEOF'
import torch
from grpo_lib.distributed import gpu_visibility_problem
problem = gpu_visibility_problem()
n = torch.cuda.device_count()
name = torch.cuda.get_device_name(0) if n else "none"
print(f"{n}\t{torch.__version__} (CUDA {torch.version.cuda})\t{name}\t{problem or ''}")
PYEOF
) || { row "env: torch" FAIL "torch does not import: $GPU_INFO"; finish; }
IFS=$'\t' read -r GPUS TORCH GPU_NAME PROBLEM <<< "$GPU_INFO"
N=${N:-$GPUS}
if [ -n "$PROBLEM" ]; then
  row "env: gpu" FAIL "$PROBLEM"; finish
elif [ "$GPUS" -ge 1 ]; then
  row "env: gpu" OK "torch $TORCH, $GPUS x $GPU_NAME, python $($PY -c 'import platform; print(platform.python_version())')"
  ON_GPU=1
elif [ "${ALLOW_CPU:-0}" = 1 ]; then
  row "env: gpu" INFO "torch $TORCH, no CUDA device: the CPU path (ALLOW_CPU=1), as on the GPU image but without CUDA"
  ON_GPU=0; N=${N:-1}; [ "$N" -ge 1 ] || N=1
else
  row "env: gpu" FAIL "torch $TORCH sees no CUDA device and the NVIDIA driver lists none (no GPU here; ALLOW_CPU=1 runs the CPU path)"
  finish
fi
if has env; then
  if $PY -c "import math_verify" 2>/dev/null; then
    if $PY -c "
import math_verify, sys
from grpo_lib.rewards.math import score as math_score
score = math_score(r'so the answer is \boxed{\frac{1}{2}}', '0.5')
sys.exit(0 if score == 1.0 else f'math reward scored {score} for 1/2 == 0.5')" > "$WORK/math.log" 2>&1; then
      row "env: math reward" OK "math_verify from $($PY -c 'import math_verify, os; print(os.path.dirname(math_verify.__file__))') scores \\frac{1}{2} == 0.5"
    else
      row "env: math reward" FAIL "$(tail -1 "$WORK/math.log")"
    fi
  fi
  if $PY scripts/torch_api_check.py > "$WORK/torch_api.log" 2>&1; then
    row "env: torch APIs" OK "$(tail -1 "$WORK/torch_api.log" | sed 's/^torch_api_check: //')"
  else
    row "env: torch APIs" FAIL "$(grep -E "MISSING|SIGNATURE" "$WORK/torch_api.log" | head -5 | tr '\n' ';')"
  fi
fi

# -- shared inputs ----------------------------------------------------------------------------------------------------
$PY data_prep/tiny_model.py --out "$WORK/model" --warmup-steps 0 > "$WORK/prep.log" 2>&1 \
  && $PY data_prep/synthetic.py --out "$WORK/data" --train-size 256 --test-size 16 >> "$WORK/prep.log" 2>&1 \
  || { row "prep" FAIL "tiny model / data: $(tail -2 "$WORK/prep.log" | tr '\n' ' ')"; finish; }
WARM=${WARM_MODEL:-$WORK/model_warm}  # WARM_MODEL: a model folder whose responses already stop at spread lengths
if has packed && [ -z "${WARM_MODEL:-}" ]; then  # a warmed model: its responses end at spread lengths (random weights never stop: no spread)
  $PY data_prep/tiny_model.py --out "$WARM" --warmup-steps 300 >> "$WORK/prep.log" 2>&1 \
    || row "prep: warmed model" FAIL "$(tail -2 "$WORK/prep.log" | tr '\n' ' ')"
fi
ENGINE=()
if ! $PY -c "import vllm" 2>/dev/null; then
  ENGINE=(rollout.name=hf)
  row "env: engine" INFO "vllm not importable: every run uses rollout.name=hf (no tensor-parallel run)"
fi
IDS=$(seq -s, 0 $((N - 1)))  # physical GPUs the runs use (nvidia-smi ignores CUDA_VISIBLE_DEVICES)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && IDS=$(echo "$CUDA_VISIBLE_DEVICES" | cut -d, -f1-"$N")
KIND=MULTI_GPU; [ "$N" -eq 1 ] && KIND=NO
printf '%s\n' "compute_environment: LOCAL_MACHINE" "distributed_type: $KIND" "num_machines: 1" "machine_rank: 0" \
  "num_processes: $N" "gpu_ids: all" "mixed_precision: 'no'" "rdzv_backend: static" "same_network: true" "use_cpu: false" \
  "main_training_function: main" > "$WORK/accelerate.yaml"  # its own config: a default one in ~/.cache is not read

# train NAME RECIPE STEPS_EXPECTED [key=value ...]: a run under accelerate launch into $WORK/NAME/run, then its report row
train() {
  local name=$1 recipe=$2 steps=$3 out="$WORK/$1" status smi=""
  shift 3
  mkdir -p "$out"
  echo "== $name: $recipe $*"
  if [ "$ON_GPU" = 1 ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --id="$IDS" --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$out/smi.csv" 2>/dev/null &
    smi=$!
  fi
  $PY -m accelerate.commands.launch --config_file "$WORK/accelerate.yaml" train_grpo.py "$recipe" model.path="${MODEL:-$WORK/model}" \
    data.train_files="[$WORK/data/train.parquet]" data.val_files="[$WORK/data/test.parquet]" \
    trainer.default_local_dir="$out/run" trainer.test_freq=-1 trainer.val_before_train=false \
    trainer.check_weight_sync=true trainer.logger="[console,jsonl]" data.train_batch_size=$((4 * N)) \
    actor.ppo_mini_batch_size=$((4 * N)) rollout.n=4 rollout.gpu_memory_utilization=0.3 rollout.kv_cache_memory_bytes=null \
    "${ENGINE[@]}" "$@" > "$out/train.log" 2>&1
  status=$?
  [ -n "$smi" ] && kill "$smi" 2>/dev/null
  grep -E "\] (actor|reference):|resumed from" "$out/train.log" || true
  if [ -s "$out/smi.csv" ]; then
    echo "  peak memory per GPU (nvidia-smi, whole process incl. the engine): $(awk -F', ' '{ if ($2 > p[$1]) p[$1] = $2 } END { for (g in p) printf "GPU %s %d MiB; ", g, p[g] }' "$out/smi.csv")"
  fi
  if [ "$status" -ne 0 ]; then
    row "$name" FAIL "training exited $status: $(grep -E "Error|error" "$out/train.log" | tail -2 | tr '\n' ' ' | cut -c1-300) ($out/train.log)"
    return 1
  fi
  $PY scripts/gpu_report.py run "$out/run/metrics.jsonl" --name "$name" --steps "$steps" --tol "$TOL" --verdict "$VERDICT"
}

if has attention; then
  if $PY scripts/gpu_attention_check.py > "$WORK/attention.log" 2>&1; then
    if grep -q "no CUDA device" "$WORK/attention.log"; then row "attention" INFO "$(tail -1 "$WORK/attention.log")"
    else row "attention" OK "$(grep -v 'gpu_attention_check: OK' "$WORK/attention.log" | sed 's/^gpu_attention_check: //' | tr '\n' ' ' | cut -c1-600)"; fi
  else
    row "attention" FAIL "$(grep FAILED "$WORK/attention.log" | head -3 | tr '\n' ' ' | cut -c1-600) ($WORK/attention.log)"
  fi
  cat "$WORK/attention.log"
fi
if has tiny; then
  train tiny recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3
  if [ ${#ENGINE[@]} -eq 0 ] && [ $((N % 2)) -eq 0 ]; then
    train tiny_tp2 recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3 rollout.tensor_model_parallel_size=2
  fi
fi
if has packed && [ -f "$WARM/config.json" ]; then
  if MODEL="$WARM" train packed recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3 \
       model.use_remove_padding=true actor.fsdp_config.param_dtype=bfloat16; then
    $PY scripts/gpu_report.py layouts "$WORK/packed/run/metrics.jsonl" --name "packed: layouts" --verdict "$VERDICT"
  fi
fi
if has lora; then
  train lora_bf16 recipes/tiny_cpu_lora.yaml 1,2 trainer.total_training_steps=2 actor.fsdp_config.param_dtype=bfloat16
fi
if has resume; then  # DCP save at steps 1 and 2, then the same command to step 3: a resume from step 2
  if train resume_save recipes/tiny_cpu.yaml 1,2 trainer.total_training_steps=2 trainer.save_freq=1; then
    mkdir -p "$WORK/resume_load" && cp -r "$WORK/resume_save/run" "$WORK/resume_load/run"
    train resume_load recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3 trainer.save_freq=1 \
      && { grep -q "resumed from .*global_step_2" "$WORK/resume_load/train.log" \
           || row "resume_load: resumed" FAIL "no 'resumed from .../global_step_2' line in $WORK/resume_load/train.log"; }
  fi
fi
if has gputest; then
  if $PY -c "import pytest" 2>/dev/null; then
    $PY -m pytest -q -p no:cacheprovider tests/test_fsdp.py -k on_gpu > "$WORK/gputest.log" 2>&1
    status=$?
    summary=$(tail -1 "$WORK/gputest.log")
    if [ "$status" -ne 0 ]; then row "gputest" FAIL "$summary ($WORK/gputest.log)";
    elif [[ "$summary" == *skipped* ]]; then row "gputest" INFO "$summary (no CUDA)"; else row "gputest" OK "$summary"; fi
  else
    row "gputest" INFO "pytest not importable (scripts/gpu_wheels.sh brings it): skipped"
  fi
fi
if has big; then
  BIG="$WORK/big"
  CONFIG=${BIG_MODEL_CONFIG:-tests/data/qwen3_4b_config.json}
  SHRINK=(); [ "${BIG_SHRINK:-$((1 - ON_GPU))}" = 1 ] && SHRINK=(--shrink)
  read -r -a BIG_EXTRA <<< "${BIG_ARGS:-}"  # key=value overrides of the big run (CPU: a shorter response, say)
  echo "== big: $CONFIG ${SHRINK[*]}, ${BIG_STEPS:-2} steps ${BIG_EXTRA[*]}"
  if $PY scripts/gpu_big_run.py --config "$CONFIG" --tokenizer "$WORK/model" --data "$WORK/data" --out "$BIG" \
       --steps "${BIG_STEPS:-2}" "${SHRINK[@]}" "${BIG_EXTRA[@]}" > "$BIG.log" 2>&1; then
    GIB=$($PY -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80)")
    mapfile -t OVERRIDES < <($PY -c "import json, sys; print('\n'.join(json.load(open(sys.argv[1]))['overrides']))" "$BIG/big.json")
    PLAN=(train_grpo.py recipes/qwen3_4b_gsm8k.yaml "${OVERRIDES[@]}" --print-plan --num-processes 1
          --gpu-memory-gb "$GIB" --model-config "$BIG/model/architecture.json")
    $PY "${PLAN[@]}" > "$BIG/plan.txt" 2>&1
    MEASURE=()
    if grep -q -- "--measure" grpo_lib/plan.py 2>/dev/null; then
      $PY "${PLAN[@]}" --measure > "$BIG/measure.txt" 2>&1; MEASURE=(--measure "$BIG/measure.txt")
    fi
    $PY scripts/gpu_report.py big "$BIG" --plan "$BIG/plan.txt" "${MEASURE[@]}" --verdict "$VERDICT"
  else
    row "big" FAIL "scripts/gpu_big_run.py failed: $(grep -E "Error|error" "$BIG.log" | tail -2 | tr '\n' ' ' | cut -c1-300) ($BIG.log)"
  fi
fi
finish
