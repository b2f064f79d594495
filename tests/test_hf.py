"""HF checkpoints: our JAX model reproduces transformers' PyTorch logits; import/export round trips; clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from safetensors.numpy import load_file, save_file

from vcppo_jax.models import (CausalLM, ModelConfig, ValueModel, load_hf_checkpoint, load_hf_value_checkpoint,
                              position_ids, save_hf_checkpoint, save_hf_value_checkpoint)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
HF_CONFIGS = {
    # Qwen2: q/k/v bias, GQA 2:1; tied and untied (untied also with linear RoPE scaling).
    "qwen2_tied": (tr.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2_untied_linear": (tr.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0))),
    # Llama: no biases, GQA 4:1, llama3 RoPE whose original length (16) puts frequencies in all three bands.
    "llama3_gqa": (tr.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    # Qwen3: no biases, per-head q/k RMSNorm before RoPE, head_dim != hidden_size / heads; tied and untied.
    "qwen3_tied": (tr.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                        tie_word_embeddings=True)),
    "qwen3_untied": (tr.Qwen3Config, dict(num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                                          tie_word_embeddings=False, rms_norm_eps=1e-5)),
}
B, T = 3, 11
PADS = (0, 4, 2)  # left padding per row


def _perturb(model: torch.nn.Module) -> None:
    """HF init (norms = 1, biases = 0, std 0.02) would hide norm/bias bugs and give near-uniform attention."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def _inputs():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TINY["vocab_size"], size=(B, T)).astype(np.int32)
    mask = np.arange(T)[None, :] >= np.array(PADS)[:, None]
    tokens = np.where(mask, tokens, 0)
    return tokens, mask, np.asarray(position_ids(jnp.asarray(mask)))


def _torch_logits(model, tokens, mask, positions, *, seq_cls=False):
    with torch.no_grad():
        kw = dict(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                  position_ids=torch.tensor(positions, dtype=torch.long))
        if seq_cls:  # per-token scores through HF's own backbone + score layer
            return model.score(model.model(**kw).last_hidden_state)[..., 0].numpy()
        return model(**kw).logits.numpy()


@pytest.fixture(scope="module")
def inputs():
    return _inputs()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, inputs):
    """name -> (folder, torch reference logits [B, T, vocab])."""
    tokens, mask, positions = inputs
    out = {}
    for name, (cfg_cls, kw) in HF_CONFIGS.items():
        torch.manual_seed(0)
        cfg = cfg_cls(**TINY, **kw)
        model = tr.AutoModelForCausalLM.from_config(cfg).eval()
        _perturb(model)
        folder = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(folder)
        out[name] = (folder, _torch_logits(model, tokens, mask, positions))
    return out


_FWD = {}


def _our_logits(cfg: ModelConfig, variables, tokens, mask, positions):
    """One jitted forward per config (equal configs hash equal, so re-imports reuse the compiled function)."""
    if cfg not in _FWD:
        model = CausalLM(cfg)

        def fwd(v, t, p, m):
            h, _ = model.apply(v, t, p, m)
            return model.apply(v, h, method=CausalLM.logits)

        _FWD[cfg] = jax.jit(fwd)
    return np.asarray(_FWD[cfg](variables, tokens, positions, mask))


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_logits_match_transformers(checkpoints, inputs, name):
    folder, ref = checkpoints[name]
    tokens, mask, positions = inputs
    cfg, variables = load_hf_checkpoint(folder)
    assert cfg.tie_embeddings == name.endswith("_tied") and ("lm_head" in variables["params"]) != cfg.tie_embeddings
    assert cfg.num_params == sum(x.size for x in jax.tree.leaves(variables))
    ours = _our_logits(cfg, variables, tokens, mask, positions)
    # Only real (non-pad) query positions are defined; padded ones differ between implementations.
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)
    assert np.abs(ref[mask]).max() > 1.0  # logits are not trivially small


