"""Tests for vcppo_jax.data.word_problems (the arithmetic word-problem task) and its verifier's "The answer is"
fallback in vcppo_jax.rewards."""

import re

import pytest

from vcppo_jax import rewards
from vcppo_jax.data import load_task, word_problems
from vcppo_jax.data.math_tasks import DEFAULT_TEMPLATE
from vcppo_jax.rewards import extract_math_answer, make_verifier

SMALL = dict(num_train=60, num_test=20)
ALL_OPS = dict(ops='+-*', min_ops=1, max_ops=4, max_value=9, **SMALL)

# The test's own reading of the English, independent of the generator's tables: which words make a step which
# operation. Every step sentence must match exactly one of these.
STEP_MEANING = {
    '+': re.compile(r'\b(more|finds|wins)\b'),
    '-': re.compile(r'\b(gives \d+ to|loses|sells|takes)\b'),
    '*': re.compile(r'\b(times|each)\b'),
}
APPLY = {'+': lambda a, b: a + b, '-': lambda a, b: a - b, '*': lambda a, b: a * b}


@pytest.fixture(scope='module')
def verifier():
    return make_verifier('word_problems')


def records(split, **knobs):
    return [word_problems.make_record(p)
            for p in word_problems.generate_problems(word_problems.word_problems_config(**knobs), split)]


def read_question(question: str) -> tuple[int, list[tuple[str, int]]]:
    """(start count, [(operation, operand)]) read off the question text alone."""
    sentences = re.split(r'(?<=[.?]) ', question)
    assert re.fullmatch(r'[A-Z][a-z]+ has \d+ [a-z]+\.', sentences[0]), sentences[0]
    assert re.fullmatch(r'How many [a-z]+ does [A-Z][a-z]+ have now\?', sentences[-1]), sentences[-1]
    start = int(re.search(r'\d+', sentences[0]).group())
    steps = []
    for sentence in sentences[1:-1]:
        ops = [op for op, pattern in STEP_MEANING.items() if pattern.search(sentence)]
        numbers = re.findall(r'\d+', sentence)
        assert len(ops) == 1 and len(numbers) == 1, sentence
        steps.append((ops[0], int(numbers[0])))
    return start, steps


# ----------------------------------------------------------------------------- content

@pytest.mark.parametrize('knobs', [SMALL, ALL_OPS, dict(ops='*', max_ops=3, **SMALL),
                                   dict(ops='-', min_ops=2, max_ops=2, max_value=30, **SMALL)])
def test_gold_answer_matches_an_independent_reading_of_the_question(knobs):
    cfg = word_problems.word_problems_config(**knobs)
    for split in ('train', 'test'):
        for problem in word_problems.generate_problems(cfg, split):
            rec = word_problems.make_record(problem)
            start, steps = read_question(rec['question'])
            assert (start, steps) == (problem.start, [(op, k) for op, k, _ in problem.steps])
            pronouns = {word_problems.PEOPLE[i][1] for i in (problem.person, problem.friend)}
            assert len(pronouns) == 2  # 'he'/'she' always means the protagonist
            assert cfg.min_ops <= len(steps) <= cfg.max_ops and {op for op, _ in steps} <= set(cfg.ops)
            assert 1 <= start <= cfg.max_value and all(1 <= k <= cfg.max_value for _, k in steps)
            count = start
            cot_lines = rec['cot'].split('\n')
            for (op, k), line in zip(steps, cot_lines[1:-1]):
                assert line.endswith(f': {count} {op} {k} = {APPLY[op](count, k)}.'), line
                count = APPLY[op](count, k)
                assert count >= 0
            assert len(cot_lines) == len(steps) + 2
            assert rec['answer'] == str(count)
            assert cot_lines[-1] == f'The answer is \\boxed{{{count}}}.'


