"""Tests for vcppo_jax.rewards: answer extraction, equivalence, and robustness to garbage."""

import threading
import time

import numpy as np
import pytest

from vcppo_jax import rewards
from vcppo_jax.data import synthetic
from vcppo_jax.rewards import answer_extractor, extract_math_answer, last_boxed, make_verifier, score_batch


@pytest.fixture(scope='module')
def math_verifier():
    return make_verifier('math')


@pytest.fixture(scope='module')
def synth_verifier():
    return make_verifier('synthetic')


def test_synthetic_reference_traces_score_correct(synth_verifier):
    cfg = synthetic.synthetic_config(num_train=10, num_test=50, ops='+-')
    for rec in synthetic.generate_records(cfg, 'test'):
        assert synth_verifier(rec['cot'], rec['answer']) == 1.0
        assert synth_verifier(rec['direct'], rec['answer']) == 1.0
        assert synth_verifier(rec['cot'].replace(f"Answer: {rec['answer']}", f"Answer: {int(rec['answer']) + 1}"),
                              rec['answer']) == -1.0


@pytest.mark.parametrize('response, expected', [
    ('Answer: 494', 1.0),
    ('Answer:494', 1.0),
    ('Answer: 494  \n', 1.0),
    ('Answer: 12\nmore work\nAnswer: 494', 1.0),  # the last answer line counts
    ('Answer: 494\nAnswer: 12', -1.0),
    ('Answer: 494\nAnswer: oops', -1.0),  # last answer line malformed
    ('Answer: 4945', -1.0),
    ('Answer: 0494', -1.0),  # exact string
    ('Answer: 494x', -1.0),
    ('Answer: 49 4', -1.0),
    ('494', -1.0),  # no answer line
    ('', -1.0),
    ('answer: 494', -1.0),
])
def test_synthetic_answer_line(synth_verifier, response, expected):
    assert synth_verifier(response, '494') == expected


def test_last_boxed_nested_and_last_counts():
    assert last_boxed(r'first \boxed{1} then \boxed{\frac{a}{\sqrt{b}}} end') == r'\frac{a}{\sqrt{b}}'
    assert last_boxed(r'\boxed{2} and a truncated \boxed{\frac{1}{') == '2'
    assert last_boxed(r'\boxed{{x}}') == '{x}'
    assert last_boxed(r'\fbox{7}') == '7'
    assert last_boxed(r'\boxed{3} so \boxed 9') == '9'
    assert last_boxed('no box at all') is None


@pytest.mark.parametrize('text, expected', [
    (r'So $\boxed{5}$. #### 6', '5'),  # boxed beats ####
    ('work\n#### 1,234\n', '1,234'),
    ('#### 1\n#### 2', '2'),
    ('blah\nAnswer: $\\frac{1}{2}$', '$\\frac{1}{2}$'),
    ('#### 3\nAnswer: 4', '3'),  # #### beats Answer:
    ('nothing', None),
    ('####   ', None),
])
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


@pytest.mark.parametrize('response, gold, expected', [
    (r'The answer is $\boxed{\frac{1}{2}}$.', '0.5', 1.0),
    (r'\boxed{0.5}', r'\frac{1}{2}', 1.0),
    (r'\boxed{\dfrac{3}{4}}', '0.75', 1.0),
    (r'\boxed{\frac12}', '1/2', 1.0),
    (r'\boxed{0.33}', r'\frac{1}{3}', -1.0),
    ('#### 1,234', '1234', 1.0),
    ('#### 1234', '1,234', 1.0),
    ('#### 1,235', '1,234', -1.0),
    (r'\boxed{\$18}', '18', 1.0),
    (r'\boxed{18.}', '18', 1.0),
    (r'\boxed{\sqrt{2}}', r'2^{1/2}', 1.0),  # needs math_verify
    (r'\boxed{x=3}', '3', 1.0),
    (r'\boxed{(1, 2)}', '(1,2)', 1.0),
    (r'\boxed{\text{(C)}}', r'\text{(C)}', 1.0),
    (r'\boxed{2\pi}', r'\pi', -1.0),
    (r'\boxed{1}\boxed{2}', '1', -1.0),  # last box counts
    ('no final answer', '5', -1.0),
    (r'\boxed{}', '5', -1.0),
])
def test_math_equivalence(math_verifier, response, gold, expected):
    assert math_verifier(response, gold) == expected


