# Shared by scripts/gpu_check.sh and scripts/gpu_vllm_check.sh (sourced, not run): the verdict file and table, stages
# run each under its own timeout, and the tiny training runs. The sourcing script sets PY, WORK, STAGES and defines
# stage_NAME functions; `run_stage NAME LIMIT_S` runs one.
#
# How a stage runs: `timeout LIMIT bash SCRIPT --stage NAME` (its own process group, SIGKILLed 10 s after the TERM),
# within what is left of the check's BUDGET_S; its output goes to the terminal and to LOGS/NAME.log, and the runs it
# starts write their logs straight into LOGS (NAME.train.log ...), so a stage stopped at its timeout still leaves them;
# the rows it adds are printed as soon as it ends. The verdict table is rewritten before every stage (its last line
# `LABEL: INCOMPLETE: NAME running, not started: ...`, from PLANNED: the stages still to run, set by the sourcing
# script) and after it, so a check killed from outside leaves the rows of the stages that ended and a last line that
# says it did not end. A stage that times out, or exits non-zero without a row, gets a FAIL row naming the newest log
# it wrote with its last lines; one that cannot start because the budget is spent gets a SKIP row.
#
# Where the verdict goes: REPORT = $OUT when set (the lent machine's output folder, which comes back), else the work
# dir; printed at the start. REPORT/gpu_check_verdict.tsv (rows), REPORT/gpu_check_verdict.md (the table) and
# REPORT/gpu_check_logs.tar.gz (the logs folder, WORK/gpu_check_logs/: each stage's output and each run's log, packed
# again with every table): three files, since at most 8 come back from the lent machine's $OUT.

# Row statuses (scripts/gpu_report.py says what each means): OK, FAIL, SKIP, INFO.
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$(printf '%s' "$3" | tr '\t\n' '  ')" >> "$VERDICT"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

report_init() {  # NAME: the file prefix (gpu_check, gpu_vllm_check)
  REPORT=${OUT:-$WORK}
  mkdir -p "$REPORT" "$WORK/${1}_logs"
  VERDICT="$REPORT/${1}_verdict.tsv"; TABLE="$REPORT/${1}_verdict.md"; LOGS="$WORK/${1}_logs"; LABEL=$1
  LOGPACK="$REPORT/${1}_logs.tar.gz"
  : > "$VERDICT"
  START=$SECONDS
  DEADLINE=$((START + ${BUDGET_S:-570}))
  echo "$1: verdict table -> $TABLE (rows $VERDICT, logs $LOGS packed into $LOGPACK; work dir $WORK; budget ${BUDGET_S:-570} s)"
  export REPORT VERDICT TABLE LOGS LABEL LOGPACK
}

# write_table [RUNNING]: the table so far; while stages run (RUNNING) or PLANNED names some not started, its last line
# says INCOMPLETE (scripts/gpu_report.py table --pending)
write_table() {
  local pending=${1:+$1 running} args=()
  [ -n "${PLANNED:-}" ] && pending+="${pending:+, }not started: $PLANNED"
  [ -n "$pending" ] && args=(--pending "$pending")
  $PY scripts/gpu_report.py table "$VERDICT" --out "$TABLE" --label "$LABEL" --quiet "${args[@]}" || true
  pack_logs
}
# pack_logs: the logs folder as one file beside the table (written whole, then renamed: never half a file)
pack_logs() {
  tar -czf "$LOGPACK.part" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null && mv -f "$LOGPACK.part" "$LOGPACK"
  rm -f "$LOGPACK.part"
}
unplan() { local s keep=(); for s in ${PLANNED:-}; do [[ " $* " == *" $s "* ]] || keep+=("$s"); done; PLANNED="${keep[*]}"; }
# last_lines FILE [N]: a log's last N (3) lines on one line, for a row
last_lines() { tail -n "${2:-3}" "$1" 2>/dev/null | cut -c1-200 | paste -sd ' ' -; }
# error_lines FILE: its last 2 lines naming an error, else its last 2 lines, on one line
error_lines() { { grep -E "Error|error" "$1" | tail -2 | grep . || tail -2 "$1"; } 2>/dev/null | cut -c1-200 | paste -sd ' ' -; }

