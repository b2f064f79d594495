"""Build a run's parts from its config: tokenizer, model config, starting policy, task records, verifier, data dir."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections

from vcppo_jax import chat, rewards
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax.data import RecordSource, load_task
from vcppo_jax.models import ModelConfig, critic_params_from_actor, shift_value_head
from vcppo_jax.models.hf import hf_model_config, is_hf_checkpoint, load_hf_checkpoint
from vcppo_jax.tokenizer import load_tokenizer, synthetic_tokenizer


def data_dir(config: ml_collections.ConfigDict) -> str:
    """`task.data_dir`, or `tfds/` beside the run's workdir (shared by all stages of a pipeline)."""
    if config.task.data_dir:
        return config.task.data_dir
    return os.path.join(os.path.dirname(os.path.abspath(config.workdir)), "tfds")


def tokenizer(config: ml_collections.ConfigDict):
    """`task.tokenizer_path`, else the HF folder the policy starts from (`model.hf_path`, or `sft_dir` when it is
    one), else the synthetic char-level tokenizer."""
    hf_policy = config.get("sft_dir", "") if is_hf_checkpoint(config.get("sft_dir", "")) else ""
    path = config.task.tokenizer_path or config.model.hf_path or hf_policy
    tok = load_tokenizer(path) if path else synthetic_tokenizer()
    if config.task.chat_template:
        chat.check_chat_template(tok, path or "the synthetic tokenizer")
    return tok


def stop_ids(config: ml_collections.ConfigDict, tok) -> tuple[int, ...]:
    """The tokens that end a response: EOS, and with `task.chat_template` the template's end-of-turn token. The last
    one is what SFT targets end with."""
    ids = (tok.eos_token_id,)
    if config.task.chat_template:
        ids += (chat.end_of_turn_id(tok),)
    return tuple(dict.fromkeys(ids))  # once each, in order


def prompt_source(config: ml_collections.ConfigDict, split: str, tok) -> RecordSource | chat.ChatPrompts:
    """The task's `split` (`task_source`) as the model is prompted: through `tok`'s chat template with
    `task.system_prompt` when `task.chat_template`, else the raw text."""
    source = task_source(config, split)
    return chat.ChatPrompts(source, tok, config.task.system_prompt) if config.task.chat_template else source


def load_policy(sft_dir: str, target) -> dict:
    """The policy RL and value pretraining start from: the params of the finished SFT run in `sft_dir`, or of the
    HF (transformers) folder `sft_dir` (a pretrained or instruct model, used without an SFT stage), placed on
    `target`'s shardings (an unboxed abstract params tree, `Runtime.target`)."""
    if not is_hf_checkpoint(sft_dir):
        return ckpt_lib.load_params(sft_dir, target, key="params")
    params = load_hf_checkpoint(sft_dir)[1]["params"]
    if jax.tree.structure(params) != jax.tree.structure(target):
        raise ValueError(f"{sft_dir}: its parameters do not match the model built from its config.json")
    # Every process holds the whole host array and hands each device its shard (also across hosts).
    return jax.tree.map(lambda x, t: jax.make_array_from_callback(t.shape, t.sharding,
                                                                  lambda idx: x[idx].astype(t.dtype)), params, target)


def load_critic(config: ml_collections.ConfigDict, policy: dict, target) -> dict:
    """The critic's params a stage starts from (`critic_init`): the policy's backbone with a fresh value head
    ('actor'), or the critic of the finished stage in `critic_dir` ('value_pretrain', 'reward_model'), placed on
    `target`'s shardings; its value head shifted by `critic_init_bias` where the config has one."""
    if config.critic_init == "actor":
        params = critic_params_from_actor({"params": policy})["params"]
    else:
        params = ckpt_lib.load_params(config.critic_dir, target, key="critic_params",
                                      hint=f"train the {config.critic_init} stage into it first, or set "
                                           "config.critic_init")
    bias = config.get("critic_init_bias", 0.0)
    return shift_value_head(params, bias) if bias else params


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


def policy_model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The model a stage's policy has, from its config alone (no weights read): the config.json of `model.hf_path`
    or of an HF folder `sft_dir`, else the from-scratch fields (`scratch_model_config`); this run's compute options
    on top."""
    sft_dir = config.get("sft_dir", "")
    folder = config.model.hf_path or (sft_dir if is_hf_checkpoint(sft_dir) else "")
    if folder:
        return with_compute_options(hf_model_config(folder), config)
    return scratch_model_config(config, len(tokenizer(config)))


def scratch_model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
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
    """Saved architecture, with this run's compute options (dtype, remat, attention) applied on top."""
    cfg = ModelConfig(**d)
    if config is not None:
        cfg = with_compute_options(cfg, config)
    return cfg
