"""Wiring of the offline critic stages (`value_train`) and of the SFT data mix (`sft`), against independent references.

- `value_targets`: Monte-Carlo returns (VC-PPO value pretraining) against a numpy reverse loop written from the
  definition; the reward model's EOS-only targets against cell-by-cell hand-built weights.
- `converged`: closed-form histories whose answer is known by hand.
- `make_value_step`: the reported value loss / explained variance / mean against numpy formulas fed with values
  from a plain full-sequence forward of the critic at the *initial* params (the metrics describe the batch before
  the update) and the targets above; the update against one SGD step down a reference gradient of the same loss.
- SFT mix: `direct_fraction` around the late-phase boundary, `use_direct_style` shares and determinism, and the SFT
  loop's per-step choice between a record's direct and chain-of-thought target.

Compiles are the cost (2 shared CPU cores): one tiny critic, one batch shape, every jitted function built once
(`functools.lru_cache`) without XLA's backend optimizations (as in test_wiring.py).
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from testutil import random_params
from vcppo_jax import config as config_lib
from vcppo_jax import rl
from vcppo_jax import sft as sft_lib
from vcppo_jax import value_train
from vcppo_jax.data import RecordSource
from vcppo_jax.models import ModelConfig, ValueModel, position_ids
from vcppo_jax.optim import init_model_state

B, P, R, V = 8, 4, 6, 32
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  tie_embeddings=True)
CRITIC = ValueModel(CFG)
LR = 0.1  # plain SGD (the update has a closed form); large enough that one update visibly moves the values
TX = optax.sgd(LR)
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# Response lengths cover 1 and the full R; prompt lengths cover 1 and the full P.
RESP_LENS = np.array([1, R, 3, 2, R, 4, 5, 1])
PROMPT_LENS = np.array([1, P, 2, 3, P, 1, 2, 4])


# --------------------------------------------------------------------------------------------------------------
# Numpy references and hand-built rollouts.
# --------------------------------------------------------------------------------------------------------------


def np_mc_returns(rewards, mask, gamma):
    """G_t = r_t + gamma G_{t+1} over each row's valid (left-aligned) tokens, 0 past the response; float64."""
    rewards, mask = np.asarray(rewards, np.float64), np.asarray(mask, np.float64)
    out = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(range(int(mask[b].sum()))):
            g = rewards[b, t] + gamma * g
            out[b, t] = g
    return out


def np_eos_weights(lengths, resp_len):
    """1 at index length-1 of each row, written cell by cell; an empty row has no 1."""
    w = np.zeros((len(lengths), resp_len))
    for b, n in enumerate(lengths):
        if n > 0:
            w[b, n - 1] = 1.0
    return w


def np_value_metrics(values, targets, weights):
    """(0.5 * token-mean squared error, 1 - Var[t - v] / Var[t] with population variances, weighted value mean) over
    the tokens with weight 1."""
    valid = np.asarray(weights) > 0
    v, t = np.asarray(values, np.float64)[valid], np.asarray(targets, np.float64)[valid]
    loss = 0.5 * np.mean((v - t) ** 2)
    ev = 1.0 - np.var(t - v) / np.var(t)
    return loss, ev, v.mean()


def hand_rollout(seed, lengths=RESP_LENS, dense_rewards=False):
    """Left-padded prompts, right-padded responses of `lengths`; garbage token ids on every padding position.
    Rewards: the sequence reward at each row's last response token (as `rollout.to_rollout` places it), plus
    (dense_rewards) random rewards on the other valid tokens and garbage past the response (which must be ignored)."""
    rs = np.random.RandomState(seed)
    prompt_mask = np.arange(P)[None, :] >= (P - PROMPT_LENS)[:, None]
    resp_mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.float32)
    seq_rewards = rs.normal(size=B).round(2).astype(np.float32)
    rewards = rs.normal(scale=0.5, size=(B, R)).astype(np.float32) if dense_rewards else np.zeros((B, R), np.float32)
    for b, n in enumerate(lengths):
        if n > 0:
            rewards[b, n - 1] = seq_rewards[b]
    return rl.Rollout(tokens=jnp.asarray(rs.randint(1, V, size=(B, P + R)), jnp.int32),
                      attn_mask=jnp.asarray(np.concatenate([prompt_mask, resp_mask > 0], 1)),
                      response_mask=jnp.asarray(resp_mask), rewards=jnp.asarray(rewards),
                      seq_rewards=jnp.asarray(seq_rewards))


