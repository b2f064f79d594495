"""Outcome reward model (loss only at EOS) on frozen-policy samples; seeds the PPO baseline critic.

  python experiments/train_reward_model.py --config=configs/reward_model.py
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vcppo_jax import stages  # noqa: E402

if __name__ == "__main__":
    stages.cli("Reward-model config file.")