def test_defaults_and_every_template_are_used():
    cfg = word_problems.word_problems_config()
    assert (cfg.min_ops, cfg.max_ops, cfg.max_value, cfg.ops) == (1, 2, 20, '+-')
    problems = list(word_problems.generate_problems(word_problems.word_problems_config(**ALL_OPS), 'train'))
    used = {(op, template) for p in problems for op, _, template in p.steps}
    assert used == {(op, t) for op in '+-*' for t in range(word_problems.MAX_TEMPLATES)}
    one = word_problems.word_problems_config(num_templates=1, **ALL_OPS)
    assert {t for p in word_problems.generate_problems(one, 'train') for _, _, t in p.steps} == {0}


def test_generation_is_deterministic_by_seed():
    first = records('train', **SMALL)
    assert first == records('train', **SMALL)
    assert [r['question'] for r in first] != [r['question'] for r in records('train', seed=1, **SMALL)]


def test_splits_are_disjoint_and_distinct():
    # A small problem space (1 '+' step of 1-2, one template: 256 questions) makes collisions certain.
    knobs = dict(min_ops=1, max_ops=1, max_value=2, ops='+', num_templates=1, num_train=80, num_test=40)
    train = [r['question'] for r in records('train', **knobs)]
    test = [r['question'] for r in records('test', **knobs)]
    assert len(set(train)) == 80 and len(set(test)) == 40
    assert not set(train) & set(test)
    with pytest.raises(ValueError, match='too few'):
        records('train', **dict(knobs, num_train=250))


def test_names_encode_the_knobs_and_ops_order_does_not_matter():
    names = {word_problems.word_problems_config(**k).name for k in (
        {}, dict(min_ops=2), dict(max_ops=3), dict(max_value=9), dict(ops='+'), dict(num_templates=2),
        dict(num_train=7), dict(num_test=7), dict(seed=1))}
    assert len(names) == 9
    assert word_problems.word_problems_config(ops='-+').name == word_problems.word_problems_config(ops='+-').name


@pytest.mark.parametrize('knobs, knob', [
    (dict(min_ops=0), 'min_ops'), (dict(min_ops=3, max_ops=2), 'max_ops'), (dict(max_value=1), 'max_value'),
    (dict(max_value=2.5), 'max_value'), (dict(ops='+/'), 'ops'), (dict(ops=''), 'ops'), (dict(ops='++'), 'ops'),
    (dict(num_templates=0), 'num_templates'), (dict(num_templates=word_problems.MAX_TEMPLATES + 1), 'num_templates'),
    (dict(num_train=0), 'num_train'), (dict(seed=-1), 'seed'), (dict(max_steps=2), 'max_steps'),
])
def test_bad_knobs_name_the_knob(knobs, knob):
    with pytest.raises(ValueError, match=knob):
        word_problems.word_problems_config(**knobs)


# ----------------------------------------------------------------------------- verifier

def test_reference_solutions_verify_and_wrong_numbers_do_not(verifier):
    for rec in records('test', **ALL_OPS):
        answer, cot = rec['answer'], rec['cot']
        assert verifier(cot, answer) == 1.0
        wrong = str(int(answer) + 1)
        assert verifier(cot.replace(f'\\boxed{{{answer}}}', f'\\boxed{{{wrong}}}'), answer) == -1.0
        unboxed = cot.replace(f'\\boxed{{{answer}}}', answer)
        assert verifier(unboxed, answer) == 1.0  # the "The answer is" fallback
        assert verifier(unboxed.replace(f'The answer is {answer}.', f'The answer is {wrong}.'), answer) == -1.0


