"""Memory-linear causal attention in pure JAX (any backend): FlashAttention-2's algorithm over blocks.

Dense attention holds a [B, N, T, T] score tensor (and a [B, 1, T, T] mask) per layer, so a long chain of thought
costs memory quadratic in its length. Here the queries and keys are cut into blocks of `block_size`; each query
block runs an online softmax over the key blocks it can see (causality skips the rest, half the work), keeping only
a running max, normalizer and weighted sum. The backward pass is a custom VJP that recomputes each block's
probabilities from the saved log-sum-exp instead of storing them. What stays in memory is linear in T: q, k, v, the
output, the log-sum-exp [B, N, T] and the gradient of q.

The mask is causality plus a key-padding mask (left padding): query i sees key j iff kv_mask[b, j] and j <= i.
A query with no visible key (a padding row) gets a finite, meaningless output, as in the dense path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array

_MASKED = -1e30  # finite: a row whose visible keys are all masked so far stays NaN-free


def _blocks(x: Array, block: int, num_blocks: int) -> Array:
    """[B, T, *rest] (T padded to num_blocks * block) -> [num_blocks, B, block, *rest]."""
    b = x.shape[0]
    x = x.reshape(b, num_blocks, block, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unblocks(x: Array, t: int) -> Array:
    """Inverse of `_blocks`, dropping the padding: [num_blocks, B, block, *rest] -> [B, t, *rest]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :t]


def _prepare(q, k, v, kv_mask, block):
    """Pads T to a multiple of `block` and cuts into blocks; q [nb, B, bs, K, G, H], k/v [nb, B, bs, K, H],
    kv_mask [nb, B, bs]."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    pad = (-t) % block
    widths = lambda x: ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)  # noqa: E731
    q, k, v, kv_mask = (jnp.pad(x, widths(x)) for x in (q, k, v, kv_mask))
    nb = (t + pad) // block
    q = q.reshape(b, t + pad, kh, n // kh, h)  # query head n uses kv head n // G (GQA, as jax and HF)
    return _blocks(q, block, nb), _blocks(k, block, nb), _blocks(v, block, nb), _blocks(kv_mask, block, nb), nb


def _visible(mask_j: Array, i, j, block: int) -> Array:
    """[B, 1, 1, bs_q, bs_k] bool: key (block j, slot s) is a real token at or before query (block i, slot q)."""
    pos = jnp.arange(block)
    causal = (j * block + pos)[None, :] <= (i * block + pos)[:, None]
    return mask_j[:, None, None, None, :] & causal[None, None, None]


def _scores(q_i: Array, k_j: Array, scale: float) -> Array:
    """q_i [B, bs, K, G, H], k_j [B, bs, K, H] -> fp32 scores [B, K, G, bs_q, bs_k]."""
    return jnp.einsum("bqkgh,bskh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale


def _online_softmax_step(carry, scores: Array, v_j: Array, v_axes: str = "bskh"):
    """One key block of the online softmax: carry (acc [B, K, G, Q, H], running max m and normalizer l [B, K, G, Q]),
    fp32 scores [B, K, G, Q, S] (masked ones at _MASKED), values v_j [B, S, K, H] (or as `v_axes` names them:
    'bksh' for the KV cache's head-major blocks) -> the updated carry."""
    acc, m, l = carry
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.exp(scores - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum(f"bkgqs,{v_axes}->bkgqh", p, v_j.astype(jnp.float32))
    return acc * corr[..., None] + pv, m_new, l * corr + p.sum(axis=-1)


def _forward(q, k, v, kv_mask, block):
    t = q.shape[1]
    scale = q.shape[-1] ** -0.5
    qb, kb, vb, mb, nb = _prepare(q, k, v, kv_mask, block)
    _, b, bs, kh, g, h = qb.shape

    def query_block(i):
        q_i = qb[i]

        def key_block(j, carry):
            s = jnp.where(_visible(mb[j], i, j, block), _scores(q_i, kb[j], scale), _MASKED)
            return _online_softmax_step(carry, s, vb[j])

        init = (jnp.zeros((b, kh, g, bs, h), jnp.float32), jnp.full((b, kh, g, bs), -jnp.inf, jnp.float32),
                jnp.zeros((b, kh, g, bs), jnp.float32))
        acc, m, l = jax.lax.fori_loop(0, i + 1, key_block, init)  # key blocks after i are causally invisible
        return acc / l[..., None], m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(nb))  # [nb, B, K, G, bs, H], [nb, B, K, G, bs]
    out = jnp.moveaxis(out, 4, 2).reshape(nb, b, bs, kh * g, h)  # -> [nb, B, bs, N, H]
    return _unblocks(out, t).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, kv_mask, block):
    return _forward(q, k, v, kv_mask, block)[0]


