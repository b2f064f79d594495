"""Checkpoints on orbax `CheckpointManager`: save/resume with fallback, param loading, preemption.

Layout of a run directory (orbax default naming; one folder per step):

    <directory>/<step>/state/   StandardSave of the train-state pytree (arrays only, unboxed)
    <directory>/<step>/meta/    JsonSave of python-level info (data position, config, PRNG, ...)
    <directory>/corrupt/        unreadable steps moved aside by `Checkpointer.restore`

Orbax writes each step into `<step>.orbax-checkpoint-tmp-*` and renames it when complete, so a
crash mid-save leaves an ignored tmp folder and the older steps untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax.core import meta as flax_meta

STATE, META = "state", "meta"
CORRUPT_SUBDIR = "corrupt"


class CheckpointMismatchError(ValueError):
    """The checkpoint is readable but its tree does not match the restore target."""


# ----------------------------------------------------------------------------------------------
# Tree helpers
# ----------------------------------------------------------------------------------------------


def _abstract(tree: Any) -> Any:
    """Restore target: arrays / ShapeDtypeStructs -> ShapeDtypeStruct keeping the target sharding.

    A leaf without a sharding is restored onto the first local device (as `jnp` would place it).
    """

    def one(x: Any) -> Any:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def _absolute(path: str | epath.PathLike) -> epath.Path:
    """Orbax's tensorstore writer needs absolute paths; URLs (gs://...) already are."""
    text = str(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _reject_boxes(tree: Any, what: str) -> None:
    boxed = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, flax_meta.AxisMetadata))
    if any(isinstance(x, flax_meta.AxisMetadata) for x in boxed):
        raise ValueError(f"{what} contains flax partitioning boxes; pass `nn.unbox(tree)` (arrays only)")


def _fmt_key(key: tuple[str, ...]) -> str:
    return "/".join(key)


def _check_matches(stored: Any, target: Any, where: str) -> None:
    """CheckpointMismatchError listing missing / unexpected / wrongly shaped leaves."""
    have = ocp.tree.to_flat_dict(stored)
    want = ocp.tree.to_flat_dict(target)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = sorted(
        f"{_fmt_key(k)}: checkpoint {tuple(have[k].shape)} vs target {tuple(want[k].shape)}"
        for k in set(want) & set(have)
        if hasattr(want[k], "shape") and hasattr(have[k], "shape") and tuple(have[k].shape) != tuple(want[k].shape)
    )
    if missing or extra or shapes:
        parts = []
        for label, items in (("missing in checkpoint", [_fmt_key(k) for k in missing]),
                             ("not in target", [_fmt_key(k) for k in extra]),
                             ("shape mismatch", shapes)):
            if items:
                more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
                parts.append(f"{label}: {', '.join(items[:5])}{more}")
        raise CheckpointMismatchError(f"{where} does not match the restore target; " + "; ".join(parts))


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(x).tolist()
    return x


# ----------------------------------------------------------------------------------------------
# Checkpointer
# ----------------------------------------------------------------------------------------------


def _newest_readable(steps: Sequence[int], read: Callable[[int], Any], where: Callable[[int], str],
                     run: str) -> tuple[int, Any, list[int]]:
    """(step, read(step), unreadable newer steps) for the newest of `steps` (newest first) that reads.

    A CheckpointMismatchError (readable, but not what the caller expects: a code or config change) propagates at
    once. Any other failure makes that step unusable: with older steps left it is skipped with a warning; when no
    step reads, RuntimeError names each failure (`where(step)`: how a step is named; `run`: the run directory).
    """
    failures: list[tuple[int, Exception]] = []
    for s in steps:
        try:
            return s, read(s), [b for b, _ in failures]
        except CheckpointMismatchError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure means "this step is unusable"
            if s != steps[-1]:
                logging.warning("%s is unreadable (%s: %s); trying the previous step", where(s), type(e).__name__,
                                str(e)[:500])
            failures.append((s, e))
    if len(failures) == 1:
        (s, e), = failures
        raise RuntimeError(f"{where(s)} is unreadable ({type(e).__name__}: {str(e)[:500]})") from e
    details = "; ".join(f"step {s}: {type(e).__name__}: {str(e)[:200]}" for s, e in failures)
    raise RuntimeError(f"no restorable checkpoint in {run} ({details})")


