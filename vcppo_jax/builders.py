"""Build a run's parts from its config: tokenizer, model config, task records, verifier, data dir."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
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
    """The task's `split`; built on first use. Multi-host: process 0 builds it while the others wait, so that no two
    processes write the same dataset folder (every process must call this)."""
    load = lambda: load_task(config.task.name, split, data_dir=data_dir(config), **config.task.knobs.to_dict())
    if jax.process_count() == 1:
        return load()
    from jax.experimental import multihost_utils  # noqa: PLC0415

    source = load() if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices(f"vcppo task_source {split}")
    return source if source is not None else load()


def verifier(config: ml_collections.ConfigDict):
    return rewards.make_verifier(config.task.name, correct=config.reward_correct, wrong=config.reward_wrong)


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    """The from-scratch decoder described by `config.model` (HF checkpoints carry their own config): each field is
    the ModelConfig field of the same name, except `hf_path`."""
    fields = {k: v for k, v in config.model.to_dict().items() if k != "hf_path"}
    # A ConfigDict field cannot switch between int and None, so 0 stands for "not set" in these two.
    fields["vocab_size"] = fields["vocab_size"] or vocab_size
    fields["head_dim"] = fields["head_dim"] or None
    fields["attention_impl"] = fields["attention_impl"] or None
    return ModelConfig(**fields)


# The `config.model` fields that say how a model computes, not what it is: a run sets them for itself, and they are
# not part of a stage's fingerprint (`stage_meta.settings`).
COMPUTE_OPTIONS = ("dtype", "remat", "attention_impl", "attention_block_size")


def with_compute_options(cfg: ModelConfig, config: ml_collections.ConfigDict) -> ModelConfig:
    """`cfg` with this run's COMPUTE_OPTIONS from `config.model` ('' attention_impl: chosen by length, None)."""
    options = {k: config.model[k] for k in COMPUTE_OPTIONS}
    return cfg.replace(**options | {"attention_impl": options["attention_impl"] or None})


def model_config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None
    return d


def model_config_from_json(d: dict[str, Any], config: ml_collections.ConfigDict | None = None) -> ModelConfig:
    """Saved architecture, with this run's compute options (dtype, remat, attention) applied on top.

    Configs saved before `model_type` existed name the family by `qkv_bias` instead (True: qwen2, False: llama).
    """
    d = dict(d)
    if "qkv_bias" in d:
        d["model_type"] = "qwen2" if d.pop("qkv_bias") else "llama"
    cfg = ModelConfig(**d)
    if config is not None:
        cfg = with_compute_options(cfg, config)
    return cfg