def _attention_fwd(q, k, v, kv_mask, block):
    out, lse = _forward(q, k, v, kv_mask, block)
    return out, (q, k, v, kv_mask, out, lse)


def _attention_bwd(block, residuals, d_out):
    q, k, v, kv_mask, out, lse = residuals
    t = q.shape[1]
    scale = q.shape[-1] ** -0.5
    qb, kb, vb, mb, nb = _prepare(q, k, v, kv_mask, block)
    ob, dob = (_prepare(x, k, v, kv_mask, block)[0] for x in (out, d_out))  # [nb, B, bs, K, G, H]
    # D_i = rowsum(dO_i * O_i): the softmax's Jacobian term, [nb, B, K, G, bs].
    delta = jnp.moveaxis(jnp.sum(dob.astype(jnp.float32) * ob.astype(jnp.float32), axis=-1), 2, -1)

    def key_block(dq, j):
        k_j, v_j = kb[j], vb[j]

        def query_block(i, carry):
            dq, dk, dv = carry
            q_i, do_i = qb[i], dob[i].astype(jnp.float32)
            visible = _visible(mb[j], i, j, block)
            p = jnp.exp(jnp.where(visible, _scores(q_i, k_j, scale), _MASKED) - lse[i][..., None])
            dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p, do_i)
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do_i, v_j.astype(jnp.float32))
            ds = jnp.where(visible, p * (dp - delta[i][..., None]), 0.0) * scale
            dq = dq.at[i].add(jnp.einsum("bkgqs,bskh->bqkgh", ds, k_j.astype(jnp.float32)))
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, q_i.astype(jnp.float32))
            return dq, dk, dv

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(j, nb, query_block, (dq, zeros, zeros))  # queries before j cannot see it
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, jnp.float32), jnp.arange(nb))
    n = q.shape[2]
    dq = _unblocks(dq.reshape(*dq.shape[:3], n, q.shape[-1]), t)
    return dq.astype(q.dtype), _unblocks(dk, t).astype(k.dtype), _unblocks(dv, t).astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def check_self_attention_inputs(name: str, q: Array, k: Array, v: Array, kv_mask: Array) -> None:
    """The shapes every memory-linear kernel takes (this one and `splash.splash_attention`): q [B, T, N, H], k = v
    [B, T, K, H] with N % K == 0, kv_mask [B, T]; raises ValueError naming `name` otherwise."""
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"{name}: q [B, T, N, H] and k = v [B, T, K, H] with N % K == 0, got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if kv_mask.shape != q.shape[:2]:
        raise ValueError(f"{name}: kv_mask must be [B, T] = {q.shape[:2]}, got {kv_mask.shape}")


