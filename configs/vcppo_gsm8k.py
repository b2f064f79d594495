"""VC-PPO on GSM8K with a real policy of ~0.5B parameters (Qwen2.5-0.5B-Instruct or Qwen3-0.6B), from local files.

Prepare once, online or from copies (nothing is downloaded at run time):
  checkpoints/Qwen2.5-0.5B-Instruct/, checkpoints/Qwen3-0.6B/   HF folders: config.json, *.safetensors, tokenizer files
  python -c "from vcppo_jax.data.math_tasks import prepare_gsm8k as p; p('data/tfds', manual_dir='data/gsm8k')"
      # data/gsm8k: GSM8K's train.jsonl / test.jsonl (or no manual_dir, online: TFDS downloads them)
Run (one GPU, or every host of a TPU slice; the SFT cold start on GSM8K's worked solutions and value pretraining run
first when their checkpoints are missing):
  python experiments/train.py --config=configs/vcppo_gsm8k.py:qwen2.5-0.5b
  python experiments/train.py --config=configs/vcppo_gsm8k.py:qwen3-0.6b --config.mesh.fsdp=4
Add `--config.model.hf_path=DIR` for a folder elsewhere. Sizes follow the paper's recipe scaled to one device
(actor lr 1e-6, critic lr 2e-6, temperature 1.0, 512 responses of up to 1024 tokens per step); they have not been
run in this repository (no accelerator, no model files on its machines): check the memory plan before spending
accelerator hours.
"""

import ml_collections

from vcppo_jax.config import base_rl_config

# preset -> local HF folder
MODELS = {"qwen2.5-0.5b": "checkpoints/Qwen2.5-0.5B-Instruct", "qwen3-0.6b": "checkpoints/Qwen3-0.6B"}


def get_config(model: str = "qwen2.5-0.5b") -> ml_collections.ConfigDict:
    if model not in MODELS:
        raise ValueError(f"unknown model preset {model!r}; presets: {sorted(MODELS)} (or set --config.model.hf_path)")
    c = base_rl_config("vcppo")
    c.lambda_actor, c.lambda_critic, c.critic_init = 0.95, 1.0, "value_pretrain"
    root = f"runs/gsm8k_{model}"
    c.workdir, c.sft_dir, c.critic_dir = f"{root}/vcppo", f"{root}/sft", f"{root}/value_pretrain"
    c.model.hf_path = MODELS[model]
    c.model.dtype, c.model.remat = "bfloat16", True
    c.task.name, c.task.data_dir = "gsm8k", "data/tfds"
    c.task.knobs = ml_collections.ConfigDict()  # the default prompt template (math_tasks.DEFAULT_TEMPLATE)
    c.task.max_prompt_len, c.task.max_response_len = 256, 1024
    c.sampling.temperature = 1.0
    c.prompts_per_step, c.group_size, c.num_minibatches = 64, 8, 8
    c.actor_optim.lr, c.critic_optim.lr = 1e-6, 2e-6
    c.logprob_chunk = 256
    c.num_steps, c.eval_every, c.eval_prompts, c.save_every = 300, 25, 256, 25
    c.stage_overrides.sft.update(dict(num_steps=200, batch_size=64, eval_every=100, lr=1e-5))
    c.stage_overrides.value_pretrain.update(dict(max_steps=100, prompts_per_step=64, group_size=8, lr=2e-6))
    return c
