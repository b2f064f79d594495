"""Batched autoregressive sampling with a KV cache: one jitted prefill + a `lax.while_loop` decode.

Layout (shared with the rest of the project): prompts LEFT-padded to P tokens, responses RIGHT-padded to
R = max_new_tokens, full sequence [B, P + R]. The cache has P + R slots: slot j < P holds prompt token j, slot
P + t holds response token t. Positions continue from each row's real-token count (cumsum(mask) - 1), so a
prompt's output does not depend on how much left padding the batch gave it.

Randomness is per row: row b at response step t draws with `fold_in(fold_in(rng, b), t)`, so a row's sample
depends only on (rng, its index, its own prompt), never on the other rows of the batch.

Use with a mesh: pass batch-sharded prompts (`sharding.shard_batch`) and sharded params, and call inside
`sharding.use_mesh(mesh)` so the model's logical constraints (and the cache's) are active; B must then be a
multiple of data * fsdp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vcppo_jax.models import CausalLM, KVCache, init_cache, position_ids

Array = jax.Array
_CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")
# What the KV cache stores: the model's compute dtype, or bfloat16 (half the cache memory of an fp32 model; keys
# and values are rounded to bf16 when written and attention still runs in the compute dtype).
KV_CACHE_DTYPES = ("compute", "bfloat16")


class SampleOutput(NamedTuple):
    """Result of `sample`. B = batch, P = prompt length, R = max_new_tokens.

    tokens: [B, P + R] int32, the prompt (left-padded, as given) then the response (pad_id after EOS).
    response_mask: [B, R] float32, 1 for generated tokens including the EOS token, 0 after.
    lengths: [B] int32, number of generated tokens including EOS.
    logprobs: [B, R] float32, log-prob of each sampled token under the sampling distribution (temperature, then
      top-k / top-p renormalization); greedy (temperature 0): under softmax(logits) at temperature 1. 0 where
      masked.
    num_steps: [] int32, decode forward passes run after the prefill (max(lengths) - 1: the loop stops once every
      row has emitted EOS).
    """

    tokens: Array
    response_mask: Array
    lengths: Array
    logprobs: Array
    num_steps: Array


@dataclasses.dataclass(frozen=True)
class _Options:
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    temperature: float
    top_k: int
    top_p: float
    kv_cache_dtype: str


# ------------------------------------------------------------------------------------------------ token choice
def filter_logits(logits: Array, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Array:
    """logits [..., V] -> fp32 logits / temperature with the tokens outside top-k, then top-p, set to -inf.

    top_k: keep the k largest (0 = off). top_p: keep the smallest prefix of the (top-k renormalized) tokens
    sorted by probability whose mass reaches top_p (1.0 = off); the most likely token is always kept. Ties at a
    threshold keep every tied token (as HF's warpers do).
    """
    logits = logits.astype(jnp.float32) / temperature
    if top_k == 0 and top_p >= 1.0:
        return logits
    # Descending logits of the candidate set: the top-k ones, or the whole vocab for top-p alone.
    ranked = jax.lax.top_k(logits, top_k)[0] if top_k else -jnp.sort(-logits, axis=-1)
    threshold = ranked[..., -1:]
    if top_p < 1.0:
        probs = jax.nn.softmax(ranked, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1: the first has mass_before 0
        threshold = jnp.take_along_axis(ranked, n_keep - 1, axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _choose(logits: Array, keys: Array, opts: _Options) -> tuple[Array, Array]:
    """logits [B, V], keys [B] -> (tokens [B] int32, log-probs [B] float32 of those tokens)."""
    if opts.temperature == 0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    else:
        filtered = filter_logits(logits, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
        tokens = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        logq = jax.nn.log_softmax(filtered, axis=-1)
    return tokens, jnp.take_along_axis(logq, tokens[:, None], axis=-1)[:, 0]


# ------------------------------------------------------------------------------------------------ generation
def _constrain(cache: KVCache) -> KVCache:
    # Keeps the while_loop carry batch-sharded like the activations (no-op outside `use_mesh`).
    return KVCache(*(nn.with_logical_constraint(x, _CACHE_AXES) for x in cache))


def _generate(model: CausalLM, opts: _Options, params: Any, prompt_tokens: Array, prompt_mask: Array,
              rng: Array) -> SampleOutput:
    b, p = prompt_tokens.shape
    r = opts.max_new_tokens
    variables = {"params": params}
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(bool)
    n_real = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)  # position of response token 0
    row_keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(b, dtype=jnp.int32))
    step_keys = lambda t: jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)  # noqa: E731
    last_logits = lambda hidden: model.apply(variables, hidden[:, -1], method=CausalLM.logits)  # noqa: E731
    is_eos = lambda tok: jnp.isin(tok, jnp.asarray(opts.stop_ids, jnp.int32))  # noqa: E731 (no stop ids: never)

    # Prefill: the prompt's last slot (always real under left padding) predicts response token 0.
    kv_mask = jnp.concatenate([prompt_mask, jnp.zeros((b, r), bool)], axis=1)
    cache_dtype = None if opts.kv_cache_dtype == "compute" else jnp.dtype(opts.kv_cache_dtype)
    cache = _constrain(init_cache(model.cfg, b, p + r, cache_dtype))
    hidden, cache = model.apply(variables, prompt_tokens, position_ids(prompt_mask), kv_mask, cache, 0)
    token, logp = _choose(last_logits(hidden), step_keys(0), opts)
    response = jnp.full((b, r), opts.pad_id, jnp.int32).at[:, 0].set(token)
    logprobs = jnp.zeros((b, r), jnp.float32).at[:, 0].set(logp)
    state = (jnp.int32(1), cache, kv_mask, response, logprobs, is_eos(token), jnp.ones((b,), jnp.int32))

    def cond(state):
        t, _, _, _, _, done, _ = state
        return (t < r) & ~jnp.all(done)

    def body(state):
        # Feed response token t-1 (slot p+t-1) to get the logits of token t.
        t, cache, kv_mask, response, logprobs, done, lengths = state
        slot = p + t - 1
        prev = jax.lax.dynamic_slice_in_dim(response, t - 1, 1, axis=1)
        kv_mask = kv_mask.at[:, slot].set(True)
        hidden, cache = model.apply(variables, prev, (n_real + t - 1)[:, None], kv_mask, cache, slot)
        token, logp = _choose(last_logits(hidden), step_keys(t), opts)
        token = jnp.where(done, opts.pad_id, token)
        logp = jnp.where(done, 0.0, logp)
        response = response.at[:, t].set(token)
        logprobs = logprobs.at[:, t].set(logp)
        lengths = lengths + (~done).astype(jnp.int32)
        return t + 1, _constrain(cache), kv_mask, response, logprobs, done | is_eos(token), lengths

    t, _, _, response, logprobs, _, lengths = jax.lax.while_loop(cond, body, state)
    response_mask = (jnp.arange(r)[None, :] < lengths[:, None]).astype(jnp.float32)
    return SampleOutput(tokens=jnp.concatenate([prompt_tokens, response], axis=1), response_mask=response_mask,
                        lengths=lengths, logprobs=logprobs * response_mask, num_steps=t - 1)


@functools.lru_cache(maxsize=64)
def _compiled(model: CausalLM, opts: _Options) -> Callable[..., SampleOutput]:
    # One jax.jit per (model, options); jit itself then caches one executable per input shapes/shardings.
    return jax.jit(functools.partial(_generate, model, opts))


# ------------------------------------------------------------------------------------------------ validation
def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def stop_token_ids(eos_id: Any) -> tuple:
    """`eos_id` as a tuple of stop ids: None -> (), an int -> (id,), a sequence -> its items (unchecked)."""
    if eos_id is None:
        return ()
    return tuple(eos_id) if isinstance(eos_id, (tuple, list)) else (eos_id,)


def _check_options(model: Any, max_new_tokens: Any, eos_id: Any, pad_id: Any, temperature: Any, top_k: Any,
                   top_p: Any, kv_cache_dtype: Any) -> _Options:
    if not isinstance(model, CausalLM):
        raise ValueError(f"model must be a vcppo_jax.models.CausalLM, got {type(model).__name__}")
    vocab = model.cfg.vocab_size
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    stop_ids = stop_token_ids(eos_id)
    if not all(_is_int(i) and 0 <= i < vocab for i in stop_ids):
        raise ValueError(f"eos_id must be None, an int or a sequence of ints in [0, vocab_size) = [0, {vocab}), got "
                         f"{eos_id!r}")
    if not _is_int(pad_id) or not 0 <= pad_id < vocab:
        raise ValueError(f"pad_id must be an int in [0, vocab_size) = [0, {vocab}), got {pad_id!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not _is_int(top_k) or not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be an int in [0, vocab_size] = [0, {vocab}] (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _Options(int(max_new_tokens), tuple(int(i) for i in stop_ids), int(pad_id), float(temperature),
                    int(top_k), float(top_p), kv_cache_dtype)


def _check_prompts(prompt_tokens: Any, prompt_mask: Any) -> None:
    shape = np.shape(prompt_tokens)
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"prompt_tokens must be [batch, prompt_len] with prompt_len >= 1, got shape {shape}")
    if np.shape(prompt_mask) != shape:
        raise ValueError(f"prompt_mask must have the shape of prompt_tokens {shape}, got {np.shape(prompt_mask)}")
    if not jnp.issubdtype(jnp.result_type(prompt_tokens), jnp.integer):
        raise ValueError(f"prompt_tokens must be integer token ids, got dtype {jnp.result_type(prompt_tokens)}")
    if isinstance(prompt_mask, np.ndarray):  # host input: cheap to check the layout (device arrays are trusted)
        mask = prompt_mask.astype(bool)
        if not mask[:, -1].all():
            rows = np.flatnonzero(~mask[:, -1]).tolist()
            raise ValueError(f"prompt_mask must be LEFT-padded with >= 1 real token per row: rows {rows[:8]} end "
                             "in padding")
        if np.any(mask[:, :-1] & ~mask[:, 1:]):
            raise ValueError("prompt_mask must be LEFT-padded (pads first, then real tokens): a row has a pad "
                             "after a real token")


# ------------------------------------------------------------------------------------------------ public API
def make_sampler(model: CausalLM, *, max_new_tokens: int, eos_id: int | Sequence[int] | None, pad_id: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, kv_cache_dtype: str = "compute"
                 ) -> Callable[[Any, Array, Array, Array], SampleOutput]:
    """Validated, jitted `fn(params, prompt_tokens [B, P], prompt_mask [B, P], rng) -> SampleOutput`.

    params: the 'params' collection (`model.apply({'params': params}, ...)`). rng: a PRNG key. Options as in
    `sample`. Calls with the same (model, options) share one `jax.jit` (`fn.__wrapped__`), compiled once per
    input shapes and shardings. `fn.stop_ids`: the tokens that end a response (what `decode_responses` cuts).
    """
    opts = _check_options(model, max_new_tokens, eos_id, pad_id, temperature, top_k, top_p, kv_cache_dtype)
    jitted = _compiled(model, opts)

    @functools.wraps(jitted)
    def fn(params: Any, prompt_tokens: Array, prompt_mask: Array, rng: Array) -> SampleOutput:
        _check_prompts(prompt_tokens, prompt_mask)
        return jitted(params, prompt_tokens, prompt_mask, rng)

    fn.stop_ids = opts.stop_ids
    return fn


def sample(model: CausalLM, params: Any, prompt_tokens: Array, prompt_mask: Array, rng: Array, *,
           max_new_tokens: int, eos_id: int | Sequence[int] | None, pad_id: int, temperature: float = 1.0,
           top_k: int = 0,
           top_p: float = 1.0, kv_cache_dtype: str = "compute") -> SampleOutput:
    """Samples up to `max_new_tokens` tokens after each left-padded prompt.

    Args:
      model: the CausalLM; params: its 'params' collection.
      prompt_tokens: [B, P] int token ids, LEFT-padded. prompt_mask: [B, P], 1/True for real tokens (>= 1 per
        row, the last column always real).
      rng: PRNG key (unused when temperature == 0).
      max_new_tokens: R >= 1. eos_id: stop token in [0, vocab), several (e.g. EOS and a chat template's
        end-of-turn token: a response ends at the first of them), or None for no stop (always R tokens).
      pad_id: written after EOS. temperature: >= 0, 0 = greedy. top_k: 0 (off) or the number of most likely
        tokens kept. top_p: nucleus mass in (0, 1], 1 = off. Filters apply in the order temperature, top-k,
        top-p (as HF's warpers). kv_cache_dtype: one of KV_CACHE_DTYPES ('compute' = the model's compute
        dtype; 'bfloat16' halves an fp32 model's cache).
    Returns:
      SampleOutput; the decode loop stops as soon as every row has emitted EOS.
    """
    fn = make_sampler(model, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature,
                      top_k=top_k, top_p=top_p, kv_cache_dtype=kv_cache_dtype)
    return fn(params, prompt_tokens, prompt_mask, rng)


def decode_responses(tokenizer: Any, out: SampleOutput, *, eos_id: int | Sequence[int] | None = None,
                     skip_special_tokens: bool = False) -> list[str]:
    """Text of each row's response, up to but excluding its stop token: one of `eos_id` (an id or several; the
    sampler's `fn.stop_ids`), by default `tokenizer.eos_token_id`."""
    stop_ids = stop_token_ids(tokenizer.eos_token_id if eos_id is None else eos_id)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    r = np.shape(out.response_mask)[1]
    texts = []
    for row, n in zip(tokens[:, tokens.shape[1] - r:], lengths):
        ids: Sequence[int] = row[:n].tolist()
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
    return texts
