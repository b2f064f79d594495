"""Device mesh, logical-axis sharding rules and host-to-mesh transfer.

Model code names every parameter dimension with a logical axis ('embed', 'mlp', ...) through
`flax.linen.with_logical_partitioning`; this module owns the single table that maps those names to
the physical mesh axes ('data', 'fsdp', 'tensor'). The same code then runs on one CPU (mesh 1x1x1)
and on a pod slice.

Typical use in a trainer:

    maybe_initialize_distributed()                       # before any other JAX call
    mesh = make_mesh(data=-1, fsdp=cfg.fsdp, tensor=cfg.tensor)
    rules = DEFAULT_LOGICAL_RULES
    abstract = jax.eval_shape(init_fn, rng)              # leaves boxed by with_logical_partitioning
    shardings = logical_shardings(abstract, mesh, rules)
    state = jax.jit(lambda r: nn.unbox(init_fn(r)), out_shardings=shardings)(rng)
    batch = shard_batch(host_batch, mesh)                # process-local numpy -> global arrays
    with use_mesh(mesh, rules):                          # activates nn.with_logical_constraint
        state, metrics = train_step(state, batch)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
LogicalRules = tuple[tuple[str, MeshAxes], ...]

# Logical axis -> mesh axes. Order matters (flax semantics): for each array the first rule whose
# logical name appears claims its mesh axes if they are still free on that array, so an activation
# ('batch', 'length', 'embed') gives ('data','fsdp') to 'batch' and leaves 'embed' replicated, while a
# parameter ('embed', 'mlp') is FSDP-sharded on 'embed' and tensor-sharded on 'mlp'.
DEFAULT_LOGICAL_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("head_dim", None),
    ("layers", None),
)

_DATA_AXES: tuple[str, str] = ("data", "fsdp")


# ----------------------------------------------------------------------------------------------
# Mesh
# ----------------------------------------------------------------------------------------------


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all devices).

    One of the sizes may be -1, meaning "all remaining devices". Axis types are Auto so that
    `jit` shardings and `with_sharding_constraint` propagate as in GSPMD.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"mesh axis {name}={size!r} must be a positive int or -1 (fill the rest)")
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {fill} = -1")
    if fill:
        known = math.prod(size for size in sizes.values() if size != -1)
        if n % known:
            raise ValueError(
                f"cannot fill mesh axis {fill[0]!r}: {n} devices are not divisible by the product of the "
                f"other axes ({known}; data={data}, fsdp={fsdp}, tensor={tensor})"
            )
        sizes[fill[0]] = n // known
    shape = tuple(int(sizes[a]) for a in MESH_AXES)
    if math.prod(shape) != n:
        raise ValueError(
            f"mesh data*fsdp*tensor = {'*'.join(map(str, shape))} = {math.prod(shape)} does not match "
            f"the {n} available devices"
        )
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: LogicalRules = DEFAULT_LOGICAL_RULES) -> Iterator[None]:
    """Context in which `nn.with_logical_constraint(x, ('batch', 'length', 'embed'))` is active."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def mesh_platform() -> str:
    """The platform of the active mesh's devices (`use_mesh`), else `jax.default_backend()`: what programs traced
    now will run on. They differ when a dry run compiles on this host for a TPU slice's devices (tpu_topology)."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


# ----------------------------------------------------------------------------------------------
# Logical rules -> shardings
# ----------------------------------------------------------------------------------------------


def _axis_names(axes: MeshAxes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> tuple[PartitionSpec, list[int]]:
    """Drop mesh axes that do not divide their dimension; returns (spec, dims that lost axes).

    For a multi-axis entry such as ('data', 'fsdp') the longest prefix whose size product divides
    the dimension is kept, so a batch of 2 on data=2, fsdp=2 is still split over 'data'.
    """
    if len(spec) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than the array has dims {tuple(shape)}")
    entries, degraded = [], []
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        named = [(a, mesh.shape[a]) for a in _axis_names(axes)]
        keep = len(named)
        while keep and size % math.prod(s for _, s in named[:keep]):
            keep -= 1
        if keep < len(named):
            degraded.append(dim)
        kept = tuple(a for a, _ in named[:keep])
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries), degraded


def _check_rules_fit_mesh(rules: LogicalRules, mesh: Mesh) -> None:
    for name, axes in rules:
        for a in _axis_names(axes):
            if a not in mesh.shape:
                raise ValueError(f"logical rule {name!r} -> {axes!r} names mesh axis {a!r}; mesh has {tuple(mesh.shape)}")


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_LOGICAL_RULES) -> Any:
    """NamedShardings for a pytree whose array leaves may be boxed with logical axis names.

    abstract_tree: e.g. `jax.eval_shape(init_fn, rng)` where params come from
      `nn.with_logical_partitioning`; optax states built on boxed params carry the same boxes.
      Unboxed array leaves (step counters, adam's `count`) are replicated.
    Returns a tree with one NamedSharding per box / array leaf: a valid `out_shardings` for a
    function returning either the boxed or the `nn.unbox`-ed tree. Dimensions that their mesh axes
    do not divide are replicated on those axes (logged once per call).
    """
    _check_rules_fit_mesh(rules, mesh)
    degraded: list[str] = []

    def one(path: Any, x: Any) -> NamedSharding | None:
        if isinstance(x, meta.Partitioned):
            value, names = x.value, x.get_partition_spec()
            # LogicallyPartitioned carries logical names; a plain nn.Partitioned already names mesh axes.
            spec = nn.logical_to_mesh_axes(tuple(names), rules) if isinstance(x, nn.LogicallyPartitioned) else names
        elif isinstance(x, meta.AxisMetadata):
            value, spec = x.unbox(), PartitionSpec()
        elif hasattr(x, "shape"):
            value, spec = x, PartitionSpec()
        else:
            return None
        spec, lost = fit_spec(spec, value.shape, mesh)
        if lost:
            degraded.append(f"{jax.tree_util.keystr(path)} {tuple(value.shape)} dims {lost}")
        return NamedSharding(mesh, spec)

    out = jax.tree_util.tree_map_with_path(one, abstract_tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
    if degraded:
        logging.warning(
            "logical_shardings: replicating non-divisible dims on mesh %s: %s", dict(mesh.shape), "; ".join(degraded)
        )
    return out


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------


def data_parallel_size(mesh: Mesh) -> int:
    """Number of batch shards: data * fsdp."""
    return math.prod(mesh.shape[a] for a in _DATA_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dim split over ('data', 'fsdp'), every other dim replicated."""
    return NamedSharding(mesh, PartitionSpec(_DATA_AXES))


def check_batch_divisible(batch_size: int, mesh: Mesh, what: str = "batch_size") -> None:
    """ValueError unless the global `batch_size` splits evenly over data*fsdp and over processes."""
    n = data_parallel_size(mesh)
    if batch_size % n:
        raise ValueError(
            f"{what}={batch_size} is not divisible by data*fsdp={n} (mesh data={mesh.shape['data']}, "
            f"fsdp={mesh.shape['fsdp']}); use a multiple of {n}"
        )
    if batch_size % jax.process_count():
        raise ValueError(f"{what}={batch_size} is not divisible by the {jax.process_count()} processes")


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Process-local host arrays [local_batch, ...] -> global jax.Arrays split on the batch dim.

    Multi-host safe: each process passes only its own slice of the global batch (global batch =
    local_batch * process_count). On one host this is the whole batch.
    """
    sharding = batch_sharding(mesh)

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError("shard_batch: every leaf needs a leading batch dim, got a scalar")
        check_batch_divisible(x.shape[0] * jax.process_count(), mesh, what="global batch dim")
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(one, batch)


def local_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows of a global batch of `batch_size` that this process feeds to (and gets back from) the devices.

    Every process builds the same global host batch (prompts come from (seed, step)); it passes `batch[rows]` to
    `shard_batch` and reads `fetch_local` results as those rows. One host: all rows.
    """
    index_map = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    spans = sorted({(idx[0].start or 0, batch_size if idx[0].stop is None else idx[0].stop)
                    for idx in index_map.values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:  # make_array_from_process_local_data needs one block
        raise ValueError(f"this process's devices hold non-contiguous rows {spans} of the batch; order the mesh's "
                         "devices by process")
    return slice(start, stop)


def fetch_local(tree: Any) -> Any:
    """Global arrays -> numpy: each batch-sharded leaf as this process's rows (`local_rows`, in order), each
    replicated leaf (scalars, metrics) whole. One host: `jax.device_get`."""

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        blocks = {s.index[0].start or 0: s.data for s in x.addressable_shards}  # replicas share a start
        return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)], axis=0)

    return jax.tree.map(one, tree)


