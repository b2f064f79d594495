"""DAPO (Yu et al. 2025): GRPO's group advantages without a KL term, plus clip-higher (0.2 / 0.28), the token-mean
loss, dynamic sampling (only prompt groups neither all right nor all wrong train; more prompts are sampled to fill the
batch) and a soft overlong penalty over the last quarter of the response budget.

Run: python experiments/train.py --config=configs/dapo.py
"""

from vcppo_jax.config import base_rl_config


def get_config():
    c = base_rl_config("dapo")
    c.advantage = "group"
    c.group_size = 8
    c.prompts_per_step = 8
    c.kl_coef = 0.0
    c.clip_low, c.clip_high = 0.2, 0.28
    c.loss_agg = "token-mean"
    c.group_filter = "mixed"
    c.max_sampling_rounds = 3
    c.reward_shaping = "overlong"
    c.overlong_buffer = c.task.max_response_len // 4
    c.overlong_penalty = 1.0
    return c
