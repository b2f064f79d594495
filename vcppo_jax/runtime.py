"""Run-time plumbing shared by the training loops: mesh and state shardings, checkpoint trees, logging, halting.

Nothing here holds hidden global state; each loop builds one `Runtime` from its config and passes it along.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
import tqdm

from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import sharding
from vcppo_jax.metrics import MetricWriter
from vcppo_jax.models.config import check_attention_backend
from vcppo_jax.optim import ModelState, init_model_state


@dataclasses.dataclass
class Runtime:
    mesh: jax.sharding.Mesh
    rules: Any

    def place_batch(self, tree):
        """This process's rows of a host batch (`local_rows`) -> global arrays split over ('data', 'fsdp')."""
        return sharding.shard_batch(tree, self.mesh)

    def local_rows(self, batch_size: int) -> slice:
        """The rows of a global batch this process feeds and reads back (all of them on one host)."""
        return sharding.local_rows(self.mesh, batch_size)

    def fetch(self, tree):
        """Device results -> numpy: batch-sharded leaves as this process's rows, replicated leaves whole."""
        return sharding.fetch_local(tree)

    def gather(self, tree, rows: slice):
        """This process's `rows` of a host batch -> the whole batch on every process (collective)."""
        return sharding.gather_rows(tree, rows)

    def shardings(self, abstract_boxed):
        return sharding.logical_shardings(abstract_boxed, self.mesh, self.rules)

    def target(self, abstract_boxed):
        """The unboxed abstract tree, each leaf carrying its sharding on this mesh: a restore / load target."""
        return with_shardings(abstract_boxed, self.shardings(abstract_boxed))

    def context(self):
        """Activates logical activation constraints inside the model while tracing."""
        return sharding.use_mesh(self.mesh, self.rules)


def batch_sizes(config: ml_collections.ConfigDict) -> dict[str, int]:
    """Every global batch the loop of `config.stage` splits over data*fsdp, keyed by the expression that sets it."""
    if config.stage == "sft":
        return {"batch_size": config.batch_size,
                "min(eval_prompts, batch_size)": min(config.eval_prompts, config.batch_size)}
    batch = config.prompts_per_step * config.group_size
    sizes = {"prompts_per_step*group_size": batch}
    if config.stage == "rl":
        sizes["prompts_per_step*group_size/num_minibatches"] = batch // config.num_minibatches
        sizes["min(eval_prompts, prompts_per_step*group_size)"] = min(config.eval_prompts, batch)
    return sizes


def make_runtime(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> Runtime:
    """Mesh from `config.mesh` over `devices` (default: all of this run's; a dry run passes a TPU slice's); checks
    every batch of the stage divides data*fsdp, and that the attention kernel runs on those devices, before anything
    compiles."""
    sharding.maybe_initialize_distributed()
    check_attention_backend(config.model.attention_impl or None,
                            jax.default_backend() if devices is None else devices[0].platform)
    mesh = sharding.make_mesh(**config.mesh.to_dict(), devices=devices)
    for what, size in batch_sizes(config).items():
        sharding.check_batch_divisible(size, mesh, what=what)
    return Runtime(mesh=mesh, rules=sharding.DEFAULT_LOGICAL_RULES)


def _dummy_inputs():
    return jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)


def abstract_params(model: nn.Module) -> Any:
    """Boxed (logically annotated) abstract 'params' of `model`."""
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *_dummy_inputs()))["params"]


def abstract_model_state(model: nn.Module, tx: optax.GradientTransformation | None) -> Any:
    """Boxed abstract ModelState (params + optimizer state), or just the boxed params when tx is None."""
    params = abstract_params(model)
    return params if tx is None else jax.eval_shape(lambda p: init_model_state(p, tx), params)


