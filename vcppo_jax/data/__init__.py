"""Task registry: `load_task(name, split, *, data_dir, **knobs)` -> random-access records of str fields.

Every task yields {'prompt', 'answer', 'cot'}; the synthetic task also has 'direct' (the answer line alone).
"""

from __future__ import annotations

from vcppo_jax.data.math_tasks import load_gsm8k, load_math
from vcppo_jax.data.source import Record, RecordSource
from vcppo_jax.data.synthetic import load_synthetic
from vcppo_jax.data.word_problems import load_word_problems
from vcppo_jax.rewards import TASKS  # the task list is the verifier's: a task is defined by how it is scored

_LOADERS = {'synthetic': load_synthetic, 'gsm8k': load_gsm8k, 'math': load_math,
            'word_problems': load_word_problems}
if set(_LOADERS) != set(TASKS):
    raise ImportError(f'data loaders {tuple(_LOADERS)} and verifier tasks {TASKS} must name the same tasks')


def load_task(name: str, split: str, *, data_dir: str, **knobs) -> RecordSource:
    """Records of `split` of task `name` in data_dir (synthetic, word_problems: built on first use; others: prepared).

    knobs: synthetic difficulty knobs (see `synthetic.SyntheticConfig`); gsm8k/math: `template`; word_problems:
    `template` and the generation knobs (see `word_problems.WordProblemsConfig`).
    """
    if name not in _LOADERS:
        raise ValueError(f'unknown task {name!r}; known tasks: {TASKS}')
    if not isinstance(data_dir, str) or not data_dir:
        raise ValueError(f'data_dir must be a non-empty path string, got {data_dir!r}')
    return _LOADERS[name](split, data_dir=data_dir, **knobs)


__all__ = ['Record', 'RecordSource', 'TASKS', 'load_task']
