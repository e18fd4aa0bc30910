#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine, run first thing; every stage under its own timeout, the whole
# within BUDGET_S (570 s). BUDGET_S plus the last stage's kill grace (10 s) and the final table bound the command itself
# (the lent machine allows 10 minutes a command); the machine's start-up is not in it (charged to the device budget).
#
#   scripts/gpu_wheels.sh           # beforehand, on a machine with network: the missing pure-Python wheels into .whl/
#   scripts/gpu_check.sh            # on the GPU machine, from the checkout root (N = every visible GPU)
#   N=2 scripts/gpu_check.sh        # N processes / GPUs for the tiny runs
#   STAGES="env tiny" scripts/gpu_check.sh   # only some stages (names below)
#   TIMEOUT_big=400 BUDGET_S=900 scripts/gpu_check.sh   # a stage's timeout, the whole check's budget (seconds)
#
# For the lent machine as it is: Python 3.12, a CUDA torch (2.11 there), transformers, accelerate, peft, pandas,
# pyarrow, pyyaml, tensorboard, safetensors, tokenizers; no vllm, datasets or math-verify, no network. The wheels of
# .whl/ are installed with `pip install --target` into a clean folder of the work dir (PYTHONPATH), never into the
# machine's Python. Without vLLM every run uses rollout.name=hf; what only vLLM on a GPU shows (sleep / wake, a reload
# under CUDA graphs, TP 2, the probe on vLLM's kernels) is scripts/gpu_vllm_check.sh's, for a machine with vLLM.
#
# Verdict: one row per check (scripts/gpu_report.py): OK, FAIL (wrong, crashed or timed out), SKIP (could not run
# here, with the reason: it proves nothing) or INFO (numbers shown, not judged). Each stage's rows are printed as it
# ends and the table is rewritten under $OUT (when set: the lent machine's output folder) or the work dir, as
# gpu_check_verdict.md / .tsv and gpu_check_logs.tar.gz (the work dir's gpu_check_logs/, each stage's log and each
# run's log written there as they run, packed with every table: at most 8 files come back from the lent machine's
# $OUT; the paths are printed first). The last line counts them: `gpu_check: OK (...)`, `gpu_check: no failure, but K SKIPPED
# ...: names` or `gpu_check: FAILED: names (...)`; while a stage runs (or if the check was killed mid-way) it reads
# `gpu_check: INCOMPLETE: NAME running, not started: ...`. Exit code: 1 when a row FAILED; SKIPs alone exit 0 (read
# their reasons: a SKIP checked nothing).
#
# Stages (default timeout in seconds; lib: scripts/gpu_check_lib.sh):
#   env (120)      python / torch / CUDA / GPU (an old driver is named as such: CUDA 13 builds need R580+), packages, the
#                  .whl/ install (one MATH answer scored with the installed math-verify), every torch API the code names
#                  (scripts/torch_api_check.py)
#   prep (150)     the tiny model (random weights), a warmed one for `packed`, the synthetic data: before the runs
#   attention (120) scripts/gpu_attention_check.py: grpo_varlen's shared prompts in one varlen_attn call against the
#                  per-continuation path (bf16 values and gradients, both timed at a Qwen3-4B layer's shape; SKIP when
#                  this torch's varlen_attn does not take the call), the start-up packing isolation check on the GPU
#   tiny (150)     3 steps of recipes/tiny_cpu.yaml on N GPUs under accelerate launch (FSDP2, bf16 compute, fp32 master
#                  weights), the weight-sync check after every push (within WEIGHT_SYNC_TOL, default 5e-2)
#   collectives (150) 2 processes even on ONE GPU (scripts/gpu_collective_check.py: "cpu:gloo,cuda:gloo" there, NCCL
#                  refusing two ranks on one device; the run's own group on 2+ GPUs), 2 steps with the KL reference's
#                  shards in host memory (ref.fsdp_config.param_offload, as the 4-GPU recipe): the reference's and the
#                  actor's builds, the update and the push run their collectives, each audited for one device type on
#                  every process (issue 41 item 1 hung there)
#   packed (150)   3 steps with model.use_remove_padding=true and bf16 compute on the warmed tiny model (responses of
#                  spread lengths): shared-prompt micro-batches (perf/shared_prefix > 0 required), the isolation check
#                  on the sharded policy, the weight probe's ratios; WARM_MODEL=DIR uses a model folder of that kind
#   lora (120)     recipes/tiny_cpu_lora.yaml, bf16 compute, 2 steps (adapters only, merged push), weight sync checked
#   resume (200)   2 steps saving a DCP checkpoint each step, then the same command to 3 steps: resumes from step 2
#   gputest (120)  the suite's GPU-only tests (pytest from .whl/): the offload of shards to the host and back
#   measure (180)  `python -m grpo_lib.planning.measure` for the big run's config: the training phase measured on fake
#                  tensors beside the plan's (on a torch other than 2.13 with its "unverified" warning and self-check)
#   big (330)      a true-size random-init Qwen3-4B (tests/data/qwen3_4b_config.json, no download) for BIG_STEPS (2)
#                  steps of the seed recipe (scripts/gpu_big_run.py; responses capped at BIG_RESPONSE_TOKENS=256: random
#                  weights never stop, and the hf engine would decode 1024 tokens per sample): peak memory per phase
#                  against the 1-process plan (--print-plan) and `measure`, step time, tokens/s, MFU; BIG_ARGS="k=v ..."
# CPU: every stage runs as it would on the GPU image (tests/repo/test_gpu_check_script.py runs `env tiny collectives` with
# vllm blocked, and a stage that outlives its timeout); BIG_SHRINK=1 (the default without CUDA) builds the same
# architecture shrunk, since 4B parameters with AdamW do not fit a laptop.
set -uo pipefail
cd "$(dirname "$0")/.."
SELF=scripts/gpu_check.sh
source scripts/gpu_check_lib.sh

