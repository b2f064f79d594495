"""The dry run on Cloud TPU slices without a TPU (`dry_run_topology`, vcppo_jax/tpu_topology.py).

The TPU compiler (libtpu, ~680 MB) is installed once into this user's cache folder (`tpu_topology.install`, keyed
by version; skipped only when the package index cannot be reached) and loaded only in a subprocess, so this test
process and every other one keep their CPU-only JAX. In it, the tiny RL stage with splash attention is compiled
for a v5e-8 and the tiny SFT stage for a two-host v4-16: every program through the TPU compiler, with its memory
plan and FLOPs. Config errors (unknown slice, missing libtpu) are checked in this process, before any compile.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import config_files
from vcppo_jax import config as config_lib
from vcppo_jax import stages, tpu_topology

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def libtpu() -> str:
    if tpu_topology.library_path() is None:
        try:
            tpu_topology.install()
        except subprocess.CalledProcessError:
            index = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "libtpu"], capture_output=True)
            if index.returncode:
                pytest.skip(f"libtpu=={tpu_topology.LIBTPU_VERSION} cannot be installed: the package index is "
                            f"unreachable ({index.stderr.decode().strip()[-200:]})")
            raise
    return tpu_topology.library_path()


SUBPROCESS = textwrap.dedent("""
    import json, pathlib
    from test_dry_run import tiny
    from vcppo_jax import stages

    tmp = pathlib.Path({tmp!r})
    rl = tiny("vcppo", tmp, dry_run_topology="v5e:2x4")
    rl.model.update(attention_impl="splash", dtype="bfloat16")
    sft = tiny("sft", tmp, dry_run_topology="v4:2x2x2")
    print("PLANS " + json.dumps([stages.run_stage(rl), stages.run_stage(sft)]))
""")


def test_tiny_rl_with_splash_and_a_multihost_sft_compile_for_tpu_slices(libtpu, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / d) for d in ("tests", "experiments")))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile-only TPU executables are not for the CPU session's cache
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS.format(tmp=str(tmp_path))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rl, sft = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PLANS "))[6:])
    assert not (tmp_path / "never_written").exists()

    assert (rl["platform"], rl["device_kind"], rl["num_devices"], rl["hosts"]) == ("tpu", "TPU v5 lite", 8, 1)
    assert set(rl["programs"]) == {"sampler", "experience", "update"} and rl["fits"]
    assert rl["device_memory_mib"] == 16 * 1024 and rl["peak_tflops_per_device"] == 197.0
    # Splash, printed before the compiles: the 12-token prompt and the 28-token sequence each fill one 128 block.
    assert [(p["length"], p["block"], p["padded"]) for p in rl["splash"]] == [(28, 128, 128), (12, 128, 128)]
    assert "splash" in proc.stdout.split("resident state")[0]
    for name in ("sampler", "experience", "update"):  # the Mosaic kernel is in every program, forward and backward
        assert any("splash" in k for k in rl["programs"][name]["kernels"]), rl["programs"][name]["kernels"]
    update = rl["programs"]["update"]
    assert update["peak"] >= rl["resident_mib"] > 0 and update["tflops_exact"]
    assert update["seconds_at_peak"] == pytest.approx(update["tflops"] / 197.0)
    # XLA counts each loop body once (the layers' and the minibatches' scans) and splash as nothing.
    assert update["tflops"] > 2 * update["xla_cost_analysis_tflops"] > 0

    assert (sft["device_kind"], sft["num_devices"], sft["hosts"]) == ("TPU v4", 8, 2)  # megacore: a device per chip
    assert set(sft["programs"]) == {"sampler", "sft_step"} and sft["fits"] and sft["splash"] == []
    assert "DOES NOT FIT" not in proc.stdout and "compiled plan, not a run on TPU hardware" in proc.stdout


@pytest.mark.parametrize("name", ["v5litepod-8", "v4-32", "v7x:2x2", "v5e", "v5e:2x"])
def test_unknown_slice_names_fail_in_validation(tmp_path, name):
    c = config_files.load("sft")
    c.update(dict(dry_run=True, dry_run_topology=name))
    with pytest.raises(config_lib.ConfigError, match=r"dry_run_topology.*'v5e:2x4' \(v5e-8\)"):
        config_lib.validate(c)


def test_a_slice_needs_dry_run_and_libtpu_before_anything_compiles(tmp_path, monkeypatch):
    c = config_files.load("sft")
    c.dry_run_topology = "v5e:2x4"
    with pytest.raises(config_lib.ConfigError, match="needs dry_run=True"):
        config_lib.validate(c)
    c.dry_run = True
    monkeypatch.setenv("TPU_LIBRARY_PATH", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(tpu_topology.importlib.util, "find_spec", lambda name: None)  # as without an installed libtpu
    with pytest.raises(config_lib.ConfigError, match=r"needs libtpu.*python -m vcppo_jax.tpu_topology install"):
        stages.run_stage(c)
    assert tpu_topology.parse("v5:2x2x2") == ("v5p", (2, 2, 2)) and tpu_topology.parse("v4:2x2x4")[1] == (2, 2, 4)
