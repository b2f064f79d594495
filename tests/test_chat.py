"""Chat templates and pretrained starting policies, on a tiny ChatML tokenizer and a random HF folder.

- Prompts rendered through the template encode to exactly `apply_chat_template(..., add_generation_prompt=True)`'s
  ids (no second BOS), with or without a system prompt; SFT targets end with the end-of-turn token.
- A response ends at the end-of-turn token as well as at EOS, and the verifier sees the text before it.
- An HF folder as `sft_dir` is a finished SFT stage: value pretraining and RL start from its weights without
  running SFT, its run id follows its files, and a critic fit on other weights is stale.
(The same on the real SmolLM2 tokenizer and weights: tests/test_real_model.py.)
"""

import json
import pathlib


import jax
import ml_collections
import numpy as np
import pytest
import torch
import transformers


import calibrate_task
import eval_hf
from test_pipeline import tiny_config
from testutil import random_params
from vcppo_jax import builders, chat, rollout, stage_meta, stages
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import runtime as rt_lib
from vcppo_jax.config import ConfigError, validate
from vcppo_jax.data import RecordSource
from vcppo_jax.data.batching import encode_sft
from vcppo_jax.export import export_policy
from vcppo_jax.metrics import METRICS_FILE
from vcppo_jax.models import CausalLM, ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from vcppo_jax.rewards import make_verifier
from vcppo_jax.sampling import SampleOutput, make_sampler
from vcppo_jax.tokenizer import load_tokenizer, synthetic_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, as SmolLM2 and Qwen write it (a default system turn when none is given).
CHATML = ("{% if messages[0]['role'] != 'system' %}" + IM_START + "system\nbe brief" + IM_END + "\n{% endif %}"
          "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
          "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")


def chat_tokenizer():
    """The synthetic char tokenizer (which prepends [BOS] to plain text) with ChatML's two special tokens."""
    tok = synthetic_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.chat_template = CHATML
    return tok


TOK = chat_tokenizer()
RECORDS = RecordSource([{"prompt": "what is 2+3?", "answer": "5"}, {"prompt": "what is 10-4?", "answer": "6"}],
                       transform=dict)


def chat_config(**task) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"task": {"chat_template": True, "system_prompt": "", **task}})


@pytest.mark.parametrize("system_prompt", ["", "you add numbers"])
def test_prompt_ids_equal_apply_chat_template(system_prompt):
    source = chat.ChatPrompts(RECORDS, TOK, system_prompt)
    batch = rollout.prompt_batch(source, [0, 1], TOK, max_prompt_len=64)
    for row, record in enumerate(RECORDS):
        want = TOK.apply_chat_template(chat.messages(record["prompt"], system_prompt), add_generation_prompt=True)
        want = want["input_ids"]  # transformers 5: a BatchEncoding
        n = int(batch.mask[row].sum())
        assert batch.tokens[row, -n:].tolist() == list(want)
        assert TOK.bos_token_id not in want  # the plain-text path would have prepended [BOS]
    assert batch.answers == ["5", "6"]
    assert (system_prompt or "be brief") in chat.render_prompt(TOK, "hi", system_prompt)


def test_end_of_turn_token_and_stop_ids():
    assert chat.end_of_turn_id(TOK) == TOK.convert_tokens_to_ids(IM_END)
    assert builders.stop_ids(chat_config(), TOK) == (TOK.eos_token_id, TOK.convert_tokens_to_ids(IM_END))
    assert builders.stop_ids(chat_config(chat_template=False), TOK) == (TOK.eos_token_id,)
    with pytest.raises(ValueError, match="does not start with a special token"):
        plain = chat_tokenizer()
        plain.chat_template = CHATML.replace(IM_END, "\n\n")
        chat.end_of_turn_id(plain)
    with pytest.raises(ValueError, match="has no chat template"):
        chat.check_chat_template(synthetic_tokenizer(), "the synthetic tokenizer")


