"""MetricWriter round trip, bucket means and early-token bias against numpy loops."""

import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcppo_jax import metrics as mt


def _random_mask(rng, batch, time):
    """Right-padded response masks with lengths in [0, time]."""
    lengths = rng.integers(0, time + 1, batch)
    lengths[0] = time  # one full-length (clipped) response
    return (np.arange(time)[None, :] < lengths[:, None]).astype(np.float32), lengths


def test_metric_writer_jsonl_and_tensorboard(tmp_path):
    with mt.MetricWriter(tmp_path) as w:
        w.write(1, {"policy/loss": jnp.float32(0.5), "value/ev": np.float64(0.25), "rollout/n": np.int32(3),
                    "flag": True, "hist/adv": jnp.arange(6.0), "note": "skip me", "bad": float("nan")})
        w.write(2, {"policy/loss": 0.25})
        w.flush()
        assert len(glob.glob(os.path.join(tmp_path, "events.out.tfevents.*"))) == 1
    lines = open(tmp_path / mt.METRICS_FILE).read().splitlines()
    first = json.loads(lines[0])
    assert first == {"step": 1, "policy/loss": 0.5, "value/ev": 0.25, "rollout/n": 3, "flag": 1, "bad": None}
    assert isinstance(first["rollout/n"], int)
    assert json.loads(lines[1]) == {"step": 2, "policy/loss": 0.25}
    with mt.MetricWriter(tmp_path, tensorboard=False) as w:  # resume: appends, last record per step wins
        w.write(2, {"policy/loss": 0.125})
    assert [r["policy/loss"] for r in mt.read_metrics(tmp_path)] == [0.5, 0.125]
    tb_files = glob.glob(os.path.join(tmp_path, "events.out.tfevents.*"))
    assert len(tb_files) == 1 and os.path.getsize(tb_files[0]) > 0
    with pytest.raises(ValueError, match="reserved key 'step'"):
        with mt.MetricWriter(tmp_path / "x", tensorboard=False) as w:
            w.write(0, {"step": 1})


def test_tensorboard_event_contents(tmp_path):
    import struct

    from tensorboardX.proto import event_pb2 as pb

    with mt.MetricWriter(tmp_path) as w:
        w.write(3, {"value/loss": 0.75})
    (path,) = glob.glob(os.path.join(tmp_path, "events.out.tfevents.*"))
    data, seen = open(path, "rb").read(), {}
    while data:  # TFRecord framing: u64 length, u32 crc, payload, u32 crc
        (n,) = struct.unpack("<Q", data[:8])
        event = pb.Event.FromString(data[12 : 12 + n])
        for v in event.summary.value:
            seen[(event.step, v.tag)] = v.simple_value
        data = data[16 + n :]
    assert seen == {(3, "value/loss"): 0.75}


@pytest.mark.parametrize("time_len, num_buckets", [(10, 3), (8, 4), (5, 8)])
def test_position_bucket_means_vs_numpy(time_len, num_buckets):
    rng = np.random.default_rng(time_len)
    x = rng.normal(size=(6, time_len)).astype(np.float32)
    mask, _ = _random_mask(rng, 6, time_len)
    means, counts = jax.jit(mt.position_bucket_means, static_argnums=2)(x, mask, num_buckets)
    ref_sum, ref_cnt = np.zeros(num_buckets), np.zeros(num_buckets)
    for b in range(6):
        for t in range(time_len):
            k = int(math.floor(t * num_buckets / time_len))
            ref_sum[k] += x[b, t] * mask[b, t]
            ref_cnt[k] += mask[b, t]
    ref = np.where(ref_cnt > 0, ref_sum / np.maximum(ref_cnt, 1), 0.0)
    np.testing.assert_allclose(counts, ref_cnt)
    np.testing.assert_allclose(means, ref, rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(means)).all()
    if num_buckets > time_len:
        assert (np.asarray(counts) == 0).any()  # some buckets hold no position at all