class Checkpointer:
    """Periodic train-state checkpoints with corrupt-step fallback.

    save(step, state, meta): `state` is a pytree of arrays (params, optax state, step counter);
      `meta` a JSON-serializable dict (numpy scalars/arrays are converted).
    restore(abstract_state): newest readable step, restored into the types and shardings of
      `abstract_state` (e.g. `jax.eval_shape` output with `.sharding` set, or live arrays).
    """

    def __init__(
        self,
        directory: str | epath.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 or None (keep all)")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps={save_interval_steps} must be >= 1")
        self.directory = _absolute(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                save_interval_steps=save_interval_steps,
                create=True,
                enable_async_checkpointing=async_save,
            ),
            item_handlers={STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
        )

    # -- queries -------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    # -- save ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, force: bool = False) -> bool:
        """Save if `step` is on the save interval (or `force`); returns whether a save started.

        Saving a step that already exists is a no-op returning False (e.g. a preemption save right
        after a periodic one), so an existing checkpoint is never overwritten.
        """
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        _reject_boxes(state, "state")
        meta = _jsonable(dict(meta))
        try:
            json.dumps(meta)
        except TypeError as e:
            raise ValueError(f"meta must be JSON-serializable: {e}") from None
        if int(step) in self._manager.all_steps():
            logging.info("checkpoint step %d already exists in %s; not saving again", step, self.directory)
            return False
        return self._manager.save(
            int(step),
            args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}),
            force=force,
        )

    def wait(self) -> None:
        """Block until pending async saves are on disk (call before exiting)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- restore -------------------------------------------------------------------------------

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict]:
        stored = self._manager.item_metadata(step)[STATE]  # reads the tree metadata; raises if unreadable
        if stored is None:
            raise FileNotFoundError(f"step {step} has no '{STATE}' item")
        _check_matches(stored.tree, target, f"checkpoint {self.directory / str(step)}")
        out = self._manager.restore(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()})
        )
        return out[STATE], dict(out[META] or {})

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """(state, meta, step) from `step`, or from the newest step that restores.

        With step=None an unreadable newest step (truncated files, missing item) is skipped with a
        warning and moved to `<directory>/corrupt/` once an older step restored, so the run can save
        that step number again. A readable step whose tree differs from `abstract_state` raises
        CheckpointMismatchError at once (a code/config change, not corruption).
        """
        _reject_boxes(abstract_state, "abstract_state")
        self.wait()
        target = _abstract(abstract_state)
        steps = sorted(self._manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; available: {sorted(steps)}")
            steps = [step]
        if not steps:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        found, (state, meta), bad = _newest_readable(steps, lambda s: self._restore_step(s, target),
                                                     lambda s: f"checkpoint step {s} in {self.directory}",
                                                     str(self.directory))
        self._quarantine(bad)
        return state, meta, found

    def _quarantine(self, steps: Sequence[int]) -> None:
        """Move unreadable steps out of orbax's view (kept for inspection, never deleted)."""
        if not steps:
            return
        if jax.process_index() == 0:
            dest = self.directory / CORRUPT_SUBDIR
            dest.mkdir(parents=True, exist_ok=True)
            for s in steps:
                target = dest / f"{s}.{int(time.time())}"
                (self.directory / str(s)).rename(target)
                logging.warning("moved unreadable checkpoint step %d to %s", s, target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("vcppo_checkpoint_quarantine")
        self._manager.reload()


# ----------------------------------------------------------------------------------------------
# Loading params from another run
# ----------------------------------------------------------------------------------------------


def _resolve_run_dir(path: epath.Path, step: int | None) -> tuple[epath.Path, int | None]:
    """A run dir (integer step subdirs) or a step dir (<run>/<step> with a 'state' item)."""
    if (path / STATE).exists() and path.name.isdigit():
        if step is not None and step != int(path.name):
            raise ValueError(f"step={step} conflicts with the step directory {path}")
        return path.parent, int(path.name)
    return path, step


def _load_subtree(
    manager: ocp.CheckpointManager, step: int, keys: tuple[str, ...], target: Any, where: str
) -> Any:
    stored = manager.item_metadata(step)[STATE]  # raises if the step is unreadable
    if stored is None:
        raise FileNotFoundError(f"{where} has no '{STATE}' item")
    sub = stored.tree
    for i, k in enumerate(keys):
        if not isinstance(sub, Mapping) or k not in sub:
            have = sorted(sub) if isinstance(sub, Mapping) else type(sub).__name__
            raise CheckpointMismatchError(f"{where} has no subtree {'/'.join(keys[: i + 1])!r}; available: {have}")
        sub = sub[k]
    _check_matches(sub, target, f"{where} subtree {'/'.join(keys)!r}")
    item, restore_args = target, ocp.checkpoint_utils.construct_restore_args(target)
    for k in reversed(keys):
        item, restore_args = {k: item}, {k: restore_args}
    out = manager.restore(
        step,
        args=ocp.args.Composite(
            **{STATE: ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)}
        ),
    )[STATE]
    for k in keys:
        out = out[k]
    return out


