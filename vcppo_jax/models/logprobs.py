"""Per-token log-probs and entropies without materializing [batch, time, vocab] logits.

Time is cut into chunks; each chunk's logits are computed, reduced to (logp, entropy) and dropped. The chunk
function is wrapped in `jax.checkpoint`, so the backward pass recomputes a chunk's logits instead of storing them:
peak memory is O(batch * chunk_size * vocab) forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def token_logprobs(logits_fn: Callable[[Array], Array], hidden: Array, targets: Array, *, chunk_size: int,
                   temperature: float = 1.0, with_entropy: bool = True) -> tuple[Array, Array | None]:
    """Log-prob of `targets` (and the entropy) under softmax(logits_fn(hidden) / temperature).

    Args:
      logits_fn: hidden [B, C, D] -> logits [B, C, vocab] (e.g. `lambda h: model.apply(params, h,
        method=CausalLM.logits)`); cast to fp32 here.
      hidden: [B, T, D] hidden states; position t predicts targets[:, t].
      targets: [B, T] int token ids.
      chunk_size: time steps per chunk; T need not be a multiple (the tail is padded and dropped).
      temperature: divides the logits (sampling temperature), > 0.
      with_entropy: also return the per-token entropy of the tempered distribution.

    Returns:
      (logp [B, T] float32, entropy [B, T] float32 or None when with_entropy is False).
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [batch, time, dim], got shape {hidden.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [batch, time] = {hidden.shape[:2]}, got {targets.shape}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    b, t, d = hidden.shape
    chunk = min(chunk_size, t)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    # [n_chunks, B, chunk, ...]: chunks on the leading axis for lax.map.
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n_chunks, chunk, d).swapaxes(0, 1)
    y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(args: tuple[Array, Array]) -> tuple[Array, Array]:
        h_c, y_c = args
        logits = logits_fn(h_c).astype(jnp.float32) / temperature
        log_z = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, y_c[..., None], axis=-1)[..., 0] - log_z
        if not with_entropy:
            return logp, jnp.zeros_like(logp)
        # H = log Z - E_p[logits]
        entropy = log_z - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(one_chunk, (h, y))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]  # noqa: E731
    return unchunk(logp), (unchunk(entropy) if with_entropy else None)
