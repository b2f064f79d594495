"""The RL loop for VC-PPO / PPO / GRPO (paper Algorithm 1): rollout -> rewards -> experience (decoupled GAE) ->
update -> log -> evaluate -> save.

Every step is reproducible from (seed, step): prompts come from `batch_indices(seed, step)` and the sampling key is
`fold_in(seed key, step)`, so a resumed run continues exactly where the checkpoint left it.

The programs a run compiles (`programs`) and its train state's layout (`abstract_state`) are defined once here, and
`dry_run` compiles the same ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vcppo_jax import builders
from vcppo_jax import config as config_lib
from vcppo_jax import hooks
from vcppo_jax import metrics as metrics_lib
from vcppo_jax import rewards
from vcppo_jax import rl
from vcppo_jax import runtime as rt_lib
from vcppo_jax import stage_meta
from vcppo_jax.compile_options import jit_training
from vcppo_jax.data.batching import batch_indices
from vcppo_jax.metrics import Timer
from vcppo_jax.models import CausalLM, ValueModel
from vcppo_jax.optim import init_model_state, learning_rate, make_optimizer
from vcppo_jax.rollout import (evaluate, generate_and_score, prompt_batch, sample_filtered, shuffle_rewards,
                               whole_batch_stats, with_seq_rewards)
from vcppo_jax.sampling import sampler_from_config
from vcppo_jax.stage_run import stage_run

# The progress bar's postfix.
SHOW = ("rollout/accuracy", "rollout/response_length_mean", "value/explained_var", "diag/adv_length_corr")


class Models(NamedTuple):
    """The networks and optimizers of an RL run; no critic without GAE (`rl.RLHparams.has_critic`)."""
    actor: CausalLM
    critic: ValueModel | None
    actor_tx: optax.GradientTransformation
    critic_tx: optax.GradientTransformation | None

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, cfg) -> "Models":
        has_critic = rl.RLHparams.from_config(config).has_critic
        return cls(CausalLM(cfg), ValueModel(cfg) if has_critic else None, make_optimizer(config.actor_optim),
                   make_optimizer(config.critic_optim) if has_critic else None)


class Programs(NamedTuple):
    """The jitted programs of an RL run."""
    sampler: Callable  # (params, prompt tokens [B, P], prompt mask [B, P], rng) -> SampleOutput, training temperature
    greedy: Callable  # the same at temperature 0: evaluation
    experience: Callable  # (state, rollout) -> (experience, metrics)
    update: Callable  # (state, experience) -> (state, metrics); donates the state
    policy_logprobs: Callable  # (params, tokens [B, P+R], attn_mask [B, P+R]) -> [B, R]: the drift probe's reference


def init_state(policy: Any, critic_params: Any, key: jax.Array, models: Models, *, kl_coef: float) -> rl.RLState:
    """The state RL starts from: the policy and the critic (None: no critic) with fresh optimizer states, the policy
    again as the KL reference (only when kl_coef > 0), the rng `key`, step 0. Copies the reference and the key: the
    state is donated to `update`, and device_put would alias the inputs' buffers."""
    return rl.RLState(actor=init_model_state(policy, models.actor_tx),
                      critic=None if critic_params is None else init_model_state(critic_params, models.critic_tx),
                      ref_params=jax.tree.map(jnp.copy, policy) if kl_coef > 0 else None, rng=jnp.copy(key),
                      step=jnp.zeros((), jnp.int32))


def abstract_state(config: ml_collections.ConfigDict, models: Models) -> rl.RLState:
    """The layout of `init_state` (boxed with logical axis names: `Runtime.target` shards it)."""
    critic = rt_lib.abstract_params(models.critic) if models.critic is not None else None
    return jax.eval_shape(functools.partial(init_state, models=models, kl_coef=config.kl_coef),
                          rt_lib.abstract_params(models.actor), critic, jax.random.PRNGKey(0))


def state_to_dict(state: rl.RLState) -> dict:
    """The checkpoint's tree: {'actor', 'critic' (with a critic), 'ref_params' (with a KL term), 'rng', 'step'}."""
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


def programs(config: ml_collections.ConfigDict, models: Models, state_shardings: rl.RLState, tok, *,
             backend: str | None = None) -> Programs:
    """The run's programs over a state placed on `state_shardings`. backend: whose training compiler options
    (`compile_options`; default: this host's)."""
    hp = rl.RLHparams.from_config(config)
    jit = functools.partial(jit_training, backend=backend)
    sample = functools.partial(sampler_from_config, models.actor, config.sampling,
                               max_new_tokens=config.task.max_response_len, eos_id=builders.stop_ids(config, tok),
                               pad_id=tok.pad_token_id)
    return Programs(
        sampler=sample(), greedy=sample(greedy=True),
        experience=jit(rl.make_experience_fn(hp, models.actor, models.critic), in_shardings=(state_shardings, None)),
        update=jit(rl.make_update_fn(hp, *models), in_shardings=(state_shardings, None),
                   out_shardings=(state_shardings, None), donate_argnums=0),
        policy_logprobs=jit(lambda params, tokens, mask: rl.policy_logprobs(
            models.actor, params, tokens, mask, prompt_len=hp.prompt_len, chunk=hp.logprob_chunk,
            temperature=hp.temperature)[0]))


