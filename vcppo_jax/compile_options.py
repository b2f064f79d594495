"""How the training programs (SFT, value and RL updates, the experience and log-prob passes) are compiled.

On CPU, XLA's default MLIR fusion emitters hold about 300 MiB while compiling an RL update even of a tiny model,
and that compile is the whole-process memory peak of a short-response run (GRPO, 128 tokens, d=128: high-water
mark 866 MiB with them, 634 MiB with the older elemental emitters in the training programs). The elemental
emitters alone compile each full reduction (a masked mean) slowly, because XLA's tree-reduction rewrite turns it
into 512-element windows that they unroll (seconds per mean); without that rewrite a reduction is one loop again.
LLVM's -O2 instead of -O3 unrolls less of what is left (tiny models' parameter-wise reductions): a dry run of the
GRPO test stage compiled in 7.5 s instead of 22 s (13 s with XLA's defaults), its steps running as fast. Training
programs compile once and then run for seconds per call with no measured slow-down, so they take these options;
the sampler keeps XLA's defaults (its decode loop ran 1.3x slower with the elemental emitters). Other backends keep
theirs.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

CPU_TRAINING_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_disable_hlo_passes": "tree_reduction_rewriter",
                        "xla_backend_optimization_level": 2}


def training_compiler_options(backend: str) -> dict[str, Any] | None:
    """XLA options for a training program on `backend` ('cpu', 'gpu', 'tpu'); None = XLA's defaults."""
    return dict(CPU_TRAINING_OPTIONS) if backend == "cpu" else None


def jit_training(fn: Callable, backend: str | None = None, **jit_kwargs) -> Callable:
    """`jax.jit(fn, **jit_kwargs)` compiled with `training_compiler_options` of `backend` (default: the default
    backend's; a dry run for a TPU slice on a CPU host names 'tpu')."""
    return jax.jit(fn, compiler_options=training_compiler_options(backend or jax.default_backend()), **jit_kwargs)
