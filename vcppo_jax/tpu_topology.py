"""Cloud TPU slices without a TPU: a topology name -> the slice's devices, for compiling ahead of time on any host.

`jax.experimental.topologies.get_topology_desc` asks libtpu (the TPU compiler and runtime, a ~680 MB wheel) for
compile-only devices of a slice: `jax.jit(f).lower(...)` on a mesh of them, then `.compile()`, runs the real TPU
compiler here and gives XLA's memory plan and cost analysis, with no TPU attached. These are compiled plans, not
runs on TPU hardware.

libtpu stays out of the ordinary install: with it importable, every JAX start looks for TPU chips. The dry run
finds it, in this order, at `$TPU_LIBRARY_PATH`, as an installed `libtpu` package, or in this user's cache folder
(`cache_dir()`, filled once by `python -m vcppo_jax.tpu_topology install`), and loads it only when a topology is
asked for, after JAX has started on its own devices.

Names are libtpu's: `<generation>:<chips per dimension>`, e.g. `v5e:1x1` (v5e-1), `v5e:2x4` (v5e-8), `v4:2x2x4`
(v4-32: 16 chips, 4 hosts), `v5p:2x2x2` (v5p-16). Cloud's accelerator names count chips for v5e / v6e and
TensorCores for v2-v4 / v5p (two per chip).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

# What `pip install "jax[tpu]==0.10.2"` resolves (jax is pinned in requirements.txt); a libtpu built for another
# jaxlib may not load. Bump both together.
LIBTPU_VERSION = "0.0.42.1"
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of a generation: its HBM and peak dense bf16 matmul rate, and how libtpu lays out a slice.

    megacore: the chip's two TensorCores are one JAX device (v4, v5p). host_chips: chips per host of a multi-host
    slice (`chips_per_host_bounds`), single_host_max: the largest slice one host holds.
    """

    kind: str  # jax's device_kind
    hbm_gib: float
    peak_bf16_tflops: float
    megacore: bool = False
    host_chips: tuple[int, int, int] = (2, 2, 1)
    single_host_max: int = 4


# Per JAX device, from Google Cloud's TPU documentation (cloud.google.com/tpu/docs/v2, v3, v4, v5e, v5p, v6e:
# "HBM capacity per chip" and "Peak compute per chip (bf16)"). v2 / v3 devices are single TensorCores, half a chip.
# v5e and v6e machines hold 1, 4 or 8 chips (the -1 / -4 / -8 slices are one host); larger slices are 4 per host.
CHIPS = {
    "v2": Chip("TPU v2", 8.0, 22.5),
    "v3": Chip("TPU v3", 16.0, 61.5),
    "v4": Chip("TPU v4", 32.0, 275.0, megacore=True),
    "v5e": Chip("TPU v5 lite", 16.0, 197.0, single_host_max=8),
    "v5p": Chip("TPU v5", 95.0, 459.0, megacore=True),
    "v6e": Chip("TPU v6 lite", 32.0, 918.0, single_host_max=8),
}
ALIASES = {"v5": "v5p", "v5litepod": "v5e"}  # libtpu's own spellings of the same generations
_NAME = re.compile(r"^(v[0-9][a-z]*):([1-9][0-9]*(?:x[1-9][0-9]*){1,2})$")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice's compile-only devices (`devices`: one per chip, or per core on v2 / v3) and their `chip`."""

    name: str
    chip: Chip
    devices: tuple
    hosts: int

    @property
    def device_memory_bytes(self) -> int:
        return int(self.chip.hbm_gib * GIB)

    @property
    def peak_flops(self) -> float:
        """Peak dense bf16 FLOP/s of one device."""
        return self.chip.peak_bf16_tflops * 1e12


def parse(name: str) -> tuple[str, tuple[int, ...]]:
    """'v5e:2x4' -> ('v5e', (2, 4)); raises ValueError naming the accepted forms."""
    m = _NAME.match(name)
    generation = ALIASES.get(m.group(1), m.group(1)) if m else None
    if generation not in CHIPS:
        raise ValueError(f"unknown TPU topology {name!r}: use <generation>:<chips per dimension> with a generation "
                         f"in {tuple(CHIPS)}, e.g. 'v5e:1x1' (v5e-1), 'v5e:2x4' (v5e-8), 'v4:2x2x4' (v4-32), "
                         "'v5p:2x2x2' (v5p-16)")
    return generation, tuple(int(d) for d in m.group(2).split("x"))


