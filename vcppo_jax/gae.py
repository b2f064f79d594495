"""Generalized advantage estimation over right-padded response tokens.

Layout: `rewards, values, mask: [batch, time]`; `mask` is 1 on generated response tokens (incl. EOS).
A masked step is skipped: it adds no TD error and the recursion carry `(next_value, gae)` passes through it
unchanged, so a valid step sees the value of the next *valid* step. The value after the last valid step is 0
(the episode ends at the last response token). Advantages and returns are 0 on masked steps.

    delta_t = r_t + gamma * V(s_next) - V(s_t)
    A_t     = delta_t + gamma * lam * A_next
    R_t     = V(s_t) + A_t

VC-PPO's decoupled GAE runs one recursion with two lambdas: lambda_actor for the policy advantages and
lambda_critic (= 1) for the value targets. Both live in one scan (`decoupled_gae`).

Two equivalent implementations share the maths: `impl='scan'` (sequential `lax.scan`, reverse time) and
`impl='associative'` (two `lax.associative_scan`s over affine maps, O(log T) depth). The default comes from
`jax.default_backend()` (see `DEFAULT_IMPL`; numbers in experiments/bench_gae.py).
"""

from __future__ import annotations

import functools
import numbers
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Impl = Literal["scan", "associative"]

# CPU, measured with experiments/bench_gae.py (2 shared cores, batch 256, time 1k / 4k / 16k): lax.scan is 2-4x
# faster than associative_scan at every length. GPU/TPU are not measured here; there XLA runs a while loop one
# iteration (kernel launch + host sync on GPU, jax-ml/jax#2491) per token, so the O(log T)-depth form is the default
# (rlax PR #168 reports the same swap faster on GPU). Re-run the benchmark on the accelerator to confirm.
DEFAULT_IMPL: dict[str, Impl] = {"cpu": "scan", "gpu": "associative", "cuda": "associative",
                                 "rocm": "associative", "tpu": "associative"}
IMPLS: tuple[Impl, ...] = ("scan", "associative")


def _check_unit_interval(name: str, x) -> None:
    """Raises ValueError if a concrete (python / numpy) `x` has entries outside [0, 1]."""
    if isinstance(x, jax.Array):
        return  # Traced or device values are the caller's responsibility (checking would force a host sync).
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number (or array) in [0, 1], got {x!r}") from None
    if not np.all((arr >= 0.0) & (arr <= 1.0)):
        raise ValueError(f"{name} must be in [0, 1], got {x!r}")


def _check_inputs(rewards, values, mask) -> None:
    shapes = {"rewards": jnp.shape(rewards), "values": jnp.shape(values), "mask": jnp.shape(mask)}
    if len(shapes["rewards"]) != 2:
        raise ValueError(f"rewards must be [batch, time], got shape {shapes['rewards']}")
    for name, shape in shapes.items():
        if shape != shapes["rewards"]:
            raise ValueError(f"{name} must have the shape of rewards {shapes['rewards']}, got {shape}")


def _check_lam_shape(name: str, lam, batch: int) -> None:
    if jnp.ndim(lam) not in (0, 1) or (jnp.ndim(lam) == 1 and jnp.shape(lam)[0] != batch):
        raise ValueError(f"{name} must be a scalar or a per-sequence array of shape [{batch}], "
                         f"got shape {jnp.shape(lam)}")


def default_impl() -> Impl:
    """The implementation used when `impl=None`, from `jax.default_backend()` (accelerators: 'associative')."""
    return DEFAULT_IMPL.get(jax.default_backend(), "associative")


def _check_impl(impl: Impl | None) -> Impl:
    if impl is None:
        return default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    return impl


def _float_dtype(*xs) -> jnp.dtype:
    # Accumulate in at least float32: bf16 sums over thousands of tokens lose the EOS reward.
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def _gae_scan(rewards, values, valid, gamma, lams):
    """Sequential reverse-time recursion. lams: [K, B]. Returns advantages [K, B, T]."""
    def step(carry, x):
        next_value, acc = carry  # [B], [K, B]
        r, v, m = x  # [B] each
        delta = r + gamma * next_value - v
        new_acc = delta + gamma * lams * acc
        acc = jnp.where(m, new_acc, acc)
        next_value = jnp.where(m, v, next_value)
        return (next_value, acc), jnp.where(m, acc, 0.0)

    batch = rewards.shape[0]
    init = (jnp.zeros((batch,), rewards.dtype), jnp.zeros(lams.shape, rewards.dtype))
    xs = (rewards.T, values.T, valid.T)  # scan runs over the leading (time) axis.
    _, adv = jax.lax.scan(step, init, xs, reverse=True)  # [T, K, B]
    return jnp.transpose(adv, (1, 2, 0))


def _affine_compose(later, earlier):
    """Composes y -> a_e * y + b_e after y -> a_l * y + b_l (reverse-time accumulation order)."""
    a_l, b_l = later
    a_e, b_e = earlier
    return a_e * a_l, a_e * b_l + b_e


def _gae_associative(rewards, values, valid, gamma, lams):
    """Parallel form: both recursions are affine, y_t = a_t * y_{t+1} + b_t with y_T = 0. Returns [K, B, T]."""
    m = valid.astype(rewards.dtype)
    # Value seen at step t from the right: V_t if valid else carried through; shifted by one gives V(s_next).
    # `where`, not `* m`: NaN or inf in a padded position times 0 is NaN and would reach every valid step.
    _, carried_v = jax.lax.associative_scan(_affine_compose, (1.0 - m, jnp.where(valid, values, 0.0)), reverse=True,
                                            axis=1)
    next_value = jnp.concatenate([carried_v[:, 1:], jnp.zeros_like(carried_v[:, :1])], axis=-1)
    delta = jnp.where(valid, rewards + gamma * next_value - values, 0.0)
    # Valid step: A_t = delta_t + gamma*lam*A_next. Masked step: identity map (a=1, b=0), the carry passes through.
    a = jnp.where(valid[None], gamma * lams[:, :, None], 1.0)
    b = jnp.broadcast_to(delta[None], a.shape)
    _, adv = jax.lax.associative_scan(_affine_compose, (a, b), reverse=True, axis=2)
    return jnp.where(valid[None], adv, 0.0)


