"""VC-PPO (paper Algorithm 1): critic from value pretraining, decoupled GAE (lambda_actor 0.95, lambda_critic 1.0).

Run (CPU, synthetic task; runs SFT and value pretraining first if their checkpoints are missing):
  python experiments/train.py --config=configs/vcppo.py
  python experiments/train.py --config=configs/vcppo.py --config.lambda_actor=0.99
"""

from vcppo_jax.config import base_rl_config


def get_config():
    c = base_rl_config("vcppo")
    c.lambda_actor = 0.95
    c.lambda_critic = 1.0
    c.critic_init = "value_pretrain"
    c.critic_dir = "runs/default/value_pretrain"
    return c