def cache_dir() -> pathlib.Path:
    """This user's libtpu folder, one per version: <XDG cache, default ~/.cache>/vcppo_jax/libtpu-<version>."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "vcppo_jax" / f"libtpu-{LIBTPU_VERSION}"


def library_path() -> str | None:
    """libtpu.so from $TPU_LIBRARY_PATH, an installed libtpu package, or `cache_dir()`; None when there is none."""
    candidates = [os.environ.get("TPU_LIBRARY_PATH", "")]
    spec = importlib.util.find_spec("libtpu")  # finds it without importing (importing it starts nothing either)
    if spec is not None and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), "libtpu.so"))
    candidates.append(str(cache_dir() / "libtpu" / "libtpu.so"))
    return next((p for p in candidates if p and os.path.isfile(p)), None)


def missing_libtpu_message() -> str:
    return (f"compiling for a TPU topology needs libtpu, which is not installed: run `python -m vcppo_jax.tpu_topology "
            f"install` (pip installs libtpu=={LIBTPU_VERSION}, ~680 MB, into {cache_dir()}, outside the environment, "
            "so ordinary CPU runs are unchanged), or set TPU_LIBRARY_PATH to a libtpu.so")


def check(name: str) -> None:
    """Raises ValueError before anything compiles when `name` is not a known topology or libtpu is missing."""
    parse(name)
    if library_path() is None:
        raise ValueError(missing_libtpu_message())


def install(python: str = sys.executable) -> pathlib.Path:
    """pip-installs libtpu==LIBTPU_VERSION into `cache_dir()` (once; a partial download never takes its place)."""
    target = cache_dir()
    if (target / "libtpu" / "libtpu.so").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(staging),
                        f"libtpu=={LIBTPU_VERSION}"], check=True)
        try:
            staging.rename(target)
        except OSError:  # another process installed it meanwhile
            if not (target / "libtpu" / "libtpu.so").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def get(name: str) -> Topology:
    """The slice `name`'s compile-only devices (loads libtpu into this process on first use)."""
    generation, dims = parse(name)
    chip = CHIPS[generation]
    path = library_path()
    if path is None:
        raise ValueError(missing_libtpu_message())
    # jax reads this when it first loads the TPU plugin, which get_topology_desc does on demand.
    os.environ.setdefault("TPU_LIBRARY_PATH", path)
    # libtpu locks /tmp/libtpu_lockfile so that one process owns the chips; there are none here, and two dry runs
    # (or a test beside a dry run) must not lock each other out.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies  # noqa: PLC0415

    chips = math.prod(dims)
    dims3 = dims + (1,) * (3 - len(dims))
    per_host = dims3 if chips <= chip.single_host_max else chip.host_chips
    kwargs = dict(chip_config_name="megacore") if chip.megacore else {}
    if generation not in ("v2", "v3"):  # their hosts hold a fixed 2x2 board; libtpu knows it
        kwargs["chips_per_host_bounds"] = tuple(min(a, b) for a, b in zip(per_host, dims3))
    # libtpu logs that it found no TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES (true: there is no TPU) and carries on.
    devices = tuple(topologies.get_topology_desc(topology_name=f"{generation}:{'x'.join(map(str, dims))}",
                                                 platform="tpu", **kwargs).devices)
    if devices[0].device_kind != chip.kind:
        raise ValueError(f"topology {name!r}: libtpu made {devices[0].device_kind!r} devices, the table says "
                         f"{chip.kind!r} (tpu_topology.CHIPS)")
    return Topology(name=name, chip=chip, devices=devices, hosts=len({d.process_index for d in devices}))


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m vcppo_jax.tpu_topology install")
    print(f"libtpu {LIBTPU_VERSION} in {install()}")
