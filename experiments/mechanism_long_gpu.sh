#!/usr/bin/env bash
# The long-response mechanism study (`reproduce.py --mechanism --long`, 3 seeds) on one accelerator: seed 0 trains
# the shared SFT policy, then seeds 1 and 2 run beside it (the model is far too small to fill a GPU alone). It ran in
# about 8 minutes on one H200 (README, "Long responses"); the same runs take hours on 2 CPU cores.
#
# Usage, from the repo root:  bash experiments/mechanism_long_gpu.sh [out dir] [results dir]
#   PYTHON=... picks the interpreter; PROFILE_ARGS (default '--mechanism --long') picks the study, e.g. '--tiny'.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARGS=${PROFILE_ARGS:---mechanism --long}
OUT_DIR=${1:-runs/mechanism_long}
RESULTS=${2:-$OUT_DIR/results}
# Several processes share the device: allocate on demand. fp32 matmuls at full precision, as on CPU (not TF32).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest
mkdir -p "$OUT_DIR"
run_seed() { $PY experiments/reproduce.py $ARGS --out "$OUT_DIR" --seeds "$1," > "$OUT_DIR/seed$1.log" 2>&1; }
sft_ready() { grep -q "sft: \(finished\|done\)" "$OUT_DIR/seed0.log" 2>/dev/null; }

run_seed 0 &
first=$!
until sft_ready; do
  kill -0 $first 2>/dev/null || break
  sleep 5
done
sft_ready || { echo "the SFT stage did not finish: see $OUT_DIR/seed0.log"; exit 1; }
run_seed 1 &
run_seed 2 &
wait
grep -h "^\[reproduce" "$OUT_DIR"/seed[012].log | grep -v wrote
# Every run is finished now: this only writes the report.
$PY experiments/reproduce.py $ARGS --out "$OUT_DIR" --results "$RESULTS"
