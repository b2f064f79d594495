"""Arithmetic word problems: short English stories of chained +, -, * steps over small numbers, generated locally.

A TFDS builder (array_record, no download, no tensorflow) generates the problems deterministically from the knobs
in `WordProblemsConfig`; `load_word_problems` builds them on first use and returns a random-access source of the
same records as gsm8k (the prompt is `template` filled with the question, so any template fits the stored data):

    prompt: 'Tom has 5 apples. He buys 7 more. He gives 3 to Ann. How many apples does Tom have now?\\n'
            'Please reason step by step, and put your final answer within \\boxed{}.\\n'
    cot:    'Tom starts with 5 apples.\\n'
            'He gets 7 more: 5 + 7 = 12.\\n'
            'He has 3 fewer: 12 - 3 = 9.\\n'
            'The answer is \\boxed{9}.'
    answer: '9'

Every number in the question is drawn from [1, max_value] ('*' factors from [2, max_value]); a subtraction never
takes more than the running count, so every answer is a non-negative integer (counts above max_value are possible:
'+' and '*' grow them); '-' and '*' need at least one thing. Each step is phrased by one of the first
`num_templates` templates of its operation, with the protagonist, a friend (of the other pronoun, so 'he'/'she' is
never ambiguous) and the counted things drawn from small lists.

Default knobs: 1-2 steps of '+'/'-' over numbers up to 20, all templates, 10000 train / 500 test problems.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator

import numpy as np
import tensorflow_datasets as tfds

# The template knob means what it means for gsm8k/math (one prompt convention for every math-style task).
from vcppo_jax.data.math_tasks import DEFAULT_TEMPLATE, _check_template
from vcppo_jax.data.generated import SPLITS, GeneratedBuilder, check_range, config_with_knobs, prepared
from vcppo_jax.data.source import RecordSource

STORED_FIELDS = ('question', 'answer', 'cot')
FIELDS = ('prompt', 'answer', 'cot')
_SPLIT_STREAM = {'train': 0, 'test': 1}
_MAX_OPS = 16
_MAX_VALUE = 10 ** 6
# Draws in a row that may repeat an earlier question before generation gives up: only knobs that allow too few
# distinct questions (or none, e.g. more '-'-only steps than max_value) get near it.
_MAX_REJECTED_DRAWS = 10_000


@dataclasses.dataclass(frozen=True)
class Operation:
    """One kind of step: how it changes the count, which operands it can take, and how it is phrased."""

    symbol: str
    name: str  # the symbol in dataset folder names
    apply: Callable[[int, int], int]
    min_count: int  # the step needs at least this many things (none to give away or to multiply is no story)
    min_operand: int
    can_exceed_count: bool  # False for '-': the operand is at most the running count
    cot_phrase: str  # the step in the worked solution, e.g. 'He gets 7 more'
    templates: tuple[str, ...]  # the step in the question; placeholders: `_story_words`' keys, {k}, {k_things}


OPERATIONS = (
    Operation('+', 'add', operator.add, min_count=0, min_operand=1, can_exceed_count=True,
              cot_phrase='{Subj} gets {k} more', templates=(
        '{Subj} buys {k} more.',
        '{friend} gives {obj} {k} more.',
        '{Subj} finds {k_things} on the way home.',
        'Then {subj} wins {k_things} in a game.',
    )),
    Operation('-', 'sub', operator.sub, min_count=1, min_operand=1, can_exceed_count=False,
              cot_phrase='{Subj} has {k} fewer', templates=(
        '{Subj} gives {k} to {friend}.',
        '{Subj} loses {k_things}.',
        'Then {subj} sells {k} of them.',
        '{friend} takes {k} of {poss} {things}.',
    )),
    Operation('*', 'mul', operator.mul, min_count=1, min_operand=2, can_exceed_count=True,
              cot_phrase='{Subj} has {k} times as many', templates=(
        'Now {subj} has {k} times as many {things} as before.',
        '{Subj} trades each {thing} for {k} new ones.',
        '{Subj} swaps all of them for {k} bags, each holding that many {things}.',
        'The number of {things} {name} has becomes {k} times as large.',
    )),
)
OPS = ''.join(op.symbol for op in OPERATIONS)
_OPERATION = {op.symbol: op for op in OPERATIONS}
MAX_TEMPLATES = min(len(op.templates) for op in OPERATIONS)

# (name, subject pronoun, object pronoun, possessive)
PEOPLE = (
    ('Tom', 'he', 'him', 'his'), ('Ann', 'she', 'her', 'her'), ('Ravi', 'he', 'him', 'his'),
    ('Maria', 'she', 'her', 'her'), ('Omar', 'he', 'him', 'his'), ('Lena', 'she', 'her', 'her'),
    ('Sam', 'he', 'him', 'his'), ('Mei', 'she', 'her', 'her'),
)
THINGS = (  # (singular, plural)
    ('apple', 'apples'), ('marble', 'marbles'), ('sticker', 'stickers'), ('pencil', 'pencils'),
    ('cookie', 'cookies'), ('stamp', 'stamps'), ('shell', 'shells'), ('card', 'cards'),
)


@dataclasses.dataclass(eq=False)
class WordProblemsConfig(tfds.core.BuilderConfig):
    """Generation knobs; build with `word_problems_config(**knobs)` so the name encodes them."""

    min_ops: int = 1  # steps after the start count
    max_ops: int = 2
    max_value: int = 20  # largest number drawn
    ops: str = '+-'  # a subset of OPS
    num_templates: int = MAX_TEMPLATES  # phrasings per operation: the first num_templates of its templates
    num_train: int = 10000
    num_test: int = 500
    seed: int = 0


def _canonical_ops(ops: object) -> str:
    """ops as a subset of OPS in OPS order (so '-+' and '+-' name the same data)."""
    if not isinstance(ops, str) or not ops or set(ops) - set(OPS) or len(set(ops)) != len(ops):
        raise ValueError(f'ops must be a non-empty string of distinct operations from {OPS!r}, got {ops!r}')
    return ''.join(op for op in OPS if op in ops)


def word_problems_config(**knobs: int | str) -> WordProblemsConfig:
    """Validated `WordProblemsConfig` whose name encodes every knob (distinct knobs never share a data_dir folder)."""
    cfg = config_with_knobs(WordProblemsConfig, 'word_problems', knobs)
    check_range('min_ops', cfg.min_ops, 1, _MAX_OPS)
    check_range('max_ops', cfg.max_ops, cfg.min_ops, _MAX_OPS)
    check_range('max_value', cfg.max_value, 2, _MAX_VALUE)
    check_range('num_templates', cfg.num_templates, 1, MAX_TEMPLATES)
    check_range('num_train', cfg.num_train, 1, 10 ** 7)
    check_range('num_test', cfg.num_test, 1, 10 ** 7)
    check_range('seed', cfg.seed, 0, 2 ** 31 - 1)
    ops = _canonical_ops(cfg.ops)
    ops_name = '-'.join(_OPERATION[op].name for op in ops)
    name = (f'o{cfg.min_ops}-{cfg.max_ops}_v{cfg.max_value}_{ops_name}_t{cfg.num_templates}'
            f'_n{cfg.num_train}-{cfg.num_test}_s{cfg.seed}')
    return dataclasses.replace(cfg, ops=ops, name=name, description='Arithmetic word problems.')


# ----------------------------------------------------------------------------- problem generation (pure python)

@dataclasses.dataclass(frozen=True)
class Problem:
    """A story: who counts which things, the start count and each step (operation symbol, operand, template index).

    The structured side of a record: tests recompute the answer from it independently of the generator.
    """

    person: int  # index into PEOPLE
    friend: int  # index into PEOPLE, someone of the other pronoun
    thing: int  # index into THINGS
    start: int
    steps: tuple[tuple[str, int, int], ...]


def _count_things(count: int, thing: int) -> str:
    singular, plural = THINGS[thing]
    return f'{count} {singular if count == 1 else plural}'


def _story_words(problem: Problem) -> dict[str, str]:
    name, subj, obj, poss = PEOPLE[problem.person]
    return {'name': name, 'Subj': subj.capitalize(), 'subj': subj, 'obj': obj, 'poss': poss,
            'friend': PEOPLE[problem.friend][0], 'thing': THINGS[problem.thing][0],
            'things': THINGS[problem.thing][1]}


def _operand_range(op: Operation, count: int, max_value: int) -> range:
    """The operands `op` can take at the running `count` (empty when the step is impossible there)."""
    if count < op.min_count:
        return range(0)
    return range(op.min_operand, (max_value if op.can_exceed_count else min(count, max_value)) + 1)


def sample_problem(rng: np.random.Generator, cfg: WordProblemsConfig) -> Problem | None:
    """A random story, or None when a step has no possible operation (e.g. ops '-' with nothing left to take)."""
    person = int(rng.integers(len(PEOPLE)))
    # A friend of the other pronoun, so that every 'he'/'she' in the story can only mean the protagonist.
    friends = [i for i, other in enumerate(PEOPLE) if other[1] != PEOPLE[person][1]]
    friend = friends[int(rng.integers(len(friends)))]
    thing = int(rng.integers(len(THINGS)))
    start = count = int(rng.integers(1, cfg.max_value + 1))
    steps = []
    for _ in range(int(rng.integers(cfg.min_ops, cfg.max_ops + 1))):
        operands_of = {symbol: _operand_range(_OPERATION[symbol], count, cfg.max_value) for symbol in cfg.ops}
        choices = [(_OPERATION[symbol], operands) for symbol, operands in operands_of.items() if operands]
        if not choices:
            return None
        op, operands = choices[int(rng.integers(len(choices)))]
        operand = operands[int(rng.integers(len(operands)))]
        steps.append((op.symbol, operand, int(rng.integers(cfg.num_templates))))
        count = op.apply(count, operand)
    return Problem(person, friend, thing, start, tuple(steps))


def format_question(problem: Problem) -> str:
    words = _story_words(problem)
    sentences = [f'{words["name"]} has {_count_things(problem.start, problem.thing)}.']
    for symbol, operand, template in problem.steps:
        sentences.append(_OPERATION[symbol].templates[template].format(
            k=operand, k_things=_count_things(operand, problem.thing), **words))
    sentences.append(f'How many {words["things"]} does {words["name"]} have now?')
    return ' '.join(sentences)


def format_cot(problem: Problem) -> tuple[str, int]:
    """Worked solution (start, one line per step with its equation, boxed answer) and the answer."""
    words = _story_words(problem)
    lines = [f'{words["name"]} starts with {_count_things(problem.start, problem.thing)}.']
    count = problem.start
    for symbol, operand, _ in problem.steps:
        op = _OPERATION[symbol]
        result = op.apply(count, operand)
        lines.append(f'{op.cot_phrase.format(k=operand, **words)}: {count} {symbol} {operand} = {result}.')
        count = result
    lines.append(f'The answer is \\boxed{{{count}}}.')
    return '\n'.join(lines), count


def make_record(problem: Problem) -> dict[str, str]:
    """The stored record of a problem (the prompt is made from `question` at load time)."""
    cot, answer = format_cot(problem)
    return {'question': format_question(problem), 'answer': str(answer), 'cot': cot}


def _split_problems(cfg: WordProblemsConfig, split: str, exclude: frozenset[str]) -> Iterator[Problem]:
    """Problems of a split with distinct questions, skipping `exclude` (the test questions: splits are disjoint)."""
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAM[split]])
    num = cfg.num_train if split == 'train' else cfg.num_test
    seen: set[str] = set()
    rejected = 0
    while len(seen) < num:
        problem = sample_problem(rng, cfg)
        question = None if problem is None else format_question(problem)
        if question is None or question in seen or question in exclude:
            rejected += 1
            if rejected > _MAX_REJECTED_DRAWS:
                raise ValueError(f'found only {len(seen)} of {num} distinct {split} word problems: these knobs allow '
                                 'too few; raise max_value, max_ops or num_templates, add ops, or lower '
                                 'num_train / num_test')
            continue
        rejected = 0
        seen.add(question)
        yield problem


def generate_problems(cfg: WordProblemsConfig, split: str) -> Iterator[Problem]:
    """All problems of a split in order; a pure function of the knobs (what the builder writes, as records)."""
    if split not in SPLITS:
        raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
    exclude = frozenset() if split == 'test' else frozenset(
        format_question(p) for p in _split_problems(cfg, 'test', frozenset()))
    yield from _split_problems(cfg, split, exclude)


# ----------------------------------------------------------------------------- TFDS builder

class WordProblems(GeneratedBuilder):
    """Arithmetic word problems; one builder config per knob setting (see `word_problems_config`)."""

    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Chained +, -, * word problems with a short worked solution.'}
    BUILDER_CONFIGS = [word_problems_config()]
    FIELDS = STORED_FIELDS

    def generate(self, split: str) -> Iterator[dict[str, str]]:
        return (make_record(problem) for problem in generate_problems(self.builder_config, split))


def word_problems_builder(*, data_dir: str, **knobs: int | str) -> WordProblems:
    """The builder for these knobs, prepared (generated) in data_dir if it is not there yet."""
    return prepared(WordProblems, word_problems_config(**knobs), data_dir)


def prompt_record(stored: dict[str, str], template: str) -> dict[str, str]:
    """A stored record as a task record: the question goes into the prompt template."""
    return {'prompt': template.format(question=stored['question']), 'answer': stored['answer'],
            'cot': stored['cot']}


def load_word_problems(split: str, *, data_dir: str, template: str = DEFAULT_TEMPLATE,
                       **knobs: int | str) -> RecordSource:
    """Random-access records {'prompt', 'answer', 'cot'} (str) of a split; builds on first use.

    template: the prompt, a str with '{question}' (as for gsm8k/math); it is applied at read time, so it is not
    part of the dataset folder. knobs: see `WordProblemsConfig`.
    """
    if split not in SPLITS:
        raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
    _check_template(template)
    builder = word_problems_builder(data_dir=data_dir, **knobs)
    return RecordSource(builder.as_data_source(split=split), transform=lambda ex: prompt_record(ex, template))
