"""RL entrypoint: VC-PPO, PPO and GRPO on one loop.

  python experiments/train.py --config=configs/vcppo.py [--config.lambda_actor=0.99 ...]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from vcppo_jax import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "RL experiment config file.", lock_config=True)


def main(argv):
    del argv
    config = config_lib.validate(_CONFIG.value)
    print(config)


if __name__ == "__main__":
    app.run(main)