def test_config_parsed_from_hf(checkpoints):
    cfg, _ = load_hf_checkpoint(checkpoints["llama3_gqa"][0])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias) == (4, 1, 16, False)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    cfg, _ = load_hf_checkpoint(checkpoints["qwen2_untied_linear"][0])
    assert cfg.qkv_bias and cfg.rms_norm_eps == 1e-5 and dict(cfg.rope_scaling) == {"rope_type": "linear",
                                                                                    "factor": 2.0}
    cfg, variables = load_hf_checkpoint(checkpoints["qwen3_tied"][0])
    assert (cfg.model_type, cfg.head_dim, cfg.qkv_bias, cfg.qk_norm) == ("qwen3", 24, False, True)
    assert variables["params"]["backbone"]["layers"]["attn"]["q_norm"]["scale"].shape == (2, 24)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_round_trip_export_loads_in_transformers(checkpoints, inputs, tmp_path, name):
    folder, ref = checkpoints[name]
    tokens, mask, positions = inputs
    cfg, variables = load_hf_checkpoint(folder)
    save_hf_checkpoint(str(tmp_path), cfg, variables, eos_token_id=7)
    exported = json.load(open(tmp_path / "config.json"))
    assert exported["eos_token_id"] == 7
    assert exported["model_type"] == HF_CONFIGS[name][0].model_type  # e.g. Qwen3 (no q/k/v bias) is not Llama
    model = tr.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(_torch_logits(model, tokens, mask, positions)[mask], ref[mask], atol=1e-5, rtol=1e-5)
    # and back: same config, bit-identical params
    cfg2, variables2 = load_hf_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, variables2, variables)


def test_bf16_export_and_import(checkpoints, tmp_path, inputs):
    folder, ref = checkpoints["qwen2_tied"]
    tokens, mask, positions = inputs
    cfg, variables = load_hf_checkpoint(folder)
    save_hf_checkpoint(str(tmp_path), cfg, variables, dtype="bfloat16")
    assert str(load_file(str(tmp_path / "model.safetensors"))["model.norm.weight"].dtype) == "bfloat16"
    model = tr.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    cfg_bf, v_bf = load_hf_checkpoint(str(tmp_path))
    assert v_bf["params"]["backbone"]["embed"]["embedding"].dtype == np.float32  # params stay fp32
    ours = _our_logits(cfg_bf, v_bf, tokens, mask, positions)
    np.testing.assert_allclose(ours[mask], _torch_logits(model, tokens, mask, positions)[mask], atol=1e-4,
                               rtol=1e-4)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=0.2)  # bf16 rounding of the weights only


def test_sharded_index_checkpoint(checkpoints, tmp_path):
    folder, _ = checkpoints["llama3_gqa"]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(tmp_path / "model.safetensors.index.json", "w"))
    shutil.copy(os.path.join(folder, "config.json"), tmp_path)
    _, sharded = load_hf_checkpoint(str(tmp_path))
    _, single = load_hf_checkpoint(folder)
    jax.tree.map(np.testing.assert_array_equal, sharded, single)


# ----------------------------------------------------------------------------------------------- value head
@pytest.fixture(scope="module", params=["qwen2_tied", "qwen3_tied"])
def value_checkpoint(request, tmp_path_factory, inputs):
    tokens, mask, positions = inputs
    torch.manual_seed(0)
    cfg_cls, kw = HF_CONFIGS[request.param]
    cfg = cfg_cls(**TINY, **kw, num_labels=1, pad_token_id=0)
    model = tr.AutoModelForSequenceClassification.from_config(cfg).eval()
    _perturb(model)
    folder = str(tmp_path_factory.mktemp(f"{request.param}_rm"))
    model.save_pretrained(folder)
    return folder, _torch_logits(model, tokens, mask, positions, seq_cls=True)


