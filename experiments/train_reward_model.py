"""Outcome reward model (loss only at EOS) on frozen-policy samples; seeds the PPO baseline critic.

  python experiments/train_reward_model.py --config=configs/reward_model.py
"""



from vcppo_jax import stages

if __name__ == "__main__":
    stages.cli("Reward-model config file.")
