"""Wiring of the RL step: which log-probs, values, rewards and params flow into experience, losses and updates.

Each test compares the real entry point (`rl.make_experience_fn`, `rl.actor_loss_fn`, `rl.critic_loss_fn`,
`rl.make_update_fn`, `sft.sft_loss_fn`, the sampler) with an independent reference: numpy written from the formula,
fed with log-probs / values from a plain full-sequence forward pass (not the chunked `policy_logprobs` path), or a
hand-built batch with known answers. Host-side plumbing (rollout layout, prompt batches, evaluation, optimizer
loops) is in test_wiring_loops.py.

Compiles are the cost here (2 shared CPU cores): one tiny model, one batch shape [B, P+R] everywhere, every jitted
function built once per hyper-parameter set (`functools.lru_cache`) and compiled without XLA's backend optimizations
(`jit`: same results, about half the compile time).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from testutil import random_params
from vcppo_jax import config as config_lib
from vcppo_jax import rl
from vcppo_jax import rollout as rollout_lib
from vcppo_jax.models import CausalLM, ModelConfig, ValueModel, position_ids
from vcppo_jax.optim import init_model_state
from vcppo_jax.sampling import make_sampler
from vcppo_jax.sft import sft_loss_fn

B, P, R, V = 8, 4, 6, 32
G = 4  # GRPO group size: two groups of four.
TEMP = 0.7  # the sampling temperature every hparams set below uses (config default, set explicitly)
CHUNK = 4  # < R: the log-prob path runs two chunks, the second one padded.
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  tie_embeddings=True)
ACTOR, CRITIC = CausalLM(CFG), ValueModel(CFG)
TX = optax.adam(1e-2)
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# Response lengths cover 1 and the full R; prompt lengths cover 1 and the full P.
RESP_LENS = np.array([1, R, 3, 2, R, 4, 5, 1])
PROMPT_LENS = np.array([1, P, 2, 3, P, 1, 2, 4])


# --------------------------------------------------------------------------------------------------------------
# Shared params, compiled functions and numpy references.
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def actor_params():
    return random_params(ACTOR, 0)["params"]


@functools.lru_cache(maxsize=None)
def ref_params():
    """A different policy (not a copy of the actor), so every KL term is clearly nonzero."""
    return random_params(ACTOR, 10)["params"]


@functools.lru_cache(maxsize=None)
def critic_params():
    return random_params(CRITIC, 1)["params"]  # random value head too: values are far from 0


@jit
def _full_logits(params, tokens, attn_mask):
    """Plain forward over the whole sequence (no chunking, last token included): fp32 logits [B, T, V]."""
    hidden, _ = ACTOR.apply({"params": params}, tokens, position_ids(attn_mask), attn_mask)
    return ACTOR.apply({"params": params}, hidden, method=CausalLM.logits)


@jit
def _full_values(params, tokens, attn_mask):
    return CRITIC.apply({"params": params}, tokens, position_ids(attn_mask), attn_mask)


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ref_response_logp(params, batch, temperature):
    """(logp [B, R], entropy [B, R]) of the response tokens at `temperature`, numpy float64 from full logits:
    full position P-1+t predicts response token t."""
    logits = np.asarray(_full_logits(params, batch.tokens, batch.attn_mask), np.float64)
    logq = np_log_softmax(logits[:, P - 1:-1] / temperature)
    targets = np.asarray(batch.tokens)[:, P:]
    logp = np.take_along_axis(logq, targets[..., None], -1)[..., 0]
    entropy = -(np.exp(logq) * logq).sum(-1)
    return logp, entropy


def ref_values(params, batch):
    return np.asarray(_full_values(params, batch.tokens, batch.attn_mask), np.float64)[:, P - 1:-1]


def np_aggregate(x, mask, mode):
    x, mask = np.asarray(x, np.float64), np.asarray(mask, np.float64)
    if mode == "token-mean":
        return (x * mask).sum() / max(mask.sum(), 1.0)
    lengths = mask.sum(1)
    per_seq = (x * mask).sum(1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / np.maximum(lengths, 1.0)
    assert mode in ("seq-mean-token-mean", "seq-mean-token-sum"), mode
    rows = lengths > 0
    return per_seq[rows].mean() if rows.any() else 0.0


def np_kl(logp, ref, kind):
    d = logp - ref
    return {"k1": d, "k2": 0.5 * d ** 2, "k3": np.exp(-d) + d - 1.0}[kind]  # k3 = exp(ref-logp) - (ref-logp) - 1


def np_policy_loss_per_token(logp, old_logp, adv, clip_low, clip_high, dual_clip):
    ratio = np.exp(logp - old_logp)
    per = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high))
    if dual_clip:
        per = np.where(adv < 0, np.minimum(per, -adv * dual_clip), per)
    return per


def np_gae(rewards, values, mask, gamma, lam):
    """Reverse loop straight from the definition (right-padded rows):
    delta_t = r_t + gamma V_{t+1} m_{t+1} - V_t;  A_t = (delta_t + gamma lam A_{t+1}) m_t."""
    rewards, values, mask = (np.asarray(x, np.float64) for x in (rewards, values, mask))
    batch, time = rewards.shape
    adv = np.zeros((batch, time))
    for b in range(batch):
        for t in reversed(range(time)):
            v_next = values[b, t + 1] * mask[b, t + 1] if t + 1 < time else 0.0
            a_next = adv[b, t + 1] if t + 1 < time else 0.0
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            adv[b, t] = (delta + gamma * lam * a_next) * mask[b, t]
    return adv


def np_whiten(x, mask):
    valid = np.asarray(mask) > 0
    mean = x[valid].mean()
    var = ((x[valid] - mean) ** 2).mean()
    return np.where(valid, (x - mean) / np.sqrt(var + 1e-8), 0.0)


def hparams(algorithm="vcppo", **overrides) -> rl.RLHparams:
    c = config_lib.base_rl_config(algorithm)
    c.task.max_prompt_len, c.task.max_response_len = P, R
    c.prompts_per_step, c.group_size = B // G, G
    c.num_epochs, c.num_minibatches = 1, 1
    c.logprob_chunk = CHUNK
    c.diag_buckets, c.diag_early_tokens = 2, 2
    c.sampling.temperature = TEMP
    if algorithm == "grpo":
        c.advantage = "group"
    for k, v in overrides.items():
        c[k] = v
    config_lib.validate(c)
    return rl.RLHparams.from_config(c)


@functools.lru_cache(maxsize=None)
def experience_fn(hp):
    return jit(rl.make_experience_fn(hp, ACTOR, CRITIC if hp.has_critic else None))


@functools.lru_cache(maxsize=None)
def update_fn(hp):
    critic = CRITIC if hp.has_critic else None
    return jit(rl.make_update_fn(hp, ACTOR, critic, TX, TX if critic else None))


@functools.lru_cache(maxsize=None)
def critic_loss(hp):
    return jit(rl.critic_loss_fn(hp, CRITIC))


def make_state(hp, with_ref):
    critic = init_model_state(critic_params(), TX) if hp.has_critic else None
    return rl.RLState(actor=init_model_state(actor_params(), TX), critic=critic,
                      ref_params=ref_params() if with_ref else None, rng=jax.random.key(3),
                      step=jnp.zeros((), jnp.int32))


def as_batch(ro):
    """A rollout as the jitted experience functions get it (fixed keys and dtypes: one compile per hparams)."""
    return rl.Rollout(tokens=jnp.asarray(ro.tokens, jnp.int32), attn_mask=jnp.asarray(ro.attn_mask, bool),
                      response_mask=jnp.asarray(ro.response_mask, jnp.float32),
                      rewards=jnp.asarray(ro.rewards, jnp.float32),
                      seq_rewards=jnp.asarray(ro.seq_rewards, jnp.float32))


def experience(ro, **fields):
    """An `rl.Experience` on `ro`'s tokens and masks: the given fields, zeros for the ones a loss does not read."""
    zeros = jnp.zeros_like(ro.response_mask)
    base = dict(old_logp=zeros, ref_logp=zeros, old_values=zeros, advantages=zeros, returns=zeros,
                positive=jnp.zeros_like(ro.seq_rewards))
    return rl.Experience(tokens=ro.tokens, attn_mask=ro.attn_mask, response_mask=ro.response_mask,
                         **{**base, **fields})


