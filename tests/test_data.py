"""Tests for vcppo_jax.data (synthetic task, gsm8k/math readers, batching) and vcppo_jax.tokenizer."""

import json
import os
import re

import numpy as np
import pytest
import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vcppo_jax.data import load_task, math_tasks, synthetic
from vcppo_jax.data.batching import batch_indices, encode_prompts, encode_sft, trim_sft_padding
from vcppo_jax.tokenizer import load_tokenizer, synthetic_tokenizer

SMALL = dict(num_train=300, num_test=40)


@pytest.fixture(scope='module')
def default_train():
    return list(synthetic.generate_records(synthetic.synthetic_config(), 'train'))


@pytest.fixture(scope='module')
def tok():
    return synthetic_tokenizer()


# ----------------------------------------------------------------------------- synthetic task: content

def _check_step(line: str, expected_left: int, op: str, term: int) -> int:
    """Independent check of one scratchpad line against integer arithmetic; returns the running value."""
    m = re.fullmatch(r'(\d+)([+-])(\d+): ((?:\d[+-]\d[+-]\d=\d\d ?)+); (\d+)', line)
    assert m, line
    left, line_op, right, columns, result = m.groups()
    assert (int(left), line_op, int(right)) == (expected_left, op, term)
    value = expected_left + term if op == '+' else expected_left - term
    assert int(result) == value and str(value) == result
    cols = columns.split()
    assert len(cols) == max(len(left), len(right))
    carry = 0
    for i, col in enumerate(cols):
        a, b = expected_left // 10 ** i % 10, term // 10 ** i % 10
        raw = a + b + carry if op == '+' else a - b - carry
        carry_out = int(raw >= 10) if op == '+' else int(raw < 0)
        assert col == f'{a}{op}{b}{op}{carry}={carry_out}{raw % 10}', (line, i)
        carry = carry_out
    return value


@pytest.mark.parametrize('ops', ['+', '+-'])
def test_records_arithmetic_is_correct(ops):
    cfg = synthetic.synthetic_config(ops=ops, **SMALL)
    for split in ('train', 'test'):
        for rec in synthetic.generate_records(cfg, split):
            expr = rec['prompt']
            assert expr.endswith('=?\n')
            tokens = re.findall(r'[+-]|\d+', expr[:-3])
            terms, signs = [int(t) for t in tokens[0::2]], tokens[1::2]
            assert cfg.min_terms <= len(terms) <= cfg.max_terms
            assert all(cfg.min_digits <= len(str(t)) <= cfg.max_digits for t in terms)
            lines = rec['cot'].split('\n')
            assert len(lines) == len(terms)
            value = terms[0]
            for line, sign, term in zip(lines[:-1], signs, terms[1:]):
                value = _check_step(line, value, sign, term)
                assert value >= 0
            assert value == sum(t if s == '+' else -t for s, t in zip(['+'] + signs, terms))
            assert rec['answer'] == str(value)
            assert rec['direct'] == f'Answer: {value}' == lines[-1]
    if ops == '+-':
        assert any('-' in r['prompt'] for r in synthetic.generate_records(cfg, 'test'))


def test_generation_is_deterministic_by_seed():
    cfg = synthetic.synthetic_config(**SMALL)
    first = list(synthetic.generate_records(cfg, 'train'))
    assert first == list(synthetic.generate_records(synthetic.synthetic_config(**SMALL), 'train'))
    other = list(synthetic.generate_records(synthetic.synthetic_config(seed=1, **SMALL), 'train'))
    assert [r['prompt'] for r in first] != [r['prompt'] for r in other]


def test_splits_are_disjoint_and_distinct():
    # Tiny problem space (2 terms of 1 digit: 100 problems) makes collisions certain without the exclusion.
    cfg = synthetic.synthetic_config(min_terms=2, max_terms=2, min_digits=1, max_digits=1, num_train=40,
                                     num_test=10)
    train = [r['prompt'] for r in synthetic.generate_records(cfg, 'train')]
    test = [r['prompt'] for r in synthetic.generate_records(cfg, 'test')]
    assert len(set(train)) == 40 and len(set(test)) == 10
    assert not set(train) & set(test)


