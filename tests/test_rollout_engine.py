"""The 'slots' rollout engine: the dense engine's samples row for row, the trainer's log-probs, the config's choice."""

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest

import config_files
from vcppo_jax import config as config_lib
from vcppo_jax import rl
from vcppo_jax import sharding as shd
from vcppo_jax.rollout import to_rollout
from vcppo_jax.sampling import ENGINES, make_sampler, sampler_from_config, slot_widths

from test_sampling import CFG, MODEL, PAD_ID, _abstract, params  # noqa: F401 (params: the module's fixture)

B, P, R = 8, 5, 10  # B: a multiple of the test mesh's data x fsdp = 4
RNG = jax.random.key(3)
TEMP = 0.7


@pytest.fixture(scope="module")
def prompts():
    """Left-padded [B, P] prompts with 1 to P real tokens."""
    rng = np.random.default_rng(1)
    mask = np.arange(P)[None, :] >= rng.integers(0, P, size=B)[:, None]
    return np.where(mask, rng.integers(1, CFG.vocab_size, size=(B, P)), PAD_ID).astype(np.int32), mask


def _sample(params, prompts, temperature, eos_id, **engine):
    fn = make_sampler(MODEL, max_new_tokens=R, eos_id=eos_id, pad_id=PAD_ID, temperature=temperature, **engine)
    return jax.device_get(fn(params, *prompts, RNG))


@pytest.fixture(scope="module")
def eos(params, prompts) -> int:
    """A stop token that ends the dense engine's rows at the most different lengths, one row running to R: the
    tokens before a row's first stop do not depend on the stop id, so its length is that token's first index + 1."""
    tokens = _sample(params, prompts, TEMP, None).tokens[:, P:]
    first = lambda tok: [int(np.argmax(row == tok)) + 1 if tok in row else R for row in tokens]  # noqa: E731
    return max((t for t in range(1, CFG.vocab_size) if R in first(t)), key=lambda t: len(set(first(t))))


@pytest.fixture(scope="module")
def three_slots(params, prompts, eos):
    return _sample(params, prompts, TEMP, eos, engine="slots", num_slots=3)


def test_slots_sample_what_dense_samples(params, prompts, eos, three_slots):
    """Each row samples the same tokens and log-probs whether it decodes with all rows (dense), alone in one slot
    (each row after the previous one ended), or in 3 or 4 slots refilled as rows end and narrowed (3 -> 1,
    4 -> 2 -> 1) once no row waits: its PRNG stream is keyed by its row index, its positions are the dense engine's,
    and where its keys sit in the cache does not enter attention's sum."""
    dense = _sample(params, prompts, TEMP, eos)
    lengths = dense.lengths
    assert lengths.max() == R and len(set(lengths.tolist())) >= 3, lengths  # rows end at different times
    assert int(dense.decode_rows) == int(dense.num_steps) * B
    live = {}
    for slots, out in [(1, _sample(params, prompts, TEMP, eos, engine="slots", num_slots=1)), (3, three_slots),
                       (4, _sample(params, prompts, TEMP, eos, engine="slots", num_slots=4))]:
        np.testing.assert_array_equal(out.tokens, dense.tokens)
        np.testing.assert_array_equal(out.lengths, lengths)
        np.testing.assert_array_equal(out.response_mask, dense.response_mask)
        np.testing.assert_allclose(out.logprobs, dense.logprobs, atol=1e-5)
        live[slots] = (lengths - 1).sum() / int(out.decode_rows)
        assert int(out.decode_rows) <= int(out.num_steps) * slots
    assert live[1] == 1.0  # one slot: every decode step computes the live row, rows one after another
    assert (lengths - 1).sum() / int(dense.decode_rows) < min(live[3], live[4])


def test_tail_narrowing_counts_the_rows_it_computes(params, prompts, eos):
    """With B slots every row starts at once, so before decode step k the live rows are those longer than k; each
    step runs at the narrowest of `slot_widths(B)` that holds them, and decode_rows sums those widths (a numpy count
    from the dense engine's lengths). The rows still sample what the dense engine samples."""
    assert slot_widths(8) == (8, 4, 2, 1) and slot_widths(3) == (3, 1) and slot_widths(1) == (1,)
    assert slot_widths(64) == (64, *range(60, 0, -4), 2, 1) and slot_widths(12) == (12, 8, 4, 2, 1)
    assert slot_widths(256) == (256, *range(240, 0, -16), 8, 4, 2, 1)
    dense = _sample(params, prompts, TEMP, eos)
    out = _sample(params, prompts, TEMP, eos, engine="slots", num_slots=B)
    np.testing.assert_array_equal(out.tokens, dense.tokens)
    live = [(dense.lengths > k).sum() for k in range(1, dense.lengths.max())]
    widths = [min(w for w in slot_widths(B) if w >= n) for n in live]
    assert widths[-1] < B  # the tail did narrow
    assert int(out.num_steps) == len(live) and int(out.decode_rows) == sum(widths)
    # No stop token: every row runs to R and ends at the full width, where the narrowing tail is skipped.
    dense, out = (_sample(params, prompts, TEMP, None, **kw) for kw in ({}, dict(engine="slots", num_slots=B)))
    np.testing.assert_array_equal(out.tokens, dense.tokens)
    np.testing.assert_allclose(out.logprobs, dense.logprobs, atol=1e-5)
    assert (out.lengths == R).all() and int(out.decode_rows) == (R - 1) * B


