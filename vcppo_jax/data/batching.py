"""Deterministic, resumable batch sampling and tokenization into the shared rollout layout.

Layout: prompts LEFT-padded to P tokens, targets/responses RIGHT-padded to R tokens, full sequence [B, P+R].
Response token t sits at full position P+t and is predicted from position P+t-1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}')


def _epoch_permutation(num_records: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_records)


def batch_indices(num_records: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Record indices of batch `step`: int64 [batch_size].

    Sample k of the run (k = step * batch_size + j) is position k % num_records of epoch k // num_records's
    permutation, so every epoch visits each record once and resuming only needs the step.
    """
    _check_positive('num_records', num_records)
    _check_positive('batch_size', batch_size)
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise ValueError(f'step must be an integer >= 0, got {step!r}')
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f'seed must be an integer >= 0, got {seed!r}')
    positions = int(step) * int(batch_size) + np.arange(batch_size, dtype=np.int64)
    epochs, offsets = np.divmod(positions, num_records)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _epoch_permutation(num_records, int(seed), int(epoch))[offsets[sel]]
    return out


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    # Padding is masked everywhere, so eos stands in when a tokenizer defines no pad token.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError('tokenizer has neither pad_token_id nor eos_token_id')
    return int(pad)


def _check_texts(name: str, texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts) or len(texts) == 0:
        raise ValueError(f'{name} must be a non-empty sequence of str')
    return list(texts)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], max_len: int, *,
                   truncate: bool = False, add_special_tokens: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize (with the tokenizer's special tokens, e.g. BOS, unless `add_special_tokens=False`: prompts rendered
    by a chat template hold their own) and LEFT-pad to exactly `max_len`.

    Returns tokens: int32 [B, max_len], mask: int32 [B, max_len] (1 on prompt tokens).
    A prompt longer than max_len raises ValueError, or with truncate=True keeps its LAST max_len tokens
    (the question end and any template suffix survive; a leading BOS is dropped).
    """
    prompts = _check_texts('prompts', prompts)
    _check_positive('max_len', max_len)
    ids = tokenizer(prompts, add_special_tokens=add_special_tokens)['input_ids']
    tokens = np.full((len(ids), max_len), _pad_id(tokenizer), dtype=np.int32)
    mask = np.zeros((len(ids), max_len), dtype=np.int32)
    for i, seq in enumerate(ids):
        if len(seq) == 0:
            # The first response token is predicted from position P-1, which must be a real token.
            raise ValueError(f'prompts[{i}] encodes to no tokens')
        if len(seq) > max_len:
            if not truncate:
                raise ValueError(f'prompts[{i}] has {len(seq)} tokens > max_len={max_len} '
                                 '(raise max_len or pass truncate=True)')
            seq = seq[-max_len:]
        tokens[i, max_len - len(seq):] = seq
        mask[i, max_len - len(seq):] = 1
    return tokens, mask


def encode_sft(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], targets: Sequence[str],
               max_prompt_len: int, max_target_len: int, *, truncate: bool = False, add_special_tokens: bool = True,
               end_id: int | None = None) -> dict[str, np.ndarray]:
    """SFT batch in the rollout layout: prompt LEFT-padded to P, target + its end token RIGHT-padded to R.

    end_id: the token a target ends with (default EOS; a chat template's end-of-turn token for chat prompts).
    add_special_tokens: as in `encode_prompts`.

    Returns int32 arrays:
      tokens:         [B, P+R]
      attention_mask: [B, P+R]  1 on prompt and target tokens (incl. the end token)
      prompt_mask:    [B, P]
      response_mask:  [B, R]    1 on target tokens incl. the end token (the rollout `response_mask`)
      loss_mask:      [B, P+R]  = [0..0, response_mask]: weight of predicting tokens[:, t] from position t-1
    A target (+ end token) longer than R raises ValueError, or with truncate=True keeps its first R tokens (no end
    token then).
    """
    prompts = _check_texts('prompts', prompts)
    targets = _check_texts('targets', targets)
    if len(prompts) != len(targets):
        raise ValueError(f'prompts ({len(prompts)}) and targets ({len(targets)}) must have the same length')
    _check_positive('max_target_len', max_target_len)
    end_id = tokenizer.eos_token_id if end_id is None else end_id
    if end_id is None:
        raise ValueError('tokenizer has no eos_token_id and no end_id was given; SFT targets end with one')
    prompt_tokens, prompt_mask = encode_prompts(tokenizer, prompts, max_prompt_len, truncate=truncate,
                                                add_special_tokens=add_special_tokens)
    target_ids = tokenizer(targets, add_special_tokens=False)['input_ids']
    batch = len(prompts)
    response = np.full((batch, max_target_len), _pad_id(tokenizer), dtype=np.int32)
    response_mask = np.zeros((batch, max_target_len), dtype=np.int32)
    for i, seq in enumerate(target_ids):
        seq = list(seq) + [end_id]
        if len(seq) > max_target_len:
            if not truncate:
                raise ValueError(f'targets[{i}] has {len(seq)} tokens with its end token > max_target_len='
                                 f'{max_target_len} (raise max_target_len or pass truncate=True)')
            seq = seq[:max_target_len]
        response[i, :len(seq)] = seq
        response_mask[i, :len(seq)] = 1
    return {
        'tokens': np.concatenate([prompt_tokens, response], axis=1),
        'attention_mask': np.concatenate([prompt_mask, response_mask], axis=1),
        'prompt_mask': prompt_mask,
        'response_mask': response_mask,
        'loss_mask': np.concatenate([np.zeros_like(prompt_mask), response_mask], axis=1),
    }


def trim_sft_padding(batch: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """An `encode_sft` batch without the columns that are padding in every row: the prompt's left padding and the
    target's right padding, each kept to a multiple of `multiple` tokens (so few shapes compile) and never longer
    than before. The loss is unchanged: those columns carry no loss and no token attends to them.
    """
    _check_positive('multiple', multiple)
    p, r = batch['prompt_mask'].shape[1], batch['response_mask'].shape[1]
    keep = lambda n, cap: min(cap, -(-max(int(n), 1) // multiple) * multiple)  # noqa: E731
    p_keep = keep(batch['prompt_mask'].sum(axis=1).max(), p)
    r_keep = keep(batch['response_mask'].sum(axis=1).max(), r)
    cols = slice(p - p_keep, p + r_keep)
    return {'tokens': batch['tokens'][:, cols], 'attention_mask': batch['attention_mask'][:, cols],
            'prompt_mask': batch['prompt_mask'][:, p - p_keep:], 'response_mask': batch['response_mask'][:, :r_keep],
            'loss_mask': batch['loss_mask'][:, cols]}