def hand_rollout(seed=0, seq_rewards=None, dense_rewards=False):
    """Left-padded prompts, right-padded responses of RESP_LENS; garbage token ids on every padding position (the
    masks alone must keep them out). Rewards: the sequence reward at each last token, plus (dense_rewards) random
    per-token rewards on the other valid tokens."""
    rs = np.random.RandomState(seed)
    prompt_mask = np.arange(P)[None, :] >= (P - PROMPT_LENS)[:, None]
    resp_mask = np.arange(R)[None, :] < RESP_LENS[:, None]
    tokens = rs.randint(1, V, size=(B, P + R))
    if seq_rewards is None:
        seq_rewards = rs.normal(size=B).round(2)
    seq_rewards = np.asarray(seq_rewards, np.float32)
    rewards = np.zeros((B, R), np.float32)
    if dense_rewards:
        rewards = (rs.normal(scale=0.3, size=(B, R)) * resp_mask).astype(np.float32)
    rewards[np.arange(B), RESP_LENS - 1] = seq_rewards
    return as_batch(rl.Rollout(tokens=tokens, attn_mask=np.concatenate([prompt_mask, resp_mask], 1),
                               response_mask=resp_mask, rewards=rewards, seq_rewards=seq_rewards))


# The hyper-parameter sets (each compiles its own experience function once).
HP_GAE = dict(whiten_advantages=False, lambda_actor=0.9, lambda_critic=0.95, gamma=0.9)
HP_KL_REWARD = dict(kl_coef=0.5, kl_estimator="k1", kl_in_reward=True, whiten_advantages=True, lambda_actor=0.9,
                    lambda_critic=1.0, gamma=1.0)