# --------------------------------------------------------------------------------------------------------------
# value_targets.
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_value_targets_are_discounted_returns_of_every_token_reward(gamma):
    """Value pretraining regresses V(s_t) on the Monte-Carlo return from token t: the gamma-discounted sum of the
    token rewards from t to the row's end (dense rewards here, so every position matters), weight 1 on exactly the
    response tokens. Rows of length 0, 1, partial and full R; garbage rewards past the response are ignored."""
    lengths = np.array([1, R, 3, 0, R, 4, 2, 5])
    ro = hand_rollout(seed=3, lengths=lengths, dense_rewards=True)
    rewards = np.asarray(ro.rewards)
    assert (rewards[np.arange(R)[None] >= lengths[:, None]] != 0).any()  # precondition: garbage past the end
    mask = np.asarray(ro.response_mask)
    targets, weights = value_train.value_targets(ro.rewards, ro.seq_rewards, ro.response_mask, gamma=gamma,
                                                 eos_only=False)
    want = np_mc_returns(rewards, mask, gamma)
    np.testing.assert_allclose(np.asarray(targets), want, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(weights), mask)
    assert np.asarray(targets)[3].tolist() == [0.0] * R  # the empty row
    assert np.asarray(targets)[0, 0] == pytest.approx(rewards[0, 0])  # length 1: its own reward
    if gamma < 1:  # the discount is applied (gamma 1 would give the plain reverse cumulative sum)
        undiscounted = np_mc_returns(rewards, mask, 1.0)
        assert np.abs(undiscounted - want).max() > 0.1


def test_value_targets_eos_only_sequence_reward_at_each_last_token():
    """The outcome reward model is supervised only at each row's own last response token (varied lengths, not the
    final column), with the sequence reward as target; every other cell (and the whole of an empty row) has weight
    0 and target 0. Token rewards are not read: replacing them by unrelated garbage (not even the sequence reward at
    the last token, where a return would equal it) changes nothing."""
    lengths = np.array([1, R, 3, 0, 2, 4, 5, 1])
    garbage = np.random.RandomState(8).normal(size=(B, R)).astype(np.float32)
    for rewards in (None, garbage):
        ro = hand_rollout(seed=4, lengths=lengths)
        if rewards is not None:
            ro = ro.replace(rewards=jnp.asarray(rewards))
        seq = np.asarray(ro.seq_rewards)
        targets, weights = value_train.value_targets(ro.rewards, ro.seq_rewards, ro.response_mask, gamma=0.9,
                                                     eos_only=True)
        want_w = np_eos_weights(lengths, R)
        np.testing.assert_array_equal(np.asarray(weights), want_w)
        np.testing.assert_array_equal(np.asarray(targets), want_w * seq[:, None])
        assert np.asarray(weights)[3].sum() == 0  # the empty row is never supervised
        for b, n in enumerate(lengths):  # spelled out: the target cell holds this row's sequence reward
            if n:
                assert np.asarray(targets)[b, n - 1] == seq[b]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_value_targets_truncated_responses_are_failures_at_a_strict_prefix(fraction):
    """The pessimistic reward model: with truncated_fraction f, each row of length >= 2 is, with probability f,
    supervised once at a cut strictly before its last token with the failure reward; every other row keeps its
    sequence reward at its last token. One target per non-empty row, never past the response. Over many rows the
    truncated share matches f and cuts cover every strict prefix position."""
    lengths = np.array([1, R, 3, 0, 2, 4, 5, 1] * 64)
    n = len(lengths)
    mask = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
    seq = np.where(np.arange(n) % 3 == 0, 1.0, -1.0).astype(np.float32)
    rollout = (jnp.zeros((n, R)), jnp.asarray(seq), jnp.asarray(mask))  # token rewards, sequence rewards, mask
    targets, weights = value_train.value_targets(*rollout, gamma=1.0, eos_only=True, truncated_fraction=fraction,
                                                 truncated_reward=-3.0, rng=jax.random.PRNGKey(5))
    targets, weights = np.asarray(targets), np.asarray(weights)
    np.testing.assert_array_equal(weights.sum(1), (lengths > 0).astype(np.float32))
    assert (weights * (1 - mask)).sum() == 0
    pos = weights.argmax(1)
    cut = (lengths > 0) & (pos < lengths - 1)
    np.testing.assert_array_equal(targets[cut, pos[cut]], -3.0)
    kept = (lengths > 0) & ~cut
    np.testing.assert_array_equal(pos[kept], lengths[kept] - 1)
    np.testing.assert_array_equal(targets[kept, pos[kept]], seq[kept])
    assert not cut[lengths < 2].any()  # a 1-token response has no strict prefix
    eligible = lengths >= 2
    share = cut[eligible].mean()
    assert abs(share - fraction) < 4 * np.sqrt(fraction * (1 - fraction) / eligible.sum())
    full = cut & (lengths == R)
    assert set(pos[full].tolist()) == set(range(R - 1))  # every strict prefix of a full row is drawn
    again = value_train.value_targets(*rollout, gamma=1.0, eos_only=True, truncated_fraction=fraction,
                                      truncated_reward=-3.0, rng=jax.random.PRNGKey(5))[1]
    np.testing.assert_array_equal(np.asarray(again), weights)  # a function of the key
    plain = value_train.value_targets(*rollout, gamma=1.0, eos_only=True)[1]
    assert (np.asarray(plain).argmax(1) != pos).any() and fraction > 0


