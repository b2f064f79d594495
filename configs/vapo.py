"""VAPO (Yue et al. 2025): VC-PPO (value pretraining, decoupled GAE with lambda_critic 1.0) plus a length-adaptive
lambda_actor (1 - 1 / (alpha * length) per response), clip-higher (0.2 / 0.28), the token-mean loss and an NLL term
on the correct responses (weight 0.1).

Run: python experiments/train.py --config=configs/vapo.py
"""

from vcppo_jax.config import base_rl_config


def get_config():
    c = base_rl_config("vapo")
    c.lambda_critic = 1.0
    c.critic_init = "value_pretrain"
    c.critic_dir = "runs/default/value_pretrain"
    c.adaptive_lambda = True
    c.adaptive_lambda_alpha = 0.05
    c.clip_low, c.clip_high = 0.2, 0.28
    c.loss_agg = "token-mean"
    c.nll_coef = 0.1
    return c
