"""GRPO baseline (DeepSeek-R1 style): no critic, group-relative advantages over `group_size` samples per prompt.

Run: python experiments/train.py --config=configs/grpo.py
"""

from vcppo_jax.config import base_rl_config


def get_config():
    c = base_rl_config("grpo")
    c.advantage = "group"
    c.group_size = 8
    c.prompts_per_step = 8  # 8 prompts x 8 samples: the same 64 responses per step as PPO and VC-PPO
    c.kl_coef = 0.001
    c.kl_estimator = "k3"
    c.grpo_normalize_std = True
    return c
