"""The TFDS builder shape of the tasks generated in code (synthetic, word_problems): no download, one builder config
per knob setting, records stored in generation order."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import tensorflow_datasets as tfds
from etils import epath

SPLITS = ('train', 'test')


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