def gather_rows(tree: Any, rows: slice) -> Any:
    """Process-local host rows (this process's `rows` of a global batch) -> the whole batch on every process.
    Collective on multi-host: every process must call it with leaves of the same shapes. One host: unchanged."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils  # noqa: PLC0415

    starts = np.asarray(multihost_utils.process_allgather(np.asarray(rows.start, np.int64))).reshape(-1)

    def one(x: Any) -> np.ndarray:
        x = np.asarray(x)
        parts = np.asarray(multihost_utils.process_allgather(x))  # [processes, local rows, ...]
        out = np.empty((int(max(starts)) + x.shape[0],) + x.shape[1:], x.dtype)
        for start, part in zip(starts, parts):
            out[start:start + x.shape[0]] = part  # processes holding replicas of a row write the same values
        return out

    return jax.tree.map(one, tree)


# ----------------------------------------------------------------------------------------------
# Multi-host
# ----------------------------------------------------------------------------------------------

# Environment variables that mean "this process is one of several" for the launchers JAX detects.
_MULTIPROCESS_COUNT_VARS = ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _running_on_cloud_tpu_vm() -> bool:
    try:
        from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm  # private: no public equivalent
    except ImportError:
        return False
    return bool(running_in_cloud_tpu_vm)


def multihost_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment describes a multi-process launch JAX can auto-detect.

    True for a coordinator address, a multi-worker TPU slice (TPU_WORKER_HOSTNAMES with several
    hosts, or any Cloud TPU VM, where JAX reads the worker list from the metadata server), or a
    SLURM / Open MPI launch with more than one task.
    """
    env = os.environ if environ is None else environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return True
    for var in _MULTIPROCESS_COUNT_VARS:
        try:
            if int(env.get(var, "1")) > 1:
                return True
        except ValueError:
            raise ValueError(f"environment variable {var}={env[var]!r} is not an integer") from None
    return environ is None and _running_on_cloud_tpu_vm()


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else None
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def maybe_initialize_distributed(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Call `jax.distributed.initialize` for multi-host runs; no-op on a single host.

    Must run before any other JAX call. Explicit arguments win, then the environment variables
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (JAX itself reads only the first:
    the other two are what a multi-node GPU launch without SLURM or MPI sets); otherwise JAX
    auto-detects the cluster (Cloud TPU, SLURM, Open MPI) when `multihost_requested()` says so.
    Returns whether the distributed runtime is (now) initialized.
    """
    if jax.distributed.is_initialized():
        return True
    num_processes = _env_int("JAX_NUM_PROCESSES") if num_processes is None else num_processes
    process_id = _env_int("JAX_PROCESS_ID") if process_id is None else process_id
    explicit = (coordinator_address, num_processes, process_id)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if all(v is None for v in explicit) and not multihost_requested():
        return False
    if num_processes == 1 and coordinator_address is None:
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    return True