def test_default_lengths_fit_budget(default_train, tok):
    cfg = synthetic.synthetic_config()
    assert len(default_train) == cfg.num_train
    prompt_tokens = [len(tok(r['prompt'])['input_ids']) for r in default_train]  # incl. BOS
    cot_tokens = [len(tok(r['cot'], add_special_tokens=False)['input_ids']) + 1 for r in default_train]  # + EOS
    direct_tokens = [len(tok(r['direct'], add_special_tokens=False)['input_ids']) + 1 for r in default_train]
    assert max(prompt_tokens) <= 48
    assert max(cot_tokens) <= 256
    assert 100 <= np.mean(cot_tokens) <= 250
    assert max(direct_tokens) <= 16
    assert np.mean(cot_tokens) > 8 * np.mean(direct_tokens)


def test_knobs_change_lengths_and_names():
    def mean_cot(**knobs):
        cfg = synthetic.synthetic_config(num_train=10, num_test=200, **knobs)
        return np.mean([len(r['cot']) for r in synthetic.generate_records(cfg, 'test')]), cfg.name

    base, base_name = mean_cot()
    more_terms, terms_name = mean_cot(min_terms=6, max_terms=8)
    more_digits, digits_name = mean_cot(min_digits=4, max_digits=5)
    assert more_terms > 1.5 * base and more_digits > 1.3 * base
    assert len({base_name, terms_name, digits_name, synthetic.synthetic_config(ops='+-').name,
                synthetic.synthetic_config(seed=3).name, synthetic.synthetic_config(num_test=7).name}) == 6


@pytest.mark.parametrize('knobs', [dict(min_terms=1), dict(max_terms=2, min_terms=3), dict(max_digits=10),
                                   dict(ops='*'), dict(num_train=0), dict(seed=-1), dict(foo=1),
                                   dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, num_train=60)])
def test_bad_knobs_raise(knobs):
    with pytest.raises(ValueError):
        synthetic.synthetic_config(**knobs)


def test_tfds_round_trip(tmp_path):
    cfg = synthetic.synthetic_config(**SMALL)
    src = load_task('synthetic', 'train', data_dir=str(tmp_path), **SMALL)
    assert len(src) == SMALL['num_train']
    assert list(src) == list(synthetic.generate_records(cfg, 'train'))  # on-disk order = generation order
    assert all(isinstance(v, str) for v in src[0].values()) and set(src[0]) == set(synthetic.FIELDS)
    assert src[-1] == src[len(src) - 1] and src[2:4] == [src[2], src[3]]
    assert src.get_batch(np.array([5, 1])) == [src[5], src[1]]
    variant = tmp_path / 'synthetic_arith' / cfg.name / '1.0.0'
    assert (variant / 'dataset_info.json').exists()
    stamp = os.path.getmtime(variant / 'dataset_info.json')
    test = synthetic.load_synthetic('test', data_dir=str(tmp_path), **SMALL)  # reuses the built data
    assert os.path.getmtime(variant / 'dataset_info.json') == stamp
    assert list(test) == list(synthetic.generate_records(cfg, 'test'))
    with pytest.raises(IndexError):
        src[len(src)]


# ----------------------------------------------------------------------------- gsm8k / math readers

def _write_jsonl(path, rows):
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))


def test_gsm8k_local_records_read_through_tfds(tmp_path):
    manual = tmp_path / 'manual'
    manual.mkdir()
    rows = [{'question': 'Ann has 3 pens and buys 4. How many? ', 'answer': 'She has 3+4=<<3+4=7>>7.\n#### 7'},
            {'question': 'What is 1000+234?', 'answer': '1000+234=<<1000+234=1234>>1234\n#### 1,234'}]
    _write_jsonl(manual / 'train.jsonl', rows)
    _write_jsonl(manual / 'test.jsonl', rows[1:])
    data_dir = str(tmp_path / 'data')
    with pytest.raises(FileNotFoundError, match='gsm8k not prepared in .*prepare_gsm8k'):
        load_task('gsm8k', 'train', data_dir=data_dir)
    math_tasks.prepare_gsm8k(data_dir, manual_dir=str(manual))
    train = load_task('gsm8k', 'train', data_dir=data_dir)
    by_answer = {r['answer']: r for r in train}
    assert set(by_answer) == {'7', '1,234'} and len(load_task('gsm8k', 'test', data_dir=data_dir)) == 1
    rec = by_answer['7']
    assert rec['prompt'] == math_tasks.DEFAULT_TEMPLATE.format(question='Ann has 3 pens and buys 4. How many?')
    assert rec['cot'] == 'She has 3+4=7.\nThe final answer is \\boxed{7}.'
    custom = load_task('gsm8k', 'train', data_dir=data_dir, template='Q: {question}\nA:')
    assert {r['prompt'] for r in custom} == {'Q: Ann has 3 pens and buys 4. How many?\nA:',
                                             'Q: What is 1000+234?\nA:'}
    with pytest.raises(ValueError, match='template'):
        load_task('gsm8k', 'train', data_dir=data_dir, template='no placeholder')
    with pytest.raises(ValueError, match='split'):
        load_task('gsm8k', 'validation', data_dir=data_dir)