# --------------------------------------------------------------------------------------------------------------
# converged.
# --------------------------------------------------------------------------------------------------------------

CONVERGED_CASES = {
    # name: (losses, evs, want); window 2, rtol 0.25, atol 0.05. Values chosen exactly representable in binary.
    "one_short": ([1.0, 1.0, 1.0], [0.5, 0.5, 0.5], False),  # 2*window - 1 steps: too few even though flat
    "flat": ([1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5], True),
    "loss_falling": ([1.0, 1.0, 0.5, 0.5], [0.5] * 4, False),  # 1.0 -> 0.5: 50% > rtol
    "loss_rising": ([0.5, 0.5, 1.0, 1.0], [0.5] * 4, False),
    # Relative to the *older* window: |0.75 - 1| = 0.25 <= 0.25 * 1.0 (inclusive). Measured against the newer window
    # (0.25 * 0.75 = 0.1875) it would fail, so this pins which window is the reference and the <=.
    "at_rtol_of_older": ([1.0, 1.0, 0.75, 0.75], [0.5] * 4, True),
    "past_rtol_of_newer": ([0.75, 0.75, 1.0, 1.0], [0.5] * 4, False),  # 0.25 > 0.25 * 0.75
    "ev_moving": ([1.0] * 4, [0.25, 0.25, 0.375, 0.375], False),  # EV moved 0.125 > atol
    "ev_small_absolute": ([1.0] * 4, [0.0, 0.0, 0.03125, 0.03125], True),  # 0.03 <= atol (relatively huge)
    # Only the last two windows count: a huge early loss / EV jump before them changes nothing ...
    "old_history_ignored": ([100.0, 50.0, 1.0, 1.0, 1.0, 1.0], [-5.0, 0.0, 0.5, 0.5, 0.5, 0.5], True),
    # ... and a change inside them is seen even when the first windows were flat.
    "recent_change_seen": ([1.0, 1.0, 1.0, 1.0, 0.5, 0.5], [0.5] * 6, False),
    "recent_ev_change_seen": ([1.0] * 6, [0.5, 0.5, 0.5, 0.5, 0.75, 0.75], False),
    "zero_loss": ([0.0] * 4, [1.0] * 4, True),  # the relative tolerance does not divide by zero
}


@pytest.mark.parametrize("name", list(CONVERGED_CASES))
def test_converged_closed_form(name):
    """The stopping rule of value pretraining: mean loss of the last `window` steps within rtol (relative to the
    window before) and mean explained variance within atol (absolute); needs 2 * window steps."""
    losses, evs, want = CONVERGED_CASES[name]
    assert value_train.converged(losses, evs, window=2, rtol=0.25, atol=0.05) is want