def load_params(
    path: str | epath.PathLike,
    abstract_params: Any,
    *,
    key: str = "params",
    step: int | None = None,
    hint: str = "",
) -> Any:
    """Restore only the subtree `state[key]` of another run's checkpoint into `abstract_params`.

    path: a run directory (newest readable step is used unless `step`) or one step directory.
    key: '/'-separated path into the saved state dict, e.g. 'critic_params' or 'params/critic'.
    abstract_params: target tree (arrays or ShapeDtypeStructs with shardings); structure and
      shapes are checked against the checkpoint metadata before any array is read. dtypes cast.
    hint: appended to the not-found error (e.g. "run experiments/pretrain_value.py first").
    """
    path = _absolute(path)
    suffix = f"; {hint}" if hint else ""
    run_dir, step = _resolve_run_dir(path, step)
    if not run_dir.exists():
        raise FileNotFoundError(f"no checkpoint found in {path} (path does not exist){suffix}")
    _reject_boxes(abstract_params, "abstract_params")
    keys = tuple(k for k in key.split("/") if k)
    if not keys:
        raise ValueError(f"key={key!r} must name a subtree of the saved state, e.g. 'critic_params'")
    manager = ocp.CheckpointManager(
        run_dir,
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
        item_handlers={STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
    )
    try:
        steps = sorted(manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"no checkpoint step {step} in {run_dir}; available: {sorted(steps)}{suffix}")
            steps = [step]
        if not steps:
            raise FileNotFoundError(f"no checkpoint found in {path}{suffix}")
        target = _abstract(abstract_params)
        where = lambda s: f"checkpoint {run_dir / str(s)}"  # noqa: E731
        return _newest_readable(steps, lambda s: _load_subtree(manager, s, keys, target, where(s)), where,
                                str(run_dir))[1]
    finally:
        manager.close()


# ----------------------------------------------------------------------------------------------
# Preemption
# ----------------------------------------------------------------------------------------------


class PreemptionGuard:
    """Set by SIGTERM (or `request_stop()`); the loop polls `should_stop` and checkpoints."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        # Signal handlers run between bytecodes of the main thread: only flip the flag here.
        self.signum = signum
        self._event.set()

    def request_stop(self) -> None:
        self._event.set()

    @property
    def should_stop(self) -> bool:
        """This process received the signal."""
        return self._event.is_set()

    def should_stop_any(self) -> bool:
        """Any process received it. Collective on multi-host: every process must call it each time."""
        if jax.process_count() == 1:
            return self.should_stop
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.should_stop, np.int32))
        return bool(np.asarray(flags).any())


@contextlib.contextmanager
def preemption_guard(signals: Sequence[int] = (signal.SIGTERM,)) -> Iterator[PreemptionGuard]:
    """Install flag-setting handlers for `signals`; the previous handlers are restored on exit.

        with preemption_guard() as guard:
            for step in range(start, num_steps):
                state, metrics = train_step(state, batch)
                if guard.should_stop:
                    ckpt.save(step, state, meta, force=True); ckpt.wait(); break
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("preemption_guard() must be entered from the main thread (signal handlers)")
    guard = PreemptionGuard()
    previous = {s: signal.signal(s, guard._handler) for s in signals}
    try:
        yield guard
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def read_meta(directory: str | epath.PathLike, step: int | None = None) -> dict | None:
    """The JSON `meta` of a run's newest readable step (or of `step`); None when the run has no checkpoint.

    Reads no arrays: used to ask whether an earlier stage finished and which architecture it saved.
    """
    path = _absolute(directory)
    if not path.exists():
        return None
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True),
                                    item_handlers={META: ocp.JsonCheckpointHandler()})
    steps = [step] if step is not None else sorted(manager.all_steps(), reverse=True)
    read = lambda s: dict(manager.restore(s, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META])  # noqa
    if not steps:
        return None
    try:
        return _newest_readable(steps, read, lambda s: f"meta of checkpoint step {s} in {path}", str(path))[1]
    except RuntimeError as e:  # no step's meta reads: as if the run had no checkpoint
        logging.warning("%s", e)
        return None