@dataclasses.dataclass
class Evaluator:
    """Greedy pass@1 on the first `eval_prompts` test prompts; with `eval_kl_to_sft` also the drift probe: the same
    prompts sampled as in training, their pass@1 and KL(policy || SFT policy). The SFT policy is the state's KL
    reference when it holds one (read from the live state at each call: `update` donates the state's buffers), else
    `sft_params`."""
    config: ml_collections.ConfigDict
    progs: Programs
    test: Any
    tok: Any
    verifier: Callable
    rt: rt_lib.Runtime
    sft_params: Any = None

    def __call__(self, state: rl.RLState) -> dict[str, float]:
        c = self.config
        kw = dict(num_prompts=c.eval_prompts, batch_size=min(c.eval_prompts, c.prompts_per_step * c.group_size),
                  max_prompt_len=c.task.max_prompt_len, correct=c.reward_correct,
                  rng=jax.random.PRNGKey(c.seed), io=self.rt)
        out = evaluate(self.progs.greedy, state.actor.params, self.test, self.tok, self.verifier,
                       extract_answer=rewards.answer_extractor(c.task.name), **kw)
        if c.eval_kl_to_sft:
            ref = state.ref_params if state.ref_params is not None else self.sft_params
            probe = evaluate(self.progs.sampler, state.actor.params, self.test, self.tok, self.verifier,
                             prefix="probe", ref_logprobs=functools.partial(self.progs.policy_logprobs, ref), **kw)
            out.update({k.replace("kl_to_ref", "kl_to_sft"): v for k, v in probe.items()
                        if not k.endswith("direct_fraction")})
        return out


def rollout_collector(config: ml_collections.ConfigDict, sampler: Callable, train, tok, verifier: Callable,
                      rt: rt_lib.Runtime) -> Callable[[Any, int], tuple[rl.Rollout, rl.Rollout, dict]]:
    """`collect(params, step) -> (rollout, train rollout, host metrics)`: this process's rows of step's sampled and
    scored batch (group-filtered rounds, `sample_filtered`), and what the update trains on: the rewards after the
    host hooks (`hooks.py`) and the shuffled-reward control."""
    key, rows = jax.random.PRNGKey(config.seed), rt.local_rows(config.prompts_per_step * config.group_size)

    def sample_round(params, step: int, k: int) -> rl.Rollout:
        # Round 0 is the step's batch; later rounds (dynamic sampling) draw other prompts from their own
        # deterministic stream, so a resumed run draws the same ones.
        seed, rng = config.seed, jax.random.fold_in(key, step)
        if k:
            seed, rng = config.seed * 1000 + k, jax.random.fold_in(rng, k)
        idx = batch_indices(len(train), config.prompts_per_step, step, seed)
        pb = prompt_batch(train, idx, tok, max_prompt_len=config.task.max_prompt_len, group_size=config.group_size)
        return generate_and_score(sampler, params, pb, rng, tok, verifier, rt)[0]

    def collect(params, step: int):
        rollout, train_rollout, m_host = sample_filtered(functools.partial(sample_round, params, step),
                                                         config.group_filter, config.group_size,
                                                         config.max_sampling_rounds, rows, rt)
        train_rollout = with_seq_rewards(train_rollout, hooks.shape_rewards(
            config.reward_shaping, train_rollout.seq_rewards, train_rollout.response_mask.sum(axis=1),
            max_len=config.task.max_response_len, buffer=config.overlong_buffer, penalty=config.overlong_penalty))
        if config.shuffle_rewards:
            train_rollout = shuffle_rewards(train_rollout, np.random.default_rng([config.seed, step]), rows, rt)
        return rollout, train_rollout, m_host

    return collect