@pytest.mark.parametrize('response, expected', [
    (r'\boxed{12}', 1.0),
    (r'So $\boxed{12.}$', 1.0),
    ('The answer is 12.', 1.0),
    ('The answer is 12', 1.0),
    ('The answer is 12 apples.', 1.0),
    ('the answer is $12$.', 1.0),
    ('The final answer is: 12', 1.0),
    (r'The answer is \text{12 apples}.', 1.0),
    ('The answer is 5 + 7 = 12.', 1.0),  # the last number of the sentence
    ('The answer is 12. Tom had 3 apples.', 1.0),  # ... which ends at the '.'
    ('The answer is 13.\nNo wait, the answer is 12.', 1.0),  # the last phrase counts
    ('The answer is 12.\n#### 13', 1.0),  # the phrase comes before #### and Answer:
    ('The answer is 120.', -1.0),
    ('The answer is 1,200.', -1.0),
    ('The answer is 12.5.', -1.0),
    ('The answer is -12.', -1.0),
    ('The answer is 1/12.', -1.0),  # a fraction, not a 12
    ('The answer is 12th.', -1.0),
    ('The answer is twelve.', -1.0),
    (r'The answer is 12. \boxed{13}', -1.0),  # a box beats the phrase
    ('I think 12.', -1.0),
    ('Answer: 12', 1.0),  # the math-style markers still work
])
def test_answer_phrase_fallback(verifier, response, expected):
    assert verifier(response, '12') == expected


def test_answer_phrase_only_for_word_problems():
    assert rewards.ANSWER_PHRASE_TASKS == ('word_problems',)
    assert extract_math_answer('The answer is 12.') is None
    assert extract_math_answer('The answer is 12.', answer_phrase=True) == '12'
    assert make_verifier('gsm8k')('The answer is 12.', '12') == -1.0  # gsm8k/math scoring is unchanged


def test_verifier_is_fast_on_garbage(verifier):
    for text in ('The answer is ' * 100_000, '1' * 1_000_000, 'the answer is 1/' * 50_000, None):
        assert verifier(text, '1') == -1.0
    assert verifier('x' * 1_000_000 + ' The answer is 7.', '7') == 1.0


# ----------------------------------------------------------------------------- TFDS round trip

def test_load_task_builds_once_and_reads_back(tmp_path):
    cfg = word_problems.word_problems_config(**ALL_OPS)
    src = load_task('word_problems', 'train', data_dir=str(tmp_path), **ALL_OPS)
    assert len(src) == ALL_OPS['num_train'] and set(src[0]) == set(word_problems.FIELDS)
    expected = [word_problems.make_record(p) for p in word_problems.generate_problems(cfg, 'train')]
    assert [r['answer'] for r in src] == [e['answer'] for e in expected]  # on-disk order = generation order
    assert [r['prompt'] for r in src] == [DEFAULT_TEMPLATE.format(question=e['question']) for e in expected]
    for rec in src:  # the gold answer of what is read back, recomputed from the prompt text alone
        start, steps = read_question(rec['prompt'].split('\n', 1)[0])
        count = start
        for op, k in steps:
            count = APPLY[op](count, k)
        assert rec['answer'] == str(count)

    variant = tmp_path / 'word_problems' / cfg.name / '1.0.0'
    stamp = (variant / 'dataset_info.json').stat().st_mtime
    test = load_task('word_problems', 'test', data_dir=str(tmp_path), template='Q: {question}\nA:', **ALL_OPS)
    assert (variant / 'dataset_info.json').stat().st_mtime == stamp  # reused, the template is applied on read
    assert test[0]['prompt'].startswith('Q: ') and test[0]['prompt'].endswith('?\nA:')
    assert not {r['prompt'][3:-3] for r in test} & {e['question'] for e in expected}

    load_task('word_problems', 'test', data_dir=str(tmp_path), **dict(ALL_OPS, seed=1))
    other = word_problems.word_problems_config(**dict(ALL_OPS, seed=1)).name
    assert (tmp_path / 'word_problems' / other / '1.0.0' / 'dataset_info.json').exists()  # other knobs, other folder
    with pytest.raises(ValueError, match='template'):
        load_task('word_problems', 'train', data_dir=str(tmp_path), template='no placeholder', **ALL_OPS)
    with pytest.raises(ValueError, match='split'):
        load_task('word_problems', 'validation', data_dir=str(tmp_path), **ALL_OPS)
