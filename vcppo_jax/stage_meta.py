"""What a stage's checkpoint records about where it came from, and what each stage needs before it.

Below the loops (`sft`, `value_train`, `rl_loop` write this metadata; `stages` reads it to order and check the
pipeline), so nothing imports back up.

Provenance: every stage's checkpoint meta records its own run id, the task and model settings it is only valid
for, and the run ids of the stages it started from (`provenance`).

An HF (transformers) model folder given as `sft_dir` stands for a finished SFT stage: RL and value pretraining
start from a pretrained or instruct model directly. Its run id is a digest of its files; it was trained for no
particular task, so it records no settings and is never stale.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from typing import Any

import ml_collections

from vcppo_jax import builders
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import config as config_lib
from vcppo_jax.models.hf import hf_model_config, is_hf_checkpoint


@functools.lru_cache(maxsize=16)
def _digest(paths: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 over the files (path, size, mtime_ns), read once per version of them."""
    h = hashlib.sha256()
    for path, _, _ in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()[:16]


def hf_folder_meta(folder: str) -> dict:
    """The meta a finished SFT run would record, for an HF model folder (module docstring)."""
    names = sorted(n for n in os.listdir(folder) if n == "config.json" or n.endswith(".safetensors"))
    stats = tuple((p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in (os.path.join(folder, n) for n in names))
    return {"stage": "sft", "done": True, "hf_folder": True,
            "model_config": builders.model_config_to_json(hf_model_config(folder)),
            "provenance": {"run_id": f"hf-{_digest(stats)}", "settings": None, "upstream": {}}}


def read_stage_meta(workdir: str) -> dict | None:
    """The meta of the run in `workdir` (None: no checkpoint), or of the HF folder `workdir` (`hf_folder_meta`)."""
    return hf_folder_meta(workdir) if is_hf_checkpoint(workdir) else ckpt_lib.read_meta(workdir)


def stage_done(workdir: str) -> bool:
    """Whether `workdir` holds a finished run (its checkpoint meta says `done`), or is an HF model folder."""
    return _done(read_stage_meta(workdir))


def _done(meta: dict | None) -> bool:
    return bool(meta and meta.get("done"))


def finished_meta(workdir: str, stage: str) -> dict:
    """The meta of the finished `stage` in `workdir`; FileNotFoundError naming the command that makes it."""
    meta = read_stage_meta(workdir)
    if not _done(meta):
        raise FileNotFoundError(f"no finished {stage} checkpoint in {workdir!r}; train the {stage} stage there first "
                                "(or set run_missing_stages=True, or point the config at an existing run)")
    return meta


def prerequisites(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
    """(stage, workdir) pairs this run needs finished, in order."""
    needs = []
    if config.stage in ("rl", "value_pretrain", "reward_model"):
        needs.append(("sft", config.sft_dir))
    if config.stage == "rl" and config_lib.has_critic(config) and config.critic_init in ("value_pretrain",
                                                                                       "reward_model"):
        needs.append((config.critic_init, config.critic_dir))
    if config.stage == "value_pretrain" and config.critic_init == "reward_model":
        needs.append(("reward_model", config.critic_dir))
    return needs


# The prompt and response caps shape what a critic stage was fit to (the returns of responses cut at the cap), not
# what an SFT policy learned from whole records: part of the critic stages' settings only.
CRITIC_STAGES = ("value_pretrain", "reward_model")
LENGTH_SETTINGS = ("max_prompt_len", "max_response_len")


def settings(config: ml_collections.ConfigDict, stage: str | None = None) -> dict[str, Any]:
    """The settings a checkpoint of `stage` (default: the config's own) is only valid for: the task's data (not where
    it is stored; for `CRITIC_STAGES` also its length caps) and the model's architecture fields (not its compute
    options), as JSON would store them."""
    drop = ("data_dir",) + (() if (stage or config.stage) in CRITIC_STAGES else LENGTH_SETTINGS)
    task = {k: v for k, v in config.task.to_dict().items() if k not in drop}
    model = {k: v for k, v in config.model.to_dict().items() if k not in builders.COMPUTE_OPTIONS}
    return json.loads(json.dumps({"task": task, "model": model}))


def settings_differ(recorded: dict[str, Any] | None, want: dict[str, Any]) -> list[str]:
    """The groups ('task', 'model') of `want` that `recorded` differs in; none for None (an HF model folder, valid
    for any task). A length cap a checkpoint did not record (written before they were part of a critic's settings)
    is not held against it."""
    if recorded is None:
        return []

    def known(group: str) -> dict[str, Any]:
        mine = recorded.get(group)
        if group != "task" or mine is None:
            return mine
        return {**{k: want[group][k] for k in LENGTH_SETTINGS if k in want[group]}, **mine}
    return [k for k in want if known(k) != want[k]]


def provenance_of(workdir: str) -> dict | None:
    """The `provenance` of the run in `workdir` (None: no checkpoint, or built before provenance was recorded)."""
    return (read_stage_meta(workdir) or {}).get("provenance")


def run_id(workdir: str) -> str | None:
    return (provenance_of(workdir) or {}).get("run_id")


def provenance(config: ml_collections.ConfigDict, meta: dict) -> dict[str, Any]:
    """The `provenance` entry of this run's checkpoint meta. `meta`: the restored checkpoint's ({} for a fresh run),
    whose run id and upstream run ids a resumed run keeps."""
    old = meta.get("provenance") or {}
    return {"run_id": old.get("run_id") or uuid.uuid4().hex, "settings": settings(config),
            "upstream": old.get("upstream") or {stage: run_id(workdir) for stage, workdir in prerequisites(config)}}
