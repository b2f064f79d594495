"""Random-access view of a TFDS data source as task records: dicts of str fields."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Record = dict[str, str]


def as_text(value: Any) -> str:
    """TFDS Text features come back as bytes (or 0-d numpy bytes); decode to str."""
    if isinstance(value, np.ndarray):
        value = value.item()
    if isinstance(value, bytes):
        return value.decode('utf-8')
    return str(value)


class RecordSource(Sequence[Record]):
    """Sequence of records over a random-access source (e.g. `tfds.data_source(...)`).

    Either `fields` (copy these features, decoded to str) or `transform` (raw decoded example -> record) is given.
    """

    prompts_have_special_tokens = False  # raw task text: encoded with the tokenizer's special tokens (e.g. BOS)

    def __init__(self, source: Sequence[Mapping[str, Any]], *, fields: Sequence[str] | None = None,
                 transform: Callable[[dict[str, str]], Record] | None = None):
        if (fields is None) == (transform is None):
            raise ValueError('give exactly one of fields or transform')
        self._source = source
        self._fields = tuple(fields) if fields is not None else None
        self._transform = transform

    def _to_record(self, example: Mapping[str, Any]) -> Record:
        if self._fields is not None:
            return {k: as_text(example[k]) for k in self._fields}
        return self._transform({k: as_text(v) for k, v in example.items()})

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index):  # int -> Record; slice -> list[Record]
        if isinstance(index, slice):
            return self.get_batch(range(*index.indices(len(self))))
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f'index {index} out of range for {len(self)} records')
        return self._to_record(self._source[index % len(self)])

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> list[Record]:
        """Records at `indices` (one batched read when the source supports it)."""
        indices = [int(i) for i in indices]
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f'index {i} out of range for {len(self)} records')
        if hasattr(self._source, '__getitems__'):
            examples = self._source.__getitems__(indices)
        else:
            examples = [self._source[i] for i in indices]
        return [self._to_record(e) for e in examples]
