"""Dr. GRPO ("Understanding R1-Zero-like training", Liu et al. 2025): GRPO without the two length and difficulty
biases: group advantages are not divided by the group's reward std, and the loss sums each response's token terms
and divides by a constant (batch x max_response_len) instead of by the response's own length.

Run: python experiments/train.py --config=configs/drgrpo.py
"""

from vcppo_jax.config import base_rl_config


def get_config():
    c = base_rl_config("drgrpo")
    c.advantage = "group"
    c.group_size = 8
    c.prompts_per_step = 8
    c.kl_coef = 0.001
    c.kl_estimator = "k3"
    c.grpo_normalize_std = False
    c.loss_agg = "seq-mean-token-sum-norm"
    return c
