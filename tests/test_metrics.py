"""MetricWriter round trip, bucket means, early-token bias and the advantage-length correlation against numpy loops."""

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
    with mt.MetricWriter(tmp_path, tensorboard=False) as w:  # each record is on disk once written (line-buffered)
        w.write(3, {"policy/loss": 0.0625})
        assert json.loads(open(tmp_path / mt.METRICS_FILE).read().splitlines()[-1])["step"] == 3
    with open(tmp_path / mt.METRICS_FILE, "a") as f:  # a process killed while writing a record
        f.write('{"step": 4, "policy/lo')
    with mt.MetricWriter(tmp_path, tensorboard=False) as w:  # the resumed run drops the torn record
        w.write(4, {"policy/loss": 0.03125})
    assert [r["policy/loss"] for r in mt.read_metrics(tmp_path)] == [0.5, 0.125, 0.0625, 0.03125]
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


def _np_adv_length_corr(adv, mask, seq):
    lengths = mask.sum(1)
    rows = [b for b in range(len(lengths)) if lengths[b] > 0]
    a = np.array([adv[b, 0] for b in rows], np.float64)
    n = np.array([lengths[b] for b in rows], np.float64)
    won = np.array([seq[b] > 0 for b in rows])
    for cls in (won, ~won):
        if cls.any():
            a[cls] -= a[cls].mean()
            n[cls] -= n[cls].mean()
    return float((a * n).sum() / np.sqrt((a * a).sum() * (n * n).sum()))


def test_advantage_length_corr_vs_numpy_and_signs():
    rng = np.random.default_rng(4)
    mask, lengths = _random_mask(rng, 12, 10)
    seq = np.where(rng.uniform(size=12) < 0.5, 1.0, -1.0).astype(np.float32)
    adv = rng.normal(size=(12, 10)).astype(np.float32)
    got = jax.jit(mt.advantage_length_corr)(adv, mask, seq)
    np.testing.assert_allclose(float(got), _np_adv_length_corr(adv, mask, seq), rtol=1e-5, atol=1e-6)
    # A constant pessimistic critic (V = -2) with lambda 0.95: A_0 = 0.95^(T-1) (r + 2), so within each outcome the
    # shorter response's first token gets more: negative. An optimistic one (V = +2): positive.
    for v, sign in ((-2.0, -1), (2.0, 1)):
        a0 = np.where(lengths > 0, 0.95 ** (np.maximum(lengths, 1) - 1) * (seq - v), 0.0).astype(np.float32)
        adv = np.zeros((12, 10), np.float32)
        adv[:, 0] = a0
        assert sign * float(mt.advantage_length_corr(adv, mask, seq)) > 0.5
    # GRPO-like: the advantage is a function of the outcome alone, so nothing is left within outcome.
    adv = np.repeat(np.where(seq > 0, 0.7, -0.4)[:, None], 10, 1).astype(np.float32)
    assert abs(float(mt.advantage_length_corr(adv, mask, seq))) < 1e-6
    with pytest.raises(ValueError, match=r"must be \[batch, time\]"):
        mt.advantage_length_corr(jnp.ones((2, 4)), jnp.ones((2, 4)), jnp.ones(3))


def test_collapse_warning_needs_both_signals_for_the_window():
    bad_corr, bad_err = [-0.7] * 3, [-1.0] * 3
    msg = mt.collapse_warning([0.2] + bad_corr, [0.0] + bad_err)
    assert msg is not None and "-0.70" in msg and "-1.00" in msg and "Fig. 1-2" in msg
    assert mt.collapse_warning(bad_corr[:2], bad_err[:2]) is None  # not enough history
    assert mt.collapse_warning(bad_corr, [-1.0, 0.0, -1.0]) is None  # calibrated critic on one step resets
    assert mt.collapse_warning([-0.7, 0.1, -0.7], bad_err) is None  # a correlation swing resets
    assert mt.collapse_warning(bad_corr, [0.0] * 3) is None  # short preference from a calibrated critic
    assert mt.collapse_warning([0.7] * 3, bad_err) is None  # pessimistic but favouring long responses
    assert mt.collapse_warning(bad_corr, [-1.0, -1.0, float("nan")]) is None
    assert mt.collapse_warning([-0.5] * 3, [-0.5] * 3, corr_threshold=-0.6) is None  # thresholds are used
    assert mt.collapse_warning([-0.5] * 4, [-0.5] * 4, window=4) is not None
    with pytest.raises(ValueError, match="window=0"):
        mt.collapse_warning([-1.0], [-1.0], window=0)


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


def test_tensorboard_tags_are_legal_and_writing_logs_nothing(tmp_path, caplog):
    assert mt.tensorboard_tag("eval/pass@1") == "eval/pass_1"
    assert mt.tensorboard_tag("/policy/approx_kl") == "policy/approx_kl"
    import logging  # noqa: PLC0415

    with caplog.at_level(logging.DEBUG), mt.MetricWriter(tmp_path) as w:
        w.write(1, {"eval/pass@1": 0.5, "hist@x": np.arange(3.0)})
    assert "illegal" not in caplog.text
    assert json.loads(open(tmp_path / mt.METRICS_FILE).read())["eval/pass@1"] == 0.5  # JSONL keeps the name
