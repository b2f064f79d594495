"""Checkpointer round trip, corrupt/partial fallback, load_params, SIGTERM guard, exact resume."""

import logging
import os
import signal
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vcppo_jax import checkpoint as ck
from vcppo_jax import sharding as shd


class TinyCritic(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: [batch, 3]
        return nn.Dense(1, name="out")(nn.tanh(nn.Dense(4, name="hidden")(x)))[..., 0]


def _state(seed: int = 0, tx=optax.adam(1e-2)):
    params = TinyCritic().init(jax.random.key(seed), jnp.zeros((1, 3)))["params"]
    params = jax.tree.map(lambda p: p + seed, params)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.asarray(seed, jnp.int32)}


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _key_to_json(key) -> list[int]:
    return jax.random.key_data(key).tolist()


def _save_steps(ckpt, steps):
    for s in steps:
        assert ckpt.save(s, _state(s), {"data_position": 10 * s, "rng": _key_to_json(jax.random.key(s))})
    ckpt.wait()


def test_round_trip_preserves_types_meta_and_shardings(tmp_path):
    mesh = shd.make_mesh(data=4, fsdp=2)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    with ck.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        _save_steps(ckpt, [1, 2])
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0))
        template["params"]["hidden"]["bias"] = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharded)
        state, meta, step = ckpt.restore(template)
    assert step == 2 and meta["data_position"] == 20
    assert meta["rng"] == _key_to_json(jax.random.key(2))
    _assert_tree_equal(state, _state(2))
    assert isinstance(state["opt_state"][0], optax.ScaleByAdamState)
    assert isinstance(state["opt_state"][1], optax.EmptyState)
    assert state["params"]["hidden"]["bias"].sharding == sharded


