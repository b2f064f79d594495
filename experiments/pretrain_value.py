"""VC-PPO value pretraining: frozen SFT policy samples, critic regresses Monte-Carlo returns until convergence.

  python experiments/pretrain_value.py --config=configs/value_pretrain.py
"""



from vcppo_jax import stages

if __name__ == "__main__":
    stages.cli("Value-pretraining config file.")