def test_math_local_release_read_through_tfds(tmp_path):
    root = tmp_path / 'manual' / 'MATH'
    for split, subject, name, solution in [
            ('train', 'algebra', '1.json', 'Half: $\\boxed{1}$, no: $\\boxed{\\frac{1}{2}}$.'),
            ('train', 'algebra', '2.json', 'No boxed answer here.'),
            ('test', 'geometry', '9.json', 'Hence $\\boxed{\\sqrt{x^{2}}}$')]:
        (root / split / subject).mkdir(parents=True, exist_ok=True)
        (root / split / subject / name).write_text(json.dumps(
            {'problem': f'Problem {name}', 'level': 'Level 1', 'type': subject, 'solution': solution}))
    data_dir = str(tmp_path / 'data')
    with pytest.raises(FileNotFoundError, match='math not prepared'):
        load_task('math', 'test', data_dir=data_dir)
    math_tasks.prepare_math(data_dir, manual_dir=str(tmp_path / 'manual'))
    train = list(load_task('math', 'train', data_dir=data_dir))
    assert len(train) == 1  # the problem without a boxed answer is skipped
    assert train[0]['answer'] == '\\frac{1}{2}'
    assert train[0]['prompt'].startswith('Problem 1.json\n') and train[0]['cot'].startswith('Half:')
    assert [r['answer'] for r in load_task('math', 'test', data_dir=data_dir)] == ['\\sqrt{x^{2}}']


def test_unknown_task_raises(tmp_path):
    with pytest.raises(ValueError, match='unknown task'):
        load_task('aime', 'test', data_dir=str(tmp_path))


# ----------------------------------------------------------------------------- batching

def test_batch_indices_epochs_are_permutations_and_resumable():
    n, bs, seed = 10, 4, 3
    steps = [batch_indices(n, bs, s, seed) for s in range(15)]  # 60 samples = 6 epochs
    flat = np.concatenate(steps)
    for e in range(6):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n))
    assert not np.array_equal(flat[:n], flat[n:2 * n])
    # Pure function of (seed, step): recomputing any step in isolation (a resume) gives the same batch.
    assert np.array_equal(batch_indices(n, bs, 7, seed), steps[7])
    assert not np.array_equal(batch_indices(n, bs, 7, seed + 1), steps[7])
    big = batch_indices(3, 7, 2, 0)  # batch larger than the dataset: 14..20 spans epochs 4-6
    assert big.shape == (7,) and big.dtype == np.int64 and set(big) <= {0, 1, 2}
    assert sorted(big[1:4]) == [0, 1, 2]  # positions 15-17 are all of epoch 5
    for bad in [dict(num_records=0), dict(batch_size=0), dict(step=-1), dict(seed=-2)]:
        args = dict(num_records=5, batch_size=2, step=0, seed=0) | bad
        with pytest.raises(ValueError):
            batch_indices(**args)


def test_encode_prompts_left_pads(tok):
    prompts = ['12+3=?\n', '1+1=?\n', '999+999+999=?\n']
    tokens, mask = encode_prompts(tok, prompts, 16)
    assert tokens.shape == mask.shape == (3, 16) and tokens.dtype == np.int32 and mask.dtype == np.int32
    for row, m, text in zip(tokens, mask, prompts):
        ids = tok(text)['input_ids']
        assert ids[0] == tok.bos_token_id
        assert list(row[16 - len(ids):]) == ids and set(row[:16 - len(ids)]) <= {tok.pad_token_id}
        assert list(m) == [0] * (16 - len(ids)) + [1] * len(ids)
    with pytest.raises(ValueError, match='max_len'):
        encode_prompts(tok, prompts, 8)
    cut, cut_mask = encode_prompts(tok, prompts, 8, truncate=True)
    assert list(cut[2]) == tok(prompts[2])['input_ids'][-8:] and cut_mask[2].all()
    with pytest.raises(ValueError):
        encode_prompts(tok, 'not a list', 8)


