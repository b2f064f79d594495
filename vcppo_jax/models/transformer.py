"""Decoder-only transformer (Qwen2 / Llama / Qwen3 dense family) in Flax linen, with a KV cache for sampling.

Layers are stacked with `nn.scan` (every per-layer param has a leading 'layers' axis, so compile time does not grow
with depth) and every param carries logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim',
'layers') for sharding rules. Numerics follow the HF PyTorch implementation (rotate_half RoPE, RMSNorm in fp32,
softmax in fp32), so HF checkpoints give the same logits.

Params tree (`variables = {'params': ...}`; L = num_layers, N/K = query/kv heads, H = head_dim, F = intermediate):
  backbone/embed/embedding                      [vocab, D]
  backbone/layers/attn_norm/scale               [L, D]
  backbone/layers/attn/{q,k,v}_proj/kernel      [L, D, N|K, H]    (+ bias [L, N|K, H] when cfg.qkv_bias)
  backbone/layers/attn/{q,k}_norm/scale         [L, H]            (when cfg.qk_norm)
  backbone/layers/attn/o_proj/kernel            [L, N, H, D]
  backbone/layers/mlp_norm/scale                [L, D]
  backbone/layers/mlp/{gate,up}_proj/kernel     [L, D, F]
  backbone/layers/mlp/down_proj/kernel          [L, F, D]
  backbone/final_norm/scale                     [D]
  lm_head/kernel                                [D, vocab]        (CausalLM, absent when cfg.tie_embeddings)
  value_head/{kernel [D, 1], bias [1]}                            (ValueModel)
'backbone' has the same layout in CausalLM and ValueModel, so it can be moved between actor and critic.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vcppo_jax.models.attention import blockwise_attention, cache_prefix_attention, cudnn_attention
from vcppo_jax.models.config import ModelConfig, long_attention_kernel, uses_memory_linear
from vcppo_jax.models.splash import splash_attention
from vcppo_jax.sharding import mesh_platform

Array = jax.Array
_INIT_STD = 0.02  # HF initializer_range; random init is only used for from-scratch toy models and tests.
_ACT = ("batch", "length", "embed")


class KVCache(NamedTuple):
    """Keys/values of every layer, stacked like the scanned params.

    k: [layers, batch, kv_heads, max_len, head_dim] (RoPE already applied; head-major, so that a decode step reads
    each head's slots as one contiguous matrix); v: same shape. Slot j holds the token that was written at cache
    index j; which slots are valid is told by the caller's `kv_mask`, not by the cache.
    """

    k: Array
    v: Array


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    """All-zero cache for `batch` sequences of up to `max_len` tokens; dtype defaults to the compute dtype."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = cfg.compute_dtype if dtype is None else dtype
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def position_ids(mask: Array) -> Array:
    """mask: [batch, time] (1 = real token) -> position ids [batch, time] int32 = cumsum - 1, clipped at 0.

    Left padding gets position 0 and the first real token also gets 0, as in HF generation.
    """
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def attention_mask(kv_mask: Array, num_queries: int, cache_index: Array | int = 0) -> Array:
    """Boolean attention mask [batch, 1, num_queries, S]: query i (at slot cache_index + i) sees key slot j iff
    kv_mask[b, j] and j <= cache_index + i.  kv_mask: [batch, S]."""
    q_slot = cache_index + jnp.arange(num_queries, dtype=jnp.int32)
    causal = jnp.arange(kv_mask.shape[-1], dtype=jnp.int32)[None, :] <= q_slot[:, None]
    return kv_mask.astype(bool)[:, None, None, :] & causal[None, None]


# ------------------------------------------------------------------------------------------------------------ RoPE
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32), following HF's ROPE_INIT_FUNCTIONS for default/linear/llama3."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    kind = "default" if rs is None else rs["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated by `factor`, short ones kept, the band in between blended smoothly.
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, blended, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """positions: [batch, time] -> (cos, sin), each [batch, time, head_dim] float32 (halves duplicated, HF style)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x: [batch, time, heads, head_dim]; rotate_half convention (first half paired with second half)."""
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# ------------------------------------------------------------------------------------------------------- modules
def _param(module: nn.Module, name: str, init, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * scale over the last axis, normalized in fp32 and cast back (as HF does).

    x: [..., C] -> [..., C]; scale: [C], with logical axis name `axis` ('embed' for the hidden state, 'head_dim'
    for Qwen3's per-head q/k norms).
    """

    eps: float
    dtype: Any
    param_dtype: Any
    axis: str

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * y.astype(self.dtype)


class Proj(nn.Module):
    """Linear map contracting the last `n_in` input axes with kernel [*in_dims, *features] (+ bias [*features])."""

    features: tuple[int, ...]
    axes: tuple[str, ...]  # logical names of the kernel axes; the bias uses the trailing len(features) of them
    dtype: Any
    param_dtype: Any
    n_in: int = 1
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = (*x.shape[x.ndim - self.n_in:], *self.features)
        kernel = _param(self, "kernel", nn.initializers.normal(_INIT_STD), shape, self.axes, self.param_dtype)
        y = jnp.tensordot(x.astype(self.dtype), kernel.astype(self.dtype), axes=self.n_in)
        if self.use_bias:
            bias = _param(self, "bias", nn.initializers.zeros, self.features, self.axes[self.n_in:], self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and an optional KV cache of all layers."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array, cos: Array, sin: Array, mask: Array, cache: tuple[Array, Array] | None,
                 layer: Array, cache_index: Array) -> tuple[Array, tuple[Array, Array] | None]:
        """x: [B, T, D]; cos/sin: [B, T, H]; cache: ([L, B, K, S, H], same) or None; mask: [B, 1, T, S'] bool
        (dense attention), or [B, T] bool key padding when the queries are the keys (blockwise or splash: causal,
        query i sees key j <= i; `Decoder` picks).

        With a cache, the T new keys/values are written at [layer, :, :, cache_index:cache_index + T] and the queries
        attend to this layer's first S' <= S slots (S' = mask.shape[-1]; the caller drops slots no query sees).
        """
        cfg = self.cfg
        dt, pdt = cfg.compute_dtype, cfg.params_dtype
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = Proj((n, h), ("embed", "heads", "head_dim"), dt, pdt, use_bias=cfg.qkv_bias, name="q_proj")(x)
        key = Proj((k, h), ("embed", "kv_heads", "head_dim"), dt, pdt, use_bias=cfg.qkv_bias, name="k_proj")(x)
        val = Proj((k, h), ("embed", "kv_heads", "head_dim"), dt, pdt, use_bias=cfg.qkv_bias, name="v_proj")(x)
        if cfg.qk_norm:  # Qwen3: each head normalized over head_dim, before RoPE (as HF's Qwen3Attention)
            q = RMSNorm(cfg.rms_norm_eps, dt, pdt, "head_dim", name="q_norm")(q)
            key = RMSNorm(cfg.rms_norm_eps, dt, pdt, "head_dim", name="k_norm")(key)
        q = nn.with_logical_constraint(apply_rope(q, cos, sin), ("batch", "length", "heads", "head_dim"))
        key = nn.with_logical_constraint(apply_rope(key, cos, sin), ("batch", "length", "kv_heads", "head_dim"))
        val = nn.with_logical_constraint(val, ("batch", "length", "kv_heads", "head_dim"))
        # One new token (a decode step): an online softmax over the cache's filled blocks, read in place.
        in_place = cache is not None and x.shape[1] == 1 and mask.ndim == 4 and cfg.attention_impl != "cudnn"
        if cache is not None:
            # Write only the T new entries into the full [L, ...] cache (the scan carries it, so XLA updates the
            # buffer in place), then attend over this layer's visible slots.
            start = (layer, 0, 0, cache_index, 0)
            cache = tuple(jax.lax.dynamic_update_slice(c, new.astype(c.dtype).transpose(0, 2, 1, 3)[None], start)
                          for c, new in zip(cache, (key, val)))
            if not in_place:
                size = (1, x.shape[0], k, mask.shape[-1], h)
                key, val = (jax.lax.dynamic_slice(c, (layer, 0, 0, 0, 0), size)[0].transpose(0, 2, 1, 3).astype(dt)
                            for c in cache)
        if in_place:
            out = cache_prefix_attention(q, *cache, layer, mask, cache_index + 1, block_size=cfg.attention_block_size)
        elif mask.ndim == 2:
            backend = mesh_platform()
            if long_attention_kernel(cfg.attention_impl, backend) == "splash":
                out = splash_attention(q, key, val, mask, block_size=cfg.attention_block_size,
                                       interpret=backend != "tpu")
            else:
                out = blockwise_attention(q, key, val, mask, block_size=cfg.attention_block_size)
        elif cfg.attention_impl == "cudnn":
            out = cudnn_attention(q, key, val, mask)
        else:
            impl = None if cfg.attention_impl == "blockwise" else cfg.attention_impl
            out = jax.nn.dot_product_attention(q, key, val, mask=mask, implementation=impl)
        y = Proj((cfg.hidden_size,), ("heads", "head_dim", "embed"), dt, pdt, n_in=2, name="o_proj")(out)
        return y, cache


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        dt, pdt, f = cfg.compute_dtype, cfg.params_dtype, cfg.intermediate_size
        gate = Proj((f,), ("embed", "mlp"), dt, pdt, name="gate_proj")(x)
        up = Proj((f,), ("embed", "mlp"), dt, pdt, name="up_proj")(x)
        hidden = nn.with_logical_constraint(nn.silu(gate) * up, ("batch", "length", "mlp"))
        return Proj((cfg.hidden_size,), ("mlp", "embed"), dt, pdt, name="down_proj")(hidden)


class DecoderLayer(nn.Module):
    """Pre-norm block; the signature is shaped for `nn.scan`: ((x, cache), layer index, broadcast args...)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, carry: tuple[Array, tuple[Array, Array] | None], layer: Array, cos: Array, sin: Array,
                 mask: Array, cache_index: Array) -> tuple[tuple[Array, tuple[Array, Array] | None], None]:
        cfg = self.cfg
        x, cache = carry
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype, "embed",  # noqa: E731
                                    name=name)
        attn, cache = Attention(cfg, name="attn")(norm("attn_norm")(x), cos, sin, mask, cache, layer, cache_index)
        x = x + attn
        x = x + MLP(cfg, name="mlp")(norm("mlp_norm")(x))
        return (nn.with_logical_constraint(x, _ACT), cache), None


def _stacked_layers(cfg: ModelConfig) -> type[nn.Module]:
    layer = DecoderLayer
    if cfg.remat:
        # prevent_cse=False is safe (and faster) inside scan.
        layer = nn.remat(layer, prevent_cse=False)
    # The whole cache rides in the carry rather than as scanned xs/ys: scanning it would slice every layer's
    # [B, K, S, H] out and stack a fresh [L, B, K, S, H] output, i.e. copy the full cache at every decode step.
    return nn.scan(
        layer,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


def _check_inputs(cfg: ModelConfig, tokens: Array, positions: Array, kv_mask: Array, cache: KVCache | None,
                  cache_index: Any) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ValueError(f"positions must have the shape of tokens {tokens.shape}, got {positions.shape}")
    b, t = tokens.shape
    if cache is None:
        if kv_mask.shape != (b, t):
            raise ValueError(f"kv_mask must be [batch, time] = {(b, t)} without a cache, got {kv_mask.shape}")
        if isinstance(cache_index, int) and cache_index != 0:
            raise ValueError(f"cache_index must be 0 without a cache, got {cache_index}")
        return
    want = (cfg.num_layers, b, cfg.num_kv_heads, cache.k.shape[3], cfg.head_dim)
    if cache.k.shape != want or cache.v.shape != want:
        raise ValueError(f"cache k/v must be [layers, batch, kv_heads, max_len, head_dim] = {want}, got "
                         f"{cache.k.shape} / {cache.v.shape}")
    if kv_mask.shape != (b, want[3]):
        raise ValueError(f"kv_mask must be [batch, max_len] = {(b, want[3])} with a cache, got {kv_mask.shape}")
    if np.ndim(cache_index) != 0:
        raise ValueError(f"cache_index must be a scalar, got shape {np.shape(cache_index)}")
    if isinstance(cache_index, int) and not 0 <= cache_index <= want[3] - t:
        raise ValueError(f"cache_index must be in [0, max_len - time] = [0, {want[3] - t}], got {cache_index}")


class Decoder(nn.Module):
    """Token embedding + stacked decoder layers + final RMSNorm (the 'backbone' of every model here)."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        self.embed = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(_INIT_STD), ("vocab", "embed")))
        self.layers = _stacked_layers(cfg)(cfg)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype, "embed")

    def __call__(self, tokens: Array, positions: Array, kv_mask: Array, cache: KVCache | None = None,
                 cache_index: Array | int = 0) -> tuple[Array, KVCache | None]:
        """Runs the decoder on T new tokens.

        Args:
          tokens: [B, T] int32 token ids.
          positions: [B, T] int32 RoPE positions (see `position_ids`).
          kv_mask: [B, S] bool, True for key slots that hold real tokens. Without a cache S == T (key padding
            mask of the T tokens); with a cache S == max_len and it must already mark the T new slots
            [cache_index, cache_index + T) that are real.
          cache: None (plain causal forward pass), or a KVCache with max_len S.
          cache_index: int32 scalar (may be traced), slot of the first new token; shared by the batch. Must be 0
            without a cache and satisfy cache_index + T <= S with one (XLA clamps out-of-range writes; a concrete
            int is checked here).

        Query i attends key slot j iff kv_mask[b, j] and j <= cache_index + i, so prefill (T = prompt length,
        cache_index = 0) and one-token decode steps (T = 1) both work with left-padded prompts. A query with no
        valid key gets a finite (meaningless) output, never NaN.

        Returns:
          hidden: [B, T, D] after the final norm (compute dtype), and the updated KVCache (None without a cache).
          Only the T new slots of each layer are written, in place when the cache is a loop carry (as in
          `sampling`) or a donated jit argument; otherwise XLA first copies the whole cache to a new buffer.
        """
        _check_inputs(self.cfg, tokens, positions, kv_mask, cache, cache_index)
        # Without a cache the queries are the keys, so the causal offset is 0 whatever was passed.
        static_index = 0 if cache is None else (cache_index if isinstance(cache_index, int) else None)
        cache_index = jnp.asarray(0 if cache is None else cache_index, jnp.int32)
        x = nn.with_logical_constraint(self.embed(tokens), _ACT)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.cfg))
        # A concrete cache_index (prefill) tells statically that slots from static_index + T on are invisible to
        # every query (causality), so attention skips them; a traced index (decode steps) needs all S slots.
        num_keys = kv_mask.shape[1] if static_index is None else static_index + tokens.shape[1]
        if self._memory_linear(tokens.shape[1], static_index):
            mask = kv_mask[:, :num_keys].astype(bool)  # causality is the kernel's; only key padding is passed
        else:
            mask = attention_mask(kv_mask[:, :num_keys], tokens.shape[1], cache_index)
        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        carry = (x, None if cache is None else (cache.k, cache.v))
        (x, new_cache), _ = self.layers(carry, layers, cos, sin, mask, cache_index)
        hidden = nn.with_logical_constraint(self.final_norm(x), _ACT)
        return hidden, (None if new_cache is None else KVCache(*new_cache))

    def _memory_linear(self, num_queries: int, static_index: int | None) -> bool:
        """A memory-linear kernel (blockwise or splash, `long_attention_kernel`) where the T queries are exactly the
        keys (no cache, or a prefill at slot 0) and the config asks for one (or leaves it to length)."""
        return static_index == 0 and uses_memory_linear(self.cfg.attention_impl, num_queries)

    def attend(self, hidden: Array) -> Array:
        """Tied LM head: hidden [..., D] -> fp32 logits [..., vocab] against the embedding matrix."""
        dt = self.cfg.compute_dtype
        table = self.embed.embedding.astype(dt)
        return jnp.einsum("...d,vd->...v", hidden.astype(dt), table, preferred_element_type=jnp.float32)


class LMHead(nn.Module):
    """Untied LM head: kernel [D, vocab] ('embed', 'vocab'); fp32 logits."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, hidden: Array) -> Array:
        cfg, dt = self.cfg, self.cfg.compute_dtype
        kernel = _param(self, "kernel", nn.initializers.normal(_INIT_STD), (cfg.hidden_size, cfg.vocab_size),
                        ("embed", "vocab"), cfg.params_dtype)
        return jnp.einsum("...d,dv->...v", hidden.astype(dt), kernel.astype(dt), preferred_element_type=jnp.float32)


class CausalLM(nn.Module):
    """Decoder + LM head. `__call__` returns hidden states; logits come from the separate `logits` method so that
    callers can compute them in chunks (see `token_logprobs`) instead of materializing [B, T, vocab]."""

    cfg: ModelConfig

    def setup(self):
        self.backbone = Decoder(self.cfg)
        if not self.cfg.tie_embeddings:
            self.lm_head = LMHead(self.cfg)

    def __call__(self, tokens: Array, positions: Array, kv_mask: Array, cache: KVCache | None = None,
                 cache_index: Array | int = 0) -> tuple[Array, KVCache | None]:
        """Same arguments and returns as `Decoder.__call__`: (hidden [B, T, D], new_cache or None)."""
        hidden, new_cache = self.backbone(tokens, positions, kv_mask, cache, cache_index)
        if self.is_initializing() and not self.cfg.tie_embeddings:
            self.lm_head(hidden)  # creates the head params during init
        return hidden, new_cache

    def logits(self, hidden: Array) -> Array:
        """hidden [..., D] -> fp32 logits [..., vocab]. Use as `model.apply(params, h, method=CausalLM.logits)`."""
        if self.cfg.tie_embeddings:
            return self.backbone.attend(hidden)
        return self.lm_head(hidden)


class ValueHead(nn.Module):
    """Per-token scalar head in fp32: kernel [D, 1] ('embed', None), bias [1]; zero-initialized so a fresh critic
    predicts 0 everywhere (no initial value bias)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, hidden: Array) -> Array:
        kernel = _param(self, "kernel", nn.initializers.zeros, (self.cfg.hidden_size, 1), ("embed", None),
                        self.cfg.params_dtype)
        bias = _param(self, "bias", nn.initializers.zeros, (1,), (None,), self.cfg.params_dtype)
        values = jnp.einsum("...d,dk->...k", hidden.astype(jnp.float32), kernel.astype(jnp.float32))
        return (values + bias.astype(jnp.float32))[..., 0]


class ValueModel(nn.Module):
    """Decoder + scalar value head: critic V(s_t) and outcome reward model (reward read at the EOS position)."""

    cfg: ModelConfig

    def setup(self):
        self.backbone = Decoder(self.cfg)
        self.value_head = ValueHead(self.cfg)

    def __call__(self, tokens: Array, positions: Array, kv_mask: Array) -> Array:
        """tokens, positions: [B, T] int32; kv_mask: [B, T] bool -> values [B, T] float32 (one per position)."""
        hidden, _ = self.backbone(tokens, positions, kv_mask)
        return self.value_head(hidden)


# ------------------------------------------------------------------------------------------------------- helpers
def _dummy_inputs() -> tuple[Array, Array, Array]:
    return jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)


def init_params(model: nn.Module, rng: Array) -> dict:
    """Random variables {'params': ...} of `model` (CausalLM or ValueModel), as plain arrays (metadata unboxed)."""
    return nn.unbox(model.init(rng, *_dummy_inputs()))


def param_logical_axes(model: nn.Module) -> dict:
    """PartitionSpecs of logical axis names, same tree as `init_params(model, ...)` (no FLOPs: uses eval_shape).

    Map them to a mesh with `nn.logical_to_mesh_sharding(specs, mesh, rules)`.
    """
    abstract = jax.eval_shape(lambda r: model.init(r, *_dummy_inputs()), jax.random.key(0))
    return nn.get_partition_spec(abstract)


def shift_value_head(critic_params: dict, bias: float) -> dict:
    """ValueModel params (the 'params' collection) with `bias` added to the value head's bias: V(s) + bias for
    every state. The critic's initial bias as an experimental factor (a pessimistic critic has bias < 0)."""
    head = critic_params["value_head"]
    return {**critic_params, "value_head": {**head, "bias": head["bias"] + jnp.asarray(bias, head["bias"].dtype)}}


def critic_params_from_actor(actor_params: dict, rng: Array | None = None, init_std: float = 0.0) -> dict:
    """ValueModel variables from CausalLM variables: copied backbone + fresh value head.

    actor_params: {'params': {'backbone': ..., ['lm_head': ...]}} (boxed or plain). The head kernel is zeros
    when init_std == 0 (default), else N(0, init_std^2) drawn with `rng`; the bias is 0. The backbone is copied
    (not aliased) so that actor and critic buffers can be donated independently.
    """
    if init_std < 0:
        raise ValueError(f"init_std must be >= 0, got {init_std}")
    backbone = nn.unbox(actor_params["params"]["backbone"])
    hidden_size = backbone["final_norm"]["scale"].shape[-1]
    dtype = backbone["final_norm"]["scale"].dtype
    if init_std > 0:
        if rng is None:
            raise ValueError("critic_params_from_actor: rng is required when init_std > 0")
        kernel = init_std * jax.random.normal(rng, (hidden_size, 1), dtype)
    else:
        kernel = jnp.zeros((hidden_size, 1), dtype)
    return {"params": {"backbone": jax.tree.map(lambda x: x.copy(), backbone),
                       "value_head": {"kernel": kernel, "bias": jnp.zeros((1,), dtype)}}}
