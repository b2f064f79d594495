"""Model hyper-parameters for the decoder-only transformer, and their mapping to HF `config.json`.

Only the dense architectures the JAX model reproduces exactly are accepted, named by `model_type` as HF spells it:
Qwen2 (q/k/v bias), Llama (no biases) and Qwen3 (no biases; RMSNorm over head_dim on each query and key head before
RoPE; head_dim set on its own). Anything else (Qwen3-MoE, sliding-window attention, ...) fails loudly instead of
silently producing a different network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax.core import FrozenDict

# Per family: HF class-name prefix, and the config.json keys that spell out as off the options we do not implement.
_HF_FAMILIES = {
    "qwen2": ("Qwen2", dict(use_sliding_window=False, sliding_window=None)),
    "llama": ("Llama", dict(attention_bias=False, mlp_bias=False)),
    "qwen3": ("Qwen3", dict(attention_bias=False, use_sliding_window=False, sliding_window=None)),
}
SUPPORTED_MODEL_TYPES = tuple(_HF_FAMILIES)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# None: a memory-linear kernel (`long_attention_kernel`: splash on TPU, blockwise elsewhere) for sequences of at
# least BLOCKWISE_MIN_LEN tokens, below that jax's own choice of dense kernel; 'xla' / 'cudnn': that dense kernel of
# `jax.nn.dot_product_attention` always; 'blockwise' (`models.attention.blockwise_attention`, any backend) or
# 'splash' (`models.splash.splash_attention`, the TPU Pallas kernel) wherever the queries are the keys (training
# passes, log-probs, values, the sampler's prefill; one-token decode steps read the cache in place).
ATTENTION_IMPLS = (None, "xla", "cudnn", "blockwise", "splash")
MEMORY_LINEAR_IMPLS = ("blockwise", "splash")
BLOCKWISE_MIN_LEN = 1024


def long_attention_kernel(impl: str | None, backend: str) -> str:
    """The memory-linear kernel ('blockwise' or 'splash') that attention `impl` uses on `backend` (as
    `jax.default_backend()` names it) for passes whose queries are the keys.

    The default (None) takes the backend's fused kernel where one exists for our mask (causality + key padding)
    without a dense mask: splash on TPU, which takes key padding as segment ids. On GPU, cuDNN's fused kernel
    takes left padding only as a dense [B, 1, T, T] mask, quadratic in T, so long passes there stay blockwise.
    """
    if impl in MEMORY_LINEAR_IMPLS:
        return impl
    return "splash" if backend == "tpu" else "blockwise"


def uses_memory_linear(impl: str | None, num_queries: int) -> bool:
    """Whether a pass whose `num_queries` queries are exactly its keys (no cache, or a prefill at slot 0) runs a
    memory-linear kernel (`long_attention_kernel`): always for 'blockwise' / 'splash', from BLOCKWISE_MIN_LEN
    tokens for the default (None)."""
    return impl in MEMORY_LINEAR_IMPLS or impl is None and num_queries >= BLOCKWISE_MIN_LEN


def check_attention_backend(impl: str | None, backend: str) -> None:
    """Raises before anything compiles if `impl` cannot run at speed on `backend`: off TPU the splash kernel only
    runs in Pallas's interpreter (the tests' reference check), orders of magnitude slower."""
    if impl == "splash" and backend != "tpu":
        raise ValueError(f"attention_impl='splash' is the TPU Pallas kernel; this run's backend is {backend!r} "
                         "(use 'blockwise', or '' to choose by backend and length)")


# Required keys (besides 'rope_type') of each supported RoPE scaling variant, as spelled in HF configs.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _normalize_rope_scaling(rope_scaling: Mapping[str, Any] | None) -> FrozenDict | None:
    """HF rope dict (either spelling: 'type' or 'rope_type'; 'rope_theta' dropped) -> hashable FrozenDict or None.

    'default' normalizes to None so that equal networks have equal configs.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be None or a dict, got {type(rope_scaling).__name__}")
    d = {k: v for k, v in dict(rope_scaling).items() if k not in ("rope_theta", "type")}
    d["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if d["rope_type"] == "default":
        return None
    return FrozenDict(d)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder (frozen and hashable, so it can be a static jit argument / module field).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads: the usual sizes;
        num_heads must be a multiple of num_kv_heads (grouped-query attention).
      head_dim: per-head size; None -> hidden_size // num_heads (resolved in __post_init__).
      rope_theta: RoPE base.
      rope_scaling: None (plain RoPE) or an HF-style dict with 'rope_type' in {'linear', 'llama3'} and its keys
        ('factor'; llama3 also 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings').
        Stored as a FrozenDict (hashable); read it like a dict.
      rms_norm_eps: RMSNorm epsilon (also of Qwen3's q/k norms).
      model_type: the architecture family, one of SUPPORTED_MODEL_TYPES; it alone decides `qkv_bias` and `qk_norm`.
      tie_embeddings: LM head reuses the token embedding matrix.
      max_position_embeddings: informational (HF round trip, llama3 default for original length).
      dtype: compute dtype, 'float32' or 'bfloat16'.
      param_dtype: storage dtype of the parameters, 'float32' (default, for training) or 'bfloat16'.
      remat: rematerialize each layer in the backward pass (`nn.remat`).
      attention_impl: one of ATTENTION_IMPLS (None: `long_attention_kernel` from BLOCKWISE_MIN_LEN tokens, dense
        below).
      attention_block_size: queries and keys per block of the blockwise attention (splash: rounded down to a
        multiple of 128, `models.splash.splash_block`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    model_type: str = "qwen2"
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    attention_impl: str | None = None
    attention_block_size: int = 512

    def __post_init__(self):
        # Frozen dataclass: derived fields are filled in through object.__setattr__.
        if self.head_dim is None and isinstance(self.hidden_size, int) and isinstance(self.num_heads, int):
            if self.num_heads > 0:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        self.validate()

    @property
    def qkv_bias(self) -> bool:
        """Bias on the q/k/v projections (Qwen2 only; o_proj and the MLP never have biases)."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over head_dim of every query and key head, before RoPE (Qwen3 only)."""
        return self.model_type == "qwen3"

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.dtype]

    @property
    def params_dtype(self) -> jnp.dtype:
        return _DTYPES[self.param_dtype]

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (e.g. `cfg.replace(dtype='bfloat16', remat=True)`)."""
        return dataclasses.replace(self, **changes)

    def validate(self) -> "ModelConfig":
        """Raises ValueError naming the offending field; returns self."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"ModelConfig.rope_theta must be a positive number, got {self.rope_theta!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"ModelConfig.rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        if isinstance(self.attention_block_size, bool) or not isinstance(self.attention_block_size, int) \
                or self.attention_block_size < 1:
            raise ValueError(f"ModelConfig.attention_block_size must be a positive int, got "
                             f"{self.attention_block_size!r}")
        self._validate_rope_scaling()
        return self

    def _validate_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        kind = rs["rope_type"]
        if kind == "dynamic":
            raise ValueError("ModelConfig.rope_scaling: rope_type 'dynamic' is not supported (its frequencies depend "
                             "on the current sequence length, which breaks KV-cache decoding); supported: "
                             f"{sorted(_ROPE_KEYS)}")
        if kind not in _ROPE_KEYS:
            raise ValueError(f"ModelConfig.rope_scaling: unsupported rope_type {kind!r}; supported: "
                             f"{sorted(_ROPE_KEYS)}")
        missing = [k for k in _ROPE_KEYS[kind] if k not in rs]
        if missing:
            raise ValueError(f"ModelConfig.rope_scaling (rope_type {kind!r}) is missing keys {missing}")
        if rs.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("ModelConfig.rope_scaling: partial_rotary_factor != 1 is not supported")
        if not rs["factor"] > 0:
            raise ValueError(f"ModelConfig.rope_scaling['factor'] must be > 0, got {rs['factor']!r}")
        if kind == "llama3" and not rs["high_freq_factor"] > rs["low_freq_factor"] > 0:
            raise ValueError("ModelConfig.rope_scaling (llama3) needs high_freq_factor > low_freq_factor > 0, got "
                             f"{rs['high_freq_factor']!r} and {rs['low_freq_factor']!r}")

    # ------------------------------------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """HF `config.json` contents (Qwen2, Llama or Qwen3; transformers 4.x or 5.x spelling) -> ModelConfig.

        `overrides` set fields that HF does not describe (dtype, param_dtype, remat, attention_impl, ...).
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture: model_type {model_type!r} (architectures "
                             f"{hf.get('architectures')}); supported model_type values: {SUPPORTED_MODEL_TYPES}")
        name = _HF_FAMILIES[model_type][0]
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}: only 'silu' (SwiGLU) is implemented")
        if hf.get("use_sliding_window", False):
            raise ValueError(f"unsupported {name} config: use_sliding_window=True (sliding-window attention is not "
                             "implemented)")
        sliding = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
        if sliding:
            raise ValueError(f"unsupported {name} config: layer_types {sliding} (only 'full_attention' is "
                             "implemented)")
        # Qwen2's q/k/v biases are fixed by the architecture; the others' are switches we only support off.
        if model_type != "qwen2" and (hf.get("attention_bias", False) or hf.get("mlp_bias", False)):
            raise ValueError(f"unsupported {name} config: attention_bias/mlp_bias=True (attention/MLP biases are "
                             f"not implemented for {model_type})")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("unsupported config: partial_rotary_factor != 1")
        # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x writes rope_theta + rope_scaling.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if any(isinstance(v, Mapping) for v in rope.values()):
            raise ValueError("unsupported config: per-layer-type rope_parameters")
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_scaling = _normalize_rope_scaling(rope) if rope else None
        max_pos = hf.get("max_position_embeddings", 32768)
        if rope_scaling is not None and rope_scaling["rope_type"] == "llama3":
            # HF's fallback when the original pretraining length is not spelled out.
            rope_scaling = FrozenDict({"original_max_position_embeddings": max_pos, **rope_scaling})
        num_heads = hf["num_attention_heads"]
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            model_type=model_type,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_dict(self, *, head: str = "causal_lm", dtype: str = "float32", **extra: Any) -> dict[str, Any]:
        """ModelConfig -> HF `config.json` dict (transformers 5 spelling) for `AutoModelFor*.from_pretrained`.

        head: 'causal_lm' (XForCausalLM) or 'sequence_classification' (XForSequenceClassification, num_labels=1).
        dtype: dtype of the saved tensors, written as the config's `dtype`.
        extra: more keys to write (e.g. eos_token_id, pad_token_id); they override the derived ones.
        """
        if head not in ("causal_lm", "sequence_classification"):
            raise ValueError(f"head must be 'causal_lm' or 'sequence_classification', got {head!r}")
        prefix, options_off = _HF_FAMILIES[self.model_type]
        suffix = {"causal_lm": "ForCausalLM", "sequence_classification": "ForSequenceClassification"}[head]
        rope = {"rope_theta": float(self.rope_theta), "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dict(self.rope_scaling))
        hf: dict[str, Any] = dict(
            architectures=[prefix + suffix],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_embeddings,
            dtype=dtype,
        )
        hf.update(options_off)
        if head == "sequence_classification":
            hf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        hf.update(extra)
        return hf

    @property
    def num_params(self) -> int:
        """Parameter count of the causal LM (embedding counted once when tied)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * h, self.num_kv_heads * h
        attn = d * (q + 2 * kv) + q * d + (q + 2 * kv if self.qkv_bias else 0) + (2 * h if self.qk_norm else 0)
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + d + head