@functools.partial(jax.jit, static_argnames=("impl",))
def _multi_lambda_gae(rewards, values, mask, gamma, lams, *, impl: Impl):
    """One pass over time for K lambdas (K-tuple of scalars or [B]).

    Returns (advantages with lams[0], returns = values + advantages with lams[-1]), both [B, T].
    """
    dtype = _float_dtype(rewards, values)
    rewards = rewards.astype(dtype)
    values = values.astype(dtype)
    valid = mask.astype(bool)
    gamma = jnp.asarray(gamma, dtype)
    lams = jnp.stack([jnp.broadcast_to(jnp.asarray(l, dtype), rewards.shape[:1]) for l in lams])  # [K, B]
    fn = _gae_scan if impl == "scan" else _gae_associative
    adv = fn(rewards, values, valid, gamma, lams)
    return adv[0], jnp.where(valid, values + adv[-1], 0.0)


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float, lam,
        impl: Impl | None = None) -> tuple[jax.Array, jax.Array]:
    """GAE(gamma, lam) over right-padded responses.

    Args:
      rewards, values, mask: [batch, time]; mask nonzero on valid (generated) tokens.
      gamma: discount in [0, 1].
      lam: GAE lambda in [0, 1], a scalar or per-sequence [batch] (see `length_adaptive_lambda`).
      impl: 'scan' | 'associative' | None (backend default, `DEFAULT_IMPL`).
    Returns:
      (advantages [batch, time], returns [batch, time]) with returns = values + advantages; both 0 where masked.
    """
    _check_inputs(rewards, values, mask)
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    _check_lam_shape("lam", lam, jnp.shape(rewards)[0])
    return _multi_lambda_gae(rewards, values, mask, gamma, (lam,), impl=_check_impl(impl))


def monte_carlo_returns(rewards: jax.Array, mask: jax.Array, *, gamma: float) -> jax.Array:
    """The gamma-discounted sum of each valid token's future rewards: [batch, time], 0 where masked. This is GAE's
    return with lambda = 1, which does not depend on the values (VC-PPO's value-pretraining target, and the
    reference a critic's calibration is measured against)."""
    return gae(rewards, jnp.zeros_like(rewards), mask, gamma=gamma, lam=1.0)[1]


def decoupled_gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float, lambda_actor,
                  lambda_critic=1.0, impl: Impl | None = None) -> tuple[jax.Array, jax.Array]:
    """VC-PPO decoupled GAE: policy advantages with lambda_actor, value targets with lambda_critic, one scan.

    Args:
      rewards, values, mask: [batch, time].
      gamma: discount in [0, 1].
      lambda_actor, lambda_critic: in [0, 1], scalars or per-sequence [batch].
    Returns:
      (advantages [batch, time] = GAE(lambda_actor), returns [batch, time] = values + GAE(lambda_critic)).
    """
    _check_inputs(rewards, values, mask)
    _check_unit_interval("gamma", gamma)
    batch = jnp.shape(rewards)[0]
    for name, lam in (("lambda_actor", lambda_actor), ("lambda_critic", lambda_critic)):
        _check_unit_interval(name, lam)
        _check_lam_shape(name, lam, batch)
    return _multi_lambda_gae(rewards, values, mask, gamma, (lambda_actor, lambda_critic), impl=_check_impl(impl))


def length_adaptive_lambda(lengths: jax.Array, alpha: float) -> jax.Array:
    """VAPO's per-sequence lambda = 1 - 1 / (alpha * length), clipped to [0, 1].

    Args:
      lengths: [batch] response lengths (valid tokens); length 0 gives lambda 0.
      alpha: > 0 (VAPO uses 0.05).
    Returns:
      lambdas: [batch] float32.
    """
    if not isinstance(alpha, jax.Array):
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
            raise ValueError(f"alpha must be a real number > 0, got {alpha!r}")
    lengths = jnp.asarray(lengths, jnp.float32)
    # Length 0 gives 1/0 = inf, then -inf, clipped to 0: no NaN on empty responses.
    return jnp.clip(1.0 - 1.0 / (alpha * lengths), 0.0, 1.0)


def whiten(x: jax.Array, mask: jax.Array, *, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
    """Normalises x to unit (population) variance over valid tokens; masked entries become 0.

    Args:
      x, mask: [batch, time] (or any equal shapes); statistics pool all valid tokens of the batch.
      shift_mean: if True the result has mean 0; if False the mean is kept and only the spread is rescaled.
      eps: added to the variance.
    Returns:
      whitened x, same shape, 0 where masked.
    """
    if jnp.shape(x) != jnp.shape(mask):
        raise ValueError(f"mask must have the shape of x {jnp.shape(x)}, got {jnp.shape(mask)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    x = jnp.asarray(x).astype(_float_dtype(x))
    valid = mask.astype(bool)
    count = jnp.maximum(valid.sum(), 1)  # an all-masked batch gives zeros, not NaN
    mean = jnp.where(valid, x, 0.0).sum() / count
    centered = jnp.where(valid, x - mean, 0.0)
    var = jnp.square(centered).sum() / count
    out = centered * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(valid, out, 0.0)