def test_value_checkpoint_matches_transformers_scores(value_checkpoint, inputs, tmp_path):
    folder, ref = value_checkpoint
    tokens, mask, positions = inputs
    cfg, variables = load_hf_value_checkpoint(folder)
    values = np.asarray(jax.jit(ValueModel(cfg).apply)(variables, tokens, positions, mask))
    assert values.shape == (B, T) and values.dtype == np.float32
    np.testing.assert_allclose(values[mask], ref[mask], atol=1e-4, rtol=1e-4)

    save_hf_value_checkpoint(str(tmp_path), cfg, variables, pad_token_id=0)
    model = tr.AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(_torch_logits(model, tokens, mask, positions, seq_cls=True)[mask], ref[mask],
                               atol=1e-5, rtol=1e-5)
    variables["params"]["value_head"]["bias"] = np.ones((1,), np.float32)
    with pytest.raises(ValueError, match="no bias"):
        save_hf_value_checkpoint(str(tmp_path / "b"), cfg, variables)


def test_value_loader_rejects_causal_lm(checkpoints):
    with pytest.raises(ValueError, match="is a causal LM.*critic_params_from_actor"):
        load_hf_value_checkpoint(checkpoints["qwen2_tied"][0])


# ----------------------------------------------------------------------------------------------- errors
def _copy(folder, dst, edit_config=None):
    shutil.copytree(folder, dst)
    if edit_config:
        path = os.path.join(dst, "config.json")
        hf = json.load(open(path))
        edit_config(hf)
        json.dump(hf, open(path, "w"))
    return str(dst)


def test_unsupported_architecture(checkpoints, tmp_path):
    folder = _copy(checkpoints["qwen2_tied"][0], tmp_path / "gpt2",
                   lambda hf: hf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="unsupported architecture: model_type 'gpt2'"):
        load_hf_checkpoint(folder)
    moe = _copy(checkpoints["qwen3_tied"][0], tmp_path / "moe",
                lambda hf: hf.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]))
    with pytest.raises(ValueError, match=r"model_type 'qwen3_moe' .*supported model_type values: "
                                         r"\('qwen2', 'llama', 'qwen3'\)"):
        load_hf_checkpoint(moe)
    for name in ("qwen2_tied", "qwen3_tied"):
        sliding = _copy(checkpoints[name][0], tmp_path / f"sw_{name}", lambda hf: hf.update(use_sliding_window=True))
        with pytest.raises(ValueError, match="use_sliding_window"):
            load_hf_checkpoint(sliding)
    layer_types = ["full_attention", "sliding_attention"]
    mixed = _copy(checkpoints["qwen3_tied"][0], tmp_path / "mixed", lambda hf: hf.update(layer_types=layer_types))
    with pytest.raises(ValueError, match=r"unsupported Qwen3 config: layer_types \['sliding_attention'\]"):
        load_hf_checkpoint(mixed)


def test_shape_mismatch_names_tensor(checkpoints, tmp_path):
    folder = _copy(checkpoints["llama3_gqa"][0], tmp_path / "bad", lambda hf: hf.update(intermediate_size=80))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\), "
                                         r"expected \(80, 64\)"):
        load_hf_checkpoint(folder)


def test_missing_and_unexpected_tensors(checkpoints, tmp_path):
    src = checkpoints["qwen2_untied_linear"][0]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    folder = _copy(src, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.self_attn.k_proj.bias'"):
        load_hf_checkpoint(folder)
    folder = _copy(src, tmp_path / "extra")
    save_file({**tensors, "model.layers.2.mlp.up_proj.weight": tensors["model.layers.1.mlp.up_proj.weight"]},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.2.mlp.up_proj.weight'\]"):
        load_hf_checkpoint(folder)


def test_save_rejects_wrong_params(checkpoints, tmp_path):
    cfg, variables = load_hf_checkpoint(checkpoints["llama3_gqa"][0])
    bad = cfg.replace(intermediate_size=80)
    with pytest.raises(ValueError, match="'backbone/layers/mlp/gate_proj/kernel' has shape"):
        save_hf_checkpoint(str(tmp_path), bad, variables)
    with pytest.raises(ValueError, match="dtype must be one of"):
        save_hf_checkpoint(str(tmp_path), cfg, variables, dtype="float16")
