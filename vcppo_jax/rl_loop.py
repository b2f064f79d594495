"""The RL loop for VC-PPO / PPO / GRPO: rollout -> reward -> experience (decoupled GAE) -> update -> eval -> save.

Every step is reproducible from (seed, step): prompts come from `batch_indices(seed, step)` and the sampling key is
`fold_in(seed key, step)`, so a resumed run continues exactly where the checkpoint left it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vcppo_jax import builders
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import config as config_lib
from vcppo_jax import hooks
from vcppo_jax import metrics as metrics_lib
from vcppo_jax import rl
from vcppo_jax import runtime as rt_lib
from vcppo_jax import stage_meta
from vcppo_jax.compile_options import jit_training
from vcppo_jax.data.batching import batch_indices
from vcppo_jax.metrics import Timer
from vcppo_jax.models import CausalLM, ValueModel, critic_params_from_actor, shift_value_head
from vcppo_jax.optim import init_model_state, learning_rate, make_optimizer
from vcppo_jax.rollout import (evaluate, generate_and_score, prompt_batch, sample_filtered, shuffle_rewards,
                               whole_batch_stats, with_seq_rewards)
from vcppo_jax.sampling import sampler_from_config

CRITIC_HINTS = {"value_pretrain": "run experiments/pretrain_value.py first or set config.critic_init",
                "reward_model": "run experiments/train_reward_model.py first or set config.critic_init"}


def state_to_dict(state: rl.RLState) -> dict:
    d = {"actor": rt_lib.model_state_to_dict(state.actor), "rng": state.rng, "step": state.step}
    if state.critic is not None:
        d["critic"] = rt_lib.model_state_to_dict(state.critic, "critic_params")
    if state.ref_params is not None:
        d["ref_params"] = state.ref_params
    return d


def state_from_dict(d: dict) -> rl.RLState:
    critic = rt_lib.model_state_from_dict(d["critic"], "critic_params") if "critic" in d else None
    return rl.RLState(actor=rt_lib.model_state_from_dict(d["actor"]), critic=critic,
                      ref_params=d.get("ref_params"), rng=d["rng"], step=d["step"])


def run_rl(config: ml_collections.ConfigDict) -> dict:
    """Runs `config.num_steps` RL iterations (resuming from `config.workdir`); returns the last evaluation."""
    config_lib.validate(config)
    hp = rl.RLHparams.from_config(config)
    batch = config.prompts_per_step * config.group_size
    rt = rt_lib.make_runtime(config)

    sft_meta = stage_meta.finished_meta(config.sft_dir, "sft")
    if hp.has_critic and config.critic_init != "actor":
        stage_meta.finished_meta(config.critic_dir, config.critic_init)
    cfg = builders.model_config_from_json(sft_meta["model_config"], config)
    tok = builders.tokenizer(config)
    train = builders.prompt_source(config, config.task.train_split, tok)
    test = builders.prompt_source(config, config.task.test_split, tok)
    verifier = builders.verifier(config)
    actor, critic = CausalLM(cfg), (ValueModel(cfg) if hp.has_critic else None)
    actor_tx = make_optimizer(config.actor_optim)
    critic_tx = make_optimizer(config.critic_optim) if hp.has_critic else None
    P, R = config.task.max_prompt_len, config.task.max_response_len

    # ---- the train state: restored, or the SFT policy and the configured critic ---------------------------------
    actor_params_abs = rt_lib.abstract_params(actor)
    actor_params_target = rt.target(actor_params_abs)
    key = jax.random.PRNGKey(config.seed)
    layout = {"actor": rt_lib.model_state_to_dict(rt_lib.abstract_model_state(actor, actor_tx)),
              "rng": jax.ShapeDtypeStruct(key.shape, key.dtype), "step": jax.ShapeDtypeStruct((), np.int32)}
    if hp.has_critic:
        layout["critic"] = rt_lib.model_state_to_dict(rt_lib.abstract_model_state(critic, critic_tx), "critic_params")
    if config.kl_coef > 0:
        layout["ref_params"] = actor_params_abs

    def init(shardings) -> dict:
        policy = builders.load_policy(config.sft_dir, actor_params_target)
        # Copies: the state is donated to `update`, and device_put would alias `key` / `policy` buffers.
        state = {"actor": rt_lib.model_state_to_dict(init_model_state(policy, actor_tx)), "rng": jnp.copy(key),
                 "step": np.zeros((), np.int32)}
        if hp.has_critic:
            if config.critic_init == "actor":
                critic_params = critic_params_from_actor({"params": policy})["params"]
            else:
                critic_params = ckpt_lib.load_params(config.critic_dir, rt.target(rt_lib.abstract_params(critic)),
                                                     key="critic_params", hint=CRITIC_HINTS[config.critic_init])
            if config.critic_init_bias:
                critic_params = shift_value_head(critic_params, config.critic_init_bias)
            state["critic"] = rt_lib.model_state_to_dict(init_model_state(critic_params, critic_tx), "critic_params")
        if config.kl_coef > 0:
            state["ref_params"] = jax.tree.map(jnp.copy, policy)
        return jax.device_put(state, shardings)

    ckpt, state_d, meta, start = rt_lib.restore_or_init_state(rt, config, layout, init)
    prov = stage_meta.provenance(config, meta)
    state = state_from_dict(state_d)
    state_sh = jax.tree.map(lambda x: x.sharding, state)

    # ---- jitted pure steps -----------------------------------------------------------------------------------
    with rt.context():
        make_experience = jit_training(rl.make_experience_fn(hp, actor, critic), in_shardings=(state_sh, None))
        update = jit_training(rl.make_update_fn(hp, actor, critic, actor_tx, critic_tx),
                              in_shardings=(state_sh, None), out_shardings=(state_sh, None), donate_argnums=0)
    s, stop_tokens = config.sampling, builders.stop_ids(config, tok)
    sampler = sampler_from_config(actor, s, max_new_tokens=R, eos_id=stop_tokens, pad_id=tok.pad_token_id)
    greedy = sampler_from_config(actor, s, max_new_tokens=R, eos_id=stop_tokens, pad_id=tok.pad_token_id, greedy=True)
    # Drift control: KL(policy || SFT policy) on the probe prompts (the first `eval_prompts` test records).
    # With a KL penalty the state already holds the SFT policy (`ref_params`); it is read from the live state at
    # each eval and passed as an argument, never closed over: `update` donates the state's buffers.
    sft_params = None
    if config.eval_kl_to_sft:
        if state.ref_params is None:
            sft_params = builders.load_policy(config.sft_dir, actor_params_target)
        with rt.context():
            policy_logprobs = jit_training(lambda params, tokens, mask: rl.policy_logprobs(
                actor, params, tokens, mask, prompt_len=P, chunk=hp.logprob_chunk, temperature=hp.temperature)[0])

    logger = rt_lib.StepLogger(config, total=config.num_steps, initial=start, desc=config.algorithm,
                               show=("rollout/accuracy", "rollout/response_length_mean", "value/explained_var",
                                     "diag/adv_length_corr"))
    timer = Timer()
    rows = rt.local_rows(batch)  # this process's rows of each step's batch
    # Histories of the collapse signals (metrics.collapse_warning), kept in the checkpoint meta across resumes.
    collapse_history: dict[str, list[float]] = {k: list(v) for k, v in meta.get("collapse_signals", {}).items()}
    last_eval: dict = dict(meta.get("eval", {}))

    def run_eval(step: int) -> None:
        nonlocal last_eval
        kw = dict(num_prompts=config.eval_prompts, batch_size=min(config.eval_prompts, batch), max_prompt_len=P,
                  correct=config.reward_correct, rng=key, io=rt)
        last_eval = evaluate(greedy, state.actor.params, test, tok, verifier, **kw)
        if config.eval_kl_to_sft:
            # The same prompts sampled as in training: sampled pass@1 and the drift from the SFT policy.
            ref = state.ref_params if state.ref_params is not None else sft_params
            probe = evaluate(sampler, state.actor.params, test, tok, verifier, prefix="probe",
                             ref_logprobs=functools.partial(policy_logprobs, ref), **kw)
            last_eval.update({k.replace("kl_to_ref", "kl_to_sft"): v for k, v in probe.items()
                              if not k.endswith("direct_fraction")})
        logger.write(step, last_eval)

    def sample_round(step: int, k: int) -> rl.Rollout:
        """This process's rows of round k of step's rollout: round 0 is the step's batch; later rounds (dynamic
        sampling) draw other prompts from their own deterministic stream, so a resumed run draws the same ones."""
        seed, rng = config.seed, jax.random.fold_in(key, step)
        if k:
            seed, rng = config.seed * 1000 + k, jax.random.fold_in(rng, k)
        idx = batch_indices(len(train), config.prompts_per_step, step, seed)
        pb = prompt_batch(train, idx, tok, max_prompt_len=P, group_size=config.group_size)
        return generate_and_score(sampler, state.actor.params, pb, rng, tok, verifier, rt)[0]

    try:
        with ckpt_lib.preemption_guard() as guard, rt.context():
            if start == 0:
                run_eval(0)
            for step in range(start, config.num_steps):
                with timer.section("rollout"):
                    # Host hooks (vcppo_jax/hooks.py) then the control change only what the update trains on;
                    # the rollout stats below report round 0's verifier rewards.
                    rollout, train_rollout, m_host = sample_filtered(
                        functools.partial(sample_round, step), config.group_filter, config.group_size,
                        config.max_sampling_rounds, rows, rt)
                    train_rollout = with_seq_rewards(train_rollout, hooks.shape_rewards(
                        config.reward_shaping, train_rollout.seq_rewards, train_rollout.response_mask.sum(axis=1),
                        max_len=R, buffer=config.overlong_buffer, penalty=config.overlong_penalty))
                    if config.shuffle_rewards:
                        train_rollout = shuffle_rewards(train_rollout, np.random.default_rng([config.seed, step]),
                                                        rows, rt)
                with timer.section("experience"):
                    # Blocks: jit returns before the work is done, which would charge it to the update.
                    experience, m_exp = jax.block_until_ready(make_experience(state, rt.place_batch(train_rollout)))
                with timer.section("update"):
                    state, m_up = update(state, experience)
                    m, actor_updates = rt.fetch(({**m_exp, **m_up}, state.actor.step))
                logger.count_nonfinite(step, float(m["train/nonfinite"]))
                stats, num_tokens = whole_batch_stats(rollout, config.reward_correct, R, rows, rt)
                num_tokens = int(m_host.pop("rollout/sampled_tokens", num_tokens))  # dynamic sampling: every round's
                m = {k: float(v) for k, v in {**m, **m_host}.items()}
                m.update(stats)
                # The lr of the iteration's last optimizer update (the schedule counts minibatch updates).
                m["policy/lr"] = float(learning_rate(config.actor_optim, max(int(actor_updates) - 1, 0)))
                m.update(timer.summary(num_tokens=num_tokens))
                for signal in ("adv_length_corr", "value_err_first"):  # meta keys without '/'
                    collapse_history.setdefault(signal, []).append(m.get(f"diag/{signal}", 0.0))  # GRPO: no error
                warning = metrics_lib.collapse_warning(collapse_history["adv_length_corr"],
                                                       collapse_history["value_err_first"])
                if warning:
                    logger.print(f"step {step + 1}: {warning}")
                logger.log(step + 1, m)
                done = step + 1 == config.num_steps
                if (step + 1) % config.eval_every == 0 or done:
                    run_eval(step + 1)
                # Collective: every host saves the same step, even if only one was signalled.
                stop = guard.should_stop_any()
                if done or (step + 1) % config.save_every == 0 or stop:
                    meta = {"stage": "rl", "algorithm": config.algorithm, "done": done, "eval": last_eval,
                            "collapse_signals": collapse_history, "model_config": sft_meta["model_config"],
                            "provenance": prov}
                    ckpt.save(step + 1, state_to_dict(state), meta, force=True)
                if stop:
                    logger.print(f"preempted: saved step {step + 1}")
                    break
    finally:
        ckpt.wait()
        ckpt.close()
        logger.close()
    return last_eval
