"""RL learns a real (small) task through the real parts, and a shuffled-reward control does not.

Task: every 2-term 1-digit addition `a+b=?` (100 prompts), answered `Answer: <sum>` and scored by the synthetic
task's verifier. A 1-layer policy is first fit (with the project's SFT loss) to noisy labels: the right sum with
probability 0.4, otherwise the sum off by 1 or 2. It converges to a policy that samples the right answer about as
often as the labels did, whose mistakes are plausible answers: headroom that only the reward can tell apart.
GRPO then runs through `prompt_batch` (groups), the jitted sampler, the verifier, `to_rollout`, `make_experience`
and `update`. With the true rewards sampled accuracy must rise by a wide margin; with the rewards permuted across
the batch (the control: same rewards and lengths, no link to the answers) it must not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcppo_jax import config as config_lib
from vcppo_jax import rl
from vcppo_jax import rollout as rollout_lib
from vcppo_jax.data import RecordSource
from vcppo_jax.data.batching import encode_sft
from vcppo_jax.models import CausalLM, ModelConfig, init_params
from vcppo_jax.optim import init_model_state, make_optimizer, train_epochs
from vcppo_jax.rewards import make_verifier
from vcppo_jax.sampling import make_sampler
from vcppo_jax.sft import sft_loss_fn
from vcppo_jax.tokenizer import synthetic_tokenizer

P, R = 8, 12  # '[BOS]a+b=?\n' is 7 tokens; 'Answer: 18' + EOS is 11.
PROMPTS, GROUP, RL_STEPS = 32, 8, 30
TOK = synthetic_tokenizer()
CFG = ModelConfig(vocab_size=len(TOK), hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=32)
ACTOR = CausalLM(CFG)
RECORDS = [{"prompt": f"{a}+{b}=?\n", "answer": str(a + b)} for a in range(10) for b in range(10)]
SOURCE = RecordSource(RECORDS, fields=("prompt", "answer"))
VERIFIER = make_verifier("synthetic")


def rl_config(shuffle: bool):
    c = config_lib.base_rl_config("grpo")
    c.advantage = "group"
    c.task.max_prompt_len, c.task.max_response_len = P, R
    c.prompts_per_step, c.group_size, c.num_minibatches = PROMPTS, GROUP, 4
    c.kl_coef = 0.0
    c.sampling.temperature = 1.0
    c.actor_optim.lr = 1e-3
    c.actor_optim.warmup_steps = 10  # Adam's first updates are lr * sign(grad) on every weight: ramp up.
    c.logprob_chunk = R
    c.shuffle_rewards = shuffle
    return config_lib.validate(c)


@functools.lru_cache
def sft_policy():
    """The noisy-label SFT policy (deterministic for its seed)."""
    c = config_lib.base_sft_config()
    c.optim.lr, c.optim.warmup_steps, c.optim.decay_steps = 3e-3, 10, 290
    tx = make_optimizer(c.optim)
    state = init_model_state(init_params(ACTOR, jax.random.PRNGKey(0))["params"], tx)
    loss_fn = sft_loss_fn(ACTOR, chunk=R)
    step = jax.jit(lambda s, b: train_epochs(s, b, jax.random.PRNGKey(0), loss_fn, tx, num_epochs=1,
                                             num_minibatches=1))
    rs = np.random.RandomState(0)
    for _ in range(300):
        idx = rs.randint(0, len(RECORDS), size=64)
        offsets = np.where(rs.rand(64) < 0.4, 0, rs.choice([-2, -1, 1, 2], size=64))
        targets = [f"Answer: {max(int(RECORDS[i]['answer']) + o, 0)}" for i, o in zip(idx, offsets)]
        enc = encode_sft(TOK, [RECORDS[i]["prompt"] for i in idx], targets, P, R)
        state, _ = step(state, {"tokens": enc["tokens"], "attn_mask": enc["attention_mask"] > 0,
                                "response_mask": enc["response_mask"].astype(np.float32)})
    return state.params


def sampled_accuracy(sampler, params, seed: int) -> float:
    """Mean reward-correct rate over 4 samples of each of the 100 prompts."""
    batch = rollout_lib.prompt_batch(SOURCE, range(len(RECORDS)), TOK, max_prompt_len=P, group_size=4)
    rollout, _ = rollout_lib.generate_and_score(sampler, params, batch, jax.random.key(seed), TOK, VERIFIER)
    return float((rollout.seq_rewards > 0).mean())


def run_grpo(shuffle: bool):
    c = rl_config(shuffle)
    hp = rl.RLHparams.from_config(c)
    tx = make_optimizer(c.actor_optim)
    make_exp = jax.jit(rl.make_experience_fn(hp, ACTOR, None))
    update = jax.jit(rl.make_update_fn(hp, ACTOR, None, tx, None))
    sampler = make_sampler(ACTOR, max_new_tokens=R, eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id,
                           temperature=c.sampling.temperature)
    params = sft_policy()
    state = rl.RLState(actor=init_model_state(params, tx), critic=None, ref_params=None, rng=jax.random.key(1),
                       step=jnp.zeros((), jnp.int32))
    before = sampled_accuracy(sampler, state.actor.params, 10_000)
    rs = np.random.RandomState(1)
    for step in range(RL_STEPS):
        batch = rollout_lib.prompt_batch(SOURCE, rs.choice(len(RECORDS), PROMPTS, replace=False), TOK,
                                         max_prompt_len=P, group_size=GROUP)
        rollout, _ = rollout_lib.generate_and_score(sampler, state.actor.params, batch, jax.random.key(step), TOK,
                                                    VERIFIER)
        if shuffle:
            rollout = rollout_lib.shuffle_rewards(rollout, np.random.default_rng(step))
        experience, _ = make_exp(state, rollout)
        state, _ = update(state, experience)
    return before, sampled_accuracy(sampler, state.actor.params, 10_000)


def test_sft_policy_has_headroom():
    sampler = make_sampler(ACTOR, max_new_tokens=R, eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id,
                           temperature=1.0)
    acc = sampled_accuracy(sampler, sft_policy(), 7)
    assert 0.2 < acc < 0.6, acc


@pytest.mark.parametrize("shuffle", [False, True], ids=["true_rewards", "shuffled_control"])
def test_grpo_learns_addition_and_the_control_does_not(shuffle):
    before, after = run_grpo(shuffle)
    if shuffle:
        assert after < before + 0.05, (before, after)
    else:
        assert after > before + 0.12, (before, after)
