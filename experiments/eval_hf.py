"""Independent evaluation of an HF folder with transformers alone: greedy `generate()` on the task's first N test
problems, prompted through the folder's own chat template (`apply_chat_template`) and graded by the task's verifier.

Nothing of our model, sampler, tokenization or chat code runs here, so its pass@1 checks what a run logged as
`eval/pass@1` (the same problems, greedy, the same template): they should agree to within float rounding of ties.

  python experiments/export_hf.py --config=configs/smollm2.py:grpo --out runs/smollm2/grpo_hf
  python experiments/eval_hf.py --config=configs/smollm2.py:grpo --model runs/smollm2/grpo_hf [--num=128]
  python experiments/eval_hf.py --config=configs/smollm2.py:grpo --model checkpoints/smollm2-135m-instruct

`experiments/real_model_report.py` sets these results beside the runs' own evaluations: write them as
`experiments/results/real_model/transformers_<arm>.json` (`--out`; `<arm>`: the run directory, or `base` for the
starting policy).
"""

import json
import pathlib
import time

import torch
import transformers as tr
from absl import app, flags
from ml_collections import config_flags

import provenance
from vcppo_jax import builders, rewards

CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config (task, template, lengths).",
                                         lock_config=True)
MODEL = flags.DEFINE_string("model", None, "HF folder to evaluate (config.json, safetensors, tokenizer).",
                            required=True)
NUM = flags.DEFINE_integer("num", None, "Number of test problems (default: config.eval_prompts).")
BATCH = flags.DEFINE_integer("batch", 64, "Prompts per generate() call (fewer calls: faster on CPU).")
OUT = flags.DEFINE_string("out", None, "Write the result (and every response) as JSON here.")


def prompt_text(tok, question: str, task) -> str:
    if not task.chat_template:
        return question
    system = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    return tok.apply_chat_template(system + [{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


def evaluate(model, tok, records, task, batch: int) -> list[dict]:
    """One greedy response per record: [{'answer', 'response', 'length', 'correct'}]."""
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    verifier = rewards.make_verifier(task.name)
    rows = []
    for start in range(0, len(records), batch):
        chunk = records[start:start + batch]
        enc = tok([prompt_text(tok, r["prompt"], task) for r in chunk], add_special_tokens=not task.chat_template,
                  padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=task.max_response_len,
                                 eos_token_id=sorted(stop), pad_token_id=tok.pad_token_id)
        for r, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:].tolist()):
            n = next((i for i, t in enumerate(ids) if t in stop), len(ids))  # the stop token ends the response
            text = tok.decode(ids[:n])
            rows.append({"answer": r["answer"], "response": text, "length": min(n + 1, len(ids)),
                         "correct": verifier(text, r["answer"]) > 0})
    return rows


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = CONFIG.value
    num = NUM.value or config.eval_prompts
    records = builders.task_source(config, config.task.test_split)[:num]
    tok = tr.PreTrainedTokenizerFast.from_pretrained(MODEL.value, padding_side="left")
    model = tr.AutoModelForCausalLM.from_pretrained(MODEL.value, dtype=torch.float32).eval()
    start = time.perf_counter()
    rows = evaluate(model, tok, records, config.task, BATCH.value)
    result = {"model": MODEL.value, "task": config.task.name, "num": len(rows),
              "pass@1": sum(r["correct"] for r in rows) / len(rows),
              "correct": sum(r["correct"] for r in rows),
              "response_length_mean": sum(r["length"] for r in rows) / len(rows),
              "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(result))
    if OUT.value:
        out = dict(result, provenance=provenance.record(), rows=rows)
        pathlib.Path(OUT.value).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
