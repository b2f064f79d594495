"""PPO-family losses and per-token estimators, as pure functions over `[batch, time]` arrays with explicit masks.

Every loss returns `(loss, metrics)`; metrics are token means over valid tokens, whatever `agg_mode` the loss uses.
Masked positions may hold garbage (even inf/NaN log-probs of padding): inputs are masked with `where` *before*
any exp/square so neither the value nor the gradient sees them.
"""

from __future__ import annotations

import numbers
from typing import Literal

import jax
import jax.numpy as jnp

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
# exp() of a log-ratio beyond this overflows float32 quickly; such tokens are far outside any clip range anyway.
_MAX_LOG_RATIO = 20.0


def _check_agg_mode(agg_mode: str) -> None:
    if agg_mode not in AGG_MODES:
        raise ValueError(f"agg_mode must be one of {AGG_MODES}, got {agg_mode!r}")


def _check_same_shape(**arrays) -> None:
    shapes = {k: jnp.shape(v) for k, v in arrays.items()}
    first_name, first = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first:
            raise ValueError(f"{name} must have the shape of {first_name} {first}, got {shape}")


def _check_number(name: str, x, *, low: float, high: float = float("inf"), low_open: bool = False,
                  high_open: bool = False) -> None:
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool)
    if ok:
        ok = (x > low if low_open else x >= low) and (x < high if high_open else x <= high)
    if not ok:
        lb, hb = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be a real number in {lb}{low}, {high}{hb}, got {x!r}")


