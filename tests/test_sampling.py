"""Sampler: KV-cache decoding == full-forward references, padding/batch invariance, filters, EOS, sharding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcppo_jax.models import CausalLM, ModelConfig, position_ids
from vcppo_jax.sampling import SampleOutput, decode_responses, filter_logits, make_sampler, sample
from vcppo_jax.tokenizer import synthetic_tokenizer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  rope_theta=1000.0)
MODEL = CausalLM(CFG)
P, R = 6, 8
PADS = np.array([4, 0, 2, 3])  # row 0 (most padding) is the one the padding test takes out alone
B = len(PADS)
PAD_ID = 0
RNG = jax.random.key(7)


def _abstract():
    dummy = (jnp.zeros((1, 1), jnp.int32),) * 2 + (jnp.ones((1, 1), bool),)
    return jax.eval_shape(lambda r: MODEL.init(r, *dummy), jax.random.key(0))


@pytest.fixture(scope="module")
def params():
    """O(1)-scale random params ('params' collection); a larger LM head gives peaked, non-uniform next-token
    distributions, so top-k/top-p sets are small and greedy has clear winners."""
    rng = np.random.default_rng(0)
    flat, treedef = jax.tree_util.tree_flatten_with_path(nn.unbox(_abstract())["params"])
    leaves = []
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        base, std = (1.0 if "norm" in name else 0.0), (0.6 if "lm_head" in name else 0.15)
        leaves.append(jnp.asarray((base + std * rng.standard_normal(x.shape)).astype(x.dtype)))
    return jax.tree.unflatten(treedef, leaves)


def _prompts(seed: int):
    rng = np.random.default_rng(seed)
    mask = np.arange(P)[None, :] >= PADS[:, None]
    return np.where(mask, rng.integers(1, CFG.vocab_size, size=(B, P)), PAD_ID).astype(np.int32), mask


@pytest.fixture(scope="module")
def prompts():
    return _prompts(1)


@jax.jit
def _full_logits(params, tokens, mask):
    """No-cache forward over the whole sequence: fp32 logits [B, T, vocab]."""
    hidden, _ = MODEL.apply({"params": params}, tokens, position_ids(mask), mask)
    return MODEL.apply({"params": params}, hidden, method=CausalLM.logits)


def _response_logits(params, out: SampleOutput, prompt_mask) -> np.ndarray:
    """Logits [B, R, vocab] that predicted each response token, recomputed without a cache."""
    mask = np.concatenate([prompt_mask, np.asarray(out.response_mask) > 0], axis=1)
    return np.asarray(_full_logits(params, out.tokens, mask), np.float64)[:, P - 1:-1]


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def greedy_reference(params, prompts):
    """Step-by-step argmax with a full forward per step (no cache, no EOS): tokens [B, R], logits [B, R, V]."""
    tokens, mask = prompts
    seq = np.concatenate([tokens, np.full((B, R), PAD_ID, np.int32)], axis=1)
    full_mask = np.concatenate([mask, np.zeros((B, R), bool)], axis=1)
    logits = []
    for t in range(R):
        step = np.asarray(_full_logits(params, seq, full_mask))[:, P + t - 1]
        seq[:, P + t] = step.argmax(-1)
        full_mask[:, P + t] = True
        logits.append(step)
    return seq[:, P:], np.stack(logits, axis=1).astype(np.float64)


def _run(params, tokens, mask, rng=RNG, **kw) -> SampleOutput:
    opts = dict(max_new_tokens=R, eos_id=None, pad_id=PAD_ID, temperature=1.0) | kw
    return jax.device_get(sample(MODEL, params, tokens, mask, rng, **opts))


@pytest.fixture(scope="module")
def eos_id(greedy_reference):
    """The stop token that the most greedy rows emit within their first R-2 steps (so that rows stop at
    different times and some run to R)."""
    ref_tokens, _ = greedy_reference
    count, neg_tok = max((sum(tok in row[:R - 2] for row in ref_tokens), -int(tok)) for tok in np.unique(ref_tokens))
    assert 2 <= count < B, "test setup: no token shared by some but not all greedy rows; change the prompt seed"
    return -neg_tok


@pytest.fixture(scope="module")
def greedy_out(params, prompts, eos_id):
    return _run(params, *prompts, temperature=0.0, eos_id=eos_id)


@pytest.fixture(scope="module")
def sampled_out(params, prompts):
    return _run(params, *prompts)


# ------------------------------------------------------------------------------------------------ greedy / logprobs
def test_greedy_matches_uncached_argmax_and_stops_at_eos(greedy_out, greedy_reference, prompts, eos_id):
    ref_tokens, ref_logits = greedy_reference
    out = greedy_out
    assert out.tokens.shape == (B, P + R) and out.tokens.dtype == np.int32
    assert out.response_mask.dtype == out.logprobs.dtype == np.float32 and out.lengths.dtype == np.int32
    np.testing.assert_array_equal(out.tokens[:, :P], prompts[0])
    hits = ref_tokens == eos_id
    want_len = np.where(hits.any(1), hits.argmax(1) + 1, R)
    assert want_len.max() == R and len(set(want_len.tolist())) > 1  # rows stop at different times, one never
    np.testing.assert_array_equal(out.lengths, want_len)
    valid = np.arange(R)[None, :] < want_len[:, None]
    np.testing.assert_array_equal(out.response_mask, valid.astype(np.float32))
    np.testing.assert_array_equal(out.tokens[:, P:], np.where(valid, ref_tokens, PAD_ID))  # pad after EOS
    # Greedy log-probs are those of softmax(logits) at temperature 1.
    want_lp = np.take_along_axis(_log_softmax(ref_logits), ref_tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logprobs, np.where(valid, want_lp, 0.0), atol=1e-5)
    assert int(out.num_steps) == R - 1


def test_several_stop_ids_end_a_row_at_the_first_of_them(params, prompts, greedy_reference, eos_id):
    """eos_id=(a, b): each row ends at its first a or b (a chat template's end-of-turn token beside EOS), equal to
    the uncached argmax up to there; `stop_ids` tells `decode_responses` what to cut."""
    ref_tokens, _ = greedy_reference
    # A second stop token that some row emits before its first eos_id (so both ids end some row).
    first = lambda row, tok: int(np.argmax(row == tok)) if tok in row else R  # noqa: E731
    other = next(int(t) for t in np.unique(ref_tokens) if t != eos_id
                 and any(first(row, t) < min(first(row, eos_id), R - 1) for row in ref_tokens))
    fn = make_sampler(MODEL, max_new_tokens=R, eos_id=(eos_id, other), pad_id=PAD_ID, temperature=0.0)
    assert fn.stop_ids == (eos_id, other)
    out = jax.device_get(fn(params, *prompts, RNG))
    want_len = np.array([min(first(row, eos_id), first(row, other), R - 1) + 1 for row in ref_tokens])
    np.testing.assert_array_equal(out.lengths, want_len)
    valid = np.arange(R)[None, :] < want_len[:, None]
    np.testing.assert_array_equal(out.tokens[:, P:], np.where(valid, ref_tokens, PAD_ID))
    ended = {int(out.tokens[b, P + n - 1]) for b, n in enumerate(out.lengths) if n < R}
    assert ended == {eos_id, other}


def test_one_token_prompts(params):
    """P = 1: the prefill is a single new token too (its mask covers one slot, not the cache): same tokens as the
    step-by-step uncached argmax."""
    prompt = np.array([[5], [17]], np.int32)
    out = _run(params, prompt, np.ones_like(prompt, bool), temperature=0.0)
    seq = np.concatenate([prompt, np.zeros((2, R), np.int32)], axis=1)
    for t in range(R):
        mask = np.arange(1 + R)[None, :] <= t
        seq[:, 1 + t] = np.asarray(_full_logits(params, seq, np.repeat(mask, 2, 0)))[:, t].argmax(-1)
    np.testing.assert_array_equal(out.tokens, seq)


def test_early_exit_when_all_rows_done(params, prompts, greedy_reference, eos_id):
    """Rows that never emit EOS are replaced by a copy of one that does: the loop must stop before R."""
    ref_tokens, _ = greedy_reference
    stops = np.array([eos_id in row[:R - 2] for row in ref_tokens])
    keep = np.where(stops, np.arange(B), np.flatnonzero(stops)[0])
    out = _run(params, *(x[keep] for x in prompts), temperature=0.0, eos_id=eos_id)
    assert np.all(out.tokens[np.arange(B), P + out.lengths - 1] == eos_id)
    assert int(out.num_steps) == out.lengths.max() - 1 < R - 2  # stopped before max_new_tokens


def test_sampled_logprobs_match_full_forward(params, sampled_out, prompts):
    out = sampled_out
    logq = _log_softmax(_response_logits(params, out, prompts[1]))
    want = np.take_along_axis(logq, out.tokens[:, P:, None], -1)[..., 0]
    np.testing.assert_allclose(out.logprobs, want, atol=1e-5)
    assert not np.array_equal(out.tokens[:, P:], logq.argmax(-1))  # it did sample, not argmax
    assert int(out.num_steps) == R - 1 and np.all(out.lengths == R)  # eos_id=None: never stops early


def test_temperature_zero_equals_top_k_one(params, prompts, greedy_out, eos_id):
    out = _run(params, *prompts, top_k=1, eos_id=eos_id)
    np.testing.assert_array_equal(out.tokens, greedy_out.tokens)
    np.testing.assert_array_equal(out.lengths, greedy_out.lengths)
    np.testing.assert_allclose(out.logprobs, 0.0, atol=1e-6)  # a single-token distribution


def _cache_carry_dtypes(kv_cache_dtype: str, tokens, mask) -> list:
    """dtypes of the decode loop's carried arrays that have the KV cache's shape [L, B, K, P + R, H]."""
    fn = make_sampler(MODEL, max_new_tokens=R, eos_id=None, pad_id=PAD_ID, kv_cache_dtype=kv_cache_dtype)
    # The jitted sampler's jaxpr is one pjit call; the decode loop sits inside it.
    inner = jax.make_jaxpr(fn.__wrapped__)(_abstract()["params"], tokens, mask, RNG).eqns[0].params["jaxpr"]
    loop = next(e for e in inner.eqns if e.primitive.name == "while")
    shape = (CFG.num_layers, B, CFG.num_kv_heads, P + R, CFG.head_dim)
    return [v.aval.dtype for v in loop.outvars if v.aval.shape == shape]


def test_bf16_kv_cache(params, prompts, greedy_reference):
    """'bfloat16' stores the cache in bf16 (the loop carries bf16 k and v instead of fp32 ones); keys and values
    are rounded, so the log-probs move off the fp32 forward pass by a little, and the greedy tokens stay."""
    assert _cache_carry_dtypes("compute", *prompts) == [jnp.float32] * 2
    assert _cache_carry_dtypes("bfloat16", *prompts) == [jnp.bfloat16] * 2
    out = _run(params, *prompts, kv_cache_dtype="bfloat16")
    logq = _log_softmax(_response_logits(params, out, prompts[1]))
    err = np.abs(out.logprobs - np.take_along_axis(logq, out.tokens[:, P:, None], -1)[..., 0])
    assert 1e-4 < err.max() < 5e-2  # rounded (fp32 cache: < 1e-5, test above), but close
    greedy = _run(params, *prompts, temperature=0.0, kv_cache_dtype="bfloat16")
    np.testing.assert_array_equal(greedy.tokens[:, P:], greedy_reference[0])


# ------------------------------------------------------------------------------------------------ top-k / top-p
def _allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """numpy reference: log-probs [..., V] of the filtered, renormalized distribution (-inf outside the set)."""
    z = logits / temperature
    out = np.full(z.shape, -np.inf)
    for idx in np.ndindex(z.shape[:-1]):
        order = np.argsort(-z[idx], kind="stable")
        cand = order[:top_k] if top_k else order
        probs = np.exp(z[idx][cand] - z[idx][cand].max())
        probs /= probs.sum()
        if top_p < 1:
            cand = cand[np.cumsum(probs) - probs < top_p]
        kept = z[idx][cand]
        out[idx][cand] = kept - kept.max() - np.log(np.exp(kept - kept.max()).sum())
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 2, 1.0), (1.3, 0, 0.8)])  # top-k; top-p alone
def test_filters_never_sample_outside_allowed_set(params, prompts, temperature, top_k, top_p):
    out = _run(params, *prompts, temperature=temperature, top_k=top_k, top_p=top_p)
    logits = _response_logits(params, out, prompts[1])
    logq = _allowed(logits, temperature, top_k, top_p)
    chosen = np.take_along_axis(logq, out.tokens[:, P:, None], -1)[..., 0]
    assert np.all(np.isfinite(chosen)), "sampled a token outside the top-k / top-p set"
    np.testing.assert_allclose(out.logprobs, chosen, atol=1e-5)
    sizes = np.isfinite(logq).sum(-1)
    assert sizes.max() > 1 and np.any(out.tokens[:, P:] != logits.argmax(-1))  # a real choice was made
    if top_k:
        assert sizes.max() <= top_k


def test_filter_logits_matches_numpy():
    logits = np.random.default_rng(3).standard_normal((5, 20)) * 2
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.5, 3, 1.0), (1.0, 0, 0.3), (2.0, 7, 0.9), (1.0, 20, 0.5)]:
        got = np.asarray(filter_logits(jnp.asarray(logits, jnp.float32), temperature=temperature, top_k=top_k,
                                       top_p=top_p))
        want = _allowed(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got[np.isfinite(got)], (logits / temperature)[np.isfinite(want)], rtol=1e-6)


# ------------------------------------------------------------------------------------------------ invariances
def test_padding_does_not_change_output(params, prompts, sampled_out):
    """Row 0 (2 real tokens, 4 pads in the batch) alone without padding samples the same response: it is row 0 in
    both calls, so its PRNG stream is the same, and the logits must match to float rounding."""
    tokens, mask = prompts
    alone = _run(params, tokens[:1, PADS[0]:], mask[:1, PADS[0]:])
    assert alone.tokens.shape == (1, P - PADS[0] + R)
    np.testing.assert_array_equal(alone.tokens[0, -R:], sampled_out.tokens[0, P:])
    np.testing.assert_allclose(alone.logprobs[0], sampled_out.logprobs[0], atol=1e-5)


def test_row_sample_independent_of_other_rows(params, prompts, sampled_out):
    tokens, mask = prompts
    other_tokens, other_mask = _prompts(2)
    swap = np.array([False, True, False, True])  # rows 1 and 3 get other prompts
    out = _run(params, np.where(swap[:, None], other_tokens, tokens), np.where(swap[:, None], other_mask, mask))
    np.testing.assert_array_equal(out.tokens[~swap], sampled_out.tokens[~swap])
    np.testing.assert_array_equal(out.logprobs[~swap], sampled_out.logprobs[~swap])
    assert not np.array_equal(out.tokens[swap], sampled_out.tokens[swap])
    # Another key changes the samples; so does the row index for one prompt repeated in every row.
    assert not np.array_equal(_run(params, tokens, mask, rng=jax.random.key(8)).tokens, sampled_out.tokens)
    same = _run(params, np.repeat(tokens[1:2], B, 0), np.repeat(mask[1:2], B, 0))
    assert len({tuple(r) for r in same.tokens.tolist()}) > 1


def test_compiles_once_per_shape(params, prompts):
    fn = make_sampler(MODEL, max_new_tokens=R, eos_id=None, pad_id=PAD_ID, temperature=1.0)
    assert fn.__wrapped__ is make_sampler(MODEL, max_new_tokens=R, eos_id=None, pad_id=PAD_ID,
                                          temperature=1).__wrapped__
    fn(params, *prompts, RNG)
    compiled = fn.__wrapped__._cache_size()
    for seed in range(3):
        fn(jax.tree.map(lambda x: x * (1 + seed), params), *prompts, jax.random.key(seed))
    assert fn.__wrapped__._cache_size() == compiled  # new values, same shapes: no recompile


# ------------------------------------------------------------------------------------------------ sharding
def test_sharded_greedy_equals_unsharded(params, prompts, greedy_out, eos_id):
    from vcppo_jax import sharding as shd

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    shardings = nn.unbox(shd.logical_shardings(_abstract(), mesh))["params"]
    sharded_params = jax.device_put(params, shardings)
    tokens, mask = shd.shard_batch(prompts, mesh)
    fn = make_sampler(MODEL, max_new_tokens=R, eos_id=eos_id, pad_id=PAD_ID, temperature=0.0)
    with shd.use_mesh(mesh):
        out = fn(sharded_params, tokens, mask, RNG)
    assert out.tokens.sharding.spec[0] == ("data", "fsdp")  # the batch stayed split over data x fsdp
    out = jax.device_get(out)
    np.testing.assert_array_equal(out.tokens, greedy_out.tokens)
    np.testing.assert_array_equal(out.lengths, greedy_out.lengths)
    np.testing.assert_allclose(out.logprobs, greedy_out.logprobs, atol=1e-5)


# ------------------------------------------------------------------------------------------------ text, errors
def test_decode_responses_stops_before_eos():
    tok = synthetic_tokenizer()
    texts = ["12+3", "7", ""]
    r = 6
    rows, lengths = [], []
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False)
        resp = ids + [tok.eos_token_id] if i < 2 else tok.encode("99999999", add_special_tokens=False)[:r]
        lengths.append(len(resp))
        rows.append([tok.pad_token_id] * 2 + [tok.bos_token_id] + resp + [tok.pad_token_id] * (r - len(resp)))
    lengths = np.array(lengths)
    out = SampleOutput(tokens=np.array(rows), response_mask=(np.arange(r) < lengths[:, None]).astype(np.float32),
                       lengths=lengths, logprobs=np.zeros((3, r), np.float32), num_steps=np.int32(r - 1))
    assert decode_responses(tok, out) == ["12+3", "7", "999999"]  # last row hit max_new_tokens: nothing cut
    # Several stop ids (EOS and a chat end-of-turn token): whichever a row ends with is cut, nothing else.
    seven = tok.convert_tokens_to_ids("7")
    assert decode_responses(tok, out, eos_id=(tok.eos_token_id, seven)) == ["12+3", "7", "999999"]
    rows = np.array(rows)
    rows[1, 3 + 1] = seven  # row 1 now ends "7" then the end-of-turn stand-in "7" instead of EOS
    out = out._replace(tokens=rows)
    assert decode_responses(tok, out, eos_id=(tok.eos_token_id, seven)) == ["12+3", "7", "999999"]
    assert decode_responses(tok, out) == ["12+3", "77", "999999"]


def test_input_validation(params, prompts):
    tokens, mask = prompts
    ok = dict(max_new_tokens=R, eos_id=1, pad_id=PAD_ID)
    bad = [
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(eos_id=CFG.vocab_size), r"eos_id must be None, an int or a sequence of ints in \[0, vocab_size\) = "
                                      r"\[0, 64\)"),
        (dict(eos_id=(1, -1)), r"eos_id must be None, an int or a sequence of ints in \[0, vocab_size\)"),
        (dict(pad_id=-1), r"pad_id must be an int in \[0, vocab_size\)"),
        (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (dict(top_k=CFG.vocab_size + 1), r"top_k must be an int in \[0, vocab_size\] = \[0, 64\]"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(kv_cache_dtype="float16"), r"kv_cache_dtype must be one of \('compute', 'bfloat16'\)"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            make_sampler(MODEL, **(ok | kw))
    with pytest.raises(ValueError, match="model must be a vcppo_jax.models.CausalLM"):
        make_sampler(object(), **ok)
    fn = make_sampler(MODEL, **ok)
    with pytest.raises(ValueError, match="prompt_mask must have the shape of prompt_tokens"):
        fn(params, tokens, mask[:, 1:], RNG)
    with pytest.raises(ValueError, match=r"prompt_tokens must be \[batch, prompt_len\]"):
        fn(params, tokens[0], mask[0], RNG)
    with pytest.raises(ValueError, match="prompt_tokens must be integer token ids"):
        fn(params, tokens.astype(np.float32), mask, RNG)
    with pytest.raises(ValueError, match=r"LEFT-padded with >= 1 real token per row: rows \[0, 2, 3\]"):
        fn(params, tokens, mask[:, ::-1], RNG)
    holey = mask.copy()
    holey[1, 2] = False
    with pytest.raises(ValueError, match="a row has a pad after a real token"):
        fn(params, tokens, holey, RNG)
