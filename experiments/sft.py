"""Cold-start SFT of the policy.

  python experiments/sft.py --config=configs/sft.py [--config.num_steps=600 ...]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vcppo_jax import stages  # noqa: E402

if __name__ == "__main__":
    stages.cli("SFT config file.")