def test_sft_targets_end_with_end_of_turn():
    eot = chat.end_of_turn_id(TOK)
    enc = encode_sft(TOK, [chat.render_prompt(TOK, "what is 2+3?")], ["5"], 64, 4, add_special_tokens=False,
                     end_id=eot)
    assert enc["tokens"][0, 64:66].tolist() == [TOK.convert_tokens_to_ids("5"), eot]
    assert enc["response_mask"][0].tolist() == [1, 1, 0, 0]


def fixed_sampler(texts: list[str], stops: list[int | None], r: int, tok=TOK):
    """A stand-in sampler: row i writes texts[i] then stops[i] (None: runs into the length limit `r`)."""
    def sampler(params, tokens, mask, rng):
        rows, lengths = [], []
        for text, stop in zip(texts, stops):
            ids = (tok(text, add_special_tokens=False)["input_ids"] + ([stop] if stop is not None else []))[:r]
            lengths.append(len(ids))
            rows.append(ids + [tok.pad_token_id] * (r - len(ids)))
        lengths = np.array(lengths, np.int32)
        return SampleOutput(tokens=np.concatenate([tokens, np.array(rows, np.int32)], 1),
                            response_mask=(np.arange(r) < lengths[:, None]).astype(np.float32), lengths=lengths,
                            logprobs=np.zeros((len(texts), r), np.float32), num_steps=np.int32(lengths.max() - 1))

    sampler.stop_ids = (tok.eos_token_id, chat.end_of_turn_id(tok))
    return sampler


def test_response_ends_at_end_of_turn_and_reward_sees_the_text_before_it():
    """A stand-in sampler whose rows end at <|im_end|>, at EOS, and at the length limit: the verifier scores the
    text before the stop token ('Answer: 5<|im_end|>' is right: the synthetic verifier wants nothing after the
    number on its line)."""
    eot, r = chat.end_of_turn_id(TOK), 24
    texts = ["so\nAnswer: 5", "Answer: 6", "Answer: 6"]
    source = chat.ChatPrompts(RecordSource(list(RECORDS) + [RECORDS[1]], transform=dict), TOK)
    batch = rollout.prompt_batch(source, [0, 1, 2], TOK, max_prompt_len=64)
    sampler = fixed_sampler(texts, [eot, TOK.eos_token_id, None], r)
    seen = []

    def verifier(text, answer):
        seen.append(text)
        return make_verifier("synthetic")(text, answer)

    out, decoded = rollout.generate_and_score(sampler, None, batch, jax.random.PRNGKey(0), TOK, verifier)
    assert decoded == seen == texts  # neither stop token reaches the verifier
    np.testing.assert_array_equal(out.seq_rewards, [1.0, 1.0, 1.0])


def test_config_validation():
    c = tiny_config("grpo", "/tmp/unused")
    c.task.system_prompt = "be brief"
    with pytest.raises(ConfigError, match="task.system_prompt.*needs task.chat_template=True"):
        validate(c)


# ------------------------------------------------------------------------------------------------ HF policies
def hf_folder(path: pathlib.Path, seed: int) -> pathlib.Path:
    """A random tiny Llama in HF format with TOK (ChatML) beside it."""
    cfg = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=2, model_type="llama", tie_embeddings=True, max_position_embeddings=128)
    save_hf_checkpoint(str(path), cfg, random_params(CausalLM(cfg), seed=seed),
                       eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    TOK.save_pretrained(str(path))
    return path


def rl_from_hf(root: pathlib.Path, folder: pathlib.Path, **overrides) -> ml_collections.ConfigDict:
    c = tiny_config("vcppo", root, num_steps=1, eval_prompts=8, eval_kl_to_sft=True, **overrides)
    c.sft_dir = str(folder)
    c.task.update(chat_template=True, max_prompt_len=40)
    return c


def check_export_and_independent_eval(config: ml_collections.ConfigDict, out: pathlib.Path) -> None:
    """The RL policy exported as an HF folder holds the checkpoint's actor; transformers' greedy `generate()` on it
    (experiments/eval_hf.py) writes the same responses as our greedy sampler, through the same chat template."""
    export_policy(config, str(out))
    with pytest.raises(FileExistsError, match="already holds a model"):
        export_policy(config, str(out))
    cfg, variables = load_hf_checkpoint(str(out))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    saved = ckpt_lib.load_params(config.workdir, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), variables["params"]), key="actor/params")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), saved, variables["params"])

    tok, n = load_tokenizer(str(out)), 4
    greedy = make_sampler(CausalLM(cfg), max_new_tokens=config.task.max_response_len,
                          eos_id=builders.stop_ids(config, tok), pad_id=tok.pad_token_id, temperature=0.0)
    batch = rollout.prompt_batch(builders.prompt_source(config, "test", tok), range(n), tok,
                                 max_prompt_len=config.task.max_prompt_len)
    _, ours = rollout.generate_and_score(greedy, variables["params"], batch, jax.random.PRNGKey(0), tok,
                                        make_verifier(config.task.name))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out), padding_side="left")
    rows = eval_hf.evaluate(model, hf_tok, builders.task_source(config, "test")[:n], config.task, batch=n)
    assert [r["response"] for r in rows] == ours and any(ours)