def test_converged_window_size_is_used():
    """window=3 over the same history: the windows [1, 1, 0.5] vs [0.5, 0.5, 0.5] differ by 25% (> rtol 0.1), while
    window=2 sees [0.5, 0.5] twice."""
    losses, evs = [1.0, 1.0, 0.5, 0.5, 0.5, 0.5], [0.0] * 6
    assert value_train.converged(losses, evs, window=2, rtol=0.1, atol=0.01) is True
    assert value_train.converged(losses, evs, window=3, rtol=0.1, atol=0.01) is False


# --------------------------------------------------------------------------------------------------------------
# make_value_step.
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def critic_params():
    return random_params(CRITIC, 1)["params"]  # random value head too: values are far from 0


def _values_full(params, tokens, attn_mask):
    return CRITIC.apply({"params": params}, tokens, position_ids(attn_mask), attn_mask)


_full_values = jit(_values_full)


def ref_values(params, batch):
    """V(s_t) for response token t from a full-sequence forward (no truncation): position P-1+t predicts token t."""
    return np.asarray(_full_values(params, batch.tokens, batch.attn_mask), np.float64)[:, P - 1:-1]


@jit
def _ref_grad(params, tokens, attn_mask, targets, weights):
    """Gradient of 0.5 * sum(w (V - T)^2) / sum(w), written from the formula on the full-sequence forward."""
    def loss(p):
        v = _values_full(p, tokens, attn_mask)[:, P - 1:-1]
        return 0.5 * jnp.sum(weights * jnp.square(v - targets)) / jnp.sum(weights)
    return jax.grad(loss)(params)


def expected_sgd_params(params, batch, targets, weights):
    """params - LR * grad: one plain SGD update on the whole batch (one minibatch: its order does not matter)."""
    g = _ref_grad(params, batch.tokens, batch.attn_mask, jnp.asarray(targets, jnp.float32),
                  jnp.asarray(weights, jnp.float32))
    return jax.tree.map(lambda p, g: np.asarray(p, np.float64) - LR * np.asarray(g, np.float64), params, g)


def assert_params_close(got, want, atol=1e-6):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=atol), got, want)


def max_param_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


@functools.lru_cache(maxsize=None)
def value_step(eos_only, gamma):
    return jit(value_train.make_value_step(CRITIC, TX, prompt_len=P, gamma=gamma, eos_only=eos_only,
                                           num_minibatches=1))


def run_step(eos_only, gamma, ro):
    state = init_model_state(critic_params(), TX)
    new_state, m = value_step(eos_only, gamma)(state, ro, jax.random.key(7))
    return new_state, jax.device_get(m)


def test_value_step_pretrain_metrics_from_initial_params_and_update():
    """Value pretraining (gamma 0.9, dense rewards): value/loss = 0.5 * token-mean (V - G)^2, value/explained_var
    and value/mean over every response token, with V from the params the step *starts* from and G the numpy
    discounted returns. The update is one SGD step down the gradient of that same loss (reference gradient from the
    formula on a full-sequence forward), so the critic is trained on these targets and weights."""
    ro = hand_rollout(seed=5, dense_rewards=True)
    mask = np.asarray(ro.response_mask)
    targets = np_mc_returns(ro.rewards, mask, 0.9)
    v0 = ref_values(critic_params(), ro)
    want_loss, want_ev, want_mean = np_value_metrics(v0, targets, mask)
    new_state, m = run_step(False, 0.9, ro)
    np.testing.assert_allclose(m["value/loss"], want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["value/explained_var"], want_ev, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m["value/mean"], want_mean, rtol=1e-5, atol=1e-6)
    assert int(new_state.step) == 1 and float(m["train/nonfinite"]) == 0
    want_params = expected_sgd_params(critic_params(), ro, targets, mask)
    assert_params_close(new_state.params, want_params)
    # Preconditions that make the checks discriminate: the update is far from zero; the same metrics at the updated
    # params (a loss measured after the update), gamma-1 targets, or EOS-only weights give clearly other numbers.
    assert max_param_diff(critic_params(), want_params) > 1e-2
    after_loss, after_ev, _ = np_value_metrics(ref_values(new_state.params, ro), targets, mask)
    assert abs(after_loss - want_loss) > 1e-3 * want_loss and abs(after_ev - want_ev) > 0.1
    undiscounted = np_mc_returns(ro.rewards, mask, 1.0)
    assert abs(np_value_metrics(v0, undiscounted, mask)[0] - want_loss) > 1e-2 * want_loss
    assert max_param_diff(expected_sgd_params(critic_params(), ro, undiscounted, mask), want_params) > 1e-4
    eos_w = np_eos_weights(RESP_LENS, R)
    assert abs(np_value_metrics(v0, targets, eos_w)[0] - want_loss) > 1e-2 * want_loss


