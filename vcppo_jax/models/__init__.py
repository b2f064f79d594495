"""Decoder-only transformer (Qwen2 / Llama / Qwen3), chunked log-probs, and HF checkpoint import/export."""

from vcppo_jax.models.config import ModelConfig
from vcppo_jax.models.hf import (load_hf_checkpoint, load_hf_value_checkpoint, save_hf_checkpoint,
                                 save_hf_value_checkpoint)
from vcppo_jax.models.logprobs import token_logprobs
from vcppo_jax.models.transformer import (CausalLM, Decoder, KVCache, ValueModel, attention_mask,
                                          critic_params_from_actor, init_cache, init_params, param_logical_axes,
                                          position_ids, shift_value_head)

__all__ = [
    "CausalLM", "Decoder", "KVCache", "ModelConfig", "ValueModel", "attention_mask", "critic_params_from_actor",
    "init_cache", "init_params", "load_hf_checkpoint", "load_hf_value_checkpoint", "param_logical_axes",
    "position_ids", "save_hf_checkpoint", "save_hf_value_checkpoint", "shift_value_head", "token_logprobs",
]