def with_shardings(abstract_boxed, shardings) -> Any:
    """Unboxed ShapeDtypeStructs carrying their target sharding (restore targets, jit out_shardings)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(abstract_boxed),
                        shardings)


def model_state_to_dict(state: ModelState, params_key: str = "params") -> dict:
    return {params_key: state.params, "opt_state": state.opt_state, "step": state.step}


def model_state_from_dict(d: dict, params_key: str = "params") -> ModelState:
    return ModelState(params=d[params_key], opt_state=d["opt_state"], step=d["step"])


class StepLogger:
    """Progress bar + metrics (JSONL/TensorBoard) every `log_every` steps; halts after too many bad steps."""

    def __init__(self, config: ml_collections.ConfigDict, *, total: int, initial: int, desc: str,
                 show: tuple[str, ...]):
        self._writer = MetricWriter(config.workdir, tensorboard=config.tensorboard)
        self._every = config.log_every
        self._show = show
        self._max_bad = config.max_bad_steps
        self._bad_in_a_row = 0
        self._main = jax.process_index() == 0  # one console and one metrics file per run, not one per host
        self._bar = tqdm.tqdm(total=total, initial=initial, desc=desc,
                              disable=not (config.progress_bar and self._main), dynamic_ncols=True, file=sys.stdout)
        self._desc, self._workdir, self._step, self._total = desc, config.workdir, initial, total
        self.print(f"[{desc}] {config.workdir}: " + (f"resuming at step {initial} of {total}" if initial
                                                      else f"{total} steps"))

    def log(self, step: int, metrics: dict[str, Any], *, force: bool = False) -> None:
        self._bar.update(1)
        self._step = step
        if force or step % self._every == 0:
            self._writer.write(step, metrics)
            self._bar.set_postfix({k.split("/")[-1]: f"{float(metrics[k]):.3g}" for k in self._show if k in metrics},
                                  refresh=False)

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Out-of-band metrics (evaluations), printed and written; returns them."""
        self._writer.write(step, metrics)
        self.print(f"step {step}: " + ", ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items())))
        return metrics

    def print(self, text: str) -> None:
        if self._main:
            self._bar.write(text)

    def count_nonfinite(self, step: int, nonfinite: float) -> None:
        """Counts steps with skipped (non-finite) updates; raises after `max_bad_steps` in a row."""
        if nonfinite > 0:
            self._bad_in_a_row += 1
            logging.warning("step %d: %d non-finite updates skipped (%d bad steps in a row)", step, nonfinite,
                            self._bad_in_a_row)
            if self._bad_in_a_row >= self._max_bad:
                raise FloatingPointError(
                    f"{self._bad_in_a_row} steps in a row had non-finite losses or gradients (config.max_bad_steps="
                    f"{self._max_bad}); halting without saving. The last good checkpoint is untouched.")
        else:
            self._bad_in_a_row = 0

    @property
    def bad_in_a_row(self) -> int:
        return self._bad_in_a_row

    def close(self) -> None:
        self._bar.close()
        self._writer.close()
        if self._main:
            print(f"[{self._desc}] stopped at step {self._step} of {self._total}: {self._workdir}", flush=True)


def checkpointer(config: ml_collections.ConfigDict) -> ckpt_lib.Checkpointer:
    return ckpt_lib.Checkpointer(config.workdir, max_to_keep=config.max_to_keep)


def configure_console(verbose: bool) -> None:
    """For an entrypoint, once: without `verbose`, the libraries' log lines (orbax and TFDS log through absl at INFO
    and WARNING, e.g. 'CheckpointManagerOptions.read_only=True, ...' on every read) and TFDS progress bars are
    silenced; this project's warnings (checkpoint fallback, stale stages, non-finite steps) use the root logger and
    still show."""
    if verbose:
        return
    import tensorflow_datasets as tfds  # noqa: PLC0415 (heavy; only entrypoints call this)

    # Not absl's set_verbosity: with absl's handler installed that sets the root logger, hiding our warnings too.
    logging.getLogger("absl").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.WARNING)  # libraries' INFO lines (e.g. JAX probing for a TPU)
    tfds.disable_progress_bar()


def restore_or_init_state(rt: Runtime, config: ml_collections.ConfigDict, abstract: dict,
                          init: Callable[[Any], dict]) -> tuple[ckpt_lib.Checkpointer, dict, dict, int]:
    """A loop's train state, sharded over the mesh: the latest checkpoint in `config.workdir` when `config.resume`
    and one exists, else `init`-ed at step 0. Returns (checkpointer, state, meta, start step).

    abstract: the checkpoint's layout, name -> abstract tree (`model_state_to_dict(abstract_model_state(...))`,
      `abstract_params(...)`, or a `jax.ShapeDtypeStruct`); leaves boxed with logical axis names are sharded by
      `rt`'s rules, the others (an rng key, a step counter) replicated.
    init(shardings) -> the fresh state in that layout, placed on `shardings` (called only when nothing is restored).
    With resume=False a workdir that already holds checkpoints is an error: starting over there would mix two runs'
    steps (and the existing ones are never overwritten).
    """
    ckpt = checkpointer(config)
    target = rt.target(abstract)
    if ckpt.latest_step() is None:
        return ckpt, init(jax.tree.map(lambda t: t.sharding, target)), {}, 0
    if not config.resume:
        raise FileExistsError(f"config.resume=False but {config.workdir} already holds checkpoints (steps "
                              f"{ckpt.all_steps()}); use a new workdir, or resume=True to continue that run")
    state, meta, step = ckpt.restore(target)
    return ckpt, state, meta, step
