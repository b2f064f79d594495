"""Cold-start SFT of the policy.

  python experiments/sft.py --config=configs/sft.py [--config.num_steps=600 ...]
"""



from vcppo_jax import stages

if __name__ == "__main__":
    stages.cli("SFT config file.")
