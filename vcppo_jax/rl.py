"""The RL update shared by VC-PPO, PPO and GRPO (paper Algorithm 1).

  rollout --make_experience--> old log-probs, ref log-probs, values, decoupled GAE (or group advantages)
          --update--> epochs x minibatches of clipped-PPO actor steps and value-regression critic steps.

Both are pure functions `f(state, batch) -> (state | experience, metrics)`, jitted once by the caller. `Rollout`
(what the host sampled and scored) and `Experience` (what the update trains on) share one layout: prompt left-padded
to P, response right-padded to R, and `response_mask` [B, R] marking the response tokens in both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from vcppo_jax import gae as gae_lib
from vcppo_jax import losses
from vcppo_jax import metrics as metrics_lib
from vcppo_jax.models import position_ids, token_logprobs
from vcppo_jax.optim import ModelState, train_epochs

# How advantages are estimated (config.advantage): 'gae' with a critic (PPO, VC-PPO: decoupled GAE), 'group' without
# one (GRPO: each response's reward relative to its prompt's group).
ADVANTAGE_ESTIMATORS = ("gae", "group")


@struct.dataclass
class Rollout:
    """One batch of sampled, scored responses (numpy on the host, arrays on the devices)."""

    tokens: jax.Array  # [B, P+R] int32: left-padded prompt, then the response right-padded
    attn_mask: jax.Array  # [B, P+R] bool: real tokens (prompt and response)
    response_mask: jax.Array  # [B, R] float32: 1 on response tokens, the EOS included
    rewards: jax.Array  # [B, R] float32: each sequence reward at its response's last token, 0 elsewhere
    seq_rewards: jax.Array  # [B] float32: the verifier's reward (or the control's / a hook's replacement)
    sample_logp: jax.Array | None = None  # [B, R] float32: the sampler's log-prob of each drawn token, 0 past it


@struct.dataclass
class Experience:
    """Everything the update needs, computed once per rollout with the pre-update networks."""

    tokens: jax.Array  # [B, P+R] int32
    attn_mask: jax.Array  # [B, P+R] bool
    response_mask: jax.Array  # [B, R] float32
    old_logp: jax.Array  # [B, R] float32: log-probs under the policy that sampled (at the sampling temperature)
    ref_logp: jax.Array  # [B, R] float32: under the reference policy (== old_logp without one)
    old_values: jax.Array  # [B, R] float32: V(s_t) before the update (0 without a critic)
    advantages: jax.Array  # [B, R] float32: actor advantages (whitened when configured), 0 past the response
    returns: jax.Array  # [B, R] float32: critic targets (0 without a critic)
    positive: jax.Array  # [B] float32: 1 for responses with a positive sequence reward (the NLL term's rows)


@struct.dataclass
class RLState:
    actor: ModelState
    critic: ModelState | None  # None for GRPO.
    ref_params: Any  # frozen initial policy for the KL term; None when kl_coef == 0.
    rng: jax.Array
    step: jax.Array  # RL iterations done (== data position).


@dataclasses.dataclass(frozen=True)
class RLHparams:
    """The static part of an RL config that the jitted functions close over."""

    advantage: str  # one of ADVANTAGE_ESTIMATORS
    prompt_len: int
    group_size: int
    gamma: float
    lambda_actor: float
    lambda_critic: float
    adaptive_lambda: bool
    adaptive_lambda_alpha: float
    whiten_advantages: bool
    grpo_normalize_std: bool
    clip_low: float
    clip_high: float
    dual_clip: float | None
    value_clip: float | None
    loss_agg: str
    kl_coef: float
    kl_estimator: str
    kl_in_reward: bool
    entropy_coef: float
    nll_coef: float
    num_epochs: int
    num_minibatches: int
    logprob_chunk: int
    temperature: float
    diag_buckets: int
    diag_early_tokens: int

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> "RLHparams":
        return cls(
            advantage=c.advantage, prompt_len=c.task.max_prompt_len, group_size=c.group_size, gamma=c.gamma,
            lambda_actor=c.lambda_actor, lambda_critic=c.lambda_critic, adaptive_lambda=c.adaptive_lambda,
            adaptive_lambda_alpha=c.adaptive_lambda_alpha, whiten_advantages=c.whiten_advantages,
            grpo_normalize_std=c.grpo_normalize_std, clip_low=c.clip_low, clip_high=c.clip_high,
            dual_clip=c.dual_clip or None, value_clip=c.value_clip or None, loss_agg=c.loss_agg,
            kl_coef=c.kl_coef, kl_estimator=c.kl_estimator, kl_in_reward=c.kl_in_reward,
            entropy_coef=c.entropy_coef, nll_coef=c.nll_coef, num_epochs=c.num_epochs,
            num_minibatches=c.num_minibatches, logprob_chunk=c.logprob_chunk,
            temperature=c.sampling.temperature or 1.0, diag_buckets=c.diag_buckets,
            diag_early_tokens=c.diag_early_tokens)

    @property
    def has_critic(self) -> bool:
        return self.advantage == "gae"


# --------------------------------------------------------------------------------------------------------------
# Forward passes over the response part of a rollout.
# --------------------------------------------------------------------------------------------------------------


def _response_hidden(model: nn.Module, params, tokens: jax.Array, attn_mask: jax.Array, prompt_len: int):
    """Hidden states that predict the response tokens: [B, R, D] (position P-1+t predicts response token t)."""
    inputs, mask = tokens[:, :-1], attn_mask[:, :-1]
    hidden, _ = model.apply({"params": params}, inputs, position_ids(mask), mask)
    return hidden[:, prompt_len - 1:]


def policy_logprobs(actor: nn.Module, params, tokens, attn_mask, *, prompt_len: int, chunk: int,
                    temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Per-token log-prob and entropy of the response tokens under `params`: ([B, R], [B, R])."""
    hidden = _response_hidden(actor, params, tokens, attn_mask, prompt_len)
    logits_fn = lambda h: actor.apply({"params": params}, h, method=type(actor).logits)
    return token_logprobs(logits_fn, hidden, tokens[:, prompt_len:], chunk_size=chunk, temperature=temperature)