def blockwise_attention(q: Array, k: Array, v: Array, kv_mask: Array, *, block_size: int = 512) -> Array:
    """Causal self-attention with key padding, memory linear in T.

    q: [B, T, N, H]; k, v: [B, T, K, H] with N % K == 0 (grouped-query); kv_mask: [B, T] bool (False: padding key).
    Query i attends key j iff kv_mask[b, j] and j <= i, with scores scaled by H ** -0.5. Returns [B, T, N, H] in
    q's dtype (scores, softmax and accumulation in fp32). `block_size`: the most queries and keys per block (T is
    cut into ceil(T / block_size) equal blocks, the last padded).
    """
    check_self_attention_inputs("blockwise_attention", q, k, v, kv_mask)
    if block_size < 1:
        raise ValueError(f"blockwise_attention: block_size must be >= 1, got {block_size}")
    t = q.shape[1]
    num_blocks = -(-t // block_size)
    # Equal blocks of at most block_size: T = 1056 with 512 runs 3 blocks of 352, not 3 of 512 over 480 padding.
    return _attention(q, k, v, kv_mask.astype(bool), -(-t // num_blocks))


# ---------------------------------------------------------------------------------------- decode against a cache
def cache_prefix_attention(q: Array, cache_k: Array, cache_v: Array, layer: Array, mask: Array, num_keys: Array, *,
                           block_size: int = 512) -> Array:
    """Attention of T new queries over one layer of a KV cache, reading only the key blocks below `num_keys`.

    A dense decode step against a static [L, B, K, S, H] cache reads all S slots of every layer at every step, filled
    or not; here the online softmax of `blockwise_attention` runs over ceil(num_keys / block) blocks sliced straight
    from the cache, so a step costs what the sequence holds so far. The cache is head-major so that each (row, kv
    head)'s block is one contiguous [bs, H] matrix, the layout the dots read (the earlier [L, B, S, K, H] cache made
    4k-token decoding on CPU 1.25x slower). q [B, T, N, H] (N % K == 0);
    cache_k / cache_v [L, B, K, S, H] (read in q's dtype); layer: int32 scalar;
    mask [B, 1, T, S'] bool over the first S' <= S slots, the dense path's (key padding and causality); num_keys:
    int32 scalar <= S', the slots at and after it are invisible to every query. Returns [B, T, N, H] in q's dtype
    (softmax and sums in fp32).
    """
    b, t, n, h = q.shape
    s, kh = mask.shape[-1], cache_k.shape[2]
    block = min(block_size, s)
    qg = q.reshape(b, t, kh, n // kh, h)  # query head n uses kv head n // G (GQA, as jax and HF)
    scale = h ** -0.5

    def key_block(j, carry):
        # The last block is clamped inside the cache; its slots that an earlier block already read are skipped.
        start = jnp.minimum(j * block, s - block)
        k_j, v_j = (jax.lax.dynamic_slice(c, (layer, 0, 0, start, 0), (1, b, kh, block, h))[0].astype(q.dtype)
                    for c in (cache_k, cache_v))  # [B, K, bs, H]
        fresh = start + jnp.arange(block) >= j * block
        visible = jax.lax.dynamic_slice(mask, (0, 0, 0, start), (b, 1, t, block)) & fresh  # [B, 1, T, bs]
        scores = jnp.einsum("btkgh,bksh->bkgts", qg, k_j, preferred_element_type=jnp.float32) * scale
        return _online_softmax_step(carry, jnp.where(visible[:, :, None], scores, _MASKED), v_j, "bksh")

    g = n // kh
    init = (jnp.zeros((b, kh, g, t, h), jnp.float32), jnp.full((b, kh, g, t), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, t), jnp.float32))
    acc, _, l = jax.lax.fori_loop(0, (num_keys + block - 1) // block, key_block, init)
    out = jnp.moveaxis(acc / l[..., None], 3, 1)  # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


# ---------------------------------------------------------------------------------------- cuDNN, made safe for us
CUDNN_SEQ_MULTIPLE = 64  # the fused kernel's constraint on query and key lengths when it is differentiated


def cudnn_attention(q: Array, k: Array, v: Array, mask: Array, *, implementation: str = "cudnn") -> Array:
    """cuDNN's fused attention (`jax.nn.dot_product_attention(implementation='cudnn')`) for our dense masks.

    q [B, T, N, H], k/v [B, S, K, H], mask [B, 1, T, S] (boolean) -> [B, T, N, H]. Two of our inputs break the
    kernel as it is, seen on an H200 (jax 0.11.2):
    - a query row that sees no key (a left-padding row) makes its backward NaN, and with it the whole gradient (the
      dense XLA path stays finite). Such a row is given its own key; its output is never used.
    - self-attention of a length that is not a multiple of 64 (a training pass over prompt + response - 1 tokens) is
      refused. T == S (training passes, the sampler's prefill) is padded with invisible tokens; decode steps
      (T = 1 against the cache) run as they are.
    `implementation` exists for the CPU test of this wrapper ('xla' runs the same padding through the dense kernel).
    """
    t, s = q.shape[1], mask.shape[-1]
    if t == s:
        pad = -t % CUDNN_SEQ_MULTIPLE
        if pad:
            q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, pad)))
        sees_nothing = ~mask.any(axis=-1, keepdims=True)
        mask = mask | (sees_nothing & jnp.eye(t + pad, dtype=bool))
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    return out[:, :t]
