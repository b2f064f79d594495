"""experiments/gradient_noise.py's statistics: the estimator against closed forms and a known signal, the Adam
metric's invariance to coordinate scales, and the group gradients against the one-shot gradient of the batch loss."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import gradient_noise
from vcppo_jax import losses, rl


def test_signal_noise_closed_form():
    """Every pair of nonzero groups shares s, each has norm^2 t; 3 batches of 4 groups hold 2, 1 and 2 nonzero ones.
    Only the 16 (ordered) pairs in different batches count towards E[h] . E[h]."""
    n, k, s, t = 4, 3, 2.0, 10.0
    batch_of_row = np.array([0, 0, 1, 2, 2])
    gram = np.full((5, 5), s) + np.eye(5) * (t - s)
    got = gradient_noise.signal_noise(gram, batch_of_row, k, n)
    cross, mean_sq = 2 * 8 * s / (k * (k - 1) * n * n), 5 * t / (k * n)
    assert got["signal"] == pytest.approx(n * n * cross) and got["noise"] == pytest.approx(n * (mean_sq - cross))
    assert got["signal_fraction"] == pytest.approx(n * cross / (n * cross + mean_sq - cross))
    assert got["steps_to_even"] == pytest.approx((mean_sq - cross) / (n * cross))
    three_in_one = gradient_noise.signal_noise(gram, np.array([0, 0, 0, 1, 2]), k, n)  # 25 - 9 - 1 - 1 pairs
    assert three_in_one["signal"] == pytest.approx(14 * s / (k * (k - 1)))
    assert gradient_noise.signal_noise(np.eye(3), np.arange(3), 3, 2)["steps_to_even"] == float("inf")
    with pytest.raises(ValueError, match="every gradient is zero"):
        gradient_noise.signal_noise(np.zeros((3, 3)), np.arange(3), 3, 2)
    with pytest.raises(ValueError, match="at most 2 gradients"):
        gradient_noise.signal_noise(np.eye(3), np.array([0, 0, 0]), 3, 2)


def test_signal_noise_recovers_a_known_signal():
    """Half the groups zero, the others mu + unit Gaussian noise: a batch of n groups has signal n^2 ||mu / 2||^2
    and noise n (E||h||^2 - ||mu / 2||^2), within the jackknife errors."""
    rng = np.random.default_rng(0)
    dim, k, n = 2000, 25, 8
    mu = rng.normal(size=dim) * 0.3
    batch_of_row = np.repeat(np.arange(k), n // 2)  # n / 2 nonzero groups in each batch
    rows = np.stack([mu + rng.normal(size=dim) for _ in batch_of_row])
    got = gradient_noise.signal_noise(rows @ rows.T, batch_of_row, k, n)
    mean = (mu / 2) @ (mu / 2)
    assert abs(got["signal"] - n * n * mean) < 3 * got["signal_se"]
    assert got["noise"] == pytest.approx(n * ((mu @ mu + dim) / 2 - mean), rel=0.05)
    assert 0 < got["signal_se"] < 0.3 * got["signal"]


def test_gram_matrices_adam_metric_ignores_coordinate_scales():
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(6, 1001)).astype(np.float32)
    rows[:, 5] = 0  # a coordinate no gradient touches stays out of both metrics
    batch_of_row = np.array([0, 0, 1, 2, 2, 2])
    got = gradient_noise.gram_matrices(rows, batch_of_row, 4, block=300)  # batch 3 had no gradient
    np.testing.assert_allclose(got["euclidean"], rows.astype(np.float64) @ rows.T.astype(np.float64), rtol=1e-12)
    scaled = rows * rng.uniform(0.01, 100.0, size=1001).astype(np.float32)
    again = gradient_noise.gram_matrices(scaled, batch_of_row, 4, block=1 << 20)
    np.testing.assert_allclose(again["adam"], got["adam"], rtol=1e-5)
    # Each coordinate's batch gradients have mean square 1 after the division, so their squares sum to K.
    sums = np.stack([rows[batch_of_row == b].sum(0) for b in range(4)]).astype(np.float64)
    white = sums / np.sqrt((sums ** 2).mean(0), where=np.any(sums != 0, 0), out=np.ones(1001))
    assert (white ** 2).sum() == pytest.approx(4 * 1000)
    one_hot = np.eye(4)[batch_of_row]  # [rows, batches]
    assert np.trace(one_hot.T @ got["adam"] @ one_hot) == pytest.approx(4 * 1000)


@pytest.mark.parametrize("agg_mode", losses.AGG_MODES)
def test_group_gradients_sum_to_the_batch_gradient(agg_mode):
    """Weighted by their share of what the aggregation averages over, the groups' gradients add up to the whole
    batch's, also with rows of different lengths and an empty row; a group of zero advantages is skipped."""
    rng = np.random.default_rng(2)
    b, t = 6, 5
    lengths = np.array([5, 1, 3, 0, 4, 2])
    mask = (np.arange(t) < lengths[:, None]).astype(np.float32)
    advantages = rng.normal(size=(b, t)).astype(np.float32)
    advantages[2:4] = 0.0
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    experience = rl.Experience(tokens=jnp.zeros((b, t), jnp.int32), attn_mask=jnp.asarray(mask > 0),
                               response_mask=jnp.asarray(mask), old_logp=arr(b, t), ref_logp=arr(b, t),
                               old_values=arr(b, t), advantages=jnp.asarray(advantages), returns=arr(b, t),
                               positive=jnp.zeros(b))
    params = {"w": arr(t), "b": arr(1)}

    def loss(p, mb):  # zero where the advantage is zero, like the policy-gradient term
        x = jnp.tanh(p["w"] * mb.old_logp + p["b"]) * mb.advantages
        return losses.aggregate(x, mb.response_mask, agg_mode)

    grad_fn = jax.grad(loss)
    got = list(gradient_noise.group_gradients(grad_fn, params, experience, group_size=2, agg_mode=agg_mode))
    assert [j for j, _ in got] == [0, 2]
    want = ravel_pytree(grad_fn(params, experience))[0]
    np.testing.assert_allclose(sum(g for _, g in got), want, rtol=1e-5, atol=1e-6)


