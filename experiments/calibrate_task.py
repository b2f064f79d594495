"""How hard is a task for the starting policy? Sampled pass@1 of a run's starting policy over a grid of task knobs.

RL needs a task the policy sometimes solves: at pass@1 near 0 a rollout group almost never holds a correct answer
(no signal), near 1 there is nothing left to learn. For each knob setting this samples one response per test problem
with the config's policy (`sft_dir`: an SFT run or an HF folder), chat template and sampling temperature, and reports
pass@1, the format rate (a `\\boxed{}` in the response), the fraction that ended before `max_response_len`, and the
mean response length.

  python experiments/calibrate_task.py --config=configs/smollm2.py:vcppo --num=64 \\
      --grid='[{"max_ops": 1, "max_value": 10}, {"max_ops": 2}]' --out=experiments/results/real_model/calibration.json

Each grid entry updates the config's `task.knobs` (a "template" key sets `task.knobs.template`).
"""

import json
import pathlib
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

import provenance
from vcppo_jax import builders, rewards, rollout
from vcppo_jax.models import CausalLM, load_hf_checkpoint
from vcppo_jax.models.hf import is_hf_checkpoint
from vcppo_jax.sampling import make_sampler

FLAGS = flags.FLAGS


def sample_stats(sampler, params, source, tok, verifier, *, num: int, batch: int, max_prompt_len: int) -> dict:
    """One sampled response to each of the first `num` problems of `source`: pass@1, format and length."""
    correct, boxed, ended, lengths = [], [], [], []
    for start in range(0, num, batch):
        b = rollout.prompt_batch(source, range(start, start + batch), tok, max_prompt_len=max_prompt_len)
        out, texts = rollout.generate_and_score(sampler, params, b, jax.random.PRNGKey(start), tok, verifier)
        n = out.response_mask.sum(axis=1).astype(int)  # [batch] response tokens, the stop token included
        last = np.asarray(out.tokens)[np.arange(len(n)), b.tokens.shape[1] + n - 1]
        correct += list(out.seq_rewards > 0)
        boxed += ["\\boxed{" in t for t in texts]
        ended += list(np.isin(last, sampler.stop_ids))  # it stopped, rather than ran into max_response_len
        lengths += list(n)
    return {"pass@1": float(np.mean(correct)), "boxed_fraction": float(np.mean(boxed)),
            "ended_fraction": float(np.mean(ended)),
            "response_length_mean": float(np.mean(lengths)), "example": texts[0]}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config, grid = FLAGS.config, json.loads(FLAGS.grid)
    if FLAGS.num % FLAGS.batch:
        raise app.UsageError(f"--num ({FLAGS.num}) must be a multiple of --batch ({FLAGS.batch})")
    if not is_hf_checkpoint(config.sft_dir):
        raise app.UsageError(f"sft_dir {config.sft_dir!r} is not an HF folder (config.json + safetensors)")
    tok = builders.tokenizer(config)
    model_config, variables = load_hf_checkpoint(config.sft_dir)
    t, s = config.task, config.sampling
    sampler = make_sampler(CausalLM(model_config), max_new_tokens=t.max_response_len,
                           eos_id=builders.stop_ids(config, tok), pad_id=tok.pad_token_id, temperature=s.temperature)
    verifier = rewards.make_verifier(t.name)
    results = []
    for update in grid:
        setting = config.copy_and_resolve_references()
        setting.task.knobs.update(update)
        source = builders.prompt_source(setting, t.test_split, tok)
        start = time.perf_counter()
        stats = sample_stats(sampler, variables["params"], source, tok, verifier, num=FLAGS.num,
                             batch=FLAGS.batch, max_prompt_len=t.max_prompt_len)
        result = {"policy": config.sft_dir, "task": t.name, "knobs": setting.task.knobs.to_dict(),
                  "system_prompt": t.system_prompt, "temperature": s.temperature, "num": FLAGS.num,
                  "max_response_len": t.max_response_len,
                  **stats, "seconds": round(time.perf_counter() - start), "provenance": provenance.record()}
        print(json.dumps(result), flush=True)
        results.append(result)
        if FLAGS.out:
            path = pathlib.Path(FLAGS.out)
            old = json.loads(path.read_text()) if path.exists() else []
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(old + [result], indent=1))


def define_flags() -> None:
    """The command line (defined here, not at import, so tests can import the statistics)."""
    config_flags.DEFINE_config_file("config", None, "A run config (policy, task, template, temperature).",
                                    lock_config=False)
    flags.DEFINE_string("grid", "[{}]", "JSON list of task.knobs updates, one per setting.")
    flags.DEFINE_integer("num", 64, "Test problems per setting (a multiple of --batch).")
    flags.DEFINE_integer("batch", 32, "Prompts per sampler call.")
    flags.DEFINE_string("out", None, "Append each setting's result to this JSON file (a list).")


if __name__ == "__main__":
    define_flags()
    app.run(main)
