"""HF (transformers) checkpoint folders <-> our params, with numpy + safetensors only (no torch needed).

Supported: Qwen2, Llama and Qwen3 (dense; its per-head `q_norm`/`k_norm` weights included), as `*ForCausalLM` (LM
head, or tied embeddings) and `*ForSequenceClassification` with num_labels = 1 (the `score` row becomes the value
head; used to seed a critic from an HF reward model).
Torch Linear weights are [out, in]; ours are [in..., out...] with heads split out, and per-layer tensors are
stacked on a leading 'layers' axis (nn.scan layout; see `transformer.py` for the tree).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from vcppo_jax.models.config import ModelConfig

_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One HF tensor and where it lives in our tree.

    n_in: number of leading input axes of our kernel when the HF tensor is a torch Linear weight [out, in]
    (transposed on the way); None for tensors that are only reshaped (embedding, norms, biases).
    """

    hf_name: str
    path: tuple[str, ...]
    layer: int | None
    hf_shape: tuple[int, ...]
    our_shape: tuple[int, ...]  # per layer (without the stacked axis)
    n_in: int | None


def _specs(cfg: ModelConfig, head: str | None) -> list[_Spec]:
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, k = cfg.num_heads, cfg.num_kv_heads
    out = [_Spec("model.embed_tokens.weight", ("backbone", "embed", "embedding"), None, (cfg.vocab_size, d),
                 (cfg.vocab_size, d), None)]
    per_layer = [
        ("input_layernorm.weight", ("attn_norm", "scale"), (d,), (d,), None),
        ("self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), (n * h, d), (d, n, h), 1),
        ("self_attn.k_proj.weight", ("attn", "k_proj", "kernel"), (k * h, d), (d, k, h), 1),
        ("self_attn.v_proj.weight", ("attn", "v_proj", "kernel"), (k * h, d), (d, k, h), 1),
        ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), (d, n * h), (n, h, d), 2),
        ("post_attention_layernorm.weight", ("mlp_norm", "scale"), (d,), (d,), None),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), (f, d), (d, f), 1),
        ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), (f, d), (d, f), 1),
        ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), (d, f), (f, d), 1),
    ]
    if cfg.qkv_bias:
        per_layer += [
            ("self_attn.q_proj.bias", ("attn", "q_proj", "bias"), (n * h,), (n, h), None),
            ("self_attn.k_proj.bias", ("attn", "k_proj", "bias"), (k * h,), (k, h), None),
            ("self_attn.v_proj.bias", ("attn", "v_proj", "bias"), (k * h,), (k, h), None),
        ]
    if cfg.qk_norm:
        per_layer += [
            ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (h,), (h,), None),
            ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (h,), (h,), None),
        ]
    for i in range(cfg.num_layers):
        out += [_Spec(f"model.layers.{i}.{name}", ("backbone", "layers", *path), i, hf_shape, our_shape, n_in)
                for name, path, hf_shape, our_shape, n_in in per_layer]
    out.append(_Spec("model.norm.weight", ("backbone", "final_norm", "scale"), None, (d,), (d,), None))
    if head == "lm_head":
        out.append(_Spec("lm_head.weight", ("lm_head", "kernel"), None, (cfg.vocab_size, d), (d, cfg.vocab_size), 1))
    elif head == "value":
        out.append(_Spec("score.weight", ("value_head", "kernel"), None, (1, d), (d, 1), 1))
    return out


def _hf_to_ours(w: np.ndarray, spec: _Spec) -> np.ndarray:
    return (w.T if spec.n_in is not None else w).reshape(spec.our_shape)


def _ours_to_hf(w: np.ndarray, spec: _Spec) -> np.ndarray:
    if spec.n_in is None:
        return w.reshape(spec.hf_shape)
    fan_in = math.prod(spec.our_shape[:spec.n_in])
    return np.ascontiguousarray(w.reshape(fan_in, -1).T)


