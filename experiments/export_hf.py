"""Exports a run's policy (RL: the actor; SFT: the model) as an HF folder with the run's tokenizer.

  python experiments/export_hf.py --config=configs/smollm2.py:grpo --out runs/smollm2/grpo_hf [--step=24]
"""



from absl import app, flags
from ml_collections import config_flags

from vcppo_jax import stages
from vcppo_jax.export import export_policy

CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file (its workdir holds the run).",
                                         lock_config=True)
OUT = flags.DEFINE_string("out", None, "Folder to write (config.json, model.safetensors, tokenizer files).",
                          required=True)
STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest readable one).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    out = stages.main_guard(lambda c: export_policy(c, OUT.value, step=STEP.value), CONFIG.value)
    print(f"[export] {CONFIG.value.workdir} -> {out}")


if __name__ == "__main__":
    app.run(main)