def critic_values(critic: nn.Module, params, tokens, attn_mask, *, prompt_len: int) -> jax.Array:
    """V(s_t) for each response token t: [B, R] (the value head at the position that predicts token t)."""
    inputs, mask = tokens[:, :-1], attn_mask[:, :-1]
    values = critic.apply({"params": params}, inputs, position_ids(mask), mask)
    return values[:, prompt_len - 1:].astype(jnp.float32)


def by_minibatch(fn: Callable, num_minibatches: int, *arrays: jax.Array):
    """`fn(*arrays)` computed on `num_minibatches` consecutive slices of the batch (leading) dim one after another
    (`lax.map`), outputs re-joined along it: a full-batch forward pass holds one slice's activations at a time, the
    size the update's minibatches are known to fit."""
    if num_minibatches == 1:
        return fn(*arrays)
    split = lambda x: x.reshape(num_minibatches, x.shape[0] // num_minibatches, *x.shape[1:])  # noqa: E731
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(x) for x in arrays))
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), out)


# --------------------------------------------------------------------------------------------------------------
# Experience: everything the update needs, computed once per rollout with the pre-update networks.
# --------------------------------------------------------------------------------------------------------------


def make_experience_fn(hp: RLHparams, actor: nn.Module, critic: nn.Module | None) -> Callable:
    """Returns `make_experience(state, rollout) -> (experience, metrics)`."""
    P = hp.prompt_len

    def logprobs(params, tokens, attn_mask):
        fn = functools.partial(policy_logprobs, actor, params, prompt_len=P, chunk=hp.logprob_chunk,
                               temperature=hp.temperature)
        return by_minibatch(fn, hp.num_minibatches, tokens, attn_mask)

    def make_experience(state: RLState, rollout: Rollout) -> tuple[Experience, dict]:
        tokens, attn_mask, mask = rollout.tokens, rollout.attn_mask, rollout.response_mask
        old_logp, entropy = logprobs(state.actor.params, tokens, attn_mask)
        if state.ref_params is not None:
            ref_logp, _ = logprobs(state.ref_params, tokens, attn_mask)
        else:
            ref_logp = old_logp
        kl = losses.kl_penalty(old_logp, ref_logp, hp.kl_estimator) * mask
        rewards = rollout.rewards
        if hp.kl_in_reward and hp.kl_coef > 0:
            rewards = rewards - hp.kl_coef * kl
        lengths = mask.sum(axis=1)
        m = {}
        if hp.has_critic:
            values = by_minibatch(functools.partial(critic_values, critic, state.critic.params, prompt_len=P),
                                  hp.num_minibatches, tokens, attn_mask) * mask
            lam_actor = (gae_lib.length_adaptive_lambda(lengths, hp.adaptive_lambda_alpha)
                         if hp.adaptive_lambda else hp.lambda_actor)
            advantages, returns = gae_lib.decoupled_gae(rewards, values, mask, gamma=hp.gamma,
                                                        lambda_actor=lam_actor, lambda_critic=hp.lambda_critic)
            mc_returns = gae_lib.monte_carlo_returns(rollout.rewards, mask, gamma=hp.gamma)
            m.update(_position_diagnostics(values, advantages, mask, hp, mc_returns=mc_returns))
            m["value/explained_var_old"] = losses.explained_variance(values, returns, mask)
        else:
            values = returns = jnp.zeros_like(mask)
            group_adv = losses.grpo_advantages(rollout.seq_rewards, hp.group_size,
                                               normalize_std=hp.grpo_normalize_std)
            advantages = group_adv[:, None] * mask
            m.update(_position_diagnostics(None, advantages, mask, hp))
        m["diag/adv_length_corr"] = metrics_lib.advantage_length_corr(advantages, mask, rollout.seq_rewards)
        raw_advantages = advantages
        if hp.whiten_advantages and hp.has_critic:
            advantages = gae_lib.whiten(advantages, mask)
        experience = Experience(tokens=tokens, attn_mask=attn_mask, response_mask=mask, old_logp=old_logp,
                                ref_logp=ref_logp, old_values=values, advantages=advantages, returns=returns,
                                positive=(rollout.seq_rewards > 0).astype(jnp.float32))
        n = jnp.maximum(mask.sum(), 1.0)
        m.update({
            "rollout/kl_to_ref": (kl * mask).sum() / n,
            "rollout/entropy": (entropy * mask).sum() / n,
            "adv/mean": (raw_advantages * mask).sum() / n,
            "adv/abs_mean": (jnp.abs(raw_advantages) * mask).sum() / n,
            "returns/mean": (returns * mask).sum() / n,
        })
        if rollout.sample_logp is not None:
            # The ratio's old log-probs are the trainer's; a sampler that computes differently (a bf16 KV cache,
            # an inference engine) draws from a slightly different policy: this is how far apart the two are.
            m["rollout/sampler_logp_gap"] = (jnp.abs(rollout.sample_logp - old_logp) * mask).sum() / n
        return experience, m

    return make_experience


