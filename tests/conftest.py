"""Test setup: 8 fake CPU devices (sharding tests) must be requested before jax is first imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; covered by an experiment/benchmark script, not in CI.")


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """A persistent JAX compilation cache for a module of end-to-end runs (they compile the same steps per stage).
    JAX opens the cache once per process, so later modules keep writing to this dir; only the settings revert."""
    import jax  # noqa: PLC0415 (after XLA_FLAGS above)

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    yield
    for n, v in before.items():
        jax.config.update(n, v)