def test_position_bucket_means_empty_and_errors():
    means, counts = mt.position_bucket_means(jnp.ones((2, 4)), jnp.zeros((2, 4)), 2)
    np.testing.assert_array_equal(means, [0.0, 0.0])
    np.testing.assert_array_equal(counts, [0.0, 0.0])
    with pytest.raises(ValueError, match="num_buckets=0 must be an int >= 1"):
        mt.position_bucket_means(jnp.ones((2, 4)), jnp.ones((2, 4)), 0)
    with pytest.raises(ValueError, match=r"must both be \[batch, time\]"):
        mt.position_bucket_means(jnp.ones((2, 4)), jnp.ones((2, 3)), 2)


def test_early_token_bias_vs_numpy():
    rng = np.random.default_rng(1)
    adv = rng.normal(size=(7, 9)).astype(np.float32)
    mask, lengths = _random_mask(rng, 7, 9)
    mask[3, :2] = 0.0  # a row whose valid tokens do not start at 0: "first k valid" is by rank
    k = 3
    got = jax.jit(mt.early_token_bias, static_argnames="early_tokens")(adv, mask, early_tokens=k)
    early, late = [], []
    for b in range(7):
        rank = 0
        for t in range(9):
            if mask[b, t]:
                (early if rank < k else late).append(adv[b, t])
                rank += 1
    np.testing.assert_allclose(got["diag/adv_early"], np.mean(early), rtol=1e-5)
    np.testing.assert_allclose(got["diag/adv_late"], np.mean(late), rtol=1e-5)
    np.testing.assert_allclose(got["diag/adv_early_bias"], np.mean(early) - np.mean(late), rtol=1e-5, atol=1e-6)
    short = mt.early_token_bias(jnp.ones((2, 4)), jnp.asarray([[1, 1, 0, 0], [1, 0, 0, 0]]), early_tokens=3)
    assert float(short["diag/adv_late"]) == 0.0 and float(short["diag/adv_early"]) == 1.0
    with pytest.raises(ValueError, match="early_tokens=0 must be an int >= 1"):
        mt.early_token_bias(jnp.ones((2, 4)), jnp.ones((2, 4)), early_tokens=0)


def test_collapse_warning_rule():
    assert mt.collapse_warning([0.7] * 4, 0.3, window=5) is None  # not enough history
    assert mt.collapse_warning([0.7, 0.7, 0.1, 0.7, 0.7, 0.7], 0.3, window=5) is None  # one dip resets
    msg = mt.collapse_warning([0.0, 0.6, 0.7, 0.8, 0.7, 0.7], 0.3, window=5)
    assert msg is not None and "latest +0.700" in msg and "Fig. 2" in msg
    assert mt.collapse_warning([0.7] * 4 + [float("nan")], 0.3, window=5) is None
    assert mt.collapse_warning([-0.7] * 5, 0.3, window=5) is None  # negative bias is not the signature


def test_response_length_stats_vs_numpy():
    rng = np.random.default_rng(2)
    mask, lengths = _random_mask(rng, 9, 6)
    got = mt.response_length_stats(jnp.asarray(mask), 6)
    assert float(got["rollout/response_length_mean"]) == pytest.approx(lengths.mean())
    assert float(got["rollout/response_length_max"]) == lengths.max()
    assert float(got["rollout/response_length_min"]) == lengths.min()
    assert float(got["rollout/clip_ratio"]) == pytest.approx(np.mean(lengths >= 6))
    with pytest.raises(ValueError, match="max_len=0 must be an int >= 1"):
        mt.response_length_stats(jnp.asarray(mask), 0)


def test_timer_sections_and_throughput():
    timer = mt.Timer()
    with timer.section("rollout"):
        sum(range(10000))
    with timer.section("rollout"):
        pass
    out = timer.summary(num_tokens=1000)
    assert set(out) == {"perf/step_time_s", "perf/rollout_s", "perf/tokens_per_s"}
    assert 0 < out["perf/rollout_s"] <= out["perf/step_time_s"]
    assert out["perf/tokens_per_s"] == pytest.approx(1000 / out["perf/step_time_s"])
    assert "perf/rollout_s" not in timer.summary()  # reset per step
