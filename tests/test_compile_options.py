"""The training programs' XLA options: CPU only, and they reach the compiler."""

import jax
import jax.numpy as jnp
import numpy as np

from vcppo_jax.compile_options import CPU_TRAINING_OPTIONS, jit_training, training_compiler_options


def test_options_apply_on_cpu_only():
    assert training_compiler_options("cpu") == CPU_TRAINING_OPTIONS
    assert training_compiler_options("gpu") is None and training_compiler_options("tpu") is None


def test_jit_training_compiles_with_the_options():
    # XLA:CPU's tree-reduction rewrite (on by default) tiles a full reduction with reduce-window; the options turn
    # it off, so its absence in the optimized HLO shows that they reached the compiler.
    masked_mean = lambda x, m: (x * m).sum() / m.sum()  # noqa: E731
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 128)), jnp.float32)
    m = jnp.asarray(np.random.default_rng(1).uniform(size=(16, 128)) < 0.7, jnp.float32)
    default = jax.jit(masked_mean).lower(x, m).compile()
    ours = jit_training(masked_mean).lower(x, m).compile()
    assert "reduce-window" in default.as_text()
    assert "reduce-window" not in ours.as_text()
    want = (np.asarray(x, np.float64) * np.asarray(m)).sum() / np.asarray(m).sum()
    np.testing.assert_allclose(float(ours(x, m)), want, rtol=1e-5)
    np.testing.assert_allclose(float(default(x, m)), want, rtol=1e-5)
