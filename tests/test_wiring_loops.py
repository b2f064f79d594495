"""Wiring of the host-side loops: rollout layout, reward placement, prompt groups, evaluation and its statistics,
the lr schedule and the minibatch loop, each against hand-built inputs with known answers or the closed form.
(The jitted RL pieces are in test_wiring.py.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vcppo_jax import config as config_lib
from vcppo_jax import optim
from vcppo_jax import rollout as rollout_lib
from vcppo_jax.data import RecordSource
from vcppo_jax.rewards import answer_extractor
from vcppo_jax.sampling import SampleOutput
from vcppo_jax.tokenizer import synthetic_tokenizer

TOK = synthetic_tokenizer()
B, P, R = 8, 4, 6
RESP_LENS = np.array([1, R, 3, 2, R, 4, 5, 1])
PROMPT_LENS = np.array([1, P, 2, 3, P, 1, 2, 4])


def expected_rewards(seq_rewards, lengths, resp_len):
    """Token rewards written cell by cell: the sequence reward at index length-1, zero elsewhere."""
    out = np.zeros((len(lengths), resp_len), np.float32)
    for b, n in enumerate(lengths):
        out[b, n - 1] = seq_rewards[b]
    return out


def hand_sample_output():
    rs = np.random.RandomState(0)
    prompt_mask = (np.arange(P)[None, :] >= (P - PROMPT_LENS)[:, None]).astype(np.int32)
    resp_mask = (np.arange(R)[None, :] < RESP_LENS[:, None]).astype(np.float32)
    prompt = np.where(prompt_mask, rs.randint(1, 50, size=(B, P)), 0)
    response = np.where(resp_mask > 0, rs.randint(1, 50, size=(B, R)), 0)
    logprobs = (-rs.uniform(0.1, 3.0, size=(B, R)) * resp_mask).astype(np.float32)
    out = SampleOutput(tokens=np.concatenate([prompt, response], 1).astype(np.int32), response_mask=resp_mask,
                       lengths=RESP_LENS.astype(np.int32), logprobs=logprobs, num_steps=np.int32(R - 1))
    return out, prompt_mask


SEQ_REWARDS = np.array([0.5, -1.0, 2.0, 3.0, -4.0, 1.5, 7.0, -0.25], np.float32)  # all distinct


# --------------------------------------------------------------------------------------------------------------
# to_rollout / shuffle_rewards.
# --------------------------------------------------------------------------------------------------------------


def test_to_rollout_layout_and_reward_at_each_last_token():
    out, prompt_mask = hand_sample_output()
    ro = rollout_lib.to_rollout(out, prompt_mask, SEQ_REWARDS)
    np.testing.assert_array_equal(ro.rewards, expected_rewards(SEQ_REWARDS, RESP_LENS, R))
    for b in range(B):  # the same, spelled out for short rows
        assert ro.rewards[b, RESP_LENS[b] - 1] == SEQ_REWARDS[b]
        assert np.count_nonzero(ro.rewards[b]) == 1
    assert ro.attn_mask.dtype == bool
    np.testing.assert_array_equal(ro.attn_mask, np.concatenate([prompt_mask > 0, out.response_mask > 0], 1))
    assert ro.response_mask.dtype == np.float32
    np.testing.assert_array_equal(ro.response_mask, out.response_mask)
    np.testing.assert_array_equal(ro.response_mask.sum(1), RESP_LENS)
    np.testing.assert_array_equal(ro.tokens, out.tokens)
    np.testing.assert_array_equal(ro.seq_rewards, SEQ_REWARDS)
    np.testing.assert_array_equal(ro.sample_logp, out.logprobs)


def test_place_rewards_on_full_and_length_one_rows():
    mask = np.array([[1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)
    np.testing.assert_array_equal(rollout_lib.place_rewards(np.array([5.0, 6.0, 7.0]), mask),
                                  [[5, 0, 0], [0, 0, 6], [0, 7, 0]])


def test_shuffle_rewards_permutes_and_replaces_at_own_last_token():
    out, prompt_mask = hand_sample_output()
    ro = rollout_lib.to_rollout(out, prompt_mask, SEQ_REWARDS)
    before = {k: v.copy() for k, v in vars(ro).items()}
    shuffled = rollout_lib.shuffle_rewards(ro, np.random.default_rng(0))
    seq = shuffled.seq_rewards
    np.testing.assert_array_equal(np.sort(seq), np.sort(SEQ_REWARDS))  # a permutation
    assert not np.array_equal(seq, SEQ_REWARDS)  # that moves something (fixed seed)
    np.testing.assert_array_equal(shuffled.rewards, expected_rewards(seq, RESP_LENS, R))
    for k in ("tokens", "attn_mask", "response_mask", "sample_logp"):
        np.testing.assert_array_equal(getattr(shuffled, k), before[k])
    for k, v in vars(ro).items():  # the input rollout is left as it was
        np.testing.assert_array_equal(v, before[k])


# --------------------------------------------------------------------------------------------------------------
# prompt_batch: a group's copies are consecutive rows.
# --------------------------------------------------------------------------------------------------------------

RECORDS = [{"prompt": p, "answer": a} for p, a in [
    ("1+2=?", "3"), ("12+345=?\n", "357"), ("a", "x"), ("7*8-9+10=? long prompt", "57"), ("9-4=?", "5")]]
SOURCE = RecordSource(RECORDS, fields=("prompt", "answer"))


def left_padded(text, max_len):
    ids = [TOK.bos_token_id] + TOK.convert_tokens_to_ids(list(text))  # char-level ids, BOS first
    ids = ids[-max_len:]  # truncation keeps the end of the prompt
    return [TOK.pad_token_id] * (max_len - len(ids)) + ids, [0] * (max_len - len(ids)) + [1] * len(ids)


@pytest.mark.parametrize("group_size", [1, 3, 4])
def test_prompt_batch_repeats_each_record_in_consecutive_rows(group_size):
    indices = [3, 0, 4, 1, 2]
    max_len = 12
    pb = rollout_lib.prompt_batch(SOURCE, indices, TOK, max_prompt_len=max_len, group_size=group_size)
    n = len(indices) * group_size
    assert pb.tokens.shape == pb.mask.shape == (n, max_len) and len(pb.answers) == n
    for i, idx in enumerate(indices):
        want_tokens, want_mask = left_padded(RECORDS[idx]["prompt"], max_len)
        for j in range(group_size):
            row = i * group_size + j
            assert pb.tokens[row].tolist() == want_tokens, (row, idx)
            assert pb.mask[row].tolist() == want_mask, (row, idx)
            assert pb.answers[row] == RECORDS[idx]["answer"], (row, idx)


# --------------------------------------------------------------------------------------------------------------
# evaluate / rollout_stats with a fake sampler and verifier.
# --------------------------------------------------------------------------------------------------------------

EVAL_R = 16
EVAL_RECORDS = [{"prompt": f"{i}+1=?", "answer": str(i + 1)} for i in range(7)]
RESPONSES = {  # prompt -> response text
    "0+1=?": "Answer: 1",  # right, one line
    "1+1=?": "1+1\nAnswer: 2",  # right, scratchpad
    "2+1=?": "Answer: 9",  # wrong, one line
    "3+1=?": "Answer: 4\n",  # right, one line once stripped
    "4+1=?": "x\ny",  # wrong, two lines
    "5+1=?": "a" * 20,  # wrong, one line, truncated at EVAL_R (no EOS)
    "6+1=?": "z\nAnswer: 7",  # right, scratchpad: left out by the batch rounding below
}


def response_ids(text):
    return (TOK.convert_tokens_to_ids(list(text)) + [TOK.eos_token_id])[:EVAL_R]


def sample_logp_of(n):
    return -(0.1 + 0.02 * np.arange(n))


class FakeSampler:
    """Answers each prompt with RESPONSES[prompt] (+ EOS), right-padded with pad ids to EVAL_R; log-prob of token t is
    -(0.1 + 0.02 t), 0 past the response."""

    def __init__(self):
        self.calls = []

    def __call__(self, params, tokens, mask, rng):
        self.calls.append((params, np.asarray(tokens).copy()))
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        b = tokens.shape[0]
        response = np.full((b, EVAL_R), TOK.pad_token_id, np.int32)
        logprobs = np.zeros((b, EVAL_R), np.float32)
        lengths = np.zeros(b, np.int32)
        for i in range(b):
            prompt = TOK.decode(tokens[i][mask[i] > 0].tolist(), skip_special_tokens=True)
            ids = response_ids(RESPONSES[prompt])
            response[i, :len(ids)] = ids
            logprobs[i, :len(ids)] = sample_logp_of(len(ids))
            lengths[i] = len(ids)
        resp_mask = (np.arange(EVAL_R)[None, :] < lengths[:, None]).astype(np.float32)
        return SampleOutput(tokens=np.concatenate([tokens, response], 1).astype(np.int32), response_mask=resp_mask,
                            lengths=lengths, logprobs=logprobs, num_steps=np.int32(lengths.max() - 1))


def fake_verifier(text, answer):
    return 1.0 if text.strip().endswith("Answer: " + answer) else -1.0


def fake_ref_logprobs(tokens, attn_mask):
    """-0.3 on response tokens, garbage past them (as a real forward pass gives on padding)."""
    valid = np.asarray(attn_mask)[:, -EVAL_R:]
    return np.where(valid, -0.3, 1e3).astype(np.float32)


def test_evaluate_against_known_answers():
    sampler, params = FakeSampler(), object()
    source = RecordSource(EVAL_RECORDS, fields=("prompt", "answer"))
    # 7 prompts in batches of 3: the last (partial) batch is dropped, so record 6 is never sampled.
    kw = dict(num_prompts=7, batch_size=3, max_prompt_len=8, correct=1.0, rng=jax.random.key(0))
    out = rollout_lib.evaluate(sampler, params, source, TOK, fake_verifier, ref_logprobs=fake_ref_logprobs, **kw)
    used = [r["prompt"] for r in EVAL_RECORDS[:6]]
    texts = [RESPONSES[p] for p in used]
    lengths = np.array([min(len(t) + 1, EVAL_R) for t in texts])
    assert list(lengths) == [10, 14, 10, 11, 4, 16]
    rewards = [fake_verifier(t, r["answer"]) for t, r in zip(texts, EVAL_RECORDS[:6])]
    assert rewards == [1.0, 1.0, -1.0, 1.0, -1.0, -1.0]
    kl = sum((sample_logp_of(n) + 0.3).sum() for n in lengths) / lengths.sum()
    assert out == pytest.approx({"eval/pass@1": 0.5, "eval/response_length_mean": lengths.mean(),
                                 "eval/direct_fraction": 4 / 6, "eval/kl_to_ref": kl,
                                 "eval/clip_ratio": 1 / 6}, rel=1e-6)  # the "a" * 20 row
    assert len(sampler.calls) == 2 and all(p is params for p, _ in sampler.calls)

    without = rollout_lib.evaluate(sampler, params, source, TOK, fake_verifier, prefix="probe", **kw)
    assert set(without) == {"probe/pass@1", "probe/response_length_mean", "probe/direct_fraction", "probe/clip_ratio"}
    assert without["probe/pass@1"] == pytest.approx(0.5)

    found = rollout_lib.evaluate(sampler, params, source, TOK, fake_verifier,
                                 extract_answer=answer_extractor("synthetic"), **kw)
    assert found["eval/answer_rate"] == pytest.approx(4 / 6)  # an "Answer: <int>" line, right or wrong


def test_rollout_stats_known_values():
    lengths = np.array([1, R, 3, R])
    stats = rollout_lib.rollout_stats(np.array([1.0, -1.0, 1.0, 0.5], np.float32), lengths, correct=1.0, max_len=R)
    assert stats == pytest.approx({"rollout/reward_mean": 0.375, "rollout/accuracy": 0.5,
                                   "rollout/response_length_mean": 4.0, "rollout/response_length_max": R,
                                   "rollout/response_length_min": 1.0, "rollout/clip_ratio": 0.5})


# --------------------------------------------------------------------------------------------------------------
# Optimizer schedule and the minibatch loop.
# --------------------------------------------------------------------------------------------------------------


def closed_form_lr(lr, warmup, decay, step):
    if warmup and step < warmup:
        return lr * step / warmup
    if not decay:
        return lr
    t = min(step - warmup, decay) / decay
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@pytest.mark.parametrize("warmup,decay", [(10, 40), (10, 0), (0, 40), (0, 0)])
def test_lr_schedule_closed_form(warmup, decay):
    cfg = config_lib.optim_config(2e-3)
    cfg.warmup_steps, cfg.decay_steps = warmup, decay
    sched = optim.lr_schedule(cfg)
    for step in [0, 1, 5, 9, 10, 11, 20, 30, 49, 50, 51, 200]:
        want = closed_form_lr(2e-3, warmup, decay, step)
        assert float(sched(step)) == pytest.approx(want, rel=1e-5, abs=1e-12), step
        assert optim.learning_rate(cfg, step) == pytest.approx(want, rel=1e-5, abs=1e-12), step
    if decay:
        assert float(sched(warmup + decay // 2)) == pytest.approx(0.55 * 2e-3, rel=1e-5)
        assert float(sched(warmup + decay + 5)) == pytest.approx(0.1 * 2e-3, rel=1e-5)


def test_make_optimizer_applies_the_schedule_per_update():
    """With a constant gradient Adam's step is lr_k * g / |g|: after n updates the param moved by sum_k lr_k."""
    cfg = config_lib.optim_config(2e-3)
    cfg.warmup_steps, cfg.decay_steps, cfg.grad_clip, cfg.eps = 4, 6, 0.0, 1e-12
    tx = optim.make_optimizer(cfg)
    params = {"w": jnp.zeros(())}
    opt_state = tx.init(params)
    update = jax.jit(tx.update)
    moved = []
    for _ in range(12):
        updates, opt_state = update({"w": jnp.ones(())}, opt_state, params)
        params = optax.apply_updates(params, updates)
        moved.append(-float(params["w"]))
    want = np.cumsum([closed_form_lr(2e-3, 4, 6, k) for k in range(12)])
    np.testing.assert_allclose(moved, want, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("num_epochs", [1, 2])
def test_train_epochs_visits_every_row_once_per_epoch(num_epochs):
    """loss = sum_i w[idx_i] * (x_i - 10 idx_i + 1): with SGD(lr 1) w ends at -(visits per row) when each minibatch
    keeps its rows' fields together (x_i = 10 idx_i); any row dropped, repeated or mispaired shows up in w."""
    n, k = 12, 3
    batch = {"idx": jnp.arange(n), "x": 10.0 * jnp.arange(n)}
    tx = optax.sgd(1.0)

    def loss_fn(params, mb):
        loss = jnp.sum(params["w"][mb["idx"]] * (mb["x"] - 10.0 * mb["idx"] + 1.0))
        return loss, {"mb_rows": jnp.float32(mb["idx"].shape[0])}

    state = optim.init_model_state({"w": jnp.zeros(n)}, tx)
    state, m = optim.train_epochs(state, batch, jax.random.key(0), loss_fn, tx, num_epochs=num_epochs,
                                  num_minibatches=k)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), -float(num_epochs) * np.ones(n))
    assert int(state.step) == num_epochs * k
    assert float(m["mb_rows"]) == n // k and float(m["train/nonfinite"]) == 0