# -- the stages (each runs as `bash scripts/gpu_check.sh --stage NAME` under run_stage's timeout) ----------------------
stage_env() {
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
  else
    row "env: math reward" SKIP "math_verify not importable ($($PY -c "import math_verify" 2>&1 | tail -1 | cut -c1-150)): no MATH answer scored (scripts/gpu_wheels.sh brings it in .whl/)"
  fi
  if $PY scripts/torch_api_check.py > "$LOGS/torch_api.log" 2>&1; then
    row "env: torch APIs" OK "$(tail -1 "$LOGS/torch_api.log" | sed 's/^torch_api_check: //')"
  else
    row "env: torch APIs" FAIL "$(grep -E "MISSING|SIGNATURE" "$LOGS/torch_api.log" | head -5 | tr '\n' ';') ($LOGS/torch_api.log)"
  fi
}

stage_prep() {  # the plain `prep` row gates the stages after it; without the warmed model only `packed` SKIPs
  local warm=""
  prepare_inputs || return 1
  if has packed && [ -z "${WARM_MODEL:-}" ]; then  # responses that end at spread lengths (random weights never stop)
    if $PY data_prep/tiny_model.py --out "$WORK/model_warm" --warmup-steps 300 >> "$WORK/prep.log" 2>&1; then
      warm=", warmed model"
    else
      row "prep: warmed model" FAIL "$(tail -2 "$WORK/prep.log" | tr '\n' ' ')"
    fi
  fi
  row "prep" OK "tiny model, data$warm in $WORK"
}

stage_attention() {
  $PY scripts/gpu_attention_check.py --verdict "$VERDICT"
}

stage_tiny() {
  train tiny recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3
}

