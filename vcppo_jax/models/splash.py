"""TPU splash attention (the Pallas kernel in `jax.experimental.pallas.ops.tpu.splash_attention`) for our masks.

Our mask is causality plus key padding: query i sees key j iff kv_mask[b, j] and j <= i. Splash takes causality as
a static block-sparse mask (the blocks above the diagonal are never loaded) and key padding as segment ids: real
tokens are segment 1, padding segment 0, and a query sees only keys of its own segment. For a real query that is
exactly our mask; a padding query sees the padding keys at or before it (itself at least, so no row is empty) and
its output, meaningless in every path, is never used. No [T, T] mask or score tensor exists, so memory is linear in
T as with `attention.blockwise_attention`; the kernel's custom VJP recomputes probabilities in the backward pass.

Grouped-query attention runs the multi-query kernel once per kv head (its G query heads share that head's k and
v). Under a mesh (`sharding.use_mesh`) the kernel runs inside `shard_map` over the batch and kv-head axes of the
logical rules, since XLA cannot partition a Mosaic call itself. Off TPU the same kernel runs in Pallas's
interpreter (`interpret=True`): slow, and only for checking it against dense attention on CPU.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec

from vcppo_jax.models.attention import check_self_attention_inputs
from vcppo_jax.sharding import fit_spec

Array = jax.Array

SPLASH_BLOCK_MULTIPLE = 128  # the kernel's query and key blocks are multiples of the TPU's 128 lanes


def _kernel(length: int, groups: int, block: int, interpret: bool):
    """The causal multi-query kernel for `groups` query heads over `length` slots ([G, T, H] q, [T, H] k / v).
    Built inside the trace that uses it: it holds arrays (its block-sparsity tables), so a cached one would leak
    that trace's values into the next."""
    sizes = kernels.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                               block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = masks.MultiHeadMask([masks.CausalMask((length, length))] * groups)
    return kernels.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_block(length: int, block_size: int) -> int:
    """The kernel's block for a sequence of `length`: `block_size` rounded down to a multiple of 128 (at least 128),
    but no larger than the length rounded up to 128."""
    up = -(-length // SPLASH_BLOCK_MULTIPLE) * SPLASH_BLOCK_MULTIPLE
    return min(max(SPLASH_BLOCK_MULTIPLE, block_size // SPLASH_BLOCK_MULTIPLE * SPLASH_BLOCK_MULTIPLE), up)


def _local(q: Array, k: Array, v: Array, segments: Array, *, block: int, interpret: bool) -> Array:
    """q [B, K, G, T, H], k / v [B, K, T, H], segments [B, T] int32 -> [B, K, G, T, H] (this device's shard)."""
    kernel = _kernel(q.shape[3], q.shape[2], block, interpret)

    def one_row(q, k, v, seg):  # q [K, G, T, H]
        ids = kernels.SegmentIds(q=seg, kv=seg)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)

    return jax.vmap(one_row)(q, k, v, segments)


def _mesh_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh) -> PartitionSpec:
    """The logical axes' mesh spec under the active rules, less any mesh axis that does not divide its dimension."""
    return fit_spec(nn.logical_to_mesh_axes(logical), shape, mesh)[0]


def splash_attention(q: Array, k: Array, v: Array, kv_mask: Array, *, block_size: int = 512,
                     interpret: bool = False) -> Array:
    """Causal self-attention with key padding through the splash kernel.

    q: [B, T, N, H]; k, v: [B, T, K, H] with N % K == 0 (grouped-query); kv_mask: [B, T] bool (False: padding key).
    Query i attends key j iff kv_mask[b, j] and j <= i, scores scaled by H ** -0.5 (applied to q, in q's dtype).
    Returns [B, T, N, H] in q's dtype. T is padded with padding tokens to a multiple of the kernel's block
    (`splash_block`). `interpret`: run the Pallas interpreter instead of compiling for a TPU.
    """
    check_self_attention_inputs("splash_attention", q, k, v, kv_mask)
    b, t, n, h = q.shape
    kh = k.shape[2]
    block = splash_block(t, block_size)
    pad = -t % block
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    qs = jnp.pad(q * jnp.asarray(h ** -0.5, q.dtype), widths).reshape(b, t + pad, kh, n // kh, h)
    qs = qs.transpose(0, 2, 3, 1, 4)  # [B, K, G, T', H]: query head n uses kv head n // G (as jax and HF)
    ks, vs = (jnp.pad(x, widths).transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, T', H]
    segments = jnp.pad(kv_mask.astype(jnp.int32), ((0, 0), (0, pad)))
    local = functools.partial(_local, block=block, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        q_spec = _mesh_spec(("batch", "kv_heads", None, None, None), qs.shape, mesh)
        kv_spec = PartitionSpec(*tuple(q_spec)[:2])
        seg_spec = PartitionSpec(*tuple(q_spec)[:1])
        local = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                              check_vma=False)
    out = local(qs, ks, vs, segments)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t + pad, n, h)[:, :t]
