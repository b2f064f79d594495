"""Tokenizers: any local Hugging Face tokenizer folder, or the built-in char-level one for the synthetic task."""

from __future__ import annotations

import os
import string

from tokenizers import Tokenizer, decoders, models, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = '[PAD]', '[BOS]', '[EOS]', '[UNK]'
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3; pad id 0
# Every character the synthetic task emits, plus lowercase letters and a few signs for ad-hoc prompts.
SYNTHETIC_CHARS = '\n 0123456789+-*/=?:;,.()A' + string.ascii_lowercase


def synthetic_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level tokenizer (55 ids: 4 specials then `SYNTHETIC_CHARS`), identical on every build.

    Encoding with special tokens prepends [BOS]; unknown characters map to [UNK]; decoding concatenates.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(SYNTHETIC_CHARS))}
    # BPE without merges splits each string into single characters (no pre-tokenizer: spaces and newlines are
    # ordinary characters).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f'{BOS} $A', pair=f'{BOS} $A $B', special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, clean_up_tokenization_spaces=False)


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Tokenizer from a local folder (never the network).

    A folder with `tokenizer.json` loads that file as-is through `PreTrainedTokenizerFast`: `AutoTokenizer` would
    follow config.json's model_type (e.g. qwen2) and swap in another pre-tokenizer, changing ids. Folders without
    tokenizer.json (e.g. sentencepiece only) go through `AutoTokenizer`.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f'tokenizer path {path!r} is not a directory')
    if os.path.exists(os.path.join(path, 'tokenizer.json')):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