def _position_diagnostics(values, advantages, mask, hp: RLHparams, mc_returns=None) -> dict:
    """VC-PPO diagnostics (paper Fig. 2): mean value / advantage by token-position bucket, early-token bias, and the
    critic's error against the Monte-Carlo return of the task reward (`mc_returns` [B, R], KL penalty excluded)
    by bucket and at each response's first token (how far from calibrated the critic is, and where)."""
    out = {}
    adv_b, counts = metrics_lib.position_bucket_means(advantages, mask, hp.diag_buckets)
    for i in range(hp.diag_buckets):
        out[f"diag/adv_pos{i:02d}"] = adv_b[i]
        # Token count per bucket: an empty bucket's mean is 0 by convention, so plots must tell empty from zero.
        out[f"diag/tokens_pos{i:02d}"] = counts[i]
    if values is not None:
        val_b = metrics_lib.position_bucket_means(values, mask, hp.diag_buckets)[0]
        err_b = metrics_lib.position_bucket_means(values - mc_returns, mask, hp.diag_buckets)[0]
        for i in range(hp.diag_buckets):
            out[f"diag/value_pos{i:02d}"] = val_b[i]
            out[f"diag/value_err_pos{i:02d}"] = err_b[i]
        first = mask[:, 0]
        out["diag/value_err_first"] = (first * (values - mc_returns)[:, 0]).sum() / jnp.maximum(first.sum(), 1.0)
    out.update(metrics_lib.early_token_bias(advantages, mask, early_tokens=hp.diag_early_tokens))
    return out


# --------------------------------------------------------------------------------------------------------------
# Update: epochs x minibatches of actor and critic steps.
# --------------------------------------------------------------------------------------------------------------


def actor_loss_fn(hp: RLHparams, actor: nn.Module) -> Callable:
    def loss_fn(params, mb: Experience) -> tuple[jax.Array, dict]:
        logp, entropy = policy_logprobs(actor, params, mb.tokens, mb.attn_mask, prompt_len=hp.prompt_len,
                                        chunk=hp.logprob_chunk, temperature=hp.temperature)
        mask = mb.response_mask
        loss, m = losses.policy_loss(logp, mb.old_logp, mb.advantages, mask, clip_low=hp.clip_low,
                                     clip_high=hp.clip_high, dual_clip=hp.dual_clip, agg_mode=hp.loss_agg)
        # Ratio statistics of this minibatch step (the first step of an iteration is exactly on-policy).
        m = {k.replace("policy/", "policy/mb_"): v for k, v in m.items() if k != "policy/loss"}
        m["policy/pg_loss"] = loss
        ent = losses.aggregate(entropy, mask, hp.loss_agg)
        m["policy/entropy"] = ent
        if hp.entropy_coef > 0:
            loss = loss - hp.entropy_coef * ent
        if hp.kl_coef > 0 and not hp.kl_in_reward:
            kl = losses.aggregate(losses.kl_penalty(logp, mb.ref_logp, hp.kl_estimator), mask, hp.loss_agg)
            m["policy/kl_loss"] = kl
            loss = loss + hp.kl_coef * kl
        if hp.nll_coef > 0:
            pos_mask = mask * mb.positive[:, None]
            nll = losses.nll_loss(logp, pos_mask, hp.loss_agg)
            m["policy/nll_loss"] = nll
            loss = loss + hp.nll_coef * nll
        m["policy/loss"] = loss
        return loss, m

    return loss_fn


