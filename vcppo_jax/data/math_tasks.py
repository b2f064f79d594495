"""GSM8K and MATH (hendrycks competition_math) as task records, read through `tfds.data_source` (array_record).

Records: {'prompt': template with the question, 'answer': final answer, 'cot': reference solution}.
* gsm8k: the stock TFDS builder `gsm8k` (features question / answer / annotation / short_answer); answer is the
  text after '####' (`short_answer`), cot is the worked solution without the `<<48/2=24>>` calculator annotations,
  ending in `\\boxed{answer}` like the prompt asks.
* math: `competition_math`, a builder defined here (TFDS ships none) over a local copy of the MATH release
  (features problem / level / type / solution); answer is the last `\\boxed{}` of the solution, cot the solution.

Both need preparing once (`prepare_gsm8k`, `prepare_math`): from local files in `manual_dir` (no network), or for
gsm8k by TFDS's download when online. Preparing writes array_record (what `tfds.data_source` reads) and needs no
tensorflow.
"""

from __future__ import annotations

import json
import re

import tensorflow_datasets as tfds
import tensorflow_datasets.text.gsm8k as tfds_gsm8k  # registers the stock 'gsm8k' builder
from etils import epath

from vcppo_jax.data.source import Record, RecordSource
from vcppo_jax.rewards import last_boxed

GSM8K_NAME = 'gsm8k'
MATH_NAME = 'competition_math'
DEFAULT_TEMPLATE = '{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.\n'
_CALCULATOR_RE = re.compile(r'<<[^<>]*>>')
_GSM8K_FILES = ('train', 'test', 'train_socratic', 'test_socratic')
_MATH_FEATURES = ('problem', 'level', 'type', 'solution')


def _check_template(template: str) -> None:
    if not isinstance(template, str) or '{question}' not in template:
        raise ValueError(f"template must be a str containing '{{question}}', got {template!r}")
    template.format(question='')  # stray braces fail here, not mid-epoch


class Gsm8kFiles(tfds_gsm8k.Gsm8k, skip_registration=True):
    """The stock gsm8k builder reading local jsonl files when manual_dir has them (else it downloads).

    Same name, version and features as the stock builder, so what it writes is what `tfds.data_source('gsm8k')`
    reads.
    """

    name = GSM8K_NAME
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        'Put the grade-school-math jsonl files (train.jsonl, test.jsonl, optionally *_socratic.jsonl; one '
        '{"question", "answer"} object per line, answer ending in "#### <number>") in manual_dir.')

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's default lookup imports the py<3.9 backport `importlib_resources`, which is not installed.
        return epath.Path(tfds_gsm8k.__file__)

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        files = {k: dl_manager.manual_dir / f'{k}.jsonl' for k in _GSM8K_FILES}
        files = {k: path for k, path in files.items() if path.exists()}
        if not files:
            return super()._split_generators(dl_manager)
        return {k: self._generate_examples(path) for k, path in files.items()}


class CompetitionMath(tfds.core.GeneratorBasedBuilder):
    """hendrycks MATH from a local copy; problems whose solution has no \\boxed{} answer are skipped."""

    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Local MATH release (problem, level, type, solution).'}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        'Put the MATH release in manual_dir: either its folders {train,test}/<subject>/<id>.json (optionally under '
        'MATH/), or train.jsonl / test.jsonl, each record with keys problem, level, type, solution.')

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's default lookup imports the py<3.9 backport `importlib_resources`, which is not installed.
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description='MATH competition problems (Hendrycks et al., 2021).',
            features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in _MATH_FEATURES}),
            homepage='https://github.com/hendrycks/math',
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        root = dl_manager.manual_dir
        if (root / 'MATH').is_dir():
            root = root / 'MATH'
        splits = {}
        for split in ('train', 'test'):
            if (root / split).is_dir():
                splits[split] = self._generate_examples(sorted((root / split).glob('*/*.json')), jsonl=False)
            elif (root / f'{split}.jsonl').exists():
                splits[split] = self._generate_examples([root / f'{split}.jsonl'], jsonl=True)
        if not splits:
            raise FileNotFoundError(f'no MATH train/test data in {dl_manager.manual_dir}')
        return splits

    def _generate_examples(self, paths: list[epath.Path], jsonl: bool):
        for path in paths:
            if jsonl:
                lines = path.read_text().splitlines()
                items = [(f'{path.name}:{i}', json.loads(line)) for i, line in enumerate(lines) if line.strip()]
            else:
                items = [(f'{path.parent.name}/{path.name}', json.loads(path.read_text()))]
            for key, ex in items:
                if last_boxed(ex['solution'], max_chars=None) is None:
                    continue
                yield key, {k: str(ex.get(k, '')) for k in _MATH_FEATURES}


