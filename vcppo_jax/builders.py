"""Build a run's parts from its config: tokenizer, model config, task records, verifier, data dir."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from vcppo_jax import rewards
from vcppo_jax.data import RecordSource, load_task
from vcppo_jax.models import ModelConfig
from vcppo_jax.tokenizer import load_tokenizer, synthetic_tokenizer


def data_dir(config: ml_collections.ConfigDict) -> str:
    """`task.data_dir`, or `tfds/` beside the run's workdir (shared by all stages of a pipeline)."""
    if config.task.data_dir:
        return config.task.data_dir
    return os.path.join(os.path.dirname(os.path.abspath(config.workdir)), "tfds")


def tokenizer(config: ml_collections.ConfigDict):
    path = config.task.tokenizer_path or (config.model.hf_path if config.model.hf_path else "")
    return load_tokenizer(path) if path else synthetic_tokenizer()


def task_source(config: ml_collections.ConfigDict, split: str) -> RecordSource:
    return load_task(config.task.name, split, data_dir=data_dir(config), **config.task.knobs.to_dict())


def verifier(config: ml_collections.ConfigDict):
    return rewards.make_verifier(config.task.name, correct=config.reward_correct, wrong=config.reward_wrong)


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The from-scratch decoder described by `config.model` (HF checkpoints carry their own config)."""
    m = config.model
    return ModelConfig(
        vocab_size=m.vocab_size or vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim or None,
        rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps, qkv_bias=m.qkv_bias, tie_embeddings=m.tie_embeddings,
        max_position_embeddings=m.max_position_embeddings, dtype=m.dtype, remat=m.remat)


def model_config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None
    return d


def model_config_from_json(d: dict[str, Any], config: ml_collections.ConfigDict | None = None) -> ModelConfig:
    """Saved architecture, with this run's compute options (dtype, remat) applied on top."""
    cfg = ModelConfig(**d)
    if config is not None:
        cfg = cfg.replace(dtype=config.model.dtype, remat=config.model.remat)
    return cfg
