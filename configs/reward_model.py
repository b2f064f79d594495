"""Outcome reward model for the PPO baseline: a value model trained on frozen-policy samples with a loss only at
the EOS token (as in standard RLHF); configs/ppo.py initializes its critic from it.

Run: python experiments/train_reward_model.py --config=configs/reward_model.py
"""

from vcppo_jax.config import base_value_config


def get_config():
    return base_value_config("reward_model")