# ---------------------------------------------------------------------------------------------------- reading
def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _tensor_files(folder: str) -> dict[str, str]:
    """tensor name -> safetensors file, for a single `model.safetensors` or a sharded index."""
    index = os.path.join(folder, _INDEX_FILE)
    if os.path.exists(index):
        weight_map = _read_json(index)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, _SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{folder}: neither {_SINGLE_FILE} nor {_INDEX_FILE} found")
    with safe_open(single, framework="np") as f:
        return {name: single for name in f.keys()}


def _open_tensors(folder: str) -> tuple[set[str], Callable[[str], np.ndarray], Callable[[], None]]:
    files = _tensor_files(folder)
    handles: dict[str, Any] = {}

    def get(name: str) -> np.ndarray:
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="np")
        return handles[path].get_tensor(name)

    return set(files), get, handles.clear


def _load_params(folder: str, cfg: ModelConfig, head: str | None, ignorable: Callable[[str], bool]) -> dict:
    specs = _specs(cfg, head)
    names, get, close = _open_tensors(folder)
    missing = [s.hf_name for s in specs if s.hf_name not in names]
    if missing:
        raise ValueError(f"{folder}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    wanted = {s.hf_name for s in specs}
    unexpected = sorted(x for x in names - wanted if not ignorable(x))
    if unexpected:
        raise ValueError(f"{folder}: unexpected tensors {unexpected[:5]} ({len(unexpected)} in all) for a "
                         f"{cfg.model_type} model; the checkpoint does not match its config.json")
    dtype = _NP_DTYPES[cfg.param_dtype]
    params: dict[str, Any] = {}
    try:
        for s in specs:
            w = get(s.hf_name)
            if tuple(w.shape) != s.hf_shape:
                raise ValueError(f"{folder}: tensor {s.hf_name!r} has shape {tuple(w.shape)}, expected "
                                 f"{s.hf_shape} from config.json")
            w = _hf_to_ours(w, s).astype(dtype)
            node = params
            for key in s.path[:-1]:
                node = node.setdefault(key, {})
            if s.layer is None:
                node[s.path[-1]] = w
            else:
                # Stack layers in place: one [L, ...] buffer per tensor kind.
                node.setdefault(s.path[-1], np.empty((cfg.num_layers, *s.our_shape), dtype))[s.layer] = w
    finally:
        close()
    return {"params": params}


def is_hf_checkpoint(folder: str) -> bool:
    """Whether `folder` looks like an HF model folder (config.json beside single or sharded safetensors), as opposed
    to one of our (orbax) run directories."""
    return bool(folder) and os.path.isfile(os.path.join(folder, "config.json")) and (
        os.path.isfile(os.path.join(folder, _SINGLE_FILE)) or os.path.isfile(os.path.join(folder, _INDEX_FILE)))


def hf_model_config(folder: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of an HF folder's config.json (no weights read)."""
    return _config(folder, overrides)[1]


def _config(folder: str, overrides: dict[str, Any]) -> tuple[dict[str, Any], ModelConfig]:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder}: no config.json")
    hf = _read_json(path)
    return hf, ModelConfig.from_hf_dict(hf, **overrides)


def _ignorable(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # a non-persistent buffer that some old checkpoints saved


def load_hf_checkpoint(folder: str, **overrides: Any) -> tuple[ModelConfig, dict]:
    """HF `*ForCausalLM` folder (config.json + safetensors, single or sharded) -> (cfg, {'params': ...}).

    Params are host numpy arrays in cfg.param_dtype, laid out for `CausalLM(cfg)` ('lm_head' absent when the
    embeddings are tied). `overrides` set ModelConfig fields HF does not describe (dtype, remat, ...).
    """
    _, cfg = _config(folder, overrides)
    head = None if cfg.tie_embeddings else "lm_head"
    # A tied checkpoint may still carry a (duplicate) lm_head.weight.
    ignorable = lambda x: _ignorable(x) or (cfg.tie_embeddings and x == "lm_head.weight")  # noqa: E731
    return cfg, _load_params(folder, cfg, head, ignorable)


def load_hf_value_checkpoint(folder: str, **overrides: Any) -> tuple[ModelConfig, dict]:
    """HF `*ForSequenceClassification` folder with num_labels = 1 (a reward model) -> (cfg, {'params': ...}) for
    `ValueModel(cfg)`: backbone + value_head (kernel = score row, bias = 0)."""
    hf, cfg = _config(folder, overrides)
    archs = hf.get("architectures") or []
    if any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(f"{folder}: {archs} is a causal LM, not a value/reward model (no 'score' head); seed the "
                         "critic with load_hf_checkpoint + critic_params_from_actor instead")
    num_labels = len(hf["id2label"]) if "id2label" in hf else hf.get("num_labels", 2)
    if num_labels != 1:
        raise ValueError(f"{folder}: a value checkpoint needs num_labels == 1 (one scalar score), got {num_labels}")
    ignorable = lambda x: _ignorable(x) or x == "lm_head.weight"  # noqa: E731
    variables = _load_params(folder, cfg, "value", ignorable)
    variables["params"]["value_head"]["bias"] = np.zeros((1,), _NP_DTYPES[cfg.param_dtype])
    return cfg, variables


# ---------------------------------------------------------------------------------------------------- writing
def _leaves(params: dict, specs: list[_Spec], num_layers: int) -> Iterator[tuple[_Spec, np.ndarray]]:
    for s in specs:
        node: Any = params
        for key in s.path:
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"params: missing {'/'.join(s.path)!r} (needed for {s.hf_name!r})")
            node = node[key]
        full = s.our_shape if s.layer is None else (num_layers, *s.our_shape)
        if tuple(node.shape) != full:
            raise ValueError(f"params: {'/'.join(s.path)!r} has shape {tuple(node.shape)}, expected {full}")
        yield s, (node if s.layer is None else node[s.layer])


def _save(folder: str, cfg: ModelConfig, variables: dict, head: str | None, hf_head: str, dtype: str,
          extra: dict[str, Any]) -> None:
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_NP_DTYPES)}, got {dtype!r}")
    if "params" not in variables:
        raise ValueError("variables must be {'params': ...} as returned by model.init / load_hf_checkpoint")
    params = jax.tree.map(np.asarray, jax.device_get(nn.unbox(variables["params"])))
    tensors = {s.hf_name: _ours_to_hf(np.asarray(w, np.float32), s).astype(_NP_DTYPES[dtype])
               for s, w in _leaves(params, _specs(cfg, head), cfg.num_layers)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(head=hf_head, dtype=dtype, **extra), f, indent=2)
    save_file(tensors, os.path.join(folder, _SINGLE_FILE), metadata={"format": "pt"})