def masked_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean of `x` over the entries where `valid` (bool, same shape) holds; 0 when there are none."""
    return jnp.where(valid, x, 0.0).sum() / jnp.maximum(valid.sum(), 1)


def aggregate(x: jax.Array, mask: jax.Array, mode: AggMode = "token-mean", *, norm: float | None = None
              ) -> jax.Array:
    """Reduces per-token values to a scalar.

    Args:
      x, mask: [batch, time].
      mode: 'token-mean': sum over all valid tokens / their count (DAPO/VAPO token-level loss);
        'seq-mean-token-mean': per-sequence token mean, then mean over non-empty sequences;
        'seq-mean-token-sum': per-sequence token sum, then mean over non-empty sequences;
        'seq-mean-token-sum-norm': total token sum / (batch * norm), a constant normaliser (Dr. GRPO).
      norm: the constant for 'seq-mean-token-sum-norm' (default: time, the padded length); > 0.
    Returns:
      scalar; 0 when nothing is valid.
    """
    _check_agg_mode(mode)
    _check_same_shape(x=x, mask=mask)
    if jnp.ndim(x) != 2:
        raise ValueError(f"x must be [batch, time], got shape {jnp.shape(x)}")
    if norm is not None:
        _check_number("norm", norm, low=0.0, low_open=True)
    valid = jnp.asarray(mask).astype(bool)
    x = jnp.where(valid, x, 0.0)  # where, not multiply: 0 * inf at padding would be NaN
    if mode == "token-mean":
        return x.sum() / jnp.maximum(valid.sum(), 1)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (x.shape[0] * (x.shape[1] if norm is None else norm))
    lengths = valid.sum(-1)
    per_seq = x.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / jnp.maximum(lengths, 1)
    return masked_mean(per_seq, lengths > 0)


def _log_ratio(logp, old_logp, valid):
    # Padding log-probs are zeroed first so exp() never sees them (keeps grads finite, see module docstring).
    return jnp.clip(jnp.where(valid, logp - old_logp, 0.0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *,
                clip_low: float, clip_high: float, dual_clip: float | None = None,
                agg_mode: AggMode = "token-mean") -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate, negated: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = pi / pi_old.

    Args:
      logp, old_logp, advantages, mask: [batch, time]; log-probs of the sampled tokens.
      clip_low: in [0, 1) (VAPO/DAPO: 0.2). clip_high: >= 0 (clip-higher: 0.28).
      dual_clip: None or > 1. For A < 0 the loss is capped at dual_clip * |A| (Ye et al. 2020), so a huge ratio on
        a bad token cannot dominate the batch.
      agg_mode: see `aggregate`.
    Returns:
      (loss scalar, metrics): policy/loss, policy/clipfrac (clipped branch active), policy/clipfrac_low
      (r < 1 - clip_low, A < 0), policy/clipfrac_high (r > 1 + clip_high, A > 0), policy/clipfrac_dual,
      policy/approx_kl (k3 estimate of KL(pi_old || pi) on pi_old samples), policy/ratio_mean|min|max.
    """
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    _check_number("clip_low", clip_low, low=0.0, high=1.0, high_open=True)
    _check_number("clip_high", clip_high, low=0.0)
    if dual_clip is not None:
        _check_number("dual_clip", dual_clip, low=1.0, low_open=True)
    _check_agg_mode(agg_mode)
    valid = jnp.asarray(mask).astype(bool)
    adv = jnp.where(valid, advantages, 0.0)
    log_ratio = _log_ratio(logp, old_logp, valid)
    ratio = jnp.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if dual_clip is not None:
        dual_bound = -adv * dual_clip  # = dual_clip * |A| where A < 0
        dual_active = (adv < 0) & (dual_bound < per_token)
        per_token = jnp.where(dual_active, dual_bound, per_token)
    else:
        dual_active = jnp.zeros_like(valid)
    loss = aggregate(per_token, valid, agg_mode)

    any_valid = valid.any()
    metrics = {
        "policy/loss": loss,
        "policy/clipfrac": masked_mean(clipped, valid),
        "policy/clipfrac_low": masked_mean(clipped & (adv < 0), valid),
        "policy/clipfrac_high": masked_mean(clipped & (adv > 0), valid),
        "policy/clipfrac_dual": masked_mean(dual_active, valid),
        "policy/approx_kl": masked_mean(ratio - 1.0 - log_ratio, valid),
        "policy/ratio_mean": masked_mean(ratio, valid),
        "policy/ratio_min": jnp.where(any_valid, jnp.where(valid, ratio, jnp.inf).min(), 1.0),
        "policy/ratio_max": jnp.where(any_valid, jnp.where(valid, ratio, -jnp.inf).max(), 1.0),
    }
    return loss, metrics


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, *,
               clip: float | None = None, agg_mode: AggMode = "token-mean"
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Critic loss 0.5 (V - R)^2, or with clip: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2).

    Args:
      values, old_values, returns, mask: [batch, time].
      clip: None or > 0 (the value clip range around old_values).
      agg_mode: see `aggregate`.
    Returns:
      (loss scalar, metrics): value/loss, value/clipfrac (clipped term larger), value/mean, value/error_mean (V - R).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None:
        _check_number("clip", clip, low=0.0, low_open=True)
    _check_agg_mode(agg_mode)
    valid = jnp.asarray(mask).astype(bool)
    values = jnp.where(valid, values, 0.0)
    returns = jnp.where(valid, returns, 0.0)
    sq_err = jnp.square(values - returns)
    if clip is None:
        per_token, clipped = sq_err, jnp.zeros_like(valid)
    else:
        old_values = jnp.where(valid, old_values, 0.0)
        v_clipped = old_values + jnp.clip(values - old_values, -clip, clip)
        sq_err_clipped = jnp.square(v_clipped - returns)
        per_token, clipped = jnp.maximum(sq_err, sq_err_clipped), sq_err_clipped > sq_err
    loss = 0.5 * aggregate(per_token, valid, agg_mode)
    metrics = {
        "value/loss": loss,
        "value/clipfrac": masked_mean(clipped, valid),
        "value/mean": masked_mean(values, valid),
        "value/error_mean": masked_mean(values - returns, valid),
    }
    return loss, metrics


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman, "Approximating KL", 2020).

    With log_r = ref_logp - logp: k1 = -log_r (unbiased, high variance), k2 = 0.5 log_r^2 (biased, low variance),
    k3 = exp(log_r) - 1 - log_r (unbiased, >= 0). Use per token as a reward penalty (rewards - beta * kl, masked)
    or as a loss term (`aggregate(kl, mask, mode)`).

    Args:
      logp, ref_logp: [...] log-probs of the sampled tokens under pi and the reference policy.
      kind: 'k1' | 'k2' | 'k3'.
    Returns:
      kl: [...] same shape; mask it (or aggregate with a mask) before use.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * jnp.square(log_r)
    log_r = jnp.clip(log_r, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # exp overflow guard
    return jnp.exp(log_r) - 1.0 - log_r


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) over the last axis, in float32; -inf logits (banned tokens) are fine.

    Args:
      logits: [..., vocab].
    Returns:
      entropy: [...].
    """
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    log_p = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(log_p)
    # p * log p is 0 * -inf = NaN for banned tokens; zero log p there first so the gradient stays finite too.
    return -jnp.sum(p * jnp.where(p > 0, log_p, 0.0), axis=-1)


def grpo_advantages(rewards: jax.Array, group_size: int, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> jax.Array:
    """Group-relative advantages: (r - mean_group) / (std_group + eps).

    Consecutive blocks of `group_size` samples share a prompt. std is the unbiased (ddof=1) group std, as in
    TRL and verl; a group of one has advantage 0. normalize_std=False gives Dr. GRPO's r - mean_group.

    Args:
      rewards: [batch] sequence rewards, batch a multiple of group_size.
      group_size: >= 1.
    Returns:
      advantages: [batch] (broadcast to tokens with the response mask by the caller).
    """
    if jnp.ndim(rewards) != 1:
        raise ValueError(f"rewards must be [batch], got shape {jnp.shape(rewards)}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if jnp.shape(rewards)[0] % group_size:
        raise ValueError(f"rewards batch {jnp.shape(rewards)[0]} must be a multiple of group_size {group_size}")
    _check_number("eps", eps, low=0.0)
    rewards = jnp.asarray(rewards)
    groups = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32)).reshape(-1, group_size)
    centered = groups - groups.mean(-1, keepdims=True)
    if normalize_std:
        std = groups.std(-1, ddof=1, keepdims=True) if group_size > 1 else jnp.zeros_like(centered)
        centered = centered / (std + eps)
    return centered.reshape(-1)


def explained_variance(pred: jax.Array, target: jax.Array, mask: jax.Array) -> jax.Array:
    """1 - Var[target - pred] / Var[target] over valid tokens (population variances); 0 if Var[target] = 0.

    Var[target] below 1e-6 of the target's mean square counts as 0: a constant target (e.g. every response wrong)
    leaves float32 rounding noise, and dividing by it would report a meaningless -1e8.

    Args:
      pred, target, mask: [batch, time] (any equal shapes).
    Returns:
      scalar; 1 is a perfect critic, 0 no better than the mean, < 0 worse.
    """
    _check_same_shape(pred=pred, target=target, mask=mask)
    valid = jnp.asarray(mask).astype(bool)

    def var(x):
        return masked_mean(jnp.square(x - masked_mean(x, valid)), valid)

    var_target = var(target)
    informative = var_target > 1e-6 * masked_mean(jnp.square(target), valid)
    safe = jnp.where(informative, var_target, 1.0)
    return jnp.where(informative, 1.0 - var(target - pred) / safe, 0.0)


def nll_loss(logp: jax.Array, mask: jax.Array, agg_mode: AggMode = "token-mean") -> jax.Array:
    """Negative log-likelihood of the sampled tokens (VAPO's positive-example LM loss).

    Args:
      logp, mask: [batch, time]; pass mask * is_positive[:, None] to train only on correct responses.
    Returns:
      scalar loss.
    """
    _check_same_shape(logp=logp, mask=mask)
    valid = jnp.asarray(mask).astype(bool)
    return aggregate(-jnp.where(valid, logp, 0.0), valid, agg_mode)
