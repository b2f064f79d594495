"""GAE against plain numpy loops, closed forms and invariances (padding, masking, vmap)."""

import contextlib
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcppo_jax import gae as gae_lib
from vcppo_jax.gae import decoupled_gae, gae, length_adaptive_lambda, whiten

IMPLS = gae_lib.IMPLS
B, T = 6, 17  # one shape for most tests, so each impl compiles once
TOL = dict(rtol=1e-5, atol=1e-5)


def reference_gae(rewards, values, mask, gamma, lam):
    """Per-sequence loop over valid steps only, float64. lam: scalar or [B]."""
    rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
    lam = np.broadcast_to(np.asarray(lam, np.float64), rewards.shape[:1])
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        next_value, acc = 0.0, 0.0
        for t in reversed(range(rewards.shape[1])):
            if not mask[b, t]:
                continue
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            acc = delta + gamma * lam[b] * acc
            adv[b, t] = acc
            next_value = values[b, t]
    return adv, np.where(mask, values + adv, 0.0)


def random_batch(seed, batch=B, time=T, lengths=None):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(batch, time)).astype(np.float32)
    values = rng.normal(size=(batch, time)).astype(np.float32)
    if lengths is None:
        lengths = rng.integers(0, time + 1, size=batch)
        lengths[0], lengths[-1] = time, 0 if batch > 1 else time  # full and empty rows
    mask = np.arange(time)[None, :] < np.asarray(lengths)[:, None]
    return rewards, values, mask


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gamma", [0.0, 0.9, 1.0])
@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_matches_numpy_reference(impl, gamma, lam):
    rewards, values, mask = random_batch(seed=int(gamma * 10 + lam * 100))
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam, impl=impl)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, **TOL)
    np.testing.assert_allclose(ret, ref_ret, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_decoupled_matches_two_reference_passes(impl):
    rewards, values, mask = random_batch(seed=1)
    adv, ret = decoupled_gae(rewards, values, mask, gamma=0.99, lambda_actor=0.9, lambda_critic=0.97, impl=impl)
    np.testing.assert_allclose(adv, reference_gae(rewards, values, mask, 0.99, 0.9)[0], **TOL)
    np.testing.assert_allclose(ret, reference_gae(rewards, values, mask, 0.99, 0.97)[1], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_critic_lambda_one_gives_monte_carlo_returns(impl):
    rewards, values, mask = random_batch(seed=2)
    _, ret = decoupled_gae(rewards, values, mask, gamma=1.0, lambda_actor=0.95, lambda_critic=1.0, impl=impl)
    masked_rewards = np.where(mask, rewards, 0.0)  # rewards on padding carry no signal
    mc = np.flip(np.cumsum(np.flip(masked_rewards, -1), -1), -1)
    np.testing.assert_allclose(ret, np.where(mask, mc, 0.0), **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_garbage_padding_changes_nothing(impl):
    rewards, values, mask = random_batch(seed=3)
    rng = np.random.default_rng(33)
    garbage = lambda shape: (rng.normal(size=shape) * 1e3).astype(np.float32)
    # Garbage in the padded tail of each row, plus 5 extra padded columns.
    pad_r = np.concatenate([np.where(mask, rewards, garbage(mask.shape)), garbage((B, 5))], 1)
    pad_v = np.concatenate([np.where(mask, values, garbage(mask.shape)), garbage((B, 5))], 1)
    pad_m = np.concatenate([mask, np.zeros((B, 5), bool)], 1)
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9, impl=impl)
    pad_adv, pad_ret = gae(pad_r, pad_v, pad_m, gamma=0.97, lam=0.9, impl=impl)
    np.testing.assert_allclose(pad_adv[:, :T], adv, **TOL)
    np.testing.assert_allclose(pad_ret[:, :T], ret, **TOL)
    assert np.all(np.asarray(pad_adv)[~pad_m] == 0) and np.all(np.asarray(pad_ret)[~pad_m] == 0)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_padding_never_reach_valid_steps(impl, jit):
    """Non-finite rewards / values on padded positions (e.g. a value head run past the end) change nothing, with and
    without jit: XLA may simplify `x * 0` away under jit, eager execution does not."""
    rewards, values, mask = random_batch(seed=4)
    bad_r = np.where(mask, rewards, np.nan).astype(np.float32)
    bad_v = np.where(mask, values, np.inf).astype(np.float32)
    want = gae(rewards, values, mask, gamma=0.97, lam=0.9, impl=impl)
    with (contextlib.nullcontext() if jit else jax.disable_jit()):
        got = decoupled_gae(bad_r, bad_v, mask, gamma=0.97, lambda_actor=0.9, lambda_critic=0.9, impl=impl)
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_mid_sequence_steps_are_skipped(impl):
    rng = np.random.default_rng(4)
    rewards, values, _ = random_batch(seed=4)
    mask = rng.random((B, T)) < 0.6
    adv, ret = gae(rewards, values, mask, gamma=0.95, lam=0.8, impl=impl)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, 0.95, 0.8)
    np.testing.assert_allclose(adv, ref_adv, **TOL)
    np.testing.assert_allclose(ret, ref_ret, **TOL)
    # Same as deleting the masked steps, running plain GAE on the compacted row, and scattering back.
    for b in range(B):
        idx = np.flatnonzero(mask[b])
        full = np.ones((1, len(idx)), bool)
        sub_adv, _ = reference_gae(rewards[b:b + 1, idx], values[b:b + 1, idx], full, 0.95, 0.8)
        np.testing.assert_allclose(np.asarray(adv)[b, idx], sub_adv[0], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_and_tiny_shapes(impl):
    fn = jax.jit(jax.vmap(functools.partial(gae, gamma=0.9, lam=0.8, impl=impl)))
    stacked = [np.stack(x) for x in zip(*(random_batch(seed=s, batch=2, time=5) for s in range(3)))]
    adv, ret = fn(*stacked)
    assert adv.shape == ret.shape == (3, 2, 5)
    for i in range(3):
        ref_adv, ref_ret = reference_gae(stacked[0][i], stacked[1][i], stacked[2][i], 0.9, 0.8)
        np.testing.assert_allclose(adv[i], ref_adv, **TOL)
        np.testing.assert_allclose(ret[i], ref_ret, **TOL)
    for batch, time in [(1, 1), (1, 4), (3, 1)]:
        r, v, m = random_batch(seed=5, batch=batch, time=time, lengths=[time] * batch)
        adv, ret = gae(r, v, m, gamma=0.9, lam=0.8, impl=impl)
        np.testing.assert_allclose(adv, reference_gae(r, v, m, 0.9, 0.8)[0], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_per_sequence_lambda(impl):
    rewards, values, mask = random_batch(seed=6)
    lam = length_adaptive_lambda(mask.sum(-1), alpha=0.5)
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=lam, impl=impl)
    np.testing.assert_allclose(adv, reference_gae(rewards, values, mask, 1.0, np.asarray(lam))[0], **TOL)
    adv_a, ret_c = decoupled_gae(rewards, values, mask, gamma=1.0, lambda_actor=lam, lambda_critic=1.0, impl=impl)
    np.testing.assert_allclose(adv_a, adv, **TOL)
    np.testing.assert_allclose(ret_c, reference_gae(rewards, values, mask, 1.0, 1.0)[1], **TOL)


def test_length_adaptive_lambda_formula():
    lengths = np.array([0, 1, 20, 100, 5000])
    expected = np.clip(1.0 - 1.0 / (0.05 * np.maximum(lengths, 1e-30)), 0.0, 1.0)
    got = length_adaptive_lambda(lengths, alpha=0.05)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got[0] == 0.0 and abs(got[-1] - 0.996) < 1e-6


def test_whiten():
    rng = np.random.default_rng(7)
    x = (rng.normal(size=(B, T)) * 3 + 2).astype(np.float32)
    _, _, mask = random_batch(seed=7)
    whiten_jit = jax.jit(whiten, static_argnames=("shift_mean", "eps"))
    out = np.asarray(whiten_jit(x, mask))
    valid = x[mask]
    np.testing.assert_allclose(out[mask], (valid - valid.mean()) / valid.std(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose([out[mask].mean(), out[mask].std()], [0.0, 1.0], atol=1e-5)
    assert np.all(out[~mask] == 0)
    kept = np.asarray(whiten_jit(x, mask, shift_mean=False))
    np.testing.assert_allclose(kept[mask], out[mask] + valid.mean(), rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(whiten_jit(x, np.zeros_like(mask))) == 0)


def test_bf16_inputs_accumulate_in_float32():
    rewards, values, mask = random_batch(seed=8)
    adv, ret = gae(jnp.asarray(rewards, jnp.bfloat16), jnp.asarray(values, jnp.bfloat16), mask, gamma=1.0, lam=1.0)
    assert adv.dtype == ret.dtype == jnp.float32


def test_new_gamma_or_lambda_does_not_recompile():
    rewards, values, mask = random_batch(seed=9)
    gae(rewards, values, mask, gamma=0.9, lam=0.9, impl="scan")
    size = gae_lib._multi_lambda_gae._cache_size()
    for gamma, lam in [(0.5, 0.1), (1.0, 0.0), (0.0, 1.0)]:
        gae(rewards, values, mask, gamma=gamma, lam=lam, impl="scan")
    assert gae_lib._multi_lambda_gae._cache_size() == size


def test_default_impl_follows_backend():
    rewards, values, mask = random_batch(seed=10)
    assert gae_lib.default_impl() == gae_lib.DEFAULT_IMPL[jax.default_backend()]
    np.testing.assert_array_equal(gae(rewards, values, mask, gamma=0.9, lam=0.9)[0],
                                  gae(rewards, values, mask, gamma=0.9, lam=0.9, impl=gae_lib.default_impl())[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma=1.5, lam=0.9), "gamma"),
    (dict(gamma=0.9, lam=-0.1), "lam"),
    (dict(gamma=0.9, lam=np.array([0.5, 1.2, 0.5, 0.5, 0.5, 0.5])), "lam"),
    (dict(gamma=0.9, lam=np.full((3,), 0.5)), r"lam must be a scalar or a per-sequence array of shape \[6\]"),
    (dict(gamma="x", lam=0.9), "gamma"),
    (dict(gamma=0.9, lam=0.9, impl="pallas"), "impl"),
])
def test_gae_rejects_bad_arguments(kwargs, match):
    rewards, values, mask = random_batch(seed=11)
    with pytest.raises(ValueError, match=match):
        gae(rewards, values, mask, **kwargs)


def test_other_bad_arguments():
    rewards, values, mask = random_batch(seed=12)
    with pytest.raises(ValueError, match="values must have the shape"):
        gae(rewards, values[:, :-1], mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"rewards must be \[batch, time\]"):
        gae(rewards[0], values[0], mask[0], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="lambda_critic"):
        decoupled_gae(rewards, values, mask, gamma=1.0, lambda_actor=0.9, lambda_critic=1.01)
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(np.array([3]), alpha=0.0)
    with pytest.raises(ValueError, match="mask must have the shape"):
        whiten(rewards, mask[:, :3])


# Property tests: one fixed padded shape, so no example triggers a recompile.
HB, HT = 4, 12
SETTINGS = hypothesis.settings(max_examples=25, deadline=None, derandomize=True, database=None)
lengths_st = st.lists(st.integers(0, HT), min_size=HB, max_size=HB)
unit_st = st.floats(0.0, 1.0)


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1), lengths=lengths_st, gamma=unit_st, impl=st.sampled_from(IMPLS))
def test_property_lambda_zero_is_one_step_td(seed, lengths, gamma, impl):
    rewards, values, mask = random_batch(seed, HB, HT, lengths)
    adv, _ = gae(rewards, values, mask, gamma=gamma, lam=0.0, impl=impl)
    next_values = np.where(mask[:, 1:], values[:, 1:], 0.0)  # right padding: V after the last valid step is 0
    next_values = np.concatenate([next_values, np.zeros((HB, 1), np.float32)], 1)
    td = rewards + gamma * next_values - values
    np.testing.assert_allclose(adv, np.where(mask, td, 0.0), **TOL)


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1), lengths=lengths_st, gamma=unit_st, impl=st.sampled_from(IMPLS))
def test_property_lambda_one_returns_ignore_values(seed, lengths, gamma, impl):
    rewards, values, mask = random_batch(seed, HB, HT, lengths)
    other_values = np.random.default_rng(seed + 1).normal(size=values.shape).astype(np.float32) * 5
    _, ret = gae(rewards, values, mask, gamma=gamma, lam=1.0, impl=impl)
    _, ret_other = gae(rewards, other_values, mask, gamma=gamma, lam=1.0, impl=impl)
    np.testing.assert_allclose(ret, ret_other, rtol=1e-4, atol=1e-4)


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**31 - 1), lengths=lengths_st, gamma=unit_st, lam_a=unit_st, lam_c=unit_st)
def test_property_impls_agree_with_reference_and_decoupled_with_single(seed, lengths, gamma, lam_a, lam_c):
    rewards, values, mask = random_batch(seed, HB, HT, lengths)
    ref_adv, _ = reference_gae(rewards, values, mask, gamma, lam_a)
    _, ref_ret = reference_gae(rewards, values, mask, gamma, lam_c)
    for impl in IMPLS:
        adv, ret = decoupled_gae(rewards, values, mask, gamma=gamma, lambda_actor=lam_a, lambda_critic=lam_c, impl=impl)
        np.testing.assert_allclose(adv, ref_adv, **TOL)
        np.testing.assert_allclose(ret, ref_ret, **TOL)
        np.testing.assert_allclose(adv, gae(rewards, values, mask, gamma=gamma, lam=lam_a, impl=impl)[0], **TOL)