# run_stage NAME LIMIT_S: the stage's own timeout (TIMEOUT_NAME overrides LIMIT_S), cut to the budget left
run_stage() {
  local name=$1 var="TIMEOUT_$1" limit left before status start log
  limit=${!var:-$2}
  left=$((DEADLINE - SECONDS))
  before=$(wc -l < "$VERDICT")
  unplan "$name"
  if [ "$left" -lt "${MIN_STAGE_S:-20}" ]; then
    row "$name" SKIP "not started: $left s left of the check's BUDGET_S=${BUDGET_S:-570} s"
  else
    [ "$limit" -gt "$left" ] && limit=$left
    write_table "$name"
    echo "== stage $name (timeout $limit s)"
    touch "$WORK/.stage_start"
    start=$SECONDS
    timeout -k 10 "$limit" bash "$SELF" --stage "$name" 2>&1 | tee "$LOGS/$name.log"
    status=${PIPESTATUS[0]}
    # the newest log the stage wrote into LOGS (a run's), else its own output
    log=$(find "$LOGS" -maxdepth 1 -type f -newer "$WORK/.stage_start" ! -name "$name.log" -printf '%T@ %p\n' 2>/dev/null \
          | sort -n | tail -1 | cut -d' ' -f2-)
    log=${log:-$LOGS/$name.log}
    if [ "$status" -eq 124 ] || { [ "$status" -eq 137 ] && [ $((SECONDS - start)) -ge "$limit" ]; }; then
      row "$name" FAIL "TIMEOUT: no end within $limit s (TIMEOUT_$name=S sets it); the last lines of $log: $(last_lines "$log")"
    elif [ "$status" -eq 137 ]; then
      row "$name" FAIL "killed (137: out of memory?) after $((SECONDS - start)) s of its $limit s; the last lines of $log: $(last_lines "$log")"
    elif [ "$status" -ne 0 ] && [ "$(wc -l < "$VERDICT")" -eq "$before" ]; then
      row "$name" FAIL "the stage exited $status without a verdict row; the last lines of $log: $(last_lines "$log")"
    fi
  fi
  tail -n +$((before + 1)) "$VERDICT" | while IFS=$'\t' read -r n s d; do
    echo "verdict row: | $n | $s | $d |"
  done
  write_table
}

finish() {
  row "total" INFO "$((SECONDS - START)) s wall, work dir $WORK"
  $PY scripts/gpu_report.py table "$VERDICT" --out "$TABLE" --label "$LABEL"
  local status=$?
  pack_logs
  exit $status
}

# run_args OUT PROCESSES: the overrides every check run shares into RUN_ARGS (the tiny model, MODEL when set, and data;
# no validation; the weight-sync check after every push; 4 prompts x 4 responses per process)
run_args() {
  RUN_ARGS=(model.path="${MODEL:-$WORK/model}" data.train_files="[$WORK/data/train.parquet]"
    data.val_files="[$WORK/data/test.parquet]" trainer.default_local_dir="$1/run" trainer.test_freq=-1
    trainer.val_before_train=false trainer.check_weight_sync=true trainer.logger="[console,jsonl]"
    data.train_batch_size=$((4 * $2)) actor.ppo_mini_batch_size=$((4 * $2)) rollout.n=4)
}