def test_max_to_keep_and_interval_and_no_overwrite(tmp_path):
    ckpt = ck.Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2)
    for s in range(6):
        ckpt.save(s, _state(s), {"s": s})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4] and ckpt.latest_step() == 4
    assert ckpt.save(5, _state(5), {"s": 5}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
    assert ckpt.save(5, _state(0), {"s": -1}, force=True) is False  # existing step is never overwritten
    _, meta, _ = ckpt.restore(_state(0))
    assert meta == {"s": 5}
    ckpt.close()


def _corrupt_files(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"\x00garbage")


def _truncate_files(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            p = os.path.join(root, f)
            os.truncate(p, os.path.getsize(p) // 2)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "partial"])
def test_corrupt_latest_falls_back_and_is_moved_aside(tmp_path, caplog, damage):
    ckpt = ck.Checkpointer(tmp_path, max_to_keep=5)
    _save_steps(ckpt, [1, 2, 3])
    if damage == "garbage":
        _corrupt_files(tmp_path / "3")
    elif damage == "truncated":
        _truncate_files(tmp_path / "3")
    else:  # step dir without its state item (a copy that never finished)
        import shutil

        shutil.rmtree(tmp_path / "3" / "state")
    with caplog.at_level(logging.WARNING):
        state, meta, step = ck.Checkpointer(tmp_path).restore(_state(0))
    assert step == 2 and meta["data_position"] == 20
    _assert_tree_equal(state, _state(2))
    assert "checkpoint step 3" in caplog.text and "unreadable" in caplog.text
    # good steps untouched, the bad one kept for inspection but out of the way of a new save of step 3
    assert sorted(os.listdir(tmp_path / "corrupt"))[0].startswith("3.")
    ckpt2 = ck.Checkpointer(tmp_path)
    assert ckpt2.all_steps() == [1, 2]
    assert ckpt2.save(3, _state(3), {"data_position": 30})
    ckpt2.wait()
    assert ckpt2.restore(_state(0))[2] == 3
    ckpt2.close()


def test_nothing_restorable_is_a_clear_error_and_moves_nothing(tmp_path):
    ckpt = ck.Checkpointer(tmp_path)
    _save_steps(ckpt, [1, 2])
    _corrupt_files(tmp_path / "1")
    _corrupt_files(tmp_path / "2")
    with pytest.raises(RuntimeError, match=r"no restorable checkpoint in .*step 2: .*step 1: "):
        ckpt.restore(_state(0))
    assert ckpt.all_steps() == [1, 2] and not (tmp_path / "corrupt").exists()
    with pytest.raises(RuntimeError, match=r"checkpoint step 2 in .* is unreadable"):
        ckpt.restore(_state(0), step=2)
    with pytest.raises(FileNotFoundError, match="no checkpoint found in"):
        ck.Checkpointer(tmp_path / "empty").restore(_state(0))


def test_structure_mismatch_raises_without_fallback(tmp_path):
    ckpt = ck.Checkpointer(tmp_path)
    _save_steps(ckpt, [1, 2])
    wrong = _state(0)
    wrong["params"]["hidden"]["kernel"] = jnp.zeros((3, 5))
    del wrong["params"]["out"]["bias"]
    with pytest.raises(ck.CheckpointMismatchError) as err:
        ckpt.restore(wrong)
    assert "checkpoint" in str(err.value) and "/2 does not match the restore target" in str(err.value)
    assert "not in target: params/out/bias" in str(err.value)
    assert "params/hidden/kernel: checkpoint (3, 4) vs target (3, 5)" in str(err.value)
    assert ckpt.all_steps() == [1, 2]  # a code change is not corruption: nothing moved
    ckpt.close()


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from vcppo_jax.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], async_save=False)
    for s in (1, 2):
        ckpt.save(s, {"w": jnp.full((3,), float(s))}, {"s": s})
    def crash(*a, **k):
        os._exit(17)  # killed after the data is written, before the atomic rename
    for name in dir(atomicity):
        cls = getattr(atomicity, name)
        if isinstance(cls, type) and hasattr(cls, "finalize"):
            cls.finalize = crash
    ckpt.save(3, {"w": jnp.full((3,), 3.0)}, {"s": 3})
    """
)


def test_crash_mid_save_leaves_older_steps_intact(tmp_path):
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    assert any("tmp" in name for name in os.listdir(tmp_path))  # the unfinished step 3
    ckpt = ck.Checkpointer(tmp_path)
    assert ckpt.all_steps() == [1, 2]
    state, meta, step = ckpt.restore({"w": jnp.zeros(3)})
    assert step == 2 and meta == {"s": 2}
    np.testing.assert_array_equal(state["w"], np.full(3, 2.0))
    ckpt.close()


# ---------------------------------------------------------------------------------------------
# load_params
# ---------------------------------------------------------------------------------------------


def test_load_params_subtree_from_run_or_step_dir(tmp_path):
    critic = _state(7)["params"]
    with ck.Checkpointer(tmp_path / "value_run") as ckpt:
        for s in (5, 9):
            state = {"critic_params": jax.tree.map(lambda p: p + s, critic), "opt_state": optax.adam(1e-3).init(critic)}
            ckpt.save(s, state, {"s": s})
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), critic)
    latest = ck.load_params(tmp_path / "value_run", template, key="critic_params")
    _assert_tree_equal(latest, jax.tree.map(lambda p: p + 9, critic))
    older = ck.load_params(tmp_path / "value_run" / "5", template, key="critic_params")
    _assert_tree_equal(older, jax.tree.map(lambda p: p + 5, critic))
    nested = ck.load_params(tmp_path / "value_run", template["out"], key="critic_params/out", step=5)
    _assert_tree_equal(nested, jax.tree.map(lambda p: p + 5, critic["out"]))
    _corrupt_files(tmp_path / "value_run" / "9")  # read-only loader: falls back, moves nothing
    _assert_tree_equal(ck.load_params(tmp_path / "value_run", template, key="critic_params"), older)
    assert (tmp_path / "value_run" / "9").exists()
    with pytest.raises(RuntimeError, match=r"value_run/9 is unreadable \(JSONDecodeError"):
        ck.load_params(tmp_path / "value_run" / "9", template, key="critic_params")


def test_load_params_errors(tmp_path):
    critic = _state(0)["params"]
    with ck.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"critic_params": critic}, {})
    hint = "run experiments/pretrain_value.py first or set config.critic_init=..."
    with pytest.raises(FileNotFoundError, match=r"no checkpoint found in .*nowhere.*pretrain_value\.py first"):
        ck.load_params(tmp_path / "nowhere", critic, key="critic_params", hint=hint)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint found in .*empty; run experiments"):
        ck.load_params(tmp_path / "empty", critic, key="critic_params", hint=hint)
    with pytest.raises(ck.CheckpointMismatchError, match=r"no subtree 'params'; available: \['critic_params'\]"):
        ck.load_params(tmp_path / "run", critic)
    bigger = TinyCritic().init(jax.random.key(0), jnp.zeros((1, 5)))["params"]
    with pytest.raises(ck.CheckpointMismatchError, match=r"hidden/kernel: checkpoint \(3, 4\) vs target \(5, 4\)"):
        ck.load_params(tmp_path / "run", bigger, key="critic_params")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step 4 .*available: \[1\]"):
        ck.load_params(tmp_path / "run", critic, key="critic_params", step=4)


# ---------------------------------------------------------------------------------------------
# preemption
# ---------------------------------------------------------------------------------------------


def test_sigterm_sets_flag_and_restores_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with ck.preemption_guard() as guard:
        assert not guard.should_stop
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs at the next bytecode boundary of the main thread
            if guard.should_stop:
                break
        assert guard.should_stop and guard.signum == signal.SIGTERM and guard.should_stop_any()
    assert signal.getsignal(signal.SIGTERM) is previous


# ---------------------------------------------------------------------------------------------
# exact resume on a toy problem
# ---------------------------------------------------------------------------------------------

_TX = optax.adam(5e-2)
_W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)


def _batch(position: int):
    """Data stream indexed by position: batch i is a pure function of i."""
    x = np.random.default_rng(position).normal(size=(8, 3)).astype(np.float32)
    return x, x @ _W_TRUE


@jax.jit
def _sgd_step(state, x, y, rng):
    def loss(w):
        noise = 0.01 * jax.random.normal(rng, y.shape)
        return jnp.mean((x @ w - y - noise) ** 2)

    g = jax.grad(loss)(state["w"])
    updates, opt = _TX.update(g, state["opt"], state["w"])
    return {"w": optax.apply_updates(state["w"], updates), "opt": opt}


def _train(ckpt, num_steps, stop_after=None):
    """Resume from ckpt if any, run to num_steps (or stop after step `stop_after`)."""
    state = {"w": jnp.zeros(3), "opt": _TX.init(jnp.zeros(3))}
    start, rng, position = 0, jax.random.key(42), 0
    if ckpt.latest_step() is not None:
        state, meta, step = ckpt.restore(state)
        start, rng, position = step + 1, jax.random.wrap_key_data(jnp.asarray(meta["rng"], jnp.uint32)), \
            meta["data_position"]
    for step in range(start, num_steps):
        rng, sub = jax.random.split(rng)
        x, y = _batch(position)
        state = _sgd_step(state, x, y, sub)
        position += 1
        ckpt.save(step, state, {"rng": _key_to_json(rng), "data_position": position})
        if step == stop_after:
            break
    ckpt.wait()
    return state


def test_resume_after_interruption_matches_uninterrupted(tmp_path):
    with ck.Checkpointer(tmp_path / "a", save_interval_steps=3) as ckpt:
        reference = _train(ckpt, 10)
    with ck.Checkpointer(tmp_path / "b", save_interval_steps=3) as ckpt:
        _train(ckpt, 10, stop_after=7)  # last checkpoint at step 6: step 7 is recomputed
    with ck.Checkpointer(tmp_path / "b", save_interval_steps=3) as ckpt:
        assert ckpt.latest_step() == 6
        resumed = _train(ckpt, 10)
    _assert_tree_equal(resumed, reference)
    assert not np.allclose(np.asarray(reference["w"]), 0.0)