def test_rl_and_value_pretraining_start_from_an_hf_folder(tmp_path):
    folder = hf_folder(tmp_path / "hf", seed=1)
    meta = stage_meta.finished_meta(str(folder), "sft")
    assert meta["done"] and meta["provenance"]["run_id"].startswith("hf-")
    assert meta["model_config"]["model_type"] == "llama"

    # The policy as loaded for RL: the folder's weights, placed on the run's mesh.
    config = rl_from_hf(tmp_path, folder)
    rt = rt_lib.make_runtime(config)
    target = rt.target(rt_lib.abstract_params(CausalLM(builders.model_config_from_json(meta["model_config"]))))
    loaded = builders.load_policy(str(folder), target)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded,
                 load_hf_checkpoint(str(folder))[1]["params"])
    assert all(a.sharding == t.sharding for a, t in zip(jax.tree.leaves(loaded), jax.tree.leaves(target)))

    # VC-PPO with value pretraining run by the pipeline itself: no SFT stage, the critic built from the folder.
    stages.run_stage(config)
    assert not (tmp_path / "sft").exists()
    assert stage_meta.provenance_of(config.critic_dir)["upstream"] == {"sft": meta["provenance"]["run_id"]}
    records = [json.loads(line) for line in (tmp_path / "vcppo" / METRICS_FILE).read_text().splitlines()]
    assert any("eval/pass@1" in r for r in records) and any("policy/clipfrac" in r for r in records)
    assert stages.stale_stages(config) == []
    check_export_and_independent_eval(config, tmp_path / "exported")

    # Other weights in the folder: another run id, so the critic fit on the old policy's samples is stale.
    hf_folder(folder, seed=2)
    assert stage_meta.run_id(str(folder)) != meta["provenance"]["run_id"]
    other = rl_from_hf(tmp_path, folder, workdir=str(tmp_path / "vcppo2"))
    (stage, _, why), = stages.stale_stages(other)
    assert stage == "value_pretrain" and meta["provenance"]["run_id"] in why


def test_calibration_counts_correct_boxed_and_ended_responses():
    """experiments/calibrate_task.py's statistics on known responses: right and boxed, right in words, wrong and
    boxed but cut at the length limit, wrong."""
    tok = chat_tokenizer()
    tok.add_tokens(["\\boxed{", "}", "T"])  # beside the char tokenizer's digits and lower-case letters
    eot, r = chat.end_of_turn_id(tok), 16
    records = RecordSource([{"prompt": "q", "answer": a} for a in ("5", "6", "7", "8")], transform=dict)
    # The second ends with its stop token at the length limit; the third runs into it.
    texts = ["so \\boxed{5}", "The answer is 6", "\\boxed{1} and on and on", "no"]
    sampler = fixed_sampler(texts, [eot, eot, None, tok.eos_token_id], r, tok)
    stats = calibrate_task.sample_stats(sampler, None, chat.ChatPrompts(records, tok), tok,
                                        make_verifier("word_problems"), num=4, batch=4, max_prompt_len=32)
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]
    lengths[2] = r
    assert stats["pass@1"] == 0.5 and stats["boxed_fraction"] == 0.5 and stats["ended_fraction"] == 0.75
    assert stats["response_length_mean"] == pytest.approx(np.mean(lengths))