def test_markdown_has_a_row_per_arm_and_metric():
    stats = gradient_noise.signal_noise(np.full((4, 4), 1.0) + 3 * np.eye(4), np.arange(4), 4, 1)
    none = gradient_noise.signal_noise(np.eye(4), np.arange(4), 4, 1)
    batches = [{"groups_with_gradient": 2}, {"groups_with_gradient": 2}]
    result = {"policy": "p", "batch_responses": 8, "group_size": 4, "num_batches": 2,
              "rewards": {"euclidean": stats, "adam": stats, "batches": batches},
              "shuffled": {"euclidean": none, "adam": none, "batches": batches}}
    rows = gradient_noise.markdown([result]).split("\n")[2:]
    assert [r.split(" | ")[4] for r in rows] == list(gradient_noise.METRICS) * 2
    # signal 1, noise 3: a quarter, no spread; the fewest steps to even is noise / signal
    assert rows[0].endswith("| 8 (2 x 4) | 2 | the verifier's rewards | euclidean | 25.00 ± 0.00 | 25.00 | 3 | 4 of 4 |")
    assert rows[3].endswith("| shuffled rewards (control) | adam | 0.00 ± 0.00 | 0.00 | - | 4 of 4 |")


@pytest.mark.parametrize("args, message", [(["--batches=2"], "--batches must be at least 3"),
                                           (["--scratch=/nonexistent/dir"], "is not a directory")])
def test_bad_flags_fail_before_anything_loads(args, message):
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "experiments/gradient_noise.py", "--config=configs/smollm2.py:grpo", *args],
                         cwd=repo, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode != 0 and message in out.stderr