# train NAME RECIPE STEPS_EXPECTED [key=value ...]: a run under accelerate launch into $WORK/NAME/run, its log written
# to LOGS/NAME.train.log ($WORK/NAME/train.log links to it), then its report row. Reads N, IDS, ON_GPU, TOL, ENGINE_ARGS
# (words), MODEL, ACCELERATE_CONFIG, WORK (with model/, data/, accelerate.yaml).
train() {
  local name=$1 recipe=$2 steps=$3 out="$WORK/$1" status smi="" engine=() log="$LOGS/$1.train.log"
  shift 3
  read -r -a engine <<< "${ENGINE_ARGS:-}"
  mkdir -p "$out"
  ln -sfn "$log" "$out/train.log"
  echo "== $name: $recipe $*"
  if [ "$ON_GPU" = 1 ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --id="$IDS" --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$out/smi.csv" 2>/dev/null &
    smi=$!
  fi
  run_args "$out" "$N"
  $PY -m accelerate.commands.launch --config_file "${ACCELERATE_CONFIG:-$WORK/accelerate.yaml}" train_grpo.py "$recipe" \
    "${RUN_ARGS[@]}" rollout.gpu_memory_utilization=0.3 rollout.kv_cache_memory_bytes=null "${engine[@]}" "$@" > "$log" 2>&1
  status=$?
  [ -n "$smi" ] && kill "$smi" 2>/dev/null
  grep -E "\] (actor|reference):|resumed from" "$log" || true
  if [ -s "$out/smi.csv" ]; then
    echo "  peak memory per GPU (nvidia-smi, whole process incl. the engine): $(awk -F', ' '{ if ($2 > p[$1]) p[$1] = $2 } END { for (g in p) printf "GPU %s %d MiB; ", g, p[g] }' "$out/smi.csv")"
  fi
  if [ "$status" -ne 0 ]; then
    row "$name" FAIL "training exited $status ($log): $(error_lines "$log")"
    return 1
  fi
  $PY scripts/gpu_report.py run "$out/run/metrics.jsonl" --name "$name" --steps "$steps" --tol "$TOL" --verdict "$VERDICT"
}

# prepare_inputs: the tiny model and data every training stage uses, and the accelerate config (its own: a default one
# in ~/.cache is not read)
prepare_inputs() {
  $PY data_prep/tiny_model.py --out "$WORK/model" --warmup-steps 0 > "$WORK/prep.log" 2>&1 \
    && $PY data_prep/synthetic.py --out "$WORK/data" --train-size 256 --test-size 16 >> "$WORK/prep.log" 2>&1 \
    || { row "prep" FAIL "tiny model / data: $(tail -2 "$WORK/prep.log" | tr '\n' ' ')"; return 1; }
  accelerate_config "$N" "$WORK/accelerate.yaml"
}

accelerate_config() {  # PROCESSES FILE: an accelerate config of its own (a default one in ~/.cache is not read)
  local kind=MULTI_GPU
  [ "$1" -eq 1 ] && kind=NO
  printf '%s\n' "compute_environment: LOCAL_MACHINE" "distributed_type: $kind" "num_machines: 1" "machine_rank: 0" \
    "num_processes: $1" "gpu_ids: all" "mixed_precision: 'no'" "rdzv_backend: static" "same_network: true" "use_cpu: false" \
    "main_training_function: main" > "$2"
}

# detect_gpus: GPUS (torch's count), TORCH, GPU_NAME, PROBLEM (why a machine with NVIDIA GPUs shows none: the message
# train_grpo.py gives, an old driver); a torch that does not import or a CUDA that does not answer is a FAIL row
detect_gpus() {
  local info
  info=$(timeout 120 $PY - <<'PYEOF'
import platform

import torch
from grpo_lib.core.distributed import gpu_visibility_problem
problem = gpu_visibility_problem()
n = torch.cuda.device_count()
name = torch.cuda.get_device_name(0) if n else "none"
gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if n else 80  # the plans' GPU size (80 GiB without one)
print(f"{n}\t{torch.__version__} (CUDA {torch.version.cuda})\t{name}\t{gib}\t{platform.python_version()}\t{problem or ''}")
PYEOF
) || { row "env: torch" FAIL "torch does not import or CUDA does not answer within 120 s: $info"; finish; }
  IFS=$'\t' read -r GPUS TORCH GPU_NAME GPU_GIB PYTHON_VERSION PROBLEM <<< "$info"
}