HP_GRPO = dict(kl_coef=0.1, kl_estimator="k3")


# --------------------------------------------------------------------------------------------------------------
# Sampler <-> trainer: the PPO ratio's old log-probs are the sampler's (same tempered distribution).
# --------------------------------------------------------------------------------------------------------------


def test_trainer_logprobs_match_sampler_at_config_temperature():
    hp = hparams(**HP_GAE)
    assert hp.temperature == TEMP
    params = actor_params()
    prompt_mask = (np.arange(P)[None, :] >= (P - PROMPT_LENS)[:, None]).astype(np.int32)
    prompt = np.where(prompt_mask, np.random.RandomState(5).randint(1, V, size=(B, P)), 0).astype(np.int32)
    # EOS = the most likely first response token, so several rows stop early and the masks matter.
    probe = jnp.concatenate([prompt, jnp.zeros((B, R), jnp.int32)], 1)
    probe_mask = jnp.concatenate([prompt_mask > 0, jnp.zeros((B, R), bool)], 1)
    first = np.asarray(_full_logits(params, probe, probe_mask))[:, P - 1, 1:]
    eos = 1 + int(np.exp(np_log_softmax(first / TEMP)).mean(0).argmax())
    sampler = make_sampler(ACTOR, max_new_tokens=R, eos_id=eos, pad_id=0, temperature=TEMP)
    # The sampler's own jitted function (`fn.__wrapped__`), compiled like the rest of this file.
    out = jax.device_get(jit(sampler.__wrapped__)(params, prompt, prompt_mask, jax.random.key(11)))
    lengths = np.asarray(out.lengths)
    assert lengths.min() < R, lengths  # precondition: some row ended early

    ro = rollout_lib.to_rollout(out, prompt_mask, np.linspace(-1, 1, B).astype(np.float32))
    np.testing.assert_array_equal(ro.sample_logp, np.asarray(out.logprobs))
    valid = np.asarray(out.response_mask) > 0
    np.testing.assert_array_equal(valid.sum(1), lengths)
    sampled = np.asarray(out.logprobs)[valid]

    # The independent full-forward reference agrees with the sampler at TEMP and visibly not at temperature 1,
    # so the comparisons below can tell the two temperatures apart.
    batch = as_batch(ro)
    want, _ = ref_response_logp(params, batch, TEMP)
    np.testing.assert_allclose(want[valid], sampled, atol=1e-4)
    at_one, _ = ref_response_logp(params, batch, 1.0)
    assert np.abs(at_one[valid] - sampled).max() > 1e-2

    exp, _ = experience_fn(hp)(make_state(hp, with_ref=False), batch)
    np.testing.assert_allclose(np.asarray(exp.old_logp)[valid], sampled, atol=1e-4)
    # With the sampler's log-probs attached, the experience reports how far they are from the trainer's.
    for shift in (0.0, 0.25):
        with_logp = batch.replace(sample_logp=jnp.asarray(out.logprobs + shift * np.asarray(out.response_mask)))
        _, m = experience_fn(hp)(make_state(hp, with_ref=False), with_logp)
        np.testing.assert_allclose(float(m["rollout/sampler_logp_gap"]), shift, atol=1e-4)
    logp_fn = jit(functools.partial(rl.policy_logprobs, ACTOR, prompt_len=P, chunk=CHUNK,
                                    temperature=hp.temperature))
    logp, _ = logp_fn(params, batch.tokens, batch.attn_mask)
    np.testing.assert_allclose(np.asarray(logp)[valid], sampled, atol=1e-4)