def save_hf_checkpoint(folder: str, cfg: ModelConfig, variables: dict, *, dtype: str = "float32",
                       **config_extra: Any) -> None:
    """Writes config.json + model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    variables: {'params': ...} for `CausalLM(cfg)` (boxed or plain, host or device). dtype: saved tensor dtype,
    'float32' or 'bfloat16'. config_extra: extra config.json keys (eos_token_id, pad_token_id, ...).
    """
    _save(folder, cfg, variables, None if cfg.tie_embeddings else "lm_head", "causal_lm", dtype, config_extra)


def save_hf_value_checkpoint(folder: str, cfg: ModelConfig, variables: dict, *, dtype: str = "float32",
                             **config_extra: Any) -> None:
    """Writes a `*ForSequenceClassification` (num_labels = 1) folder from `ValueModel(cfg)` variables.

    HF's `score` layer has no bias, so a non-zero value_head bias cannot be exported and raises ValueError.
    Pass pad_token_id in config_extra if HF should pool batches (it reads the score at the last non-pad token).
    """
    bias = np.asarray(jax.device_get(nn.unbox(variables["params"]["value_head"]["bias"])), np.float32)
    if np.any(bias != 0):
        raise ValueError(f"value_head bias is {bias.tolist()}, but HF's score layer has no bias; it cannot be "
                         "exported")
    _save(folder, cfg, variables, "value", "sequence_classification", dtype, config_extra)
