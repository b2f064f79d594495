"""VC-PPO value pretraining: frozen SFT policy samples, critic regresses Monte-Carlo returns until convergence.

  python experiments/pretrain_value.py --config=configs/value_pretrain.py
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vcppo_jax import stages  # noqa: E402

if __name__ == "__main__":
    stages.cli("Value-pretraining config file.")
