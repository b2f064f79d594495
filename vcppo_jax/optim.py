"""Optimizers from config: global-norm clipping, AdamW, linear warmup then constant."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct


def lr_schedule(cfg: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup over `warmup_steps`, then constant, or (decay_steps > 0) cosine decay to 10% of `lr` at update
    `warmup_steps + decay_steps`."""
    after = (optax.cosine_decay_schedule(cfg.lr, cfg.decay_steps, alpha=0.1) if cfg.get("decay_steps", 0)
             else optax.constant_schedule(cfg.lr))
    if not cfg.warmup_steps:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), after], [cfg.warmup_steps])


def make_optimizer(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """`cfg` has lr, warmup_steps, decay_steps, weight_decay, grad_clip (0 = off), b1, b2, eps."""
    schedule = lr_schedule(cfg)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts)


def learning_rate(cfg: ml_collections.ConfigDict, step: int) -> float:
    """The lr `make_optimizer(cfg)` applies at update `step` (for logging)."""
    return float(lr_schedule(cfg)(step))


@struct.dataclass
class ModelState:
    """Params plus optimizer state of one trained network; the transform itself stays outside (a closure)."""

    params: dict
    opt_state: optax.OptState
    step: jax.Array  # number of applied updates (skipped non-finite updates do not count).


def init_model_state(params, tx: optax.GradientTransformation) -> ModelState:
    return ModelState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))


def apply_gradients(state: ModelState, grads, tx: optax.GradientTransformation, finite: jax.Array) -> ModelState:
    """One optimizer update, or no change at all when `finite` is False (a NaN/inf loss or gradient)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return ModelState(params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
                      step=state.step + finite.astype(jnp.int32))


def all_finite(*trees) -> jax.Array:
    leaves = [x for t in trees for x in jax.tree.leaves(t)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def train_epochs(state: ModelState, batch: Any, rng: jax.Array, loss_fn, tx: optax.GradientTransformation, *,
                 num_epochs: int, num_minibatches: int) -> tuple[ModelState, dict]:
    """`num_epochs` passes of shuffled minibatch steps of `loss_fn(params, minibatch) -> (loss, metrics)`.

    batch: a pytree (a dict, an `rl.Experience`) of leaves with a leading batch axis divisible by `num_minibatches`.
    A step whose loss or gradient is not finite is skipped (params and optimizer state unchanged) and counted in
    'train/nonfinite'. Returns the new state and metrics averaged over all steps ('train/nonfinite' summed).
    """
    size = jax.tree.leaves(batch)[0].shape[0]
    mb_size = size // num_minibatches
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state, mb):
        (loss, m), grads = grad_fn(state.params, mb)
        ok = jnp.isfinite(loss) & all_finite(grads)
        m = dict(m, grad_norm=optax.tree.norm(grads), nonfinite=1.0 - ok.astype(jnp.float32))
        return apply_gradients(state, grads, tx, ok), m

    def epoch(state, key):
        perm = jax.random.permutation(key, size)
        shuffled = jax.tree.map(lambda x: x[perm].reshape(num_minibatches, mb_size, *x.shape[1:]), batch)
        return jax.lax.scan(step, state, shuffled)

    state, m = jax.lax.scan(epoch, state, jax.random.split(rng, num_epochs))
    nonfinite = m.pop("nonfinite").sum()
    metrics = jax.tree.map(jnp.mean, m)
    metrics["train/nonfinite"] = nonfinite
    return state, metrics
