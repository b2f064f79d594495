"""What a stage's checkpoint records about where it came from, and what each stage needs before it.

Below the loops (`sft`, `value_train`, `rl_loop` write this metadata; `stages` reads it to order and check the
pipeline), so nothing imports back up.

Provenance: every stage's checkpoint meta records its own run id, the task and model settings it is only valid
for, and the run ids of the stages it started from (`provenance`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import ml_collections

from vcppo_jax import builders
from vcppo_jax import checkpoint as ckpt_lib

ENTRYPOINTS = {"sft": "experiments/sft.py", "reward_model": "experiments/train_reward_model.py",
               "value_pretrain": "experiments/pretrain_value.py", "rl": "experiments/train.py"}
# `model.model_type` replaced `model.qkv_bias` after stages first recorded their settings: the families that existed
# then are fingerprinted in the old spelling, so that their finished stages do not look stale.
_QKV_BIAS_OF_OLD_MODEL_TYPES = {"qwen2": True, "llama": False}


def stage_done(workdir: str) -> bool:
    """Whether `workdir` holds a finished run (its checkpoint meta says `done`)."""
    return _done(ckpt_lib.read_meta(workdir))


def _done(meta: dict | None) -> bool:
    return bool(meta and meta.get("done"))


def finished_meta(workdir: str, stage: str) -> dict:
    """The meta of the finished `stage` in `workdir`; FileNotFoundError naming the command that makes it."""
    meta = ckpt_lib.read_meta(workdir)
    if not _done(meta):
        raise FileNotFoundError(f"no finished {stage} checkpoint in {workdir!r}; run "
                                f"`python {ENTRYPOINTS[stage]} --config=configs/{stage}.py` first (or point the "
                                "config at an existing run)")
    return meta


def prerequisites(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
    """(stage, workdir) pairs this run needs finished, in order."""
    needs = []
    if config.stage in ("rl", "value_pretrain", "reward_model"):
        needs.append(("sft", config.sft_dir))
    if config.stage == "rl" and config.critic_init in ("value_pretrain", "reward_model"):
        needs.append((config.critic_init, config.critic_dir))
    if config.stage == "value_pretrain" and config.critic_init == "reward_model":
        needs.append(("reward_model", config.critic_dir))
    return needs


def settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The settings a stage's checkpoint is only valid for: the task's data (not where it is stored) and the
    model's architecture fields (not its compute options), as JSON would store them. qwen2 and llama are recorded
    as `qkv_bias` True/False, as before `model.model_type` existed (`_QKV_BIAS_OF_OLD_MODEL_TYPES`)."""
    task = {k: v for k, v in config.task.to_dict().items() if k not in ("data_dir", "max_prompt_len",
                                                                        "max_response_len")}
    model = {k: v for k, v in config.model.to_dict().items() if k not in builders.COMPUTE_OPTIONS}
    if model["model_type"] in _QKV_BIAS_OF_OLD_MODEL_TYPES:
        model["qkv_bias"] = _QKV_BIAS_OF_OLD_MODEL_TYPES[model.pop("model_type")]
    return json.loads(json.dumps({"task": task, "model": model}))


def provenance_of(workdir: str) -> dict | None:
    """The `provenance` of the run in `workdir` (None: no checkpoint, or built before provenance was recorded)."""
    return (ckpt_lib.read_meta(workdir) or {}).get("provenance")


def run_id(workdir: str) -> str | None:
    return (provenance_of(workdir) or {}).get("run_id")


def provenance(config: ml_collections.ConfigDict, meta: dict) -> dict[str, Any]:
    """The `provenance` entry of this run's checkpoint meta. `meta`: the restored checkpoint's ({} for a fresh run),
    whose run id and upstream run ids a resumed run keeps."""
    old = meta.get("provenance") or {}
    return {"run_id": old.get("run_id") or uuid.uuid4().hex, "settings": settings(config),
            "upstream": old.get("upstream") or {stage: run_id(workdir) for stage, workdir in prerequisites(config)}}
