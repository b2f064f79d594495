"""Decoder internals: KV-cache decoding == full forward, bf16, remat, logical axes, chunked log-probs, configs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testutil import abstract_params, all_shapes, random_params
from vcppo_jax.models import (CausalLM, KVCache, ModelConfig, ValueModel, attention_mask, critic_params_from_actor,
                              init_cache, init_params, param_logical_axes, position_ids, token_logprobs)

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  rope_theta=1000.0, tie_embeddings=False)
AXIS_NAMES = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "layers", None}
P, R, EXTRA = 6, 4, 2  # prompt length, decoded tokens, unused cache slots
PADS = np.array([0, 3, 5])  # left padding per row (row 2 has a single real prompt token)
B = len(PADS)


@pytest.fixture(scope="module")
def params():
    return random_params(CausalLM(CFG))


@pytest.fixture(scope="module")
def batch():
    """Left-padded prompts [B, P] followed by R response tokens: full sequence [B, P + R]."""
    rng = np.random.default_rng(0)
    prompt_mask = np.arange(P)[None, :] >= PADS[:, None]
    full_mask = np.concatenate([prompt_mask, np.ones((B, R), bool)], axis=1)
    tokens = np.where(full_mask, rng.integers(1, CFG.vocab_size, size=(B, P + R)), 0).astype(np.int32)
    return tokens, full_mask, np.asarray(position_ids(jnp.asarray(full_mask)))


def _forward_fn(cfg):
    """Jitted full forward (no cache) -> (hidden [B, T, D], fp32 logits [B, T, vocab])."""
    model = CausalLM(cfg)

    @jax.jit
    def fwd(params, tokens, positions, kv_mask):
        hidden, _ = model.apply(params, tokens, positions, kv_mask)
        return hidden, model.apply(params, hidden, method=CausalLM.logits)

    return fwd


FULL = _forward_fn(CFG)
MAX_LEN = P + R + EXTRA
TRACES = []


@jax.jit
def STEP(params, tokens, positions, kv_mask, cache, cache_index):
    """Cached forward -> (fp32 logits, new cache); one compile per query length."""
    TRACES.append(tokens.shape)
    model = CausalLM(CFG)
    hidden, cache = model.apply(params, tokens, positions, kv_mask, cache, cache_index)
    return model.apply(params, hidden, method=CausalLM.logits), cache


@pytest.fixture(scope="module")
def full_logits(params, batch):
    tokens, mask, positions = batch
    return np.asarray(FULL(params, tokens, positions, mask)[1])


# ------------------------------------------------------------------------------------------------ KV cache
def test_kv_cache_prefill_then_decode_matches_full_forward(params, batch, full_logits):
    tokens, mask, positions = batch
    max_len = MAX_LEN
    TRACES.clear()
    cache = init_cache(CFG, B, max_len)
    assert cache.k.shape == (CFG.num_layers, B, CFG.num_kv_heads, max_len, CFG.head_dim)
    assert cache.k.dtype == jnp.float32
    # The sampler's pattern: kv_mask starts as the prompt mask; each decoded slot is switched on when written.
    kv_mask = np.zeros((B, max_len), bool)
    kv_mask[:, :P] = mask[:, :P]
    logits, cache = STEP(params, tokens[:, :P], positions[:, :P], kv_mask, cache, jnp.int32(0))
    valid = mask[:, :P]
    np.testing.assert_allclose(np.asarray(logits)[valid], full_logits[:, :P][valid], atol=1e-5, rtol=1e-5)
    for t in range(R):
        kv_mask[:, P + t] = True
        s = slice(P + t, P + t + 1)
        logits, cache = STEP(params, tokens[:, s], positions[:, s], kv_mask, cache, jnp.int32(P + t))
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full_logits[:, P + t], atol=1e-5, rtol=1e-5)
    assert TRACES == [(B, P), (B, 1)]  # the traced cache_index does not recompile per step
    assert not np.any(np.asarray(cache.k)[:, :, :, P + R:])  # unused slots untouched


def test_chunked_prefill_at_nonzero_cache_index(params, batch, full_logits):
    """Two T=3 chunks (second one at cache_index=3) == one full pass."""
    tokens, mask, positions = batch
    kv_mask = np.zeros((B, MAX_LEN), bool)
    kv_mask[:, :P] = mask[:, :P]
    cache = init_cache(CFG, B, MAX_LEN)
    _, cache = STEP(params, tokens[:, :3], positions[:, :3], kv_mask, cache, jnp.int32(0))
    logits, cache = STEP(params, tokens[:, 3:P], positions[:, 3:P], kv_mask, cache, jnp.int32(3))
    logits = np.asarray(logits)
    valid = mask[:, 3:P]
    np.testing.assert_allclose(logits[valid], full_logits[:, 3:P][valid], atol=1e-5, rtol=1e-5)
    assert isinstance(cache, KVCache)


def test_attention_mask_semantics():
    kv_mask = np.array([[False, True, True, True, False]])
    got = np.asarray(attention_mask(jnp.asarray(kv_mask), 2, 2))[0, 0]
    want = np.array([[kv_mask[0, j] and j <= 2 + i for j in range(5)] for i in range(2)])
    np.testing.assert_array_equal(got, want)


def test_query_without_valid_key_is_finite(params, batch):
    tokens, mask, positions = batch
    mask = mask.copy()
    mask[0] = False  # row 0: no key at all
    assert np.all(np.isfinite(FULL(params, tokens, positions, mask)[1]))
    logits, _ = STEP(params, tokens[:, :1], positions[:, :1], np.zeros((B, MAX_LEN), bool),
                     init_cache(CFG, B, MAX_LEN), jnp.int32(0))
    assert np.all(np.isfinite(logits))


def test_input_validation(params, batch):
    tokens, mask, positions = batch
    model = CausalLM(CFG)
    with pytest.raises(ValueError, match="kv_mask must be"):
        model.apply(params, tokens, positions, mask[:, :-1])
    with pytest.raises(ValueError, match="positions must have the shape"):
        model.apply(params, tokens, positions[:, :-1], mask)
    cache = init_cache(CFG, B, 8)
    with pytest.raises(ValueError, match=r"cache_index must be in \[0, max_len - time\] = \[0, 2\], got 3"):
        model.apply(params, tokens[:, :6], positions[:, :6], np.ones((B, 8), bool), cache, 3)
    with pytest.raises(ValueError, match="cache k/v must be"):
        model.apply(params, tokens[:, :1], positions[:, :1], np.ones((B, 8), bool), init_cache(CFG, B + 1, 8), 0)
    with pytest.raises(ValueError, match="cache_index must be 0 without a cache"):
        model.apply(params, tokens, positions, mask, None, 2)


# ------------------------------------------------------------------------------------------------ dtypes, remat
def test_bf16_compute_with_fp32_params(params, batch, full_logits):
    tokens, mask, positions = batch
    cfg = CFG.replace(dtype="bfloat16")
    hidden, _ = jax.eval_shape(CausalLM(cfg).apply, params, tokens, positions, mask)
    assert hidden.dtype == jnp.bfloat16
    _, logits = _forward_fn(cfg)(params, tokens, positions, mask)
    assert logits.dtype == jnp.float32
    scale = np.abs(full_logits[mask]).max()
    np.testing.assert_allclose(np.asarray(logits)[mask], full_logits[mask], atol=0.05 * scale)
    cache = init_cache(cfg, B, 4)
    assert cache.k.dtype == jnp.bfloat16
    abstract = nn.unbox(abstract_params(CausalLM(cfg.replace(param_dtype="bfloat16"))))
    assert {x.dtype for x in jax.tree.leaves(abstract)} == {jnp.dtype(jnp.bfloat16)}


def test_remat_gives_same_outputs_and_grads(params, batch):
    tokens, mask, positions = batch
    weights = np.random.default_rng(3).standard_normal((B, P + R, CFG.vocab_size)).astype(np.float32)

    def loss_and_grad(cfg):
        model = CausalLM(cfg)

        def loss(p):
            hidden, _ = model.apply(p, tokens, positions, mask)
            return jnp.sum(model.apply(p, hidden, method=CausalLM.logits) * weights * mask[..., None])

        return jax.jit(jax.value_and_grad(loss))(params)

    (l0, g0), (l1, g1) = loss_and_grad(CFG), loss_and_grad(CFG.replace(remat=True))
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    # Remat changes XLA's fusion (summation order), so compare relative to each gradient's scale.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max()), g1, g0)
    assert float(jnp.abs(g0["params"]["backbone"]["layers"]["attn"]["q_proj"]["kernel"]).max()) > 0


# ------------------------------------------------------------------------------------------------ params tree
@pytest.mark.parametrize("model", [CausalLM(CFG), CausalLM(CFG.replace(tie_embeddings=True)), ValueModel(CFG),
                                   CausalLM(CFG.replace(model_type="qwen3"))],
                         ids=["causal_lm", "causal_lm_tied", "value_model", "qwen3"])
def test_logical_axis_names_on_every_param(model):
    abstract = abstract_params(model)
    boxes = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
    specs = param_logical_axes(model)
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(abstract))[0]
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    spec_of = dict(jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0])
    for path, leaf in flat:
        spec = tuple(spec_of[path])
        assert len(spec) == leaf.ndim and set(spec) <= AXIS_NAMES, (path, spec)
        assert (spec[0] == "layers") == ("layers" in jax.tree_util.keystr(path)), path
        if spec[0] == "layers":
            assert leaf.shape[0] == CFG.num_layers
    qk_norms = [tuple(spec_of[p]) for p, _ in flat if any(n in jax.tree_util.keystr(p) for n in ("q_norm", "k_norm"))]
    assert qk_norms == ([("layers", "head_dim")] * 2 if model.cfg.qk_norm else [])  # one scale shared by all heads
    top = set(abstract["params"])
    want = {CausalLM: {"backbone", "lm_head"}, ValueModel: {"backbone", "value_head"}}[type(model)]
    assert top == (want - {"lm_head"} if model.cfg.tie_embeddings else want)


def test_sharded_forward_matches_unsharded(params, batch):
    from vcppo_jax import sharding as shd

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    tokens, mask, positions = (np.concatenate([x, x[:1]]) for x in batch)  # batch 4 for data * fsdp = 4
    model = CausalLM(CFG)
    abstract = jax.eval_shape(lambda r: model.init(r, tokens, positions, mask), jax.random.key(0))
    shardings = shd.logical_shardings(abstract, mesh)
    sharded = jax.device_put(params, nn.unbox(shardings))
    assert sharded["params"]["backbone"]["layers"]["mlp"]["gate_proj"]["kernel"].sharding.spec[1:] == ("fsdp",
                                                                                                       "tensor")
    with shd.use_mesh(mesh):
        _, got = _forward_fn(CFG)(sharded, tokens, positions, mask)
    _, want = FULL(params, tokens, positions, mask)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=1e-5, rtol=1e-5)


def test_critic_params_from_actor(params, batch):
    tokens, mask, positions = batch
    critic = critic_params_from_actor(params)
    ref = jax.eval_shape(lambda r: init_params(ValueModel(CFG), r), jax.random.key(0))  # plain, unboxed
    assert jax.tree.structure(critic) == jax.tree.structure(ref)
    jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape), critic, ref)
    jax.tree.map(np.testing.assert_array_equal, critic["params"]["backbone"], params["params"]["backbone"])
    assert (critic["params"]["backbone"]["final_norm"]["scale"]
            is not params["params"]["backbone"]["final_norm"]["scale"])
    values = jax.jit(ValueModel(CFG).apply)(critic, tokens, positions, mask)
    assert values.shape == (B, P + R) and values.dtype == jnp.float32 and not np.any(np.asarray(values))
    noisy = critic_params_from_actor(params, jax.random.key(1), init_std=0.1)
    assert np.asarray(noisy["params"]["value_head"]["kernel"]).std() > 0.05
    with pytest.raises(ValueError, match="rng is required"):
        critic_params_from_actor(params, init_std=0.1)


def test_position_ids_matches_loop():
    rng = np.random.default_rng(1)
    mask = rng.random((5, 9)) < 0.6
    mask[0] = False
    want = np.zeros(mask.shape, np.int32)
    for b in range(mask.shape[0]):
        count = 0
        for t in range(mask.shape[1]):
            count += mask[b, t]
            want[b, t] = max(count - 1, 0)
    np.testing.assert_array_equal(position_ids(jnp.asarray(mask)), want)


# ------------------------------------------------------------------------------------------------ log-probs
TEMPERATURE = 0.7


def _logprob_loss(params, hidden, targets, weights, chunk_size):
    """sum(w_lp * logp + w_ent * entropy); chunk_size None -> reference from whole [B, T, vocab] logits."""
    model = CausalLM(CFG)
    if chunk_size is None:
        logq = jax.nn.log_softmax(model.apply(params, hidden, method=CausalLM.logits) / TEMPERATURE)
        lp = jnp.take_along_axis(logq, targets[..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logq) * logq, -1)
    else:
        lp, ent = token_logprobs(lambda x: model.apply(params, x, method=CausalLM.logits), hidden, targets,
                                 chunk_size=chunk_size, temperature=TEMPERATURE)
    return jnp.sum(lp * weights[0] + ent * weights[1]), (lp, ent)


LOGPROB_GRAD = jax.jit(jax.value_and_grad(_logprob_loss, argnums=(0, 1), has_aux=True), static_argnums=4)


@pytest.fixture(scope="module")
def logprob_case(params, batch):
    tokens, mask, positions = batch
    hidden, logits = FULL(params, tokens, positions, mask)
    targets = jnp.asarray(np.roll(tokens, -1, axis=1))
    weights = jnp.asarray(np.random.default_rng(5).standard_normal((2, *tokens.shape)), jnp.float32)
    logits = np.asarray(logits, np.float64)
    return hidden, targets, weights, LOGPROB_GRAD(params, hidden, targets, weights, None), logits / TEMPERATURE


@pytest.mark.parametrize("chunk_size", [4, 5, 64])  # padded tail, exact split, one chunk longer than T
def test_token_logprobs_chunked_equals_unchunked(params, logprob_case, chunk_size):
    hidden, targets, weights, ((_, (lp_ref, ent_ref)), g_ref), logits = logprob_case
    (_, (lp, ent)), g = LOGPROB_GRAD(params, hidden, targets, weights, chunk_size)
    assert lp.shape == ent.shape == targets.shape
    # independent numpy reference for the values
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    np.testing.assert_allclose(lp, np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0] - logz,
                               atol=1e-5)
    np.testing.assert_allclose(ent, logz - (np.exp(logits - logz[..., None]) * logits).sum(-1), atol=1e-5)
    np.testing.assert_allclose(lp, lp_ref, atol=1e-5)
    np.testing.assert_allclose(ent, ent_ref, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max()), g, g_ref)
    assert float(jnp.abs(g[1]).max()) > 0


def test_token_logprobs_grad_never_builds_full_logits():
    b, t, d, v, chunk = 2, 12, 8, 50, 4
    table = jnp.ones((d, v))
    fn = lambda w, h: jnp.sum(token_logprobs(lambda x: x @ w, h, jnp.zeros((b, t), jnp.int32),  # noqa: E731
                                             chunk_size=chunk)[0])
    shapes = all_shapes(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(table, jnp.ones((b, t, d))).jaxpr)
    vocab_sized = [s for s in shapes if s and s[-1] == v and len(s) >= 3]
    assert vocab_sized and all(s[-2] == chunk for s in vocab_sized), set(vocab_sized)


def test_token_logprobs_options_and_errors():
    rng = np.random.default_rng(0)
    table, hidden = rng.standard_normal((8, 11)), rng.standard_normal((2, 5, 8))
    targets = jnp.zeros((2, 5), jnp.int32)
    lp, ent = jax.jit(lambda h, y: token_logprobs(lambda x: x @ table, h, y, chunk_size=2, with_entropy=False))(
        hidden, targets)
    assert ent is None and lp.shape == (2, 5)
    logits = hidden @ table
    want = logits[..., 0] - np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(lp, want, atol=1e-5)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        token_logprobs(lambda h: h @ table, hidden, targets, chunk_size=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(lambda h: h @ table, hidden, targets, chunk_size=2, temperature=0.0)
    with pytest.raises(ValueError, match="targets must be"):
        token_logprobs(lambda h: h @ table, hidden, targets[:, :4], chunk_size=2)


# ------------------------------------------------------------------------------------------------ config
def test_config_validation_errors():
    base = dict(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2)
    assert ModelConfig(**base).head_dim == 4
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        ModelConfig(**{**base, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="ModelConfig.num_layers must be a positive int"):
        ModelConfig(**{**base, "num_layers": 0})
    with pytest.raises(ValueError, match="ModelConfig.dtype must be one of"):
        ModelConfig(**base, dtype="float16")
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        ModelConfig(**base, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"missing keys \['low_freq_factor'"):
        ModelConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="head_dim must be even"):
        ModelConfig(**base, head_dim=3)
    with pytest.raises(ValueError, match="attention_impl"):
        ModelConfig(**base, attention_impl="flash")
    with pytest.raises(ValueError, match=r"model_type must be one of \('qwen2', 'llama', 'qwen3'\), got 'qwen3_moe'"):
        ModelConfig(**base, model_type="qwen3_moe")


@pytest.mark.parametrize("model_type, qkv_bias, qk_norm", [("qwen2", True, False), ("llama", False, False),
                                                           ("qwen3", False, True)])
def test_model_type_decides_attention_variant(model_type, qkv_bias, qk_norm):
    cfg = CFG.replace(model_type=model_type, head_dim=32)  # head_dim != hidden_size / num_heads = 16
    assert (cfg.qkv_bias, cfg.qk_norm) == (qkv_bias, qk_norm)
    params = nn.unbox(abstract_params(CausalLM(cfg)))["params"]
    attn = params["backbone"]["layers"]["attn"]
    assert ("bias" in attn["q_proj"]) == qkv_bias and ("q_norm" in attn) == ("k_norm" in attn) == qk_norm
    assert cfg.num_params == sum(x.size for x in jax.tree.leaves(params))


def test_config_hf_round_trip_and_hashing():
    cfg = CFG.replace(model_type="llama", rope_scaling={"type": "linear", "factor": 4.0, "rope_theta": 1.0})
    assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    hf = cfg.to_hf_dict()
    assert hf["model_type"] == "llama" and hf["architectures"] == ["LlamaForCausalLM"]
    assert ModelConfig.from_hf_dict(hf) == cfg
    assert hash(cfg) == hash(ModelConfig.from_hf_dict(hf))
    assert ModelConfig.from_hf_dict(CFG.to_hf_dict(head="sequence_classification")) == CFG
    # transformers 4.x spelling: top-level rope_theta, rope_scaling with 'type'
    legacy = {**CFG.to_hf_dict(), "rope_theta": 1000.0, "rope_scaling": None}
    del legacy["rope_parameters"]
    assert ModelConfig.from_hf_dict(legacy) == CFG
    assert ModelConfig.from_hf_dict(CFG.to_hf_dict(), dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="unsupported architecture: model_type 'gpt2'"):
        ModelConfig.from_hf_dict({**hf, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf_dict({**hf, "attention_bias": True})
    qwen3 = CFG.replace(model_type="qwen3", head_dim=32)
    hf = qwen3.to_hf_dict(head="sequence_classification")
    assert hf["model_type"] == "qwen3" and hf["architectures"] == ["Qwen3ForSequenceClassification"]
    assert not hf["attention_bias"] and not hf["use_sliding_window"]
    assert ModelConfig.from_hf_dict(hf) == qwen3
    sliding_layers = ["full_attention", "sliding_attention"]
    for bad, match in [({"use_sliding_window": True}, "Qwen3 config: use_sliding_window"),
                       ({"layer_types": sliding_layers}, r"Qwen3 config: layer_types \['sliding_attention'\]"),
                       ({"attention_bias": True}, "Qwen3 config: attention_bias"),
                       ({"model_type": "qwen3_moe"}, r"model_type 'qwen3_moe'.*\('qwen2', 'llama', 'qwen3'\)")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**hf, **bad})