def test_garbage_is_wrong_fast_and_never_raises(math_verifier, synth_verifier):
    garbage = [
        'x' * 1_000_000,
        '\\boxed{' * 200_000,
        '{' * 500_000 + '}' * 500_000,
        '#### ' + '9' * 1_000_000,
        '\u2603\x00\ud800\U0001f600' * 250_000,
        r'\boxed{10^{10^{10}}}',  # sympy would never return on this
        r'\boxed{2^{123456789}}',
        r'\boxed{99999999!}',
        r'\boxed{9!!!!!!!!!}',  # a factorial tower: sympy never returned on this one
        r'\boxed{((3!)!)!}',
        r'\boxed{1e99999999}',
        r'\boxed{\frac{' * 50 + '}' * 50,
        r'\boxed{' + 'a+' * 150 + 'a}',
        None,
        b'\xff\xfe',
        12345,
    ]
    for text in garbage:
        start = time.perf_counter()
        assert math_verifier(text, '5') == -1.0
        assert synth_verifier(text, '5') == -1.0
        assert time.perf_counter() - start < 2.0, repr(text)[:60]
    # The answer follows the garbage: still found, the garbage ahead of the tail is never scanned.
    start = time.perf_counter()
    assert math_verifier('\u2603' * 1_000_000 + r' \boxed{5}', '5') == 1.0
    assert synth_verifier('{' * 1_000_000 + '\nAnswer: 5', '5') == 1.0
    assert time.perf_counter() - start < 1.0


def test_answer_caps():
    assert not rewards.math_equal('1' * (rewards.MAX_ANSWER_CHARS + 1), '1' * (rewards.MAX_ANSWER_CHARS + 1))
    assert not rewards.is_safe_for_sympy('x^{x^{2}}')
    assert not rewards.is_safe_for_sympy('2**123456')
    assert rewards.is_safe_for_sympy('x^{2}+2^{10}')


def test_verifier_works_off_the_main_thread(math_verifier):
    out = []
    thread = threading.Thread(target=lambda: out.append(math_verifier(r'\boxed{\sqrt{4}}', '2')))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_reward_values_and_batch():
    verifier = make_verifier('gsm8k', correct=1, wrong=0)
    scores = score_batch(verifier, ['#### 3', '#### 4', 'junk'], ['3', '3', '3'])
    assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match='same length'):
        score_batch(verifier, ['a'], ['1', '2'])
    with pytest.raises(ValueError, match='task_name'):
        make_verifier('aime')
    with pytest.raises(ValueError, match='correct'):
        make_verifier('math', correct=0.0, wrong=0.0)
    with pytest.raises(ValueError, match='wrong'):
        make_verifier('math', wrong=float('nan'))


def test_bounded_call_kills_a_slow_worker_and_recovers():
    """The hard bound behind the guards: a call that outlives the deadline is scored False within about the
    deadline, the worker is replaced, and later calls work; a call that raises is False, not a crash."""
    from testutil import sleep_then  # noqa: PLC0415

    call = rewards.BoundedCall(sleep_then, timeout_s=1.0)
    try:
        assert call(0.0) is True  # starts the worker (its start-up is not counted against the deadline)
        start = time.perf_counter()
        assert call(60.0) is False
        assert time.perf_counter() - start < 10.0  # bounded: the call would take 60 s
        assert call(0.0, "yes") is True  # a fresh worker
        assert call(0.0, ValueError("boom")) is False
        assert call(0.0) is True  # an exception does not kill the worker
    finally:
        call.close()
    with pytest.raises(ValueError, match="timeout_s"):
        rewards.BoundedCall(sleep_then, timeout_s=0)


def test_math_verifier_scores_through_the_bounded_worker(monkeypatch):
    """The math verifier's sympy path goes through a BoundedCall (and the fast paths never start one)."""
    calls = []
    real = rewards.BoundedCall.__call__
    monkeypatch.setattr(rewards.BoundedCall, "__call__", lambda self, *a: calls.append(a) or real(self, *a))
    verifier = make_verifier("math")
    assert verifier(r"\boxed{5}", "5") == 1.0 and verifier(r"\boxed{0.5}", "1/2") == 1.0 and calls == []
    assert verifier(r"\boxed{\sqrt{4}}", "2") == 1.0
    assert calls == [(r"\sqrt{4}", "2")]


def test_answer_extractor_reads_what_the_verifier_reads():
    phrase = "First 3 + 4 = 7 apples. The answer is 7."
    assert answer_extractor("word_problems")(phrase) == "7"
    assert answer_extractor("math")(phrase) is None  # the answer phrase counts for word problems only
    assert answer_extractor("math")(r"so \boxed{12}") == "12"
    assert answer_extractor("synthetic")("3+4\nAnswer: 7") == "7"
    assert answer_extractor("synthetic")(r"\boxed{7}") is None
    with pytest.raises(ValueError, match="task_name"):
        answer_extractor("aime")
