"""The pipeline's stages and how they find each other: SFT -> (reward model | value pretraining) -> RL.

A stage is done when its workdir holds a checkpoint whose meta says `done`. An RL run whose earlier stages are
missing runs them first (`config.run_missing_stages`) with the stage's own config file, sharing the model, task,
mesh and seed; otherwise it fails before anything compiles, naming the command to run.

Provenance: every stage's checkpoint meta records what it was built from (`provenance`: its own run id, the task
and model settings, the run ids of the stages it started from). Before a stage starts, each finished stage it
needs is checked against it: trained on other task or model settings, or built from another run of its own
upstream stage (e.g. a value-pretrained critic fit on samples of a different SFT policy), it is stale. A stale
stage is moved aside (`<workdir>.stale-<run id>`, never deleted) and rerun when the run starts missing stages
itself; otherwise the run stops with an error naming both. A resumed run is checked the same way against the
stages it was started from.
"""

from __future__ import annotations

import logging
import pathlib
import sys
from typing import Any, Callable

import ml_collections

from vcppo_jax import config as config_lib
from vcppo_jax import runtime as rt_lib
from vcppo_jax.dry_run import plan as dry_run_plan
from vcppo_jax.rl_loop import run_rl
from vcppo_jax.sft import run_sft
from vcppo_jax.stage_meta import (finished_meta, prerequisites, provenance_of, read_stage_meta, run_id, settings,
                                  settings_differ, stage_done)
from vcppo_jax.value_train import run_value_training

# The critic stages must see the responses RL will see: same sampling distribution.
_SHARED = ("model", "task", "mesh", "seed", "sampling", "tensorboard", "progress_bar")


def derived_config(parent: ml_collections.ConfigDict, stage: str, workdir: str) -> ml_collections.ConfigDict:
    """The stage's default config (`config.default_config`) with the parent's model/task/mesh/seed, its
    `stage_overrides` for that stage, and the given workdir."""
    c = config_lib.default_config(stage)
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
        if v is not None and k == "lr":
            c.optim.lr = v
        elif v is not None:
            c[k] = v
    return config_lib.validate(c)


def stale_stages(config: ml_collections.ConfigDict) -> list[tuple[str, str, str]]:
    """(stage, workdir, why) for each finished stage this run needs that was not built for it (module docstring).
    Stages finished before provenance was recorded are not checked (a warning says so). Raises ValueError when this
    run's own checkpoint was started from another run of a stage it needs."""
    stale: list[tuple[str, str, str]] = []
    current: dict[str, str | None] = {}  # stage -> run id; None: being (re)built or not recorded
    rebuilt: set[str] = set()
    dirs = dict(prerequisites(config))
    for stage, workdir in dirs.items():
        meta = read_stage_meta(workdir) or {}  # one read per stage: a checkpoint manager each time
        prov = meta.get("provenance") if meta.get("done") else None
        current[stage] = None if prov is None else prov["run_id"]
        if not meta.get("done"):
            rebuilt.add(stage)  # missing: what was built from an older run of it is stale
            continue
        if prov is None:
            logging.warning("%s in %s records no provenance (built by an older version); not checked", stage, workdir)
            continue
        want, recorded = settings(config, stage), prov["settings"]
        why = [f"its {k} settings {recorded.get(k)} differ from this run's {want[k]}"
               for k in settings_differ(recorded, want)]
        for up, up_id in prov["upstream"].items():
            if up in rebuilt:
                why.append(f"it was built from {up} run {up_id}, which is being rebuilt")
            elif up in current and current[up] is not None and current[up] != up_id:
                why.append(f"it was built from {up} run {up_id}, but {dirs[up]} holds run {current[up]}")
        if why:
            stale.append((stage, workdir, "; ".join(why)))
            rebuilt.add(stage)
    own = provenance_of(config.workdir) if config.get("resume", True) else None
    for up, up_id in (own or {}).get("upstream", {}).items():
        if up in rebuilt or current.get(up) not in (None, up_id):
            raise ValueError(f"{config.workdir} was started from {up} run {up_id}, but {up} in {dirs[up]} is now "
                             f"{'stale' if up in rebuilt else f'run {current[up]}'}: resuming would mix the two; use "
                             "a new workdir")
    return stale


def _move_aside(workdir: str) -> str:
    path = pathlib.Path(workdir)
    name = f"{path.name}.stale-{run_id(workdir) or 'unknown'}"
    target, n = path.with_name(name), 1
    while target.exists():
        target, n = path.with_name(f"{name}-{n}"), n + 1
    path.rename(target)
    return str(target)


def ensure_prerequisites(config: ml_collections.ConfigDict) -> None:
    """Runs (or, without `run_missing_stages`, demands) every missing or stale earlier stage. Runs no compile itself
    when everything is present and current.

    Every missing stage's config, and the mesh/batch split of those stages and of this one, is checked before the
    first of them starts, so a bad override or batch size fails at once rather than after SFT has trained."""
    stale = stale_stages(config)
    if stale and not config.get("run_missing_stages", False):
        stage, workdir, why = stale[0]
        raise ValueError(f"{stage} in {workdir} was not built for this run: {why}. Point the config at a matching "
                         f"run, or move {workdir} away (with run_missing_stages it is moved aside and rerun)")
    stale_dirs = {workdir for _, workdir, _ in stale}
    missing = [(stage, workdir) for stage, workdir in prerequisites(config)
               if workdir in stale_dirs or not stage_done(workdir)]
    if missing and not config.get("run_missing_stages", False):
        finished_meta(missing[0][1], missing[0][0])  # raises the explanatory error
    plan = [derived_config(config, stage, workdir) for stage, workdir in missing]
    for c in plan + ([config] if plan else []):
        rt_lib.make_runtime(c)
    for stage, workdir, why in stale:  # only now: a bad config above fails before anything is moved
        target = _move_aside(workdir)
        print(f"[pipeline] {stage} in {workdir} was not built for this run ({why}): moved to {target}, rerunning it",
              flush=True)
    for c in plan:
        print(f"[pipeline] no finished {c.stage} in {c.workdir}: running it now", flush=True)
        run_stage(c)


def run_stage(config: ml_collections.ConfigDict) -> Any:
    """Validates, brings in missing earlier stages, then runs this stage's loop (`dry_run`: only its memory plan)."""
    config_lib.validate(config)
    if config.dry_run:
        return dry_run_plan(config)
    ensure_prerequisites(config)
    if config.stage == "sft":
        return run_sft(config)
    if config.stage in ("value_pretrain", "reward_model"):
        return run_value_training(config)
    return run_rl(config)


def main_guard(fn: Callable, config: ml_collections.ConfigDict) -> Any:
    """Entrypoint wrapper: user errors (bad config, missing checkpoints, mesh/batch mismatch) exit with one clear
    line instead of a traceback."""
    try:
        return fn(config)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # ConfigError, CheckpointMismatchError included
        sys.exit(f"error: {e}")


def cli(help_text: str) -> None:
    """`--config=configs/X.py` (+ `--config.field=value` overrides) -> `run_stage`, for the experiments/ scripts."""
    from absl import app  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    flag = config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)

    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        rt_lib.configure_console(flag.value.get("verbose", False))
        main_guard(run_stage, flag.value)

    app.run(main)
