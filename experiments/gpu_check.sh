#!/usr/bin/env bash
# The accelerator checks in one command (NVIDIA GPU; about 6 minutes on one H200 when it last ran, and expected to
# stay under 8 with part 2 now comparing three kernels):
#   1. the attention tests, where the 'cudnn' parity tests run instead of skipping (the splash tests, which run the
#      TPU kernel in Pallas's interpreter, are left to the CPU suite);
#   2. bench_attention: XLA's planned memory and the time of the actor's training pass in bf16, dense XLA vs cuDNN vs
#      blockwise, 1k / 4k response tokens, remat off and on: the measurement that decides whether the default
#      (`long_attention_kernel`: blockwise on GPU) should take cuDNN on GPUs (fp32 dense at 8k asked for a 66 GiB
#      buffer on an H200 when it last ran);
#   3. bench_mfu: the RL update step's model FLOPs utilization, Qwen2.5-0.5B-shaped random model, bf16, cudnn;
#   4. bench_rl_step: one RL iteration (generation + VC-PPO update) at 1k / 4k / 8k response tokens, with the
#      device allocator's peak;
#   5. bench_sampling at 64M parameters against transformers' generate on the same GPU.
# Each part has its own time limit and a failing part does not stop the others.
#
# Usage, from the repo root, in an environment with jax[cuda], flax, optax, orbax, transformers, torch (CUDA) and
# ml-collections:  bash experiments/gpu_check.sh [log file]      (PYTHON=... picks the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${1:-/dev/null}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TOKENIZERS_PARALLELISM=false
# The benchmarks report their own peaks: allocate on demand rather than 75% of the GPU up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

part() {  # part <seconds> <title> <command...>
  local limit=$1 title=$2; shift 2
  echo; echo "=== $title (limit ${limit} s)"
  local start=$SECONDS
  timeout "$limit" "$@"
  echo "=== $title: exit $? after $((SECONDS - start)) s"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  # fp32 parity tests compare against dense attention at 1e-6: keep XLA from using TF32 for them.
  JAX_DEFAULT_MATMUL_PRECISION=highest part 120 "attention tests (cudnn parity included)" "$PY" -m pytest tests/test_attention.py -q -rs -p no:cacheprovider -k "not splash"
  part 150 "bench_attention bf16 (xla, cudnn, blockwise)" "$PY" experiments/bench_attention.py --lengths=1024,4096 \
    --kernels=xla,cudnn,blockwise --dtype=bfloat16 --time-up-to=4096 --iters=3
  part 120 "bench_mfu" "$PY" experiments/bench_mfu.py --iters=3
  part 150 "bench_rl_step (VC-PPO, by-length attention)" "$PY" experiments/bench_rl_step.py --no-peers \
    --lengths=1024,4096,8192 --iters=1 --threads=0 --memory-cap-gib=0
  part 60 "bench_sampling" "$PY" experiments/bench_sampling.py --batch 8 --prompt-len 64 --new-tokens 256 \
    --hidden 512 --layers 8 --vocab 32000 --threads=0
} 2>&1 | tee "$LOG"