def test_encode_sft_layout(tok):
    prompts, targets = ['1+2=?\n', '10+20=?\n'], ['Answer: 3', 'a\nAnswer: 30']
    P, R = 12, 14
    batch = encode_sft(tok, prompts, targets, P, R)
    prompt_tokens, prompt_mask = encode_prompts(tok, prompts, P)
    assert np.array_equal(batch['tokens'][:, :P], prompt_tokens)
    assert np.array_equal(batch['prompt_mask'], prompt_mask)
    for i, target in enumerate(targets):
        ids = tok(target, add_special_tokens=False)['input_ids'] + [tok.eos_token_id]
        resp = batch['tokens'][i, P:]
        assert list(resp[:len(ids)]) == ids and set(resp[len(ids):]) <= {tok.pad_token_id}
        assert list(batch['response_mask'][i]) == [1] * len(ids) + [0] * (R - len(ids))
        assert tok.decode(resp[:len(ids) - 1]) == target
    assert np.array_equal(batch['attention_mask'], np.concatenate([prompt_mask, batch['response_mask']], 1))
    assert np.array_equal(batch['loss_mask'][:, P:], batch['response_mask']) and not batch['loss_mask'][:, :P].any()
    assert all(v.dtype == np.int32 and v.shape[0] == 2 for v in batch.values())
    with pytest.raises(ValueError, match='max_target_len'):
        encode_sft(tok, prompts, targets, P, 10)
    cut = encode_sft(tok, prompts, targets, P, 10, truncate=True)
    assert cut['response_mask'][1].all() and tok.eos_token_id not in cut['tokens'][1, P:]
    with pytest.raises(ValueError, match='same length'):
        encode_sft(tok, prompts, targets[:1], P, R)


def test_trim_sft_padding_keeps_every_real_token_and_rounds_up(tok):
    prompts, targets = ['1+2=?\n', '10+20=?\n'], ['Answer: 3', 'a\nAnswer: 30']
    P, R = 12, 14
    full = encode_sft(tok, prompts, targets, P, R)
    longest_p, longest_r = full['prompt_mask'].sum(1).max(), full['response_mask'].sum(1).max()
    assert longest_p < P and longest_r < R  # there is padding to trim
    exact = trim_sft_padding(full, 1)
    assert exact['prompt_mask'].shape[1] == longest_p and exact['response_mask'].shape[1] == longest_r
    for k in full:  # the kept columns are the full batch's, and every real token is kept
        assert exact[k].shape[1] in (longest_p, longest_r, longest_p + longest_r)
        assert exact[k].sum() == full[k].sum()
    assert np.array_equal(exact['tokens'], full['tokens'][:, P - longest_p:P + longest_r])
    rounded = trim_sft_padding(full, 4)
    assert rounded['prompt_mask'].shape[1] == min(P, -(-longest_p // 4) * 4)
    assert rounded['response_mask'].shape[1] == min(R, -(-longest_r // 4) * 4)
    assert trim_sft_padding(full, 64)['tokens'].shape == full['tokens'].shape  # never longer than before


# ----------------------------------------------------------------------------- tokenizer

def test_synthetic_tokenizer_covers_task_and_round_trips(tok, default_train, tmp_path):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2) and len(tok) <= 64
    addsub = list(synthetic.generate_records(synthetic.synthetic_config(ops='+-', **SMALL), 'test'))
    texts = [r[f] for r in default_train[:500] + addsub for f in synthetic.FIELDS]
    vocab = tok.get_vocab()
    assert set(''.join(texts)) <= set(vocab)
    for text in texts[:200]:
        ids = tok(text, add_special_tokens=False)['input_ids']
        assert ids == [vocab[c] for c in text]  # one id per character
        assert tok.decode(ids) == text
    assert synthetic_tokenizer().get_vocab() == vocab  # deterministic build
    tok.save_pretrained(tmp_path / 'tok')
    sample = texts[:50]
    expected = tok(sample)['input_ids']
    for reloaded in (PreTrainedTokenizerFast.from_pretrained(tmp_path / 'tok'), load_tokenizer(tmp_path / 'tok'),
                     AutoTokenizer.from_pretrained(tmp_path / 'tok')):
        assert reloaded(sample)['input_ids'] == expected
        assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 2)


def test_load_tokenizer_keeps_tokenizer_json_ids_in_a_qwen2_folder(tok, tmp_path):
    folder = tmp_path / 'model'
    tok.save_pretrained(folder)
    (folder / 'config.json').write_text(json.dumps({'model_type': 'qwen2'}))
    raw = tokenizers.Tokenizer.from_file(str(folder / 'tokenizer.json'))
    text = '12 + 3 = ?\nAnswer: 15'
    assert load_tokenizer(folder)(text)['input_ids'] == raw.encode(text).ids
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / 'missing')
