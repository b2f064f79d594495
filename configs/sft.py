"""Cold-start SFT of the policy on chain-of-thought traces of the synthetic task (a share in short direct style).

Run: python experiments/sft.py --config=configs/sft.py
"""

from vcppo_jax.config import base_sft_config


def get_config():
    return base_sft_config()
