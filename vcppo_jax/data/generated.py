"""The TFDS builder shape of the tasks generated in code (synthetic, word_problems): no download, one builder config
per knob setting, records stored in generation order."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import TypeVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

SPLITS = ('train', 'test')
ConfigT = TypeVar('ConfigT', bound=tfds.core.BuilderConfig)


class GeneratedBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Subclasses set VERSION, RELEASE_NOTES, BUILDER_CONFIGS, FIELDS (the stored text fields) and `generate`."""

    FIELDS: tuple[str, ...] = ()

    def generate(self, split: str) -> Iterator[dict[str, str]]:
        """The records of `split` under `self.builder_config`, in order."""
        raise NotImplementedError

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's default lookup imports the py<3.9 backport `importlib_resources`, which is not installed.
        return epath.Path(sys.modules[cls.__module__].__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=sys.modules[type(self).__module__].__doc__,
            features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in self.FIELDS}),
            # Keep generation order on disk so record i is the i-th generated one.
            disable_shuffling=True,
        )

    # TFDS prints "Downloading and preparing dataset Unknown size ..." and "... downloaded and prepared ..." for
    # every build; nothing is downloaded here, so one line says what happens instead.
    def _log_download_bytes(self) -> None:
        print(f'[data] generating {self.name}/{self.builder_config.name} in {self.data_dir}', flush=True)

    def _log_download_done(self) -> None:
        pass

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        del dl_manager  # nothing to download
        return {split: self._generate_examples(split) for split in SPLITS}

    def _generate_examples(self, split: str):
        yield from enumerate(self.generate(split))


def config_with_knobs(config_cls: type[ConfigT], task: str, knobs: dict) -> ConfigT:
    """`config_cls` (a BuilderConfig dataclass) with `knobs` set, still unnamed; unknown knobs are refused."""
    fields = {f.name for f in dataclasses.fields(config_cls)} - {f.name for f in
                                                                 dataclasses.fields(tfds.core.BuilderConfig)}
    unknown = set(knobs) - fields
    if unknown:
        raise ValueError(f'unknown {task} knobs {sorted(unknown)}; allowed: {sorted(fields)}')
    return config_cls(name='unnamed', **knobs)


def check_range(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f'{name} must be an integer in [{low}, {high}], got {value!r}')


def prepared(builder_cls: type[GeneratedBuilder], cfg: tfds.core.BuilderConfig, data_dir: str) -> GeneratedBuilder:
    """The builder for `cfg`, generated in data_dir if it is not there yet."""
    # TFDS refuses a new config object named like a registered one, so reuse the registered default when it matches.
    cfg = builder_cls.builder_configs.get(cfg.name, cfg)
    builder = builder_cls(config=cfg, data_dir=data_dir, file_format='array_record')
    builder.download_and_prepare()
    return builder