def test_slots_logprobs_match_the_trainers(params, prompts, three_slots):
    """The PPO ratio's old log-probs (rl.policy_logprobs on the rollout's layout, at the sampling temperature) are
    the sampler's, with rows ending early and slots refilled."""
    ro = to_rollout(three_slots, prompts[1], np.zeros(B, np.float32))
    logp_fn = jax.jit(functools.partial(rl.policy_logprobs, MODEL, prompt_len=P, chunk=R, temperature=TEMP))
    logp, _ = logp_fn(params, ro.tokens, ro.attn_mask)
    valid = ro.response_mask > 0
    assert valid.sum(1).min() < R  # some row ended early
    np.testing.assert_allclose(np.asarray(logp)[valid], ro.sample_logp[valid], atol=1e-4)
    np.testing.assert_array_equal(ro.sample_logp[~valid], 0.0)


def test_sharded_slots_equal_unsharded(params, prompts, eos, three_slots):
    """On a data x fsdp x tensor mesh (batch-sharded prompts, sharded params, `use_mesh`) the engine samples what it
    samples on one device (each row's tokens do not depend on its slot), and its outputs stay batch-sharded."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    sharded_params = jax.device_put(params, nn.unbox(shd.logical_shardings(_abstract(), mesh))["params"])
    fn = make_sampler(MODEL, max_new_tokens=R, eos_id=eos, pad_id=PAD_ID, temperature=TEMP, engine="slots",
                      num_slots=4)  # 4 slots: one per data x fsdp shard
    with shd.use_mesh(mesh):
        out = fn(sharded_params, *shd.shard_batch(prompts, mesh), RNG)
    assert out.tokens.sharding.spec[0] == ("data", "fsdp")
    out = jax.device_get(out)
    np.testing.assert_array_equal(out.tokens, three_slots.tokens)
    np.testing.assert_allclose(out.logprobs, three_slots.logprobs, atol=1e-5)


def _rl_config():
    return config_files.load("vcppo")


def test_the_config_picks_the_engine():
    """The loops build samplers with `sampler_from_config`: `sampling.engine` / `decode_slots` reach the sampler
    (one jit per options), greedy keeps them; bad values fail validation naming the field."""
    config = _rl_config()
    s = config.sampling
    assert s.engine == "dense" and ENGINES == ("dense", "slots")
    kw = dict(max_new_tokens=R, eos_id=1, pad_id=PAD_ID)
    same = lambda a, b: a.__wrapped__ is b.__wrapped__  # noqa: E731 (samplers share a jit iff their options match)
    assert same(sampler_from_config(MODEL, s, **kw), make_sampler(MODEL, temperature=s.temperature, **kw))
    s.engine, s.decode_slots = "slots", 2
    config_lib.validate(config)
    sampled = sampler_from_config(MODEL, s, **kw)
    assert same(sampled, make_sampler(MODEL, temperature=s.temperature, engine="slots", num_slots=2, **kw))
    assert not same(sampled, make_sampler(MODEL, temperature=s.temperature, engine="slots", num_slots=3, **kw))
    assert same(sampler_from_config(MODEL, s, greedy=True, **kw),
                make_sampler(MODEL, temperature=0.0, engine="slots", num_slots=2, **kw))
    for field, value, match in [("engine", "paged", r"sampling.engine='paged' .*one of \('dense', 'slots'\)"),
                                ("decode_slots", -1, r"sampling.decode_slots=-1 .*integer >= 0")]:
        bad = _rl_config()
        bad.sampling[field] = value
        with pytest.raises(config_lib.ConfigError, match=match):
            config_lib.validate(bad)
    with pytest.raises(ValueError, match=r"engine must be one of \('dense', 'slots'\)"):
        make_sampler(MODEL, engine="paged", **kw)
    with pytest.raises(ValueError, match=r"num_slots must be an int >= 0 \(0 = auto\)"):
        make_sampler(MODEL, engine="slots", num_slots=-1, **kw)
