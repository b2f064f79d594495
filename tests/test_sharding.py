"""Mesh construction, logical-rule application and a sharded train step on 8 fake CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from vcppo_jax import sharding as shd

VOCAB, EMBED, MLP = 16, 8, 12  # MLP=12: divisible by tensor=2, not by tensor=8


class ToyLM(nn.Module):
    """Embedding -> MLP -> tied-free output head, every param logically annotated."""

    @nn.compact
    def __call__(self, tokens):  # tokens: [batch, length]
        init = nn.initializers.normal(0.5)
        table = self.param("embedding", nn.with_logical_partitioning(init, ("vocab", "embed")), (VOCAB, EMBED))
        h = jnp.take(table, tokens, axis=0)
        h = nn.with_logical_constraint(h, ("batch", "length", "embed"))
        dense = lambda feats, names, name: nn.Dense(  # noqa: E731
            feats,
            kernel_init=nn.with_logical_partitioning(init, names),
            bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), names[-1:]),
            name=name,
        )
        h = jax.nn.gelu(dense(MLP, ("embed", "mlp"), "up")(h))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = dense(EMBED, ("mlp", "embed"), "down")(h)
        return h @ table.T  # [batch, length, vocab]


def _abstract_state(model, tx):
    def init(rng):
        params = model.init(rng, jnp.zeros((2, 4), jnp.int32))["params"]
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return init, jax.eval_shape(init, jax.random.key(0))


def _specs(shardings):
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding))


# ---------------------------------------------------------------------------------------------
# make_mesh
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        ({}, (8, 1, 1)),
        ({"data": -1, "fsdp": 2, "tensor": 2}, (2, 2, 2)),
        ({"data": 1, "fsdp": -1, "tensor": 4}, (1, 2, 4)),
        ({"data": 2, "fsdp": 4, "tensor": 1}, (2, 4, 1)),
    ],
)
def test_make_mesh_shapes(kwargs, shape):
    mesh = shd.make_mesh(**kwargs)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape[a] for a in mesh.axis_names) == shape
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_make_mesh_subset_of_devices():
    mesh = shd.make_mesh(data=-1, tensor=2, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"data": 3}, r"3\*1\*1 = 3 does not match the 8 available devices"),
        ({"data": -1, "fsdp": 3}, r"8 devices are not divisible by the product of the other axes \(3"),
        ({"data": -1, "fsdp": -1}, r"at most one mesh axis may be -1"),
        ({"data": 0}, r"data=0 must be a positive int or -1"),
        ({"tensor": 2.0}, r"tensor=2.0 must be a positive int"),
    ],
)
def test_make_mesh_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shd.make_mesh(**kwargs)


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------


def test_rules_on_toy_lm_params_and_optimizer_state():
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    _, abstract = _abstract_state(ToyLM(), optax.adam(1e-2))
    specs = _specs(shd.logical_shardings(abstract, mesh))
    want = {
        "embedding": P("tensor", "fsdp"),
        "up": {"kernel": P("fsdp", "tensor"), "bias": P("tensor")},
        "down": {"kernel": P("tensor", "fsdp"), "bias": P("fsdp")},
    }
    assert specs["params"] == want
    adam = specs["opt_state"][0]
    assert adam.mu == want and adam.nu == want  # optax moments inherit the param boxes
    assert adam.count == P() and specs["step"] == P()  # un-annotated leaves replicate
    # One sharding per leaf of the unboxed tree: a valid out_shardings for `nn.unbox(init(rng))`.
    assert jax.tree.structure(shd.logical_shardings(abstract, mesh)) == jax.tree.structure(nn.unbox(abstract))


def test_non_divisible_dims_replicate(caplog):
    # tensor=8: MLP=12 and VOCAB=16 -> 16 % 8 == 0 keeps vocab sharded, 12 % 8 != 0 replicates mlp.
    mesh = shd.make_mesh(data=1, fsdp=1, tensor=8)
    _, abstract = _abstract_state(ToyLM(), optax.sgd(1e-2))
    with caplog.at_level("WARNING"):
        specs = _specs(shd.logical_shardings(abstract["params"], mesh))
    assert specs["embedding"] == P("tensor", "fsdp")
    assert specs["up"]["kernel"] == P("fsdp") and specs["up"]["bias"] == P()
    assert specs["down"]["kernel"] == P(None, "fsdp")
    assert "['up']['kernel'] (8, 12) dims [1]" in caplog.text


def test_fit_spec_keeps_longest_dividing_prefix():
    mesh = shd.make_mesh(data=2, fsdp=4, tensor=1)
    assert shd.fit_spec(P(("data", "fsdp"), None), (16, 3), mesh) == (P(("data", "fsdp")), [])
    assert shd.fit_spec(P(("data", "fsdp")), (6, 3), mesh) == (P("data"), [0])
    assert shd.fit_spec(P(("data", "fsdp")), (3, 3), mesh) == (P(), [0])
    with pytest.raises(ValueError, match="more entries than the array has dims"):
        shd.fit_spec(P("data", None, None), (4, 4), mesh)


def test_rules_naming_a_mesh_axis_the_mesh_lacks_fail():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("data",))
    with pytest.raises(ValueError, match=r"names mesh axis 'fsdp'"):
        shd.logical_shardings({"w": jnp.zeros(4)}, mesh, shd.DEFAULT_LOGICAL_RULES)


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------


def test_batch_sharding_and_divisibility():
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match=r"rollout_batch_size=12 is not divisible by data\*fsdp=8"):
        shd.check_batch_divisible(12, shd.make_mesh(data=4, fsdp=2), "rollout_batch_size")
    shd.check_batch_divisible(12, mesh, "rollout_batch_size")  # 12 % 4 == 0
    host = {"tokens": np.arange(8 * 3).reshape(8, 3), "mask": np.ones((8, 3), np.float32)}
    batch = shd.shard_batch(host, mesh)
    assert batch["tokens"].sharding.spec == P(("data", "fsdp"))
    assert batch["tokens"].addressable_shards[0].data.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), host["tokens"])
    with pytest.raises(ValueError, match=r"global batch dim=6 is not divisible by data\*fsdp=4"):
        shd.shard_batch({"x": np.zeros((6, 2))}, mesh)


def test_multihost_detection_from_env(monkeypatch):
    assert not shd.multihost_requested({})
    assert not shd.multihost_requested({"SLURM_NTASKS": "1", "TPU_WORKER_HOSTNAMES": "localhost"})
    assert shd.multihost_requested({"TPU_WORKER_HOSTNAMES": "h0,h1"})
    assert shd.multihost_requested({"OMPI_COMM_WORLD_SIZE": "4"})
    assert shd.multihost_requested({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    with pytest.raises(ValueError, match="SLURM_NTASKS='x' is not an integer"):
        shd.multihost_requested({"SLURM_NTASKS": "x"})
    for var in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", *shd._MULTIPROCESS_COUNT_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(shd, "_running_on_cloud_tpu_vm", lambda: False)
    assert shd.maybe_initialize_distributed() is False  # single host: no-op
    assert shd.maybe_initialize_distributed(num_processes=1) is False
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        shd.maybe_initialize_distributed("localhost:1", num_processes=2, process_id=2)
    # A multi-node GPU launch without SLURM/MPI: the count and the id come from the environment (the 2-process
    # run of tests/test_multihost.py starts this way).
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        shd.maybe_initialize_distributed("localhost:1")
    monkeypatch.setenv("JAX_PROCESS_ID", "one")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' is not an integer"):
        shd.maybe_initialize_distributed("localhost:1")


# ---------------------------------------------------------------------------------------------
# sharded train step == unsharded train step
# ---------------------------------------------------------------------------------------------


def test_sharded_train_step_matches_unsharded():
    model, tx = ToyLM(), optax.adam(3e-2)
    init, abstract = _abstract_state(model, tx)
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    state_sh = shd.logical_shardings(abstract, mesh)

    def step(state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["tokens"])
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return (nll * batch["mask"]).sum() / batch["mask"].sum()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    unboxed_init = lambda r: nn.unbox(init(r))  # noqa: E731
    rng = np.random.default_rng(0)
    batches = [
        {
            "tokens": rng.integers(0, VOCAB, (8, 4)).astype(np.int32),
            "targets": rng.integers(0, VOCAB, (8, 4)).astype(np.int32),
            "mask": (rng.random((8, 4)) > 0.2).astype(np.float32),
        }
        for _ in range(3)
    ]

    ref_state = jax.jit(unboxed_init)(jax.random.key(1))
    ref_step = jax.jit(step)
    ref_losses = []
    for b in batches:
        ref_state, loss = ref_step(ref_state, b)
        ref_losses.append(float(loss))

    state = jax.jit(unboxed_init, out_shardings=state_sh)(jax.random.key(1))
    assert state["params"]["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    sharded_step = jax.jit(
        step, in_shardings=(state_sh, shd.batch_sharding(mesh)), out_shardings=(state_sh, None), donate_argnums=0
    )
    losses = []
    with shd.use_mesh(mesh):  # activates the with_logical_constraint calls in the model
        for b in batches:
            state, loss = sharded_step(state, shd.shard_batch(b, mesh))
            losses.append(float(loss))

    assert state["opt_state"][0].mu["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert type(state["opt_state"][0]) is type(ref_state["opt_state"][0])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6), state, ref_state
    )
