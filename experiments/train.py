"""RL entrypoint: VC-PPO, PPO and GRPO on one loop. Runs missing earlier stages (SFT, value pretraining or
reward model) first and reuses their checkpoints next time.

  python experiments/train.py --config=configs/vcppo.py [--config.lambda_actor=0.99 ...]
  python experiments/train.py --config=configs/ppo.py
  python experiments/train.py --config=configs/grpo.py
"""



from vcppo_jax import stages

if __name__ == "__main__":
    stages.cli("RL experiment config file.")
