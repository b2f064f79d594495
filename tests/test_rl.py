"""The shared RL step: position alignment, decoupled-GAE wiring, PPO/GRPO updates, non-finite skipping."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vcppo_jax import config as config_lib
from vcppo_jax import gae as gae_lib
from vcppo_jax import losses
from vcppo_jax import rl
from vcppo_jax import rollout as rollout_lib
from testutil import random_params
from vcppo_jax.models import CausalLM, ModelConfig, ValueModel, position_ids
from vcppo_jax.optim import init_model_state
from vcppo_jax.sampling import make_sampler

B, P, R, V = 8, 4, 6, 32
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  tie_embeddings=True)
ACTOR, CRITIC = CausalLM(CFG), ValueModel(CFG)


@pytest.fixture(scope="module")
def nets():
    return random_params(ACTOR, 0)["params"], random_params(CRITIC, 1)["params"]


def make_rollout(seed=0):
    rs = np.random.RandomState(seed)
    prompt_len = rs.randint(1, P + 1, size=B)
    resp_len = rs.randint(1, R + 1, size=B)
    prompt_mask = np.arange(P)[None, :] >= (P - prompt_len)[:, None]
    resp_mask = np.arange(R)[None, :] < resp_len[:, None]
    tokens = rs.randint(1, V, size=(B, P + R)) * np.concatenate([prompt_mask, resp_mask], 1)
    seq_rewards = np.where(rs.rand(B) > 0.5, 1.0, -1.0).astype(np.float32)
    rewards = np.zeros((B, R), np.float32)
    rewards[np.arange(B), resp_len - 1] = seq_rewards
    attn_mask = np.concatenate([prompt_mask, resp_mask], 1)
    return rl.Rollout(tokens=jnp.asarray(tokens, jnp.int32), attn_mask=jnp.asarray(attn_mask),
                      response_mask=jnp.asarray(resp_mask, jnp.float32), rewards=jnp.asarray(rewards),
                      seq_rewards=jnp.asarray(seq_rewards))


def hparams(algorithm="vcppo", **overrides) -> rl.RLHparams:
    c = config_lib.base_rl_config(algorithm)
    c.task.max_prompt_len = P
    c.task.max_response_len = R
    c.prompts_per_step, c.group_size, c.num_minibatches = B // 2, 2, 2
    c.logprob_chunk = 4
    c.diag_buckets = 3
    c.diag_early_tokens = 2
    if algorithm == "grpo":
        c.advantage = "group"
    for k, v in overrides.items():
        c[k] = v
    config_lib.validate(c)
    return rl.RLHparams.from_config(c)


TX = optax.adam(1e-3)
logprobs_fn = jax.jit(rl.policy_logprobs, static_argnums=0, static_argnames=("prompt_len", "chunk"))
values_fn = jax.jit(rl.critic_values, static_argnums=0, static_argnames=("prompt_len",))


@functools.lru_cache
def compiled(hp: rl.RLHparams):
    """One compile of (make_experience, update) per hyper-parameter set, shared by the tests."""
    critic = CRITIC if hp.has_critic else None
    return (jax.jit(rl.make_experience_fn(hp, ACTOR, critic)),
            jax.jit(chex.assert_max_traces(rl.make_update_fn(hp, ACTOR, critic, TX, TX if critic else None), n=1)))


UPDATE_HP = dict(num_epochs=2)


def make_state(nets, hp, tx=TX):
    actor_p, critic_p = nets
    critic = init_model_state(critic_p, tx) if hp.has_critic else None
    return rl.RLState(actor=init_model_state(actor_p, tx), critic=critic, ref_params=None,
                      rng=jax.random.key(3), step=jnp.zeros((), jnp.int32)), tx


def test_logprobs_and_values_align_with_full_forward(nets):
    """Response token t is scored from full position P-1+t, by both the actor and the critic."""
    actor_p, critic_p = nets
    ro = make_rollout()
    tokens, mask = ro.tokens, ro.attn_mask
    hidden, _ = ACTOR.apply({"params": actor_p}, tokens, position_ids(mask), mask)
    logits = ACTOR.apply({"params": actor_p}, hidden, method=CausalLM.logits)
    logp_full = jax.nn.log_softmax(logits, -1)
    want = np.take_along_axis(np.asarray(logp_full[:, P - 1:-1]), np.asarray(tokens[:, P:])[..., None], -1)[..., 0]
    got, _ = logprobs_fn(ACTOR, actor_p, tokens, mask, prompt_len=P, chunk=4)
    valid = np.asarray(ro.response_mask) > 0
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], atol=1e-5)

    values_full = CRITIC.apply({"params": critic_p}, tokens, position_ids(mask), mask)
    got_v = values_fn(CRITIC, critic_p, tokens, mask, prompt_len=P)
    np.testing.assert_allclose(np.asarray(got_v)[valid], np.asarray(values_full[:, P - 1:-1])[valid], atol=1e-5)


def test_experience_decoupled_gae(nets):
    """lambda_critic = 1, gamma = 1: value targets are the Monte-Carlo return (the sequence reward) at every token;
    advantages are GAE(lambda_actor) of the same values (before whitening)."""
    hp = hparams(whiten_advantages=False, lambda_actor=0.9)
    state, _ = make_state(nets, hp)
    ro = make_rollout()
    exp, m = compiled(hp)[0](state, ro)
    mask = np.asarray(ro.response_mask)
    want_returns = np.asarray(ro.seq_rewards)[:, None] * mask
    np.testing.assert_allclose(np.asarray(exp.returns), want_returns, atol=1e-5)
    want_adv, _ = gae_lib.gae(ro.rewards, exp.old_values, ro.response_mask, gamma=1.0, lam=0.9)
    np.testing.assert_allclose(np.asarray(exp.advantages), np.asarray(want_adv), atol=1e-5)
    assert "diag/value_pos00" in m and "diag/adv_early_bias" in m


def test_update_improves_objectives_and_traces_once(nets):
    hp = hparams(**UPDATE_HP)
    state, _ = make_state(nets, hp)
    ro = make_rollout()
    make_exp, update = compiled(hp)
    exp, _ = make_exp(state, ro)
    mask = exp.response_mask
    v0 = losses.value_loss(exp.old_values, exp.old_values, exp.returns, mask)[0]
    surrogate0 = float((exp.advantages * mask).sum())  # ratio == 1 before the update
    new_state, m = update(state, exp)
    assert int(new_state.step) == 1 and int(new_state.actor.step) == 2 * hp.num_minibatches
    assert float(m["train/nonfinite"]) == 0
    logp, _ = logprobs_fn(ACTOR, new_state.actor.params, exp.tokens, exp.attn_mask, prompt_len=P, chunk=4)
    surrogate1 = float((jnp.exp(logp - exp.old_logp) * exp.advantages * mask).sum())
    assert surrogate1 > surrogate0
    v1 = values_fn(CRITIC, new_state.critic.params, exp.tokens, exp.attn_mask, prompt_len=P)
    assert float(losses.value_loss(v1, exp.old_values, exp.returns, mask)[0]) < float(v0)
    update(new_state, exp)  # same shapes: no retrace (assert_max_traces would raise)


def test_update_reports_the_whole_iterations_movement(nets):
    """policy/approx_kl and policy/clipfrac compare the sampling policy with the policy after all minibatch steps,
    on every rollout token (not a mean over minibatch steps whose first is exactly on-policy)."""
    hp = hparams(**UPDATE_HP)
    state, _ = make_state(nets, hp)
    ro = make_rollout()
    make_exp, update = compiled(hp)
    exp, _ = make_exp(state, ro)
    new_state, m = update(state, exp)
    logp, _ = logprobs_fn(ACTOR, new_state.actor.params, exp.tokens, exp.attn_mask, prompt_len=P, chunk=4,
                          temperature=hp.temperature)
    valid = np.asarray(exp.response_mask) > 0
    log_ratio = (np.asarray(logp) - np.asarray(exp.old_logp))[valid]
    ratio = np.exp(log_ratio)
    np.testing.assert_allclose(float(m["policy/approx_kl"]), np.mean(ratio - 1 - log_ratio), rtol=1e-4, atol=1e-7)
    outside = (ratio < 1 - hp.clip_low) | (ratio > 1 + hp.clip_high)
    np.testing.assert_allclose(float(m["policy/clipfrac"]), outside.mean(), atol=1e-6)
    np.testing.assert_allclose(float(m["policy/ratio_max"]), ratio.max(), rtol=1e-5)
    assert float(m["policy/approx_kl"]) > 0 and "policy/mb_approx_kl" in m


def test_grpo_group_advantages(nets):
    hp = hparams("grpo")
    state, tx = make_state(nets, hp)
    ro = make_rollout()
    make_exp, update = compiled(hp)
    exp, _ = make_exp(state, ro)
    seq = np.asarray(ro.seq_rewards).reshape(-1, 2)
    want = (seq - seq.mean(1, keepdims=True)) / (seq.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(exp.advantages), want.reshape(-1, 1) * np.asarray(ro.response_mask),
                               atol=1e-4)
    new_state, m = update(state, exp)
    assert new_state.critic is None and np.isfinite(float(m["policy/loss"]))


def test_nonfinite_update_is_skipped(nets):
    hp = hparams(**UPDATE_HP)
    state, _ = make_state(nets, hp)
    ro = make_rollout()
    make_exp, update = compiled(hp)
    exp, _ = make_exp(state, ro)
    exp = exp.replace(advantages=exp.advantages.at[0, 0].set(jnp.nan), returns=exp.returns.at[0, 0].set(jnp.inf),
                      response_mask=exp.response_mask.at[0, 0].set(1.0))
    new_state, m = update(state, exp)
    # In each epoch the minibatch holding row 0 is skipped for both nets; the other minibatches still update.
    assert float(m["train/nonfinite"]) == 2 * hp.num_epochs  # one skipped step per epoch for each network
    assert int(new_state.actor.step) == int(new_state.critic.step) == hp.num_epochs * (hp.num_minibatches - 1)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_state.actor.params))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_state.critic.params))


@pytest.mark.parametrize("algorithm", ["vcppo", "grpo"])
def test_rl_loop_learns_a_bandit(nets, algorithm):
    """End to end through the real sampler, `to_rollout`, experience and update: reward +1 when the first response
    token is one of 8 'good' ids (of 32), else -1. A correct policy-gradient sign and token alignment must drive the
    policy's probability of a good first token from ~0.2 to near 1; a flipped sign or an off-by-one drives it down
    or leaves it at chance."""
    good, iters = 8, 30
    hp = hparams(algorithm, num_epochs=1)
    tx = optax.adam(3e-3)
    critic = CRITIC if hp.has_critic else None
    state, _ = make_state(nets, hp, tx)
    make_exp = jax.jit(rl.make_experience_fn(hp, ACTOR, critic))
    update = jax.jit(rl.make_update_fn(hp, ACTOR, critic, tx, tx if critic else None))
    sampler = make_sampler(ACTOR, max_new_tokens=R, eos_id=None, pad_id=0)
    prompt_mask = np.tile(np.array([[0, 1, 1, 1]], np.int32), (B, 1))  # left-padded, as the data pipeline does
    prompt = np.tile(np.array([[0, 5, 9, 3]], np.int32), (B, 1))

    def p_good(params) -> float:
        hidden, _ = ACTOR.apply({"params": params}, prompt[:1], position_ids(prompt_mask[:1]), prompt_mask[:1])
        logits = ACTOR.apply({"params": params}, hidden[:, -1], method=CausalLM.logits)
        return float(jax.nn.softmax(logits, -1)[0, :good].sum())

    p0 = p_good(state.actor.params)
    for i in range(iters):
        out = jax.device_get(sampler(state.actor.params, prompt, prompt_mask, jax.random.key(100 + i)))
        seq_rewards = np.where(np.asarray(out.tokens)[:, P] < good, 1.0, -1.0).astype(np.float32)
        experience, _ = make_exp(state, rollout_lib.to_rollout(out, prompt_mask, seq_rewards))
        state, _ = update(state, experience)
    assert p0 < 0.3 and p_good(state.actor.params) > 0.9, (p0, p_good(state.actor.params))
