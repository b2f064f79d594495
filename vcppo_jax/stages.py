"""The pipeline's stages and how they find each other: SFT -> (reward model | value pretraining) -> RL.

A stage is done when its workdir holds a checkpoint whose meta says `done`. An RL run whose earlier stages are
missing runs them first (`config.run_missing_stages`) with the stage's own config file, sharing the model, task,
mesh and seed; otherwise it fails before anything compiles, naming the command to run.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import sys
from typing import Any, Callable

import ml_collections

from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import config as config_lib
from vcppo_jax import runtime as rt_lib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
ENTRYPOINTS = {"sft": "experiments/sft.py", "reward_model": "experiments/train_reward_model.py",
               "value_pretrain": "experiments/pretrain_value.py", "rl": "experiments/train.py"}
# The critic stages must see the responses RL will see: same sampling distribution.
_SHARED = ("model", "task", "mesh", "seed", "sampling", "tensorboard", "progress_bar")


def load_config_file(name: str) -> ml_collections.ConfigDict:
    path = CONFIG_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"configs.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def stage_done(workdir: str) -> bool:
    meta = ckpt_lib.read_meta(workdir)
    return bool(meta and meta.get("done"))


def stage_meta(workdir: str, stage: str) -> dict:
    meta = ckpt_lib.read_meta(workdir)
    if not meta or not meta.get("done"):
        raise FileNotFoundError(f"no finished {stage} checkpoint in {workdir!r}; run "
                                f"`python {ENTRYPOINTS[stage]} --config=configs/{stage}.py` first (or point the "
                                "config at an existing run)")
    return meta


def derived_config(parent: ml_collections.ConfigDict, stage: str, workdir: str) -> ml_collections.ConfigDict:
    """configs/<stage>.py with the parent's model/task/mesh/seed and the given workdir."""
    c = load_config_file(stage)
    for k in _SHARED:
        c[k] = parent[k]
    c.workdir = workdir
    for k in ("sft_dir", "stage_overrides"):
        if k in c and k in parent:
            c[k] = parent[k]
    for k in ("reward_correct", "reward_wrong"):
        if k in c and k in parent:
            c[k] = parent[k]
    overrides = parent.get("stage_overrides", {}).get(stage, {})
    for k, v in overrides.items():
        if v is not None:
            c[k] = v
    return config_lib.validate(c)


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


def ensure_prerequisites(config: ml_collections.ConfigDict) -> None:
    """Runs (or, without `run_missing_stages`, demands) every missing earlier stage. Runs no compile itself when
    everything is present.

    Every missing stage's config, and the mesh/batch split of those stages and of this one, is checked before the
    first of them starts, so a bad override or batch size fails at once rather than after SFT has trained."""
    missing = [(stage, workdir) for stage, workdir in prerequisites(config) if not stage_done(workdir)]
    if missing and not config.get("run_missing_stages", False):
        stage_meta(missing[0][1], missing[0][0])  # raises the explanatory error
    plan = [derived_config(config, stage, workdir) for stage, workdir in missing]
    for c in plan + ([config] if plan else []):
        rt_lib.make_runtime(c)
    for c in plan:
        logging.warning("%s checkpoint missing in %s: running that stage first", c.stage, c.workdir)
        print(f"[pipeline] no finished {c.stage} in {c.workdir}: running it now", flush=True)
        run_stage(c)


def run_stage(config: ml_collections.ConfigDict) -> Any:
    """Validates, brings in missing earlier stages, then runs this stage's loop."""
    config_lib.validate(config)
    ensure_prerequisites(config)
    if config.stage == "sft":
        from vcppo_jax.sft import run_sft
        return run_sft(config)
    if config.stage in ("value_pretrain", "reward_model"):
        from vcppo_jax.value_train import run_value_training
        return run_value_training(config)
    from vcppo_jax.rl_loop import run_rl
    return run_rl(config)


def main_guard(fn: Callable, config: ml_collections.ConfigDict) -> Any:
    """Entrypoint wrapper: user errors (bad config, missing checkpoints, mesh/batch mismatch) exit with one clear
    line instead of a traceback."""
    try:
        return fn(config)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # ConfigError and CheckpointMismatchError are ValueErrors
        sys.exit(f"error: {e}")


def cli(help_text: str) -> None:
    """`--config=configs/X.py` (+ `--config.field=value` overrides) -> `run_stage`, for the experiments/ scripts."""
    from absl import app  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    flag = config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)

    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        main_guard(run_stage, flag.value)

    app.run(main)
