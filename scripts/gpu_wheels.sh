#!/usr/bin/env bash
# Run on a machine WITH network (this CPU machine), before a GPU day: downloads the pure-Python wheels that the lent GPU
# machine lacks into .whl/ (git-ignored), for Python 3.12, so scripts/gpu_check.sh can install them there offline.
#
#   scripts/gpu_wheels.sh            # PY=.venv/bin/python by default: the versions are this checkout's CI versions
#
# The lent machine has Python 3.12, torch (CUDA), transformers, accelerate, peft, pandas, pyarrow, pyyaml, tensorboard,
# safetensors and tokenizers (and their own dependencies), and NO vllm, datasets or math-verify. The hf-engine path of
# the check imports none of those three for GSM8K-style data; what is fetched here:
#   - math-verify, latex2sympy2_extended, antlr4-python3-runtime: the MATH reward (grpo_lib/rewards/math.py imports
#     math_verify when a MATH answer is scored; sympy comes with torch); gpu_check.sh scores one answer with them.
#   - pytest, pluggy, iniconfig: gpu_check.sh runs the suite's GPU-only test(s) there.
# Not fetched: vllm (a CUDA build of hundreds of MB that pins torch 2.13: the check uses rollout.name=hf) and datasets
# (only data_prep's hub downloads use it; its aiohttp / xxhash dependencies are native wheels; the check builds its data
# offline with data_prep/synthetic.py).
# Each wheel is fetched with --only-binary=:all: --no-deps for Python 3.12 at the version installed in $PY (so the lent
# machine runs what CI tested); the total must stay under 64 MiB (what a device run can carry). Writes .whl/SHA256SUMS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PACKAGES=(math-verify latex2sympy2_extended antlr4-python3-runtime pytest pluggy iniconfig)
LIMIT=$((64 * 1024 * 1024))
rm -rf .whl && mkdir -p .whl
PINS=$($PY - "${PACKAGES[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
pins = []
for name in sys.argv[1:]:
    try:
        pins.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"gpu_wheels: {name} is not installed in this Python ({sys.executable}): `make venv` first, or PY=...")
print(" ".join(pins))
PYEOF
)
echo "gpu_wheels: downloading for Python 3.12: $PINS"
# shellcheck disable=SC2086
$PY -m pip download --quiet --dest .whl --python-version 3.12 --only-binary=:all: --no-deps $PINS
for w in .whl/*.whl; do
  case "$w" in *-none-any.whl) ;; *) echo "gpu_wheels: $w is not a pure-Python wheel (py3-none-any)" >&2; exit 1 ;; esac
done
(cd .whl && sha256sum ./*.whl > SHA256SUMS)
TOTAL=$(du -cb .whl/*.whl | tail -1 | cut -f1)
[ "$TOTAL" -lt "$LIMIT" ] || { echo "gpu_wheels: .whl/ holds $TOTAL bytes, over the 64 MiB a device run carries" >&2; exit 1; }
ls -l .whl/*.whl
echo "gpu_wheels: OK: $(ls .whl/*.whl | wc -l) wheels, $((TOTAL / 1024)) KiB in .whl/ (scripts/gpu_check.sh installs them with pip --target)"