stage_collectives() {
  local out="$WORK/collectives" log="$LOGS/collectives.train.log"
  mkdir -p "$out"
  ln -sfn "$log" "$out/train.log"
  run_args "$out" 2
  $PY -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_collective_check.py recipes/tiny_cpu.yaml \
    "${RUN_ARGS[@]}" trainer.total_training_steps=2 rollout.name=hf ref.fsdp_config.param_offload=true > "$log" 2>&1
  local status=$?
  grep "gpu_collective_check:" "$log"
  local summary
  summary=$(grep -m1 "gpu_collective_check: rank 0:" "$log" | sed 's/^gpu_collective_check: rank 0: //')
  if [ "$status" -ne 0 ]; then
    row collectives FAIL "2 processes exited $status ($log): $(grep -E "FAILED|Error" "$log" | tail -2 | tr '\n' ' ' | cut -c1-400)"
    return 1
  fi
  $PY scripts/gpu_report.py run "$out/run/metrics.jsonl" --name "collectives: run" --steps 1,2 --tol "$TOL" --verdict "$VERDICT" \
    && row collectives OK "$summary"
}

stage_packed() {
  local warm=${WARM_MODEL:-$WORK/model_warm}
  [ -f "$warm/config.json" ] || { row packed SKIP "no warmed model at $warm (prep's warm-up failed or was not run)"; return 0; }
  if MODEL="$warm" train packed recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3 \
       model.use_remove_padding=true actor.fsdp_config.param_dtype=bfloat16; then
    $PY scripts/gpu_report.py layouts "$WORK/packed/run/metrics.jsonl" --name "packed: layouts" --verdict "$VERDICT"
  fi
}

stage_lora() {
  train lora_bf16 recipes/tiny_cpu_lora.yaml 1,2 trainer.total_training_steps=2 actor.fsdp_config.param_dtype=bfloat16
}

stage_resume() {  # DCP save at steps 1 and 2, then the same command to step 3: a resume from step 2
  train resume_save recipes/tiny_cpu.yaml 1,2 trainer.total_training_steps=2 trainer.save_freq=1 || return 0
  mkdir -p "$WORK/resume_load" && cp -r "$WORK/resume_save/run" "$WORK/resume_load/run"
  train resume_load recipes/tiny_cpu.yaml 1,2,3 trainer.total_training_steps=3 trainer.save_freq=1 || return 0
  grep -q "resumed from .*global_step_2" "$WORK/resume_load/train.log" \
    || row "resume_load: resumed" FAIL "no 'resumed from .../global_step_2' line in $LOGS/resume_load.train.log"
}

stage_gputest() {
  $PY -c "import pytest" 2>/dev/null \
    || { row gputest SKIP "pytest not importable (scripts/gpu_wheels.sh brings it)"; return 0; }
  $PY -m pytest -q -p no:cacheprovider tests/model/test_fsdp.py -k on_gpu > "$LOGS/gputest.pytest.log" 2>&1
  local status=$? summary
  summary=$(tail -1 "$LOGS/gputest.pytest.log")
  if [ "$status" -ne 0 ]; then row gputest FAIL "$summary ($LOGS/gputest.pytest.log)"
  elif [[ "$summary" == *skipped* ]]; then row gputest SKIP "$summary (no CUDA)"; else row gputest OK "$summary"; fi
}

big_plan_args() {  # STAGE: the 1-process plan of the big run's config (its overrides from scripts/gpu_big_run.py; when
  local overrides  # that command fails, a FAIL row for STAGE and status 1: never a plan of the bare recipe)
  overrides=$($PY scripts/gpu_big_run.py --print-overrides --config "$BIG_CONFIG" --tokenizer "$WORK/model" \
    --data "$WORK/data" --out "$WORK/big" --steps "${BIG_STEPS:-2}" --response-tokens "${BIG_RESPONSE_TOKENS:-256}" \
    "${BIG_EXTRA[@]}" 2> "$WORK/$1.overrides.log") \
    || { row "$1" FAIL "scripts/gpu_big_run.py --print-overrides failed: $(error_lines "$WORK/$1.overrides.log")"; return 1; }
  BIG_OVERRIDES=()
  [ -n "$overrides" ] && mapfile -t BIG_OVERRIDES <<< "$overrides"
  PLAN_ARGS=(recipes/qwen3_4b_gsm8k.yaml "${BIG_OVERRIDES[@]}" --num-processes 1 --gpu-memory-gb "$GPU_GIB"
             --model-config "${BIG_ARCH:-$BIG_CONFIG}")
}

