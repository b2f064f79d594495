"""PPO baseline as in standard RLHF: one lambda (0.95) for actor and critic, critic initialized from an outcome
reward model (trained only at EOS), no value pretraining.

Run: python experiments/train.py --config=configs/ppo.py
"""

from vcppo_jax.config import base_rl_config


def get_config():
    c = base_rl_config("ppo")
    c.lambda_actor = 0.95
    c.lambda_critic = 0.95
    c.critic_init = "reward_model"
    c.critic_dir = "runs/default/reward_model"
    return c