# --------------------------------------------------------------------------------------------------------------
# make_experience: values, decoupled GAE, KL-shaped rewards, whitening, GRPO groups.
# --------------------------------------------------------------------------------------------------------------


def test_experience_decoupled_gae_against_numpy_loop():
    """gamma 0.9, lambda_actor 0.9, lambda_critic 0.95, dense rewards: advantages = GAE(0.9) and returns =
    GAE(0.95) + V of the critic's own values (whitening off)."""
    hp = hparams(**HP_GAE)
    ro = hand_rollout(seed=1, dense_rewards=True)
    exp, m = experience_fn(hp)(make_state(hp, with_ref=False), ro)
    mask = np.asarray(ro.response_mask)
    values = ref_values(critic_params(), ro) * mask
    np.testing.assert_allclose(np.asarray(exp.old_values), values, atol=1e-5)
    rewards = np.asarray(ro.rewards)
    np.testing.assert_allclose(np.asarray(exp.advantages), np_gae(rewards, values, mask, 0.9, 0.9), atol=1e-5)
    want_returns = (np_gae(rewards, values, mask, 0.9, 0.95) + values) * mask
    np.testing.assert_allclose(np.asarray(exp.returns), want_returns, atol=1e-5)
    # The two lambdas really differ on this batch (a swapped or shared lambda would fail above).
    assert np.abs(np_gae(rewards, values, mask, 0.9, 0.9) - np_gae(rewards, values, mask, 0.9, 0.95)).max() > 1e-3
    # No KL term (kl_coef 0, no ref params): ref_logp is the old policy's, old_logp the actor's at TEMP.
    logp, _ = ref_response_logp(actor_params(), ro, TEMP)
    valid = mask > 0
    np.testing.assert_allclose(np.asarray(exp.old_logp)[valid], logp[valid], atol=1e-5)
    np.testing.assert_allclose(np.asarray(exp.ref_logp)[valid], logp[valid], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(exp.positive), (np.asarray(ro.seq_rewards) > 0).astype(np.float32))
    np.testing.assert_allclose(float(m["adv/mean"]), np_gae(rewards, values, mask, 0.9, 0.9)[valid].mean(),
                               rtol=1e-4, atol=1e-6)


def test_experience_in_minibatches_equals_one_pass():
    """The full-batch forward passes (old / reference log-probs, values) run num_minibatches slices one after another;
    the experience is the one-pass experience, row for row."""
    one, four = hparams("vcppo", kl_coef=0.1), hparams("vcppo", kl_coef=0.1, num_minibatches=4)
    state = make_state(one, with_ref=True)
    ro = hand_rollout(seed=5)
    exp1, m1 = experience_fn(one)(state, ro)
    exp4, m4 = experience_fn(four)(state, ro)
    for k in vars(exp1):
        np.testing.assert_allclose(np.asarray(getattr(exp4, k)), np.asarray(getattr(exp1, k)), atol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(m4["rollout/entropy"]), float(m1["rollout/entropy"]), rtol=1e-6)


