"""VC-PPO value pretraining: the frozen SFT policy samples responses; the critic regresses Monte-Carlo returns
(GAE with lambda = 1) until value loss and explained variance converge. Its checkpoint seeds configs/vcppo.py.

Run: python experiments/pretrain_value.py --config=configs/value_pretrain.py
"""

from vcppo_jax.config import base_value_config


def get_config():
    return base_value_config("value_pretrain")
