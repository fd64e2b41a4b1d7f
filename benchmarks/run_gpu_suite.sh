#!/usr/bin/env bash
# The GPU figures of docs/performance.md in one command, on a machine with one GPU,
# Python 3.12 and torch, but no network, no uv and no pydantic/torchao:
#
#   benchmarks/run_gpu_suite.sh [OUT_DIR] [gpu_suite.py arguments ...]
#
# OUT_DIR defaults to $OUT, else outputs/gpu-suite; it receives results.json,
# results.md and log.txt. Before going to the GPU machine, fetch the wheels once
# from the project root of a machine with network (they land in .whl/, git-ignored):
#
#   ../shared/tools/gpu-wheels.sh
#
# and take .whl/ along. On the device tool: carry [".whl"] and run
# `benchmarks/run_gpu_suite.sh` (figures come back through $OUT).
# PYTHON picks the interpreter (default python3); `--smoke` runs the tiny CPU check.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-outputs/gpu-suite}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out=$1; shift; fi
python=${PYTHON:-python3}
mkdir -p "$out"

# The wheels prelude (as ../shared/tools/gpu-wheels.sh prints it), only where they are missing.
if ! "$python" -c "import pydantic, torchao" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  elif ! "$python" -c "import pydantic" 2>/dev/null; then
    echo "pydantic is not installed and .whl/ holds no wheels: run ../shared/tools/gpu-wheels.sh on a machine with network and bring .whl/ along" >&2
    exit 1
  else
    echo "note: torchao is not installed and .whl/ holds no wheels: the float8 rows will be recorded as failed" >&2
  fi
fi
src=$(ls -d packages/*/src | tr '\n' ':')
export PYTHONPATH=${src%:}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

"$python" benchmarks/gpu_suite.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
# The experts' grouped matmul on this GPU (bf16 `torch._grouped_mm` against the per-expert loop).
# The fused loss alone against the plain one, in bf16 and float8 (benchmarks/fused_loss_bench.py).
# Memory: every estimate tier against the suite's measured peaks, the measured tier on this GPU,
# and titan plan's micro-batch run for real (benchmarks/gpu_memory.py).
case " $* " in
  *" --smoke "*) ;;
  *) timeout "${MEMORY_TIMEOUT_S:-200}" "$python" benchmarks/gpu_memory.py --suite "$out/results.json" --out "$out" \
       --measure --plan 2>&1 | tee "$out/memory_log.txt" || echo "gpu_memory.py stopped (exit $?)"
     timeout 60 "$python" benchmarks/moe_grouped_mm.py 2>&1 | tee "$out/moe_grouped_mm.txt" || true
     # The loss alone at 8192 tokens x 128256: plain / fused, bf16 / float8 (the output projection's float8 lever).
     timeout 120 "$python" benchmarks/fused_loss_bench.py 2>&1 | tee "$out/fused_loss.txt" || true ;;
esac