stage_measure() {
  mkdir -p "$WORK/big"
  big_plan_args measure || return 1
  $PY -m grpo_lib.planning.measure "${PLAN_ARGS[@]}" > "$LOGS/measure.txt" 2>&1
  local status=$?
  grep -A12 "measured training phase" "$LOGS/measure.txt" || tail -5 "$LOGS/measure.txt"
  $PY scripts/gpu_report.py measure "$LOGS/measure.txt" --exit-code "$status" --verdict "$VERDICT"
}

stage_big() {
  local big="$WORK/big" shrink=() log="$LOGS/big.run.log"
  [ "${BIG_SHRINK:-$((1 - ON_GPU))}" = 1 ] && shrink=(--shrink)
  echo "== big: $BIG_CONFIG ${shrink[*]}, ${BIG_STEPS:-2} steps, responses <= ${BIG_RESPONSE_TOKENS:-256} tokens ${BIG_EXTRA[*]}"
  if ! $PY scripts/gpu_big_run.py --config "$BIG_CONFIG" --tokenizer "$WORK/model" --data "$WORK/data" --out "$big" \
       --steps "${BIG_STEPS:-2}" --response-tokens "${BIG_RESPONSE_TOKENS:-256}" "${shrink[@]}" "${BIG_EXTRA[@]}" > "$log" 2>&1; then
    row big FAIL "scripts/gpu_big_run.py failed ($log): $(error_lines "$log")"
    return 1
  fi
  BIG_ARCH="$big/model/architecture.json" big_plan_args big || return 1  # the model as built (shrunk on CPU)
  $PY train_grpo.py "${PLAN_ARGS[@]}" --print-plan > "$big/plan.txt" 2>&1
  local measure=()
  [ -s "$LOGS/measure.txt" ] && [ "${BIG_SHRINK:-$((1 - ON_GPU))}" != 1 ] && measure=(--measure "$LOGS/measure.txt")
  $PY scripts/gpu_report.py big "$big" --plan "$big/plan.txt" "${measure[@]}" --verdict "$VERDICT"
}

BIG_CONFIG=${BIG_MODEL_CONFIG:-tests/data/qwen3_4b_config.json}
read -r -a BIG_EXTRA <<< "${BIG_ARGS:-}"  # key=value overrides of the big run (CPU: a shorter response, say)
if [ "${1:-}" = "--stage" ]; then
  "stage_$2"
  exit $?
fi