def step_metrics(config: ml_collections.ConfigDict, device: dict, host: dict, rollout: rl.Rollout,
                 actor_updates: int, timer: Timer, rt: rt_lib.Runtime) -> dict[str, float]:
    """One step's metrics: the experience and update programs' (`device`), the rollout's over the whole batch
    (round 0's verifier rewards, whatever the hooks or the control trained on), the learning rate, the timings."""
    rows = rt.local_rows(config.prompts_per_step * config.group_size)
    stats, num_tokens = whole_batch_stats(rollout, config.reward_correct, config.task.max_response_len, rows, rt)
    host = dict(host)
    num_tokens = int(host.pop("rollout/sampled_tokens", num_tokens))  # dynamic sampling: every round's tokens
    m = {k: float(v) for k, v in {**device, **host}.items()}
    m.update(stats)
    # The lr of the iteration's last optimizer update (the schedule counts minibatch updates).
    m["policy/lr"] = float(learning_rate(config.actor_optim, max(actor_updates - 1, 0)))
    m.update(timer.summary(num_tokens=num_tokens))
    return m


class CollapseSignals:
    """Histories of the length-collapse signals (`metrics.collapse_warning`), kept in the checkpoint meta."""

    KEYS = ("adv_length_corr", "value_err_first")  # the diag/ metrics; meta keys without '/'

    def __init__(self, history: dict[str, list[float]]):
        self.history = {k: list(v) for k, v in history.items()}

    def update(self, m: dict[str, float]) -> str | None:
        """Appends this step's signals; the warning to print, if any."""
        for signal in self.KEYS:
            self.history.setdefault(signal, []).append(m.get(f"diag/{signal}", 0.0))  # GRPO: no value error
        return metrics_lib.collapse_warning(self.history["adv_length_corr"], self.history["value_err_first"])


def run_rl(config: ml_collections.ConfigDict) -> dict:
    """Runs `config.num_steps` RL iterations (resuming from `config.workdir`); returns the last evaluation."""
    config_lib.validate(config)
    rt = rt_lib.make_runtime(config)
    sft_meta = stage_meta.finished_meta(config.sft_dir, "sft")
    if config_lib.has_critic(config) and config.critic_init != "actor":
        stage_meta.finished_meta(config.critic_dir, config.critic_init)
    models = Models.from_config(config, builders.model_config_from_json(sft_meta["model_config"], config))
    tok, verifier = builders.tokenizer(config), builders.verifier(config)
    train = builders.prompt_source(config, config.task.train_split, tok)
    test = builders.prompt_source(config, config.task.test_split, tok)
    policy_target = rt.target(rt_lib.abstract_params(models.actor))
    layout = abstract_state(config, models)
    progs = programs(config, models, jax.tree.map(lambda x: x.sharding, rt.target(layout)), tok)
    collect = rollout_collector(config, progs.sampler, train, tok, verifier, rt)

    def init(shardings) -> dict:
        policy = builders.load_policy(config.sft_dir, policy_target)
        critic = (builders.load_critic(config, policy, rt.target(rt_lib.abstract_params(models.critic)))
                  if models.critic is not None else None)
        state = init_state(policy, critic, jax.random.PRNGKey(config.seed), models, kl_coef=config.kl_coef)
        return jax.device_put(state_to_dict(state), shardings)

    timer = Timer()
    with stage_run(config, rt, state_to_dict(layout), init, total=config.num_steps, desc=config.algorithm,
                   show=SHOW) as (run, state):
        state = state_from_dict(state)
        sft_params = (builders.load_policy(config.sft_dir, policy_target)
                      if config.eval_kl_to_sft and state.ref_params is None else None)
        evaluator = Evaluator(config, progs, test, tok, verifier, rt, sft_params)
        collapse = CollapseSignals(run.meta.get("collapse_signals", {}))
        meta = {"stage": "rl", "algorithm": config.algorithm, "eval": dict(run.meta.get("eval", {})),
                "collapse_signals": collapse.history, "model_config": sft_meta["model_config"],
                "provenance": stage_meta.provenance(config, run.meta)}
        if run.start == 0:
            meta["eval"] = run.logger.write(0, evaluator(state))
        for step in range(run.start, config.num_steps):
            with timer.section("rollout"):
                rollout, train_rollout, m_host = collect(state.actor.params, step)
            with timer.section("experience"):
                # Blocks: jit returns before the work is done, which would charge it to the update.
                experience, m_exp = jax.block_until_ready(progs.experience(state, rt.place_batch(train_rollout)))
            with timer.section("update"):
                state, m_up = progs.update(state, experience)
                m_dev, actor_updates = rt.fetch(({**m_exp, **m_up}, state.actor.step))
            m = step_metrics(config, m_dev, m_host, rollout, int(actor_updates), timer, rt)
            if warning := collapse.update(m):
                run.logger.print(f"step {step + 1}: {warning}")
            run.log(step + 1, m)
            done = step + 1 == config.num_steps
            if (step + 1) % config.eval_every == 0 or done:
                meta["eval"] = run.logger.write(step + 1, evaluator(state))
            meta.update(done=done, collapse_signals=collapse.history)
            if run.save(step + 1, state_to_dict(state), dict(meta), done=done):
                break
    return meta["eval"]