def test_value_step_reward_model_only_last_tokens_count():
    """Reward model (eos_only): the loss, explained variance and mean use only each row's last response token, with
    the sequence reward as target and V from the initial params, and the SGD update follows the gradient of that
    loss alone. The token rewards are never read: replacing the sparse rewards by dense garbage leaves the metrics
    and the updated params exactly as they were."""
    ro = hand_rollout(seed=6)
    seq = np.asarray(ro.seq_rewards, np.float64)
    v0 = ref_values(critic_params(), ro)
    eos_w = np_eos_weights(RESP_LENS, R)
    eos_t = eos_w * seq[:, None]
    want_loss, want_ev, want_mean = np_value_metrics(v0, eos_t, eos_w)
    last_v = v0[np.arange(B), RESP_LENS - 1]  # spelled out per row
    assert want_loss == pytest.approx(0.5 * np.mean((last_v - seq) ** 2))
    new_state, m = run_step(True, 1.0, ro)
    np.testing.assert_allclose(m["value/loss"], want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["value/explained_var"], want_ev, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m["value/mean"], want_mean, rtol=1e-5, atol=1e-6)
    want_params = expected_sgd_params(critic_params(), ro, eos_t, eos_w)
    assert_params_close(new_state.params, want_params)
    # Preconditions that make the checks above discriminate: the final column, or every token of the response
    # regressed on the sequence reward (Monte-Carlo returns with sparse rewards), give clearly other losses and
    # updates; the loss at the updated params is clearly another.
    final_col = np.zeros_like(eos_w)
    final_col[:, -1] = 1.0
    assert abs(np_value_metrics(v0, final_col * seq[:, None], final_col)[0] - want_loss) > 1e-2 * want_loss
    mask = np.asarray(ro.response_mask)
    mc = np_mc_returns(ro.rewards, mask, 1.0)
    assert abs(np_value_metrics(v0, mc, mask)[0] - want_loss) > 1e-2 * want_loss
    assert max_param_diff(expected_sgd_params(critic_params(), ro, mc, mask), want_params) > 1e-4
    after = ref_values(new_state.params, ro)
    assert abs(np_value_metrics(after, eos_t, eos_w)[0] - want_loss) > 1e-2 * want_loss

    garbage = ro.replace(rewards=jnp.asarray(np.random.RandomState(9).normal(size=(B, R)).astype(np.float32)))
    state2, m2 = run_step(True, 1.0, garbage)
    for k in ("value/loss", "value/explained_var", "value/mean"):
        assert m2[k] == m[k], k
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state2.params,
                 new_state.params)


# --------------------------------------------------------------------------------------------------------------
# SFT mix: direct_fraction, use_direct_style, and the loop's choice of target.
# --------------------------------------------------------------------------------------------------------------


def sft_config(num_steps, late_steps, direct=0.2, late=0.9):
    c = config_lib.base_sft_config()
    c.num_steps, c.late_steps, c.direct_fraction, c.late_direct_fraction = num_steps, late_steps, direct, late
    return c


def test_direct_fraction_late_phase_is_the_last_late_steps():
    """100 steps, late_steps 10: steps 0..89 use direct_fraction, steps 90..99 (the last 10) late_direct_fraction;
    the boundary steps 89 / 90 exactly."""
    c = sft_config(100, 10)
    got = [sft_lib.direct_fraction(c, s) for s in range(100)]
    assert got == [0.2] * 90 + [0.9] * 10
    assert (sft_lib.direct_fraction(c, 89), sft_lib.direct_fraction(c, 90)) == (0.2, 0.9)