def critic_loss_fn(hp: RLHparams, critic: nn.Module) -> Callable:
    def loss_fn(params, mb: Experience) -> tuple[jax.Array, dict]:
        values = critic_values(critic, params, mb.tokens, mb.attn_mask, prompt_len=hp.prompt_len)
        loss, m = losses.value_loss(values, mb.old_values, mb.returns, mb.response_mask, clip=hp.value_clip,
                                    agg_mode=hp.loss_agg)
        m = dict(m)
        m["value/explained_var"] = losses.explained_variance(values, mb.returns, mb.response_mask)
        return loss, m

    return loss_fn


def policy_movement(hp: RLHparams, actor: nn.Module, params, experience: Experience) -> dict:
    """How far one whole update moved the policy on that iteration's rollout, measured after the update.

    Per-minibatch means of the ratio statistics include the first minibatch step, which is exactly on-policy, so
    they under-read the movement; these compare the policy that sampled the rollout (`old_logp`) with the updated
    one on every token: policy/approx_kl (k3 estimate of KL(pi_old || pi_new) per token), policy/clipfrac (tokens
    whose ratio left [1 - clip_low, 1 + clip_high]), policy/ratio_min|max.
    """
    fn = functools.partial(policy_logprobs, actor, params, prompt_len=hp.prompt_len, chunk=hp.logprob_chunk,
                           temperature=hp.temperature)
    logp, _ = by_minibatch(fn, hp.num_minibatches, experience.tokens, experience.attn_mask)
    logp = jax.lax.stop_gradient(logp)
    valid = experience.response_mask > 0
    log_ratio = jnp.where(valid, logp - experience.old_logp, 0.0)
    ratio = jnp.exp(log_ratio)
    n = jnp.maximum(valid.sum(), 1)
    outside = valid & ((ratio < 1.0 - hp.clip_low) | (ratio > 1.0 + hp.clip_high))
    return {"policy/approx_kl": jnp.where(valid, ratio - 1.0 - log_ratio, 0.0).sum() / n,
            "policy/clipfrac": outside.sum() / n,
            "policy/ratio_min": jnp.where(valid, ratio, jnp.inf).min(),
            "policy/ratio_max": jnp.where(valid, ratio, -jnp.inf).max()}


def make_update_fn(hp: RLHparams, actor: nn.Module, critic: nn.Module | None,
                   actor_tx: optax.GradientTransformation, critic_tx: optax.GradientTransformation | None):
    """Returns `update(state, experience) -> (state, metrics)`: epochs x minibatches for the actor, then the same
    for the critic (they share no parameters, so the order does not matter). Loss metrics are means over the
    minibatch steps (`policy/mb_*` for the per-minibatch ratio statistics); `policy_movement` gives the whole
    update's."""
    actor_loss, critic_loss = actor_loss_fn(hp, actor), critic_loss_fn(hp, critic) if hp.has_critic else None
    sgd = functools.partial(train_epochs, num_epochs=hp.num_epochs, num_minibatches=hp.num_minibatches)

    def update(state: RLState, experience: Experience) -> tuple[RLState, dict]:
        rng, actor_rng, critic_rng = jax.random.split(state.rng, 3)
        actor_state, m = sgd(state.actor, experience, actor_rng, actor_loss, actor_tx)
        m["policy/grad_norm"] = m.pop("grad_norm")
        m.update(policy_movement(hp, actor, actor_state.params, experience))
        critic_state = state.critic
        if hp.has_critic:
            critic_state, vm = sgd(state.critic, experience, critic_rng, critic_loss, critic_tx)
            vm["value/grad_norm"] = vm.pop("grad_norm")
            vm["train/nonfinite"] = vm["train/nonfinite"] + m.pop("train/nonfinite")
            m.update(vm)
        return state.replace(actor=actor_state, critic=critic_state, rng=rng, step=state.step + 1), m

    return update