def test_experience_kl_in_reward_and_whitening():
    """kl_in_reward with k1, gamma = lambda_critic = 1: returns are the reverse cumulative sum of the KL-shaped rewards
    r_t - kl_coef * (logp_t - ref_logp_t); advantages (critic algorithm, whitening on) are the whitened GAE(0.9) of
    the same shaped rewards: mean 0, std 1 over valid tokens, 0 on padding."""
    hp = hparams(**HP_KL_REWARD)
    ro = hand_rollout(seed=2, dense_rewards=True)
    exp, m = experience_fn(hp)(make_state(hp, with_ref=True), ro)
    mask = np.asarray(ro.response_mask)
    valid = mask > 0
    logp, _ = ref_response_logp(actor_params(), ro, TEMP)
    ref, _ = ref_response_logp(ref_params(), ro, TEMP)
    np.testing.assert_allclose(np.asarray(exp.old_logp)[valid], logp[valid], atol=1e-5)
    np.testing.assert_allclose(np.asarray(exp.ref_logp)[valid], ref[valid], atol=1e-5)
    kl = np.where(valid, logp - ref, 0.0)
    np.testing.assert_allclose(float(m["rollout/kl_to_ref"]), kl.sum() / mask.sum(), rtol=1e-4, atol=1e-6)

    shaped = (np.asarray(ro.rewards) - 0.5 * kl) * mask
    want_returns = np.cumsum(shaped[:, ::-1], axis=1)[:, ::-1] * mask
    assert np.abs(want_returns - np.cumsum(np.asarray(ro.rewards)[:, ::-1], 1)[:, ::-1] * mask).max() > 0.05
    np.testing.assert_allclose(np.asarray(exp.returns), want_returns, atol=1e-4)
    values = ref_values(critic_params(), ro) * mask
    np.testing.assert_allclose(np.asarray(exp.returns), (np_gae(shaped, values, mask, 1.0, 1.0) + values) * mask,
                               atol=1e-4)

    raw = np_gae(shaped, values, mask, 1.0, 0.9)
    adv = np.asarray(exp.advantages)
    np.testing.assert_allclose(adv, np_whiten(raw, mask), atol=1e-4)
    np.testing.assert_allclose(adv[valid].mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(adv[valid].std(), 1.0, atol=1e-4)
    assert (adv[~valid] == 0).all()
    # Metrics report the advantages before whitening.
    np.testing.assert_allclose(float(m["adv/mean"]), raw[valid].mean(), rtol=1e-4, atol=1e-5)
    # The critic's calibration error is against the Monte-Carlo return of the task reward, not the KL-shaped one.
    task_returns = np.cumsum((np.asarray(ro.rewards) * mask)[:, ::-1], axis=1)[:, ::-1]
    first = valid[:, 0]
    np.testing.assert_allclose(float(m["diag/value_err_first"]),
                               (values[first, 0] - task_returns[first, 0]).mean(), rtol=1e-4, atol=1e-5)
    shaped_first = (values[first, 0] - want_returns[first, 0]).mean()
    assert abs(shaped_first - float(m["diag/value_err_first"])) > 1e-3
    # The collapse signal reads the same advantages (whitening does not change a correlation).
    seq = np.asarray(ro.seq_rewards)
    lengths = mask.sum(1)
    a0, n = raw[:, 0].astype(np.float64), lengths.astype(np.float64)
    rows = lengths > 0
    a0, n, won = a0[rows], n[rows], seq[rows] > 0
    for cls in (won, ~won):
        if cls.any():
            a0[cls] -= a0[cls].mean()
            n[cls] -= n[cls].mean()
    np.testing.assert_allclose(float(m["diag/adv_length_corr"]), (a0 * n).sum() / np.sqrt((a0 ** 2).sum() *
                                                                                         (n ** 2).sum()), atol=1e-4)


def test_experience_grpo_group_advantages():
    """Two consecutive groups of 4 with known rewards; (r - mean) / (std_ddof1 + 1e-6) per group, constant over each
    row's tokens, 0 on padding, and not whitened (GRPO has no critic) even though whiten_advantages is on."""
    hp = hparams("grpo", **HP_GRPO)
    assert hp.whiten_advantages and not hp.has_critic
    seq = np.array([1.0, -1.0, -1.0, 1.0, 2.0, 0.0, 0.0, 0.0], np.float32)
    known = np.array([3 ** 0.5 / 2, -(3 ** 0.5) / 2, -(3 ** 0.5) / 2, 3 ** 0.5 / 2, 1.5, -0.5, -0.5, -0.5])
    groups = seq.astype(np.float64).reshape(-1, G)
    formula = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    np.testing.assert_allclose(formula, known, atol=1e-5)

    ro = hand_rollout(seed=3, seq_rewards=seq)
    exp, m = experience_fn(hp)(make_state(hp, with_ref=True), ro)
    adv = np.asarray(exp.advantages)
    for b in range(B):
        np.testing.assert_allclose(adv[b, :RESP_LENS[b]], known[b], atol=1e-5, err_msg=f"row {b}")
        assert (adv[b, RESP_LENS[b]:] == 0).all(), f"row {b}"
    assert (np.asarray(exp.returns) == 0).all() and (np.asarray(exp.old_values) == 0).all()
    # KL wiring: old log-probs from the actor params, reference log-probs from ref_params, k3 reported.
    valid = np.asarray(ro.response_mask) > 0
    logp, _ = ref_response_logp(actor_params(), ro, TEMP)
    ref, _ = ref_response_logp(ref_params(), ro, TEMP)
    np.testing.assert_allclose(np.asarray(exp.old_logp)[valid], logp[valid], atol=1e-5)
    np.testing.assert_allclose(np.asarray(exp.ref_logp)[valid], ref[valid], atol=1e-5)
    np.testing.assert_allclose(float(m["rollout/kl_to_ref"]), np_kl(logp, ref, "k3")[valid].mean(), rtol=1e-4)


# --------------------------------------------------------------------------------------------------------------
# Losses through the real loss functions.
# --------------------------------------------------------------------------------------------------------------


def actor_minibatch(seed=4):
    """A minibatch whose ratios leave the clip range both ways, with a few ratio-5 tokens at negative advantage
    (dual clip active), a reference policy != actor, and positive and non-positive rows."""
    ro = hand_rollout(seed=seed)
    rs = np.random.RandomState(seed)
    mask = np.asarray(ro.response_mask)
    logp, _ = ref_response_logp(actor_params(), ro, TEMP)
    ref, _ = ref_response_logp(ref_params(), ro, TEMP)
    log_ratio = rs.uniform(-0.6, 0.6, size=(B, R))
    adv = rs.normal(size=(B, R))
    big = [(1, 2), (4, 0), (6, 3)]  # valid tokens
    for b, t in big:
        log_ratio[b, t], adv[b, t] = np.log(5.0), -1.5
    old_logp = logp - log_ratio
    positive = np.array([1, 0, 1, 0, 0, 1, 1, 0], np.float32)
    mb = experience(ro, old_logp=jnp.asarray(np.where(mask > 0, old_logp, 0.0), jnp.float32),
                    advantages=jnp.asarray(adv * mask, jnp.float32),
                    ref_logp=jnp.asarray(np.where(mask > 0, ref, 0.0), jnp.float32), positive=jnp.asarray(positive))
    return mb, logp, ref


LOSS_CASES = [("k1", "token-mean", 3.0), ("k2", "seq-mean-token-mean", None), ("k3", "seq-mean-token-sum", 3.0)]
LOSS_COEFS = dict(kl_coef=0.2, entropy_coef=0.05, nll_coef=0.3)


@functools.lru_cache(maxsize=None)
def actor_losses():
    """`rl.actor_loss_fn(hp)(actor params, actor_minibatch())` for every LOSS_CASES hparams, in one compile."""
    hps = [hparams(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip or 0.0, loss_agg=loss_agg, kl_in_reward=False,
                   kl_estimator=kl_estimator, **LOSS_COEFS) for kl_estimator, loss_agg, dual_clip in LOSS_CASES]
    fns = [rl.actor_loss_fn(hp, ACTOR) for hp in hps]
    return jax.device_get(jit(lambda params, mb: [fn(params, mb) for fn in fns])(actor_params(), actor_minibatch()[0]))


@pytest.mark.parametrize("case", range(len(LOSS_CASES)), ids=["-".join(map(str, c)) for c in LOSS_CASES])
def test_actor_loss_terms_against_numpy(case):
    """loss = pg(clip 0.2 / 0.28, dual clip) - entropy_coef * H + kl_coef * KL(logp, ref_logp) + nll_coef * NLL over
    positive rows, every term aggregated with loss_agg, from the log-probs of the params being trained."""
    kl_estimator, loss_agg, dual_clip = LOSS_CASES[case]
    coefs = LOSS_COEFS
    mb, logp, ref = actor_minibatch()
    loss, m = actor_losses()[case]
    mask = np.asarray(mb.response_mask)
    adv, old_logp = np.asarray(mb.advantages, np.float64), np.asarray(mb.old_logp, np.float64)
    _, entropy = ref_response_logp(actor_params(), mb, TEMP)
    per_token = np_policy_loss_per_token(logp, old_logp, adv, 0.2, 0.28, dual_clip)
    pg = np_aggregate(per_token, mask, loss_agg)
    ent = np_aggregate(entropy, mask, loss_agg)
    kl = np_aggregate(np_kl(logp, ref, kl_estimator), mask, loss_agg)
    nll = np_aggregate(-logp, mask * np.asarray(mb.positive)[:, None], loss_agg)
    want = pg - coefs["entropy_coef"] * ent + coefs["kl_coef"] * kl + coefs["nll_coef"] * nll

    tol = dict(rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(float(m["policy/pg_loss"]), pg, **tol)
    np.testing.assert_allclose(float(m["policy/entropy"]), ent, **tol)
    np.testing.assert_allclose(float(m["policy/kl_loss"]), kl, **tol)
    np.testing.assert_allclose(float(m["policy/nll_loss"]), nll, **tol)
    np.testing.assert_allclose(float(loss), want, **tol)
    np.testing.assert_allclose(float(m["policy/loss"]), want, **tol)
    # The batch can tell each ingredient apart: KL sign, NLL on every row, clip range and dual clip all matter.
    assert abs(coefs["kl_coef"] * kl) > 1e-3
    assert abs(np_aggregate(-logp, mask, loss_agg) - nll) > 1e-3
    assert abs(np_aggregate(np_policy_loss_per_token(logp, old_logp, adv, 0.2, 0.2, dual_clip), mask, loss_agg)
               - pg) > 1e-4
    other = None if dual_clip else 3.0
    assert abs(np_aggregate(np_policy_loss_per_token(logp, old_logp, adv, 0.2, 0.28, other), mask, loss_agg)
               - pg) > 1e-3


def test_critic_loss_value_clip_against_numpy():
    """0.5 * agg(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)) with V from the critic being trained."""
    hp = hparams(value_clip=0.2, loss_agg="seq-mean-token-mean")
    ro = hand_rollout(seed=6)
    rs = np.random.RandomState(6)
    mask = np.asarray(ro.response_mask)
    values = ref_values(critic_params(), ro)
    old_values = values + rs.uniform(-0.6, 0.6, size=(B, R))
    returns = values + rs.normal(size=(B, R))
    mb = experience(ro, old_values=jnp.asarray(old_values * mask, jnp.float32),
                    returns=jnp.asarray(returns * mask, jnp.float32))
    loss, m = critic_loss(hp)(critic_params(), mb)
    v_clipped = old_values + np.clip(values - old_values, -0.2, 0.2)
    per_token = np.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    want = 0.5 * np_aggregate(per_token, mask, "seq-mean-token-mean")
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    unclipped = 0.5 * np_aggregate((values - returns) ** 2, mask, "seq-mean-token-mean")
    assert abs(unclipped - want) > 1e-3  # the clip is active on this batch
    assert abs(0.5 * np_aggregate(per_token, mask, "token-mean") - want) > 1e-3  # loss_agg is used


# --------------------------------------------------------------------------------------------------------------
# Update: the reference policy is frozen; movement metrics are measured after the update.
# --------------------------------------------------------------------------------------------------------------


def test_update_never_changes_ref_params_and_measures_movement():
    hp = hparams("grpo", **HP_GRPO)
    state = make_state(hp, with_ref=True)
    ro = hand_rollout(seed=3, seq_rewards=np.array([1.0, -1.0, -1.0, 1.0, 2.0, 0.0, 0.0, 0.0]))
    exp, _ = experience_fn(hp)(state, ro)
    ref_before = jax.tree.map(np.asarray, state.ref_params)
    new_state, m = update_fn(hp)(state, exp)
    assert int(new_state.actor.step) == 1 and float(m["train/nonfinite"]) == 0 and int(new_state.step) == 1
    # The state's key advances (split off what the minibatch shuffles used): the next update shuffles anew.
    key_data = lambda k: np.asarray(jax.random.key_data(k))  # noqa: E731
    np.testing.assert_array_equal(key_data(new_state.rng), key_data(jax.random.split(state.rng, 3)[0]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new_state.ref_params), ref_before)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)),
                                         new_state.actor.params, state.actor.params))
    assert any(moved)
    # The KL term was in the loss (kl_coef > 0, not in reward) and compared the actor with the frozen reference.
    valid = np.asarray(ro.response_mask) > 0
    logp, _ = ref_response_logp(actor_params(), ro, TEMP)
    ref, _ = ref_response_logp(ref_params(), ro, TEMP)
    np.testing.assert_allclose(float(m["policy/kl_loss"]), np_kl(logp, ref, "k3")[valid].mean(), rtol=1e-4)
    # policy/approx_kl and policy/clipfrac: the updated policy vs old_logp on the whole rollout.
    new_logp, _ = ref_response_logp(new_state.actor.params, ro, TEMP)
    log_ratio = (new_logp - np.asarray(exp.old_logp, np.float64))[valid]
    ratio = np.exp(log_ratio)
    assert np.abs(log_ratio).max() > 1e-3
    np.testing.assert_allclose(float(m["policy/approx_kl"]), (ratio - 1 - log_ratio).mean(), rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(float(m["policy/clipfrac"]), ((ratio < 0.8) | (ratio > 1.2)).mean(), atol=1e-6)
    np.testing.assert_allclose(float(m["policy/ratio_max"]), ratio.max(), rtol=1e-4)


# --------------------------------------------------------------------------------------------------------------
# SFT loss.
# --------------------------------------------------------------------------------------------------------------


def test_sft_loss_is_response_token_nll_and_ignores_padding():
    loss_fn = jit(sft_loss_fn(ACTOR, chunk=CHUNK))
    ro = hand_rollout(seed=7)
    batch = dict(tokens=ro.tokens, attn_mask=ro.attn_mask, response_mask=ro.response_mask)
    loss, m = loss_fn(actor_params(), batch)
    mask = np.asarray(ro.response_mask)
    logp, _ = ref_response_logp(actor_params(), ro, 1.0)  # SFT trains the untempered distribution
    want = -(logp * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["sft/loss"]), want, rtol=1e-5)

    # New ids on every padding position (prompt left padding, response right padding): same loss.
    rs = np.random.RandomState(8)
    attn = np.asarray(ro.attn_mask)
    repadded = np.where(attn, np.asarray(ro.tokens), rs.randint(1, V, size=attn.shape))
    assert (repadded != np.asarray(ro.tokens))[~attn].any()
    loss2, _ = loss_fn(actor_params(), dict(batch, tokens=jnp.asarray(repadded, jnp.int32)))
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    # ... while a response token does change it (the check above is not vacuous).
    changed = np.asarray(ro.tokens).copy()
    changed[1, P + 2] = (changed[1, P + 2] % (V - 1)) + 1
    loss3, _ = loss_fn(actor_params(), dict(batch, tokens=jnp.asarray(changed, jnp.int32)))
    assert abs(float(loss3) - float(loss)) > 1e-4


def test_sft_loss_of_a_batch_trimmed_of_padding_is_unchanged():
    """`pad_to_multiple`: the loss reads the prompt length from the shapes, so the batch without its all-padding
    columns (prompt left padding, response right padding) gives the full batch's loss."""
    loss_fn = jit(sft_loss_fn(ACTOR, chunk=CHUNK))
    rows = [0, 2, 3, 5, 6]  # prompts of at most 3 of P = 4 tokens, responses of at most 5 of R = 6
    ro = hand_rollout(seed=9)
    full = {k: np.asarray(getattr(ro, k))[rows] for k in ("tokens", "attn_mask", "response_mask")}
    p, r = PROMPT_LENS[rows].max(), RESP_LENS[rows].max()
    assert p < P and r < R
    trimmed = dict(tokens=full["tokens"][:, P - p:P + r], attn_mask=full["attn_mask"][:, P - p:P + r],
                   response_mask=full["response_mask"][:, :r])
    want, _ = loss_fn(actor_params(), full)
    got, _ = loss_fn(actor_params(), trimmed)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
