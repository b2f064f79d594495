"""Offline critic training on samples of the frozen SFT policy. Two stages share this loop:

- 'value_pretrain' (VC-PPO): targets are Monte-Carlo returns (GAE with lambda = 1) at every response token; trains
  until value loss and explained variance stop changing (paper Algorithm 1, step 1; Fig. 6).
- 'reward_model' (the PPO baseline's critic init, as in standard RLHF): an outcome reward model, supervised only at
  the EOS (last) token with the sequence reward; its values on earlier tokens are never trained, which is the
  initialization bias the paper diagnoses.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vcppo_jax import builders
from vcppo_jax import config as config_lib
from vcppo_jax import gae as gae_lib
from vcppo_jax import losses
from vcppo_jax import runtime as rt_lib
from vcppo_jax import stage_meta
from vcppo_jax.compile_options import jit_training
from vcppo_jax.data.batching import batch_indices
from vcppo_jax.metrics import Timer
from vcppo_jax.models import CausalLM, ValueModel
from vcppo_jax.optim import init_model_state, make_optimizer, train_epochs
from vcppo_jax.rl import Rollout, by_minibatch, critic_values
from vcppo_jax.rollout import generate_and_score, prompt_batch, whole_batch_stats
from vcppo_jax.sampling import sampler_from_config
from vcppo_jax.stage_run import stage_run


def value_targets(rewards: jax.Array, seq_rewards: jax.Array, mask: jax.Array, *, gamma: float, eos_only: bool,
                  truncated_fraction: float = 0.0, truncated_reward: float = -1.0, rng: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """(targets [B, R], weights [B, R]) from a rollout's token rewards [B, R], sequence rewards [B] and response
    mask [B, R]: Monte-Carlo returns on every response token, or (eos_only) the sequence reward on the last response
    token alone.

    truncated_fraction (eos_only): each response of at least 2 tokens is, with this probability, treated as cut
    off after a uniformly drawn strict prefix and labelled a failure: its one target is `truncated_reward` at the
    cut (the critic is causal, so the value there sees only the prefix). This is how RLHF pipelines label overlong
    responses, and it makes the reward model pessimistic on every unfinished prefix. Needs `rng`.
    """
    if eos_only:
        lengths = mask.sum(axis=1).astype(jnp.int32)
        target_pos, target = jnp.maximum(lengths, 1) - 1, seq_rewards
        if truncated_fraction > 0:
            pick_key, cut_key = jax.random.split(rng)
            cut = jnp.floor(jax.random.uniform(cut_key, lengths.shape) * (lengths - 1)).astype(jnp.int32)
            truncated = (jax.random.uniform(pick_key, lengths.shape) < truncated_fraction) & (lengths >= 2)
            target_pos = jnp.where(truncated, cut, target_pos)
            target = jnp.where(truncated, truncated_reward, target)
        weights = jax.nn.one_hot(target_pos, mask.shape[1], dtype=mask.dtype) * (lengths[:, None] > 0)
        return target[:, None] * weights, weights
    return gae_lib.monte_carlo_returns(rewards, mask, gamma=gamma), mask


def converged(losses_hist: Sequence[float], ev_hist: Sequence[float], *, window: int, rtol: float,
              atol: float) -> bool:
    """True when the mean value loss of the last `window` steps is within `rtol` (relative) of the window before,
    and the mean explained variance within `atol`."""
    if len(losses_hist) < 2 * window:
        return False
    l_new, l_old = np.mean(losses_hist[-window:]), np.mean(losses_hist[-2 * window:-window])
    e_new, e_old = np.mean(ev_hist[-window:]), np.mean(ev_hist[-2 * window:-window])
    return bool(abs(l_new - l_old) <= rtol * max(abs(l_old), 1e-8) and abs(e_new - e_old) <= atol)


def make_value_step(critic: ValueModel, tx, *, prompt_len: int, gamma: float, eos_only: bool,
                    num_minibatches: int, truncated_fraction: float = 0.0, truncated_reward: float = -1.0):
    """`step(state, rollout, rng) -> (state, metrics)`; loss and explained variance are measured on the fresh batch
    before the update (held-out for the current params), then minibatch regression steps follow."""

    def loss_fn(params, mb):
        values = critic_values(critic, params, mb["tokens"], mb["attn_mask"], prompt_len=prompt_len)
        loss, m = losses.value_loss(values, values, mb["targets"], mb["weights"])
        return loss, {"value/train_loss": loss}

    def step(state, rollout: Rollout, rng):
        # A key derived aside, so the minibatch order stays what it was without truncation.
        targets, weights = value_targets(rollout.rewards, rollout.seq_rewards, rollout.response_mask, gamma=gamma,
                                         eos_only=eos_only, truncated_fraction=truncated_fraction,
                                         truncated_reward=truncated_reward, rng=jax.random.fold_in(rng, 1))
        values = by_minibatch(functools.partial(critic_values, critic, state.params, prompt_len=prompt_len),
                              num_minibatches, rollout.tokens, rollout.attn_mask)
        loss, _ = losses.value_loss(values, values, targets, weights)
        metrics = {"value/loss": loss, "value/explained_var": losses.explained_variance(values, targets, weights),
                   "value/mean": (values * weights).sum() / jnp.maximum(weights.sum(), 1.0)}
        batch = dict(tokens=rollout.tokens, attn_mask=rollout.attn_mask, targets=targets, weights=weights)
        state, m = train_epochs(state, batch, rng, loss_fn, tx, num_epochs=1, num_minibatches=num_minibatches)
        metrics.update(m)
        metrics["value/grad_norm"] = metrics.pop("grad_norm")
        return state, metrics

    return step


class Programs(NamedTuple):
    """The jitted programs of a value-training run."""
    sampler: Callable  # (params, prompt tokens [B, P], prompt mask [B, P], rng) -> SampleOutput of the frozen policy
    step: Callable  # (state, rollout, rng) -> (state, metrics); donates the state


def programs(config: ml_collections.ConfigDict, actor: CausalLM, critic: ValueModel, tx: optax.GradientTransformation,
             state_shardings, tok, *, backend: str | None = None) -> Programs:
    """The run's programs over a critic state placed on `state_shardings`. backend: whose training compiler
    options (`compile_options`; default: this host's)."""
    step = make_value_step(critic, tx, prompt_len=config.task.max_prompt_len, gamma=config.gamma,
                           eos_only=config.stage == "reward_model", num_minibatches=config.num_minibatches,
                           truncated_fraction=config.truncated_fraction, truncated_reward=config.reward_wrong)
    return Programs(
        sampler=sampler_from_config(actor, config.sampling, max_new_tokens=config.task.max_response_len,
                                    eos_id=builders.stop_ids(config, tok), pad_id=tok.pad_token_id),
        step=jit_training(step, backend=backend, in_shardings=(state_shardings, None, None),
                          out_shardings=(state_shardings, None), donate_argnums=0))


def run_value_training(config: ml_collections.ConfigDict) -> dict:
    """Trains a critic for `config.stage` in ('value_pretrain', 'reward_model'); returns the last metrics."""
    config_lib.validate(config)
    rt = rt_lib.make_runtime(config)
    sft_meta = stage_meta.finished_meta(config.sft_dir, "sft")
    cfg = builders.model_config_from_json(sft_meta["model_config"], config)
    tok, verifier = builders.tokenizer(config), builders.verifier(config)
    train = builders.prompt_source(config, config.task.train_split, tok)
    actor, critic, tx = CausalLM(cfg), ValueModel(cfg), make_optimizer(config.optim)
    layout = rt_lib.model_state_to_dict(rt_lib.abstract_model_state(critic, tx), "critic_params")
    progs = programs(config, actor, critic, tx, rt_lib.model_state_from_dict(
        jax.tree.map(lambda x: x.sharding, rt.target(layout)), "critic_params"), tok)
    policy = builders.load_policy(config.sft_dir, rt.target(rt_lib.abstract_params(actor)))

    def init(shardings):
        params = builders.load_critic(config, policy, rt.target(rt_lib.abstract_params(critic)))
        return jax.device_put(rt_lib.model_state_to_dict(init_model_state(params, tx), "critic_params"), shardings)

    sample_key, update_key = jax.random.split(jax.random.PRNGKey(config.seed))
    timer, rows = Timer(), rt.local_rows(config.prompts_per_step * config.group_size)
    metrics: dict = {}
    with stage_run(config, rt, layout, init, total=config.max_steps, desc=config.stage,
                   show=("value/loss", "value/explained_var", "rollout/accuracy")) as (run, state):
        state = rt_lib.model_state_from_dict(state, "critic_params")
        meta = {"stage": config.stage, "model_config": sft_meta["model_config"],
                "converged": bool(run.meta.get("converged", False)),
                "history": run.meta.get("history", {"loss": [], "ev": []}),
                "provenance": stage_meta.provenance(config, run.meta)}
        history, step = meta["history"], run.start
        while step < config.max_steps and not meta["converged"]:
            with timer.section("rollout"):
                idx = batch_indices(len(train), config.prompts_per_step, step, config.seed)
                pb = prompt_batch(train, idx, tok, max_prompt_len=config.task.max_prompt_len,
                                  group_size=config.group_size)
                rollout, _ = generate_and_score(progs.sampler, policy, pb, jax.random.fold_in(sample_key, step), tok,
                                                verifier, rt)
            with timer.section("update"):
                state, m = progs.step(state, rt.place_batch(rollout), jax.random.fold_in(update_key, step))
                m = rt.fetch(m)
            step += 1
            metrics = {k: float(v) for k, v in m.items()}
            stats, num_tokens = whole_batch_stats(rollout, config.reward_correct, config.task.max_response_len, rows,
                                                  rt)
            metrics.update(stats)
            metrics.update(timer.summary(num_tokens=num_tokens))
            history["loss"].append(metrics["value/loss"])
            history["ev"].append(metrics["value/explained_var"])
            meta["converged"] = step >= config.min_steps and converged(
                history["loss"], history["ev"], window=config.converge_window, rtol=config.converge_rtol,
                atol=config.converge_atol)
            metrics["value/converged"] = float(meta["converged"])
            run.log(step, metrics)
            done = meta["converged"] or step == config.max_steps
            if run.save(step, rt_lib.model_state_to_dict(state, "critic_params"), dict(meta, done=done), done=done):
                break
        if meta["converged"]:
            run.logger.print(f"{config.stage}: converged after {step} steps (value loss {history['loss'][-1]:.4f}, "
                             f"explained variance {history['ev'][-1]:.3f})")
        elif step >= config.max_steps:
            run.logger.print(f"{config.stage}: stopped at max_steps={config.max_steps} without meeting the "
                             "convergence tolerance")
    return metrics