# -- before any stage: where the verdict goes, Python, packages, the wheels, the GPU --------------------------------
PY=${PY:-python}
TOL=${WEIGHT_SYNC_TOL:-5e-2}
STAGES=${STAGES:-env attention tiny collectives packed lora resume gputest measure big}
WORK=${WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$WORK"
export PY TOL STAGES WORK
report_init gpu_check
timeout 60 $PY -c "import sys; assert sys.version_info >= (3, 11), sys.version" 2>/dev/null \
  || { row "env: python" FAIL "$($PY --version 2>&1): needs Python >= 3.11"; finish; }
MISSING=$(timeout 120 $PY -c "import importlib.util as u; print(' '.join(m for m in ['torch', 'accelerate', 'transformers', 'tokenizers', 'safetensors', 'yaml', 'pandas', 'pyarrow', 'tqdm', 'peft'] if u.find_spec(m) is None))")
[ -z "$MISSING" ] || { row "env: packages" FAIL "missing python packages: $MISSING (pip install -r requirements.txt, or just these)"; finish; }
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then  # the wheels of scripts/gpu_wheels.sh, into a clean folder
  SITE="$WORK/site"
  rm -rf "$SITE"
  if timeout 120 $PY -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl > "$WORK/pip.log" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    row "env: wheels" OK "$(ls "$WHEELS"/*.whl | wc -l) wheels of $WHEELS/ installed with pip --target into $SITE"
  else
    row "env: wheels" FAIL "pip install --target $SITE $WHEELS/*.whl failed: $(tail -2 "$WORK/pip.log" | tr '\n' ' ')"
  fi
else
  row "env: wheels" INFO "no .whl/ (run scripts/gpu_wheels.sh on a machine with network): the MATH reward and the GPU tests are skipped"
fi
detect_gpus
N=${N:-$GPUS}
if [ -n "$PROBLEM" ]; then
  row "env: gpu" FAIL "$PROBLEM"; finish
elif [ "$GPUS" -ge 1 ]; then
  row "env: gpu" OK "torch $TORCH, $GPUS x $GPU_NAME, python $PYTHON_VERSION"
  ON_GPU=1
elif [ "${ALLOW_CPU:-0}" = 1 ]; then
  row "env: gpu" INFO "torch $TORCH, no CUDA device: the CPU path (ALLOW_CPU=1), as on the GPU image but without CUDA"
  ON_GPU=0; [ "$N" -ge 1 ] || N=1
else
  row "env: gpu" FAIL "torch $TORCH sees no CUDA device and the NVIDIA driver lists none (no GPU here; ALLOW_CPU=1 runs the CPU path)"
  finish
fi
ENGINE_ARGS=""
if ! timeout 120 $PY -c "import vllm" 2>/dev/null; then
  ENGINE_ARGS="rollout.name=hf"
  row "env: engine" INFO "vllm not importable: every run uses rollout.name=hf (sleep / wake, CUDA graphs, TP 2: scripts/gpu_vllm_check.sh on a machine with vLLM)"
fi
IDS=$(seq -s, 0 $((N - 1)))  # physical GPUs the runs use (nvidia-smi ignores CUDA_VISIBLE_DEVICES)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && IDS=$(echo "$CUDA_VISIBLE_DEVICES" | cut -d, -f1-"$N")
export N ON_GPU ENGINE_ARGS IDS GPU_GIB
NEED_PREP=""  # the stages that read prep's model and data
for stage in tiny collectives packed lora resume measure big; do has "$stage" && NEED_PREP+=" $stage"; done
# the stages still to run, in the order below (run_stage takes each off; until none is left the table says INCOMPLETE)
PLANNED=$(for s in env prep attention tiny collectives packed lora resume gputest measure big; do
  if has "$s" || { [ "$s" = prep ] && [ -n "$NEED_PREP" ]; }; then echo "$s"; fi; done | tr '\n' ' ')
unplan  # the names one space apart
write_table

has env && run_stage env 120
if [ -n "$NEED_PREP" ]; then
  run_stage prep 150
  # the plain `prep` row (a failed `prep: warmed model` leaves `packed` alone without its model: it SKIPs by itself)
  if awk -F'\t' '$1 == "prep" && $2 == "OK" { ok = 1 } END { exit ok }' "$VERDICT"; then
    for stage in $NEED_PREP; do row "$stage" SKIP "not run: prep did not end OK (its row above)"; done
    unplan $NEED_PREP
    write_table
    STAGES=$(for s in $STAGES; do [[ "$NEED_PREP " == *" $s "* ]] || echo "$s"; done | tr '\n' ' ')
  fi
fi
has attention && run_stage attention 120
has tiny && run_stage tiny 150
has collectives && run_stage collectives 150
has packed && run_stage packed 150
has lora && run_stage lora 120
has resume && run_stage resume 200
has gputest && run_stage gputest 120
has measure && run_stage measure 180
has big && run_stage big 330
finish