@pytest.mark.parametrize("num_steps,late_steps,n_late", [(100, 0, 0), (5, 1, 1), (5, 5, 5), (5, 7, 5)])
def test_direct_fraction_late_step_counts(num_steps, late_steps, n_late):
    """late_steps 0 is off (never late); 1 makes only the last step late; late_steps >= num_steps makes the whole run
    late (config.py)."""
    c = sft_config(num_steps, late_steps)
    got = [sft_lib.direct_fraction(c, s) for s in range(num_steps)]
    assert got == [0.2] * (num_steps - n_late) + [0.9] * n_late


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 0.7, 1.0])
def test_use_direct_style_share(fraction):
    """Over many record indices (a contiguous range and a random sample of a large dataset, two seeds) the direct
    share is the requested fraction within 4 binomial standard deviations; 0 and 1 are exact."""
    rng = np.random.default_rng(0)
    n = 20000
    for indices in (np.arange(n), rng.choice(1_000_000, size=n, replace=False)):
        for seed in (0, 17):
            share = sft_lib.use_direct_style(indices, seed, fraction).mean()
            tol = 4 * np.sqrt(fraction * (1 - fraction) / n)
            assert abs(share - fraction) <= tol, (share, fraction, seed)


def test_use_direct_style_is_a_fixed_choice_per_record_and_seed():
    """The choice depends on (record index, seed) only: the same under repeated calls, in any order or batch
    composition (each index alone gives its batch value), and another seed gives another selection."""
    idx = np.random.default_rng(1).choice(100_000, size=500, replace=False)
    a = sft_lib.use_direct_style(idx, 3, 0.4)
    assert a.dtype == bool and a.shape == idx.shape
    np.testing.assert_array_equal(sft_lib.use_direct_style(idx, 3, 0.4), a)
    perm = np.random.default_rng(2).permutation(len(idx))
    np.testing.assert_array_equal(sft_lib.use_direct_style(idx[perm], 3, 0.4), a[perm])
    singles = np.array([sft_lib.use_direct_style(np.array([i]), 3, 0.4)[0] for i in idx[:50]])
    np.testing.assert_array_equal(singles, a[:50])
    # Another seed, another selection (only partly: the seed shifts the hash by 97 of its 10007 buckets per unit).
    assert (sft_lib.use_direct_style(idx, 4, 0.4) != a).any()


class _NoCheckpoints:
    """A fresh workdir that keeps nothing (orbax's first save costs seconds and is not what is pinned here)."""

    def latest_step(self):
        return None

    def save(self, *args, **kwargs):
        pass

    def wait(self):
        pass

    def close(self):
        pass


def test_sft_loop_picks_each_records_target_by_phase(tmp_path, monkeypatch):
    """The SFT loop itself: 6 steps of batch 8 over 12 records (each record comes back at other batch positions in
    later epochs), direct_fraction 0.5 on steps 0-3, late_direct_fraction 1 on the last 2 steps. Every target is
    its own record's CoT or direct text; on the late steps 4-5 it is always the direct one (a record without a
    direct form falls back to its CoT); on the main steps the choice is a fixed property of the record (the same at
    each of its appearances, whatever the batch position) and both styles occur. Training, evaluation and
    checkpoints are stubbed out: this pins only which text reaches `encode_sft` at which step."""
    n_records, num_steps, late_steps = 12, 6, 2
    examples = [dict(prompt=f"{i}+0=?", answer=str(i), cot=f"{i}+0={i}\nAnswer: {i}", direct=f"Answer: {i}")
                for i in range(n_records)]
    del examples[5]["direct"]  # no direct form: always the CoT
    source = RecordSource(examples, transform=dict)
    by_prompt = {e["prompt"]: e for e in examples}

    seen = []  # per step: [(prompt, target)]
    real_encode = sft_lib.encode_sft

    def recording_encode(tok, prompts, targets, *args, **kwargs):
        seen.append(list(zip(prompts, targets)))
        return real_encode(tok, prompts, targets, *args, **kwargs)

    monkeypatch.setattr(sft_lib.builders, "task_source", lambda config, split: source)
    monkeypatch.setattr(sft_lib, "encode_sft", recording_encode)
    monkeypatch.setattr(sft_lib, "train_epochs", lambda s, b, *a, **k: (s, {"train/nonfinite": jnp.zeros(())}))
    monkeypatch.setattr(sft_lib, "evaluate", lambda *a, **k: {})
    monkeypatch.setattr(sft_lib.rt_lib, "checkpointer", lambda config: _NoCheckpoints())

    c = sft_config(num_steps, late_steps, direct=0.5, late=1.0)
    c.workdir = str(tmp_path / "sft")
    c.batch_size = 8
    c.model = ml_collections.ConfigDict(dict(c.model.to_dict(), hidden_size=16, intermediate_size=32, num_layers=1,
                                             num_heads=2, num_kv_heads=1, max_position_embeddings=64))
    c.task.update(max_prompt_len=8, max_response_len=16)
    c.update(dict(eval_every=100, save_every=100, eval_prompts=8, progress_bar=False, tensorboard=False))
    sft_lib.run_sft(c)

    assert len(seen) == num_steps and all(len(pairs) == 8 for pairs in seen)
    main_style = {}  # prompt -> set of styles seen on the main steps
    for step, pairs in enumerate(seen):
        for prompt, target in pairs:
            rec = by_prompt[prompt]
            assert target in (rec["cot"], rec.get("direct")), (step, prompt, target)  # its own record's text
            if step >= num_steps - late_steps:
                assert target == rec.get("direct", rec["cot"]), (step, prompt, target)
            else:
                main_style.setdefault(prompt, set()).add(target == rec.get("direct"))
    assert all(len(styles) == 1 for styles in main_style.values()), main_style
    assert main_style[examples[5]["prompt"]] == {False}
    assert {s for styles in main_style.values() for s in styles} == {False, True}
    # Preconditions: records did come back on the main steps, and the late steps saw the record without a direct form.
    main_counts = [p for pairs in seen[:num_steps - late_steps] for p, _ in pairs]
    assert len(main_counts) - len(set(main_counts)) >= 8
    assert examples[5]["prompt"] in {p for pairs in seen[num_steps - late_steps:] for p, _ in pairs}


