"""Synthetic long chain-of-thought task: multi-term addition (optionally +/-) with a digit-level scratchpad.

A TFDS builder (array_record, no download, no tensorflow) generates the data deterministically from the knobs in
`SyntheticConfig`; `load_synthetic` builds it on first use and returns a random-access source of records:

    prompt: '47+385+62=?\\n'
    cot:    '47+385: 7+5+0=12 4+8+1=13 0+3+1=04; 432\\n'
            '432+62: 2+2+0=04 3+6+0=09 4+0+0=04; 494\\n'
            'Answer: 494'
    direct: 'Answer: 494'
    answer: '494'

Each scratchpad line adds the next term to the running sum column by column, least significant digit first:
`a+b+c=kd` reads "digit a plus digit b plus carry-in c gives carry-out k and result digit d" (for '-', `a-b-c=kd`
with borrow-in c and borrow-out k), then `; <running sum>`. Every step only needs single-digit facts plus copying,
so a tiny model can learn it, while the direct answer needs all carries at once and stays inaccurate: the gap the
paper's length collapse exploits. With ops='+-' terms are subtracted only while the running sum stays >= 0.

Default knobs: 3-5 terms of 2-3 digits, '+', 10000 train / 500 test examples. Character lengths at default
(= tokens of the char tokenizer, before BOS/EOS): prompt 9-20, cot ~95-230, direct 10-12.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds

from vcppo_jax.data.generated import SPLITS, GeneratedBuilder, check_range, config_with_knobs, prepared
from vcppo_jax.data.source import RecordSource
from vcppo_jax.rewards import ANSWER_PREFIX

FIELDS = ('prompt', 'answer', 'cot', 'direct')
OPS = ('+', '+-')
_SPLIT_STREAM = {'train': 0, 'test': 1}
_MAX_TERMS = 32
_MAX_DIGITS = 9


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
    """Difficulty knobs; build with `synthetic_config(**knobs)` so the name encodes them."""

    min_terms: int = 3
    max_terms: int = 5
    min_digits: int = 2
    max_digits: int = 3
    ops: str = '+'
    num_train: int = 10000
    num_test: int = 500
    seed: int = 0


def _num_problems(cfg: SyntheticConfig) -> int:
    """Number of distinct prompts the knobs allow (ops choices counted as free: an upper bound for '+-')."""
    per_term = sum(10 ** d - (10 ** (d - 1) if d > 1 else 0) for d in range(cfg.min_digits, cfg.max_digits + 1))
    signs = 2 if cfg.ops == '+-' else 1
    return sum(per_term ** n * signs ** (n - 1) for n in range(cfg.min_terms, cfg.max_terms + 1))


def synthetic_config(**knobs: int | str) -> SyntheticConfig:
    """Validated `SyntheticConfig` whose name encodes every knob (distinct knobs never share a data_dir folder)."""
    cfg = config_with_knobs(SyntheticConfig, 'synthetic', knobs)
    check_range('min_terms', cfg.min_terms, 2, _MAX_TERMS)
    check_range('max_terms', cfg.max_terms, cfg.min_terms, _MAX_TERMS)
    check_range('min_digits', cfg.min_digits, 1, _MAX_DIGITS)
    check_range('max_digits', cfg.max_digits, cfg.min_digits, _MAX_DIGITS)
    check_range('num_train', cfg.num_train, 1, 10 ** 7)
    check_range('num_test', cfg.num_test, 1, 10 ** 7)
    check_range('seed', cfg.seed, 0, 2 ** 31 - 1)
    if cfg.ops not in OPS:
        raise ValueError(f'ops must be one of {OPS}, got {cfg.ops!r}')
    if 2 * (cfg.num_train + cfg.num_test) > _num_problems(cfg):
        raise ValueError(f'num_train + num_test = {cfg.num_train + cfg.num_test} is more than half of the '
                         f'{_num_problems(cfg)} distinct problems these knobs allow; raise the terms or digits')
    ops_name = 'add' if cfg.ops == '+' else 'addsub'
    name = (f't{cfg.min_terms}-{cfg.max_terms}_d{cfg.min_digits}-{cfg.max_digits}_{ops_name}'
            f'_n{cfg.num_train}-{cfg.num_test}_s{cfg.seed}')
    cfg = dataclasses.replace(cfg, name=name, description='Multi-term arithmetic with a digit-level scratchpad.')
    return cfg


# ----------------------------------------------------------------------------- problem generation (pure python)

def sample_problem(rng: np.random.Generator, cfg: SyntheticConfig) -> tuple[list[int], list[str]]:
    """Terms and the operator applied before each term after the first (running sum never negative)."""
    num_terms = int(rng.integers(cfg.min_terms, cfg.max_terms + 1))
    terms, ops = [], []
    total = 0
    for i in range(num_terms):
        digits = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
        term = int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits))
        if i > 0:
            op = '-' if cfg.ops == '+-' and term <= total and rng.random() < 0.5 else '+'
            ops.append(op)
            total = total + term if op == '+' else total - term
        else:
            total = term
        terms.append(term)
    return terms, ops


def format_prompt(terms: list[int], ops: list[str]) -> str:
    expr = str(terms[0]) + ''.join(f'{op}{t}' for op, t in zip(ops, terms[1:]))
    return f'{expr}=?\n'


def _column_step(left: int, op: str, right: int) -> tuple[str, int]:
    """One scratchpad line `left op right: <columns>; result` and the result."""
    width = max(len(str(left)), len(str(right)))
    a_digits, b_digits = str(left).zfill(width)[::-1], str(right).zfill(width)[::-1]
    columns, carry, result_digits = [], 0, []
    for a, b in zip(a_digits, b_digits):
        if op == '+':
            total = int(a) + int(b) + carry
            carry_out, digit = divmod(total, 10)
        else:
            total = int(a) - int(b) - carry
            carry_out, digit = (1, total + 10) if total < 0 else (0, total)
        columns.append(f'{a}{op}{b}{op}{carry}={carry_out}{digit}')
        result_digits.append(str(digit))
        carry = carry_out
    if carry:  # only '+' can carry out of the top column; '-' never borrows there since left >= right
        result_digits.append('1')
    result = int(''.join(reversed(result_digits)))
    return f'{left}{op}{right}: {" ".join(columns)}; {result}', result


def format_direct(answer: int) -> str:
    return f'{ANSWER_PREFIX} {answer}'


def format_cot(terms: list[int], ops: list[str]) -> tuple[str, int]:
    """Long trace (one line per term added, then the answer line) and the final value."""
    lines, total = [], terms[0]
    for op, term in zip(ops, terms[1:]):
        line, total = _column_step(total, op, term)
        lines.append(line)
    lines.append(format_direct(total))
    return '\n'.join(lines), total


def make_record(terms: list[int], ops: list[str]) -> dict[str, str]:
    cot, answer = format_cot(terms, ops)
    return {'prompt': format_prompt(terms, ops), 'answer': str(answer), 'cot': cot, 'direct': format_direct(answer)}


def _split_problems(cfg: SyntheticConfig, split: str,
                    exclude: frozenset[str]) -> Iterator[tuple[list[int], list[str]]]:
    """Distinct problems of a split, skipping `exclude` (the test prompts, so that splits are disjoint)."""
    rng = np.random.default_rng([cfg.seed, _SPLIT_STREAM[split]])
    num = cfg.num_train if split == 'train' else cfg.num_test
    seen: set[str] = set()
    while len(seen) < num:
        terms, ops = sample_problem(rng, cfg)
        prompt = format_prompt(terms, ops)
        if prompt in seen or prompt in exclude:
            continue
        seen.add(prompt)
        yield terms, ops


def generate_records(cfg: SyntheticConfig, split: str) -> Iterator[dict[str, str]]:
    """All records of a split in order; a pure function of the knobs (what the builder writes)."""
    if split not in SPLITS:
        raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
    exclude = frozenset() if split == 'test' else frozenset(
        format_prompt(*p) for p in _split_problems(cfg, 'test', frozenset()))
    for terms, ops in _split_problems(cfg, split, exclude):
        yield make_record(terms, ops)


# ----------------------------------------------------------------------------- TFDS builder

class SyntheticArith(GeneratedBuilder):
    """Synthetic long-CoT arithmetic; one builder config per knob setting (see `synthetic_config`)."""

    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Digit-level addition/subtraction scratchpad.'}
    BUILDER_CONFIGS = [synthetic_config()]
    FIELDS = FIELDS

    def generate(self, split: str) -> Iterator[dict[str, str]]:
        return generate_records(self.builder_config, split)


def synthetic_builder(*, data_dir: str, **knobs: int | str) -> SyntheticArith:
    """The builder for these knobs, prepared (generated) in data_dir if it is not there yet."""
    return prepared(SyntheticArith, synthetic_config(**knobs), data_dir)


def load_synthetic(split: str, *, data_dir: str, **knobs: int | str) -> RecordSource:
    """Random-access records {'prompt', 'answer', 'cot', 'direct'} (str) of a split; builds on first use."""
    if split not in SPLITS:
        raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
    builder = synthetic_builder(data_dir=data_dir, **knobs)
    return RecordSource(builder.as_data_source(split=split), fields=FIELDS)
