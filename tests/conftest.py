"""Test setup: 8 fake CPU devices (sharding tests) must be requested before jax is first imported."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for the whole session, read at JAX's start by this process and inherited by the
# processes tests start (the notebook, multi-host workers): the loops jit fresh closures on every run, and the tiny
# models' programs repeat across runs and modules (compiling is about half of an end-to-end test's time on CPU).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="vcppo_jax_test_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; covered by an experiment/benchmark script, not in CI.")