def prepare_gsm8k(data_dir: str, *, manual_dir: str | None = None) -> None:
    """Writes gsm8k (array_record) into data_dir: from local jsonl in manual_dir, else by download (online)."""
    if manual_dir is not None and not any(epath.Path(manual_dir, f'{k}.jsonl').exists() for k in _GSM8K_FILES):
        raise FileNotFoundError(f'manual_dir {manual_dir!r} has none of {[f + ".jsonl" for f in _GSM8K_FILES]}')
    builder = Gsm8kFiles(data_dir=data_dir, file_format='array_record')
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))


def prepare_math(data_dir: str, *, manual_dir: str) -> None:
    """Writes competition_math (array_record) into data_dir from a local MATH copy in manual_dir."""
    builder = CompetitionMath(data_dir=data_dir, file_format='array_record')
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))


def _data_source(task: str, tfds_name: str, split: str, data_dir: str, how: str):
    builder = tfds.builder(tfds_name, data_dir=data_dir)
    if not builder.is_prepared():
        raise FileNotFoundError(f'{task} not prepared in {data_dir}; prepare it with {how}')
    base = split.split('[', 1)[0]
    if base not in builder.info.splits:
        raise ValueError(f'split {split!r} not in {task} (available: {sorted(builder.info.splits)})')
    try:
        return tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=False)
    except NotImplementedError as e:
        raise ValueError(f'{task} in {data_dir} is not in array_record format; prepare it again with {how} '
                         'into another data_dir') from e


def gsm8k_record(ex: dict[str, str], template: str) -> Record:
    answer = ex['short_answer'].strip()
    solution = _CALCULATOR_RE.sub('', ex['annotation']).strip()
    return {'prompt': template.format(question=ex['question'].strip()), 'answer': answer,
            'cot': f'{solution}\nThe final answer is \\boxed{{{answer}}}.'}


def math_record(ex: dict[str, str], template: str) -> Record:
    return {'prompt': template.format(question=ex['problem'].strip()),
            'answer': last_boxed(ex['solution'], max_chars=None) or '', 'cot': ex['solution'].strip()}


def load_gsm8k(split: str, *, data_dir: str, template: str = DEFAULT_TEMPLATE) -> RecordSource:
    """GSM8K records of a prepared split ('train', 'test', 'train[:100]', ...)."""
    _check_template(template)
    how = f"vcppo_jax.data.math_tasks.prepare_gsm8k({data_dir!r}, manual_dir=<folder with train/test.jsonl>)"
    source = _data_source('gsm8k', GSM8K_NAME, split, data_dir, how)
    return RecordSource(source, transform=lambda ex: gsm8k_record(ex, template))


def load_math(split: str, *, data_dir: str, template: str = DEFAULT_TEMPLATE) -> RecordSource:
    """MATH records of a prepared split ('train', 'test', ...)."""
    _check_template(template)
    how = f"vcppo_jax.data.math_tasks.prepare_math({data_dir!r}, manual_dir=<MATH release folder>)"
    source = _data_source('math', MATH_NAME, split, data_dir, how)
    return RecordSource(source, transform=lambda ex: math_record(ex, template))