def test_sft_loop_trains_on_batches_trimmed_to_pad_to_multiple(monkeypatch, tmp_path):
    """`pad_to_multiple = 4`: each step's batch reaching the (jitted) update has the encoded batch's longest prompt and
    response, each rounded up to a multiple of 4 (`trim_sft_padding`'s own test pins which columns it keeps)."""
    examples = [dict(prompt=f"{i}+0=?", answer=str(i), cot=f"{i}+0={i}\nAnswer: {i}") for i in range(12)]
    encoded, trained = [], []
    real_encode = sft_lib.encode_sft

    def recording_encode(*args, **kwargs):
        encoded.append(real_encode(*args, **kwargs))
        return encoded[-1]

    def recording_update(state, batch, *args, **kwargs):
        trained.append({k: v.shape for k, v in batch.items()})  # traced (once per shape): shapes only
        return state, {"train/nonfinite": jnp.zeros(())}

    monkeypatch.setattr(sft_lib.builders, "task_source", lambda config, split: RecordSource(examples, transform=dict))
    monkeypatch.setattr(sft_lib, "encode_sft", recording_encode)
    monkeypatch.setattr(sft_lib, "train_epochs", recording_update)
    monkeypatch.setattr(sft_lib, "evaluate", lambda *a, **k: {})
    monkeypatch.setattr(sft_lib.rt_lib, "checkpointer", lambda config: _NoCheckpoints())
    c = sft_config(3, 0)
    c.update(dict(workdir=str(tmp_path / "sft"), batch_size=8, pad_to_multiple=4, eval_every=100, save_every=100,
                  eval_prompts=8, progress_bar=False, tensorboard=False))
    c.model = ml_collections.ConfigDict(dict(c.model.to_dict(), hidden_size=16, intermediate_size=32, num_layers=1,
                                             num_heads=2, num_kv_heads=1, max_position_embeddings=64))
    c.task.update(max_prompt_len=16, max_response_len=32)
    sft_lib.run_sft(c)

    want = []
    for full in encoded:
        p, r = full["prompt_mask"].sum(1).max(), full["response_mask"].sum(1).max()
        p_keep, r_keep = -(-p // 4) * 4, -(-r // 4) * 4
        assert p_keep < 16 and r_keep < 32  # trimmed
        want.append({"tokens": (8, p_keep + r_keep), "attn_mask": (8, p_keep + r_keep), "response_mask": (8, r_keep)})
    assert len(encoded) == 3
    # The update is traced once per distinct batch shape: exactly the trimmed shapes of the encoded batches.
    as_key = lambda shapes: tuple(sorted((k, tuple(map(int, v))) for k, v in shapes.items()))  # noqa: E731
    assert sorted(map(as_key, trained)) == sorted(set(map(as_key, want)))
