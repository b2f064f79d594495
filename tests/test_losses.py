"""Losses against direct numpy formulas (loops where clearer), gradients, and masked-edge cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcppo_jax import losses
from vcppo_jax.losses import (aggregate, entropy_from_logits, explained_variance, grpo_advantages, kl_penalty,
                              nll_loss, policy_loss, value_loss)

B, T = 5, 9
TOL = dict(rtol=1e-5, atol=1e-6)
# Jitted once per static setting: eager op-by-op dispatch would compile every primitive separately.
aggregate_jit = jax.jit(aggregate, static_argnames=("mode", "norm"))
policy_loss_jit = jax.jit(policy_loss, static_argnames=("clip_low", "clip_high", "dual_clip", "agg_mode"))
value_loss_jit = jax.jit(value_loss, static_argnames=("clip", "agg_mode"))
entropy_jit = jax.jit(entropy_from_logits)
explained_variance_jit = jax.jit(explained_variance)


def random_mask(rng, batch=B, time=T):
    lengths = rng.integers(1, time + 1, size=batch)
    lengths[-1] = 0  # an all-masked row
    return np.arange(time)[None] < lengths[:, None]


def np_aggregate(x, mask, mode, norm=None):
    x = np.where(mask, x, 0.0).astype(np.float64)
    if mode == "token-mean":
        return x.sum() / max(mask.sum(), 1)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (x.shape[0] * (norm or x.shape[1]))
    per_seq = []
    for b in range(x.shape[0]):
        n = mask[b].sum()
        if n == 0:
            continue
        per_seq.append(x[b].sum() / n if mode == "seq-mean-token-mean" else x[b].sum())
    return np.mean(per_seq) if per_seq else 0.0


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_matches_numpy(mode):
    rng = np.random.default_rng(0)
    x, mask = rng.normal(size=(B, T)).astype(np.float32), random_mask(rng)
    x_garbage = np.where(mask, x, np.inf).astype(np.float32)  # padding must never leak in
    np.testing.assert_allclose(aggregate_jit(x_garbage, mask, mode), np_aggregate(x, mask, mode), **TOL)
    assert aggregate_jit(x, np.zeros_like(mask), mode) == 0.0


def test_aggregate_norm_and_errors():
    rng = np.random.default_rng(1)
    x, mask = rng.normal(size=(B, T)).astype(np.float32), random_mask(rng)
    np.testing.assert_allclose(aggregate(x, mask, "seq-mean-token-sum-norm", norm=4096),
                               np_aggregate(x, mask, "seq-mean-token-sum-norm", norm=4096), **TOL)
    with pytest.raises(ValueError, match="agg_mode must be one of"):
        aggregate(x, mask, "sum")
    with pytest.raises(ValueError, match="norm"):
        aggregate(x, mask, "seq-mean-token-sum-norm", norm=0)
    with pytest.raises(ValueError, match="mask must have the shape"):
        aggregate(x, mask[:, :2])


def np_policy_terms(logp, old_logp, adv, clip_low, clip_high, dual_clip=None):
    """Per-token loss and branch flags, written as an explicit per-token loop."""
    loss = np.zeros(logp.shape)
    clipped = np.zeros(logp.shape, bool)
    dual = np.zeros(logp.shape, bool)
    for idx in np.ndindex(logp.shape):
        r = np.exp(np.float64(logp[idx]) - old_logp[idx])
        a = np.float64(adv[idx])
        unclipped_obj = r * a
        clipped_obj = min(max(r, 1 - clip_low), 1 + clip_high) * a
        loss[idx] = -min(unclipped_obj, clipped_obj)
        clipped[idx] = clipped_obj < unclipped_obj
        if dual_clip is not None and a < 0 and loss[idx] > dual_clip * -a:
            loss[idx], dual[idx] = dual_clip * -a, True
    return loss, clipped, dual


def policy_batch(seed):
    rng = np.random.default_rng(seed)
    old_logp = -rng.random((B, T)).astype(np.float32) * 3
    logp = (old_logp + rng.normal(size=(B, T)) * 0.4).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    return logp, old_logp, adv, random_mask(rng)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_policy_loss_matches_numpy(mode, dual_clip):
    logp, old_logp, adv, mask = policy_batch(seed=2)
    loss, metrics = policy_loss_jit(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip,
                                    agg_mode=mode)
    per_token, clipped, dual = np_policy_terms(logp, old_logp, adv, 0.2, 0.28, dual_clip)
    assert dual_clip is None or dual[mask].any()  # the data exercises the dual branch
    np.testing.assert_allclose(loss, np_aggregate(per_token, mask, mode), **TOL)
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    mean = lambda x: x[mask].mean()
    expected = {
        "policy/loss": np_aggregate(per_token, mask, mode),
        "policy/clipfrac": mean(clipped),
        "policy/clipfrac_low": mean(clipped & (ratio < 0.8)),
        "policy/clipfrac_high": mean(clipped & (ratio > 1.28)),
        "policy/clipfrac_dual": mean(dual),
        "policy/approx_kl": mean(ratio - 1 - np.log(ratio)),
        "policy/ratio_mean": mean(ratio),
        "policy/ratio_min": ratio[mask].min(),
        "policy/ratio_max": ratio[mask].max(),
    }
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert 0 < metrics["policy/clipfrac"] < 1


def test_policy_gradient_is_zero_on_clipped_tokens():
    logp, old_logp, adv, mask = policy_batch(seed=3)
    grad = jax.jit(jax.grad(lambda lp: policy_loss(lp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2)[0]))(logp)
    _, clipped, _ = np_policy_terms(logp, old_logp, adv, 0.2, 0.2)
    ratio = np.exp(logp.astype(np.float64) - old_logp)
    # d(-A r)/d logp = -A r on unclipped valid tokens, token-mean over all valid tokens.
    expected = np.where(mask & ~clipped, -adv * ratio / mask.sum(), 0.0)
    assert clipped[mask].any() and (~clipped[mask]).any()
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_dual_clip_gradient_is_zero_where_the_bound_binds():
    logp, old_logp, adv, mask = policy_batch(seed=4)
    fn = lambda lp: policy_loss(lp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=1.2)[0]
    _, _, dual = np_policy_terms(logp, old_logp, adv, 0.2, 0.2, 1.2)
    assert dual[mask].any()
    assert np.all(np.asarray(jax.jit(jax.grad(fn))(logp))[dual] == 0)


def test_policy_loss_survives_garbage_padding_and_empty_batches():
    logp, old_logp, adv, mask = policy_batch(seed=5)
    bad = lambda x, fill: np.where(mask, x, fill).astype(np.float32)
    fn = lambda lp, m: policy_loss_jit(lp, bad(old_logp, -np.inf), bad(adv, np.nan), m, clip_low=0.2,
                                       clip_high=0.28, dual_clip=3.0)
    loss, metrics = fn(bad(logp, np.nan), mask)
    clean_loss, _ = policy_loss_jit(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    np.testing.assert_allclose(loss, clean_loss, **TOL)
    grad = jax.jit(jax.grad(lambda lp: fn(lp, mask)[0]))(bad(logp, np.nan))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~mask] == 0)
    empty = np.zeros_like(mask)
    loss, metrics = fn(bad(logp, np.inf), empty)
    assert all(np.isfinite(v) for v in jax.tree.leaves(metrics)) and loss == 0
    assert np.all(np.isfinite(jax.jit(jax.grad(lambda lp: fn(lp, empty)[0]))(logp)))


def test_policy_loss_jits_and_rejects_bad_arguments():
    logp, old_logp, adv, mask = policy_batch(seed=6)
    fn = jax.jit(functools.partial(policy_loss, clip_low=0.2, clip_high=0.28))
    per_token, _, _ = np_policy_terms(logp, old_logp, adv, 0.2, 0.28)
    np.testing.assert_allclose(fn(logp, old_logp, adv, mask)[0], per_token[mask].mean(), **TOL)
    for kwargs, match in [(dict(clip_low=1.0, clip_high=0.2), "clip_low"),
                          (dict(clip_low=0.2, clip_high=-0.1), "clip_high"),
                          (dict(clip_low=0.2, clip_high=0.2, dual_clip=1.0), "dual_clip"),
                          (dict(clip_low=0.2, clip_high=0.2, agg_mode="mean"), "agg_mode")]:
        with pytest.raises(ValueError, match=match):
            policy_loss(logp, old_logp, adv, mask, **kwargs)
    with pytest.raises(ValueError, match="advantages must have the shape"):
        policy_loss(logp, old_logp, adv[:, :3], mask, clip_low=0.2, clip_high=0.2)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_numpy(clip):
    rng = np.random.default_rng(7)
    values, old_values, returns = (rng.normal(size=(B, T)).astype(np.float32) for _ in range(3))
    mask = random_mask(rng)
    loss, metrics = value_loss_jit(values, old_values, returns, mask, clip=clip)
    per_token, clipped = np.zeros((B, T)), np.zeros((B, T), bool)
    for idx in np.ndindex(B, T):
        sq = (values[idx] - returns[idx]) ** 2
        if clip is None:
            per_token[idx] = 0.5 * sq
            continue
        v_clip = min(max(values[idx], old_values[idx] - clip), old_values[idx] + clip)
        sq_clip = (v_clip - returns[idx]) ** 2
        per_token[idx], clipped[idx] = 0.5 * max(sq, sq_clip), sq_clip > sq
    np.testing.assert_allclose(loss, per_token[mask].mean(), **TOL)
    np.testing.assert_allclose(metrics["value/loss"], loss)
    np.testing.assert_allclose(metrics["value/clipfrac"], clipped[mask].mean(), **TOL)
    np.testing.assert_allclose(metrics["value/mean"], values[mask].mean(), **TOL)
    np.testing.assert_allclose(metrics["value/error_mean"], (values - returns)[mask].mean(), **TOL)
    if clip is not None:
        assert 0 < metrics["value/clipfrac"] < 1
        grad = jax.jit(jax.grad(lambda v: value_loss(v, old_values, returns, mask, clip=clip)[0]))(values)
        assert np.all(np.asarray(grad)[clipped & mask] == 0)  # clipped term wins -> V is outside the clip range
        np.testing.assert_allclose(np.asarray(grad)[~clipped & mask],
                                   ((values - returns) / mask.sum())[~clipped & mask], rtol=1e-5, atol=1e-7)


def test_value_loss_empty_and_errors():
    z = np.zeros((B, T), np.float32)
    loss, metrics = value_loss_jit(z + np.nan, z, z, np.zeros((B, T), bool), clip=0.5)
    assert loss == 0 and all(np.isfinite(v) for v in jax.tree.leaves(metrics))
    with pytest.raises(ValueError, match="clip"):
        value_loss(z, z, z, z, clip=0.0)


def test_kl_penalty_formulas():
    rng = np.random.default_rng(8)
    logp, ref_logp = (-rng.random((B, T)) * 4 for _ in range(2))
    log_r = ref_logp - logp
    np.testing.assert_allclose(kl_penalty(logp, ref_logp, "k1"), logp - ref_logp, **TOL)
    np.testing.assert_allclose(kl_penalty(logp, ref_logp, "k2"), 0.5 * log_r ** 2, **TOL)
    np.testing.assert_allclose(kl_penalty(logp, ref_logp, "k3"), np.exp(log_r) - 1 - log_r, **TOL)
    assert np.all(np.asarray(kl_penalty(logp, ref_logp, "k3")) >= 0)
    assert np.all(np.asarray(kl_penalty(logp, logp, "k3")) == 0)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref_logp, "k4")


def test_kl_estimators_average_to_the_exact_kl():
    rng = np.random.default_rng(9)
    vocab, n = 6, 200_000
    log_pi = np.log(rng.dirichlet(np.ones(vocab)))
    log_ref = np.log(rng.dirichlet(np.ones(vocab)))
    exact = np.sum(np.exp(log_pi) * (log_pi - log_ref))
    tokens = rng.choice(vocab, size=n, p=np.exp(log_pi))  # samples from pi
    for kind in ("k1", "k3"):  # unbiased estimators of KL(pi || ref)
        est = kl_penalty(log_pi[tokens].astype(np.float32), log_ref[tokens].astype(np.float32), kind)
        np.testing.assert_allclose(np.mean(est), exact, rtol=0.05)


def np_entropy(logits):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)


def test_entropy_from_logits():
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(3, 4, 11)) * 3
    logits[0, 0] = 0.0  # uniform: log(vocab)
    logits[0, 1, :2] = 1e4  # huge logits, two-way tie: log 2, no overflow
    logits[1, :, -3:] = -np.inf  # banned tokens contribute nothing
    logits = logits.astype(np.float32)
    got = entropy_jit(logits)
    np.testing.assert_allclose(got, np_entropy(logits.astype(np.float64)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0, :2], [np.log(11), np.log(2)], rtol=1e-6)
    np.testing.assert_allclose(got[1], np_entropy(logits[1, :, :-3].astype(np.float64)), rtol=1e-5)
    grad = jax.jit(jax.grad(lambda x: entropy_from_logits(x).sum()))(logits)
    assert np.all(np.isfinite(grad))
    assert entropy_jit(logits.astype(jnp.bfloat16)).dtype == jnp.float32


def test_grpo_advantages():
    rng = np.random.default_rng(11)
    rewards = rng.choice([-1.0, 1.0], size=12).astype(np.float32)
    rewards[:4] = 1.0  # an all-correct group -> zero advantage, no NaN
    expected, expected_no_std = np.zeros(12), np.zeros(12)
    for g in range(3):
        block = rewards[4 * g:4 * g + 4].astype(np.float64)
        expected_no_std[4 * g:4 * g + 4] = block - block.mean()
        expected[4 * g:4 * g + 4] = (block - block.mean()) / (np.std(block, ddof=1) + 1e-6)
    np.testing.assert_allclose(grpo_advantages(rewards, 4), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpo_advantages(rewards, 4, normalize_std=False), expected_no_std, **TOL)
    np.testing.assert_array_equal(grpo_advantages(rewards, 1), np.zeros(12))
    for args, match in [((rewards, 5), "multiple of group_size"), ((rewards, 0), "group_size"),
                        ((rewards.reshape(3, 4), 4), r"rewards must be \[batch\]")]:
        with pytest.raises(ValueError, match=match):
            grpo_advantages(*args)


def test_explained_variance():
    rng = np.random.default_rng(12)
    target, noise = rng.normal(size=(2, B, T)).astype(np.float32)
    mask = random_mask(rng)
    pred = target + 0.5 * noise
    expected = 1 - np.var((target - pred)[mask]) / np.var(target[mask])
    np.testing.assert_allclose(explained_variance_jit(pred, target, mask), expected, rtol=1e-5)
    np.testing.assert_allclose(explained_variance_jit(target, target, mask), 1.0, **TOL)
    np.testing.assert_allclose(explained_variance_jit(np.full_like(target, target[mask].mean()), target, mask), 0.0,
                               atol=1e-6)
    assert explained_variance_jit(pred, np.ones_like(target), mask) == 0.0
    assert explained_variance_jit(pred, target, np.zeros_like(mask)) == 0.0


def test_nll_loss():
    rng = np.random.default_rng(13)
    logp = -rng.random((B, T)).astype(np.float32)
    mask = random_mask(rng)
    positive = np.array([1, 0, 1, 1, 0], bool)
    np.testing.assert_allclose(nll_loss(np.where(mask, logp, -np.inf), mask), -logp[mask].mean(), **TOL)
    np.testing.assert_allclose(nll_loss(logp, mask & positive[:, None], "seq-mean-token-sum"),
                               np_aggregate(-logp, mask & positive[:, None], "seq-mean-token-sum"), **TOL)


def test_explained_variance_of_constant_target_is_zero():
    """Every response wrong: the target is constant, float32 rounding must not give a huge negative value."""
    rng = np.random.default_rng(0)
    mask = (rng.random((6, 9)) > 0.3).astype(np.float32)
    target = -np.ones((6, 9), np.float32) * mask
    pred = rng.standard_normal((6, 9)).astype(np.float32)
    assert float(losses.explained_variance(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask))) == 0.0
