"""Batched autoregressive sampling with a KV cache: one jitted prefill + a `lax.while_loop` decode.

Layout (shared with the rest of the project): prompts LEFT-padded to P tokens, responses RIGHT-padded to
R = max_new_tokens, full sequence [B, P + R]. The cache has P + R slots: slot j < P holds prompt token j, slot
P + t holds response token t. Positions continue from each row's real-token count (cumsum(mask) - 1), so a
prompt's output does not depend on how much left padding the batch gave it.

Randomness is per row: row b at response step t draws with `fold_in(fold_in(rng, b), t)`, so a row's sample
depends only on (rng, its index, its own prompt), never on the other rows of the batch.

Two engines (ENGINES), the same output:
- 'dense': every row decodes until the longest row ends; a step computes all B rows, ended ones included.
- 'slots': `num_slots` S < B decode slots, each holding one row's KV cache [P + R]; a slot whose row ends (stop
  token or R tokens) is refilled with the next waiting prompt (a one-row prefill into that slot), so a step
  computes S rows that are nearly all live. Once no prompt waits, the live rows move into fewer slots as soon as
  they fit (tail narrowing: static widths, `slot_widths`, one loop each), so the batch's last rows stop computing
  dead slots. Same per-row keys and positions, so each row samples the tokens the dense engine samples (up to float
  rounding). Where a step's cost grows with its rows (CPU), mixed response lengths then cost what is generated,
  not B x the longest; on an accelerator a wide batch costs about what a narrow one does, and 'dense' is the
  right choice. What 'slots' still wastes: a step attends every slot over the cache columns of its most advanced
  row (the model's kernel reads one key range for the whole batch), masked for the younger rows.

Use with a mesh: pass batch-sharded prompts (`sharding.shard_batch`) and sharded params, and call inside
`sharding.use_mesh(mesh)` so the model's logical constraints (and the cache's) are active; B must then be a
multiple of data * fsdp. 'slots' runs there too, with any S (its one-row prefills and per-slot steps are resharded
by XLA: the same samples, not an efficient layout).
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
from vcppo_jax.sharding import mesh_platform

Array = jax.Array
_CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")
# What the KV cache stores: the model's compute dtype, or bfloat16 (half the cache memory of an fp32 model; keys
# and values are rounded to bf16 when written and attention still runs in the compute dtype).
KV_CACHE_DTYPES = ("compute", "bfloat16")
# How a batch is decoded (module docstring): all rows to the longest ('dense'), or refilled decode slots ('slots').
ENGINES = ("dense", "slots")
# Key block of a decode step's attention on CPU. A step reads the cache's filled blocks (`cache_prefix_attention`);
# the model's block (512 by default, sized for the training kernels) spans a whole short cache, so every step read all
# P + R slots, and a block as long as the cache made XLA copy the layer's whole cache twice per layer and step: 37.9
# vs 7.3 ms a step (64 rows, 368 slots, experiments/bench_rollout.py's model; blocks 32-128 within 1%). Accelerators
# keep the model's block: each block is a loop trip of several kernels there.
DECODE_BLOCK_CPU = 64


class SampleOutput(NamedTuple):
    """Result of `sample`. B = batch, P = prompt length, R = max_new_tokens.

    tokens: [B, P + R] int32, the prompt (left-padded, as given) then the response (pad_id after EOS).
    response_mask: [B, R] float32, 1 for generated tokens including the EOS token, 0 after.
    lengths: [B] int32, number of generated tokens including EOS.
    logprobs: [B, R] float32, log-prob of each sampled token under the sampling distribution (temperature, then
      top-k / top-p renormalization); greedy (temperature 0): under softmax(logits) at temperature 1. 0 where
      masked.
    num_steps: [] int32, decode forward passes run after the prefill. 'dense': of all B rows, max(lengths) - 1
      (the loop stops once every row has emitted EOS); 'slots': of S slots or fewer (tail narrowing), prefills into
      slots not counted.
    decode_rows: [] int32, rows computed by those passes, live or not (the sum of each pass's width): 'dense':
      num_steps * B. sum(lengths - 1) / decode_rows is the fraction of decode compute spent on live rows. None
      where a caller builds a SampleOutput by hand (test doubles); the engines always set it.
    """

    tokens: Array
    response_mask: Array
    lengths: Array
    logprobs: Array
    num_steps: Array
    decode_rows: Array | None = None


@dataclasses.dataclass(frozen=True)
class _Options:
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    temperature: float
    top_k: int
    top_p: float
    kv_cache_dtype: str
    engine: str
    num_slots: int  # 'slots' only: decode slots (0 = auto, `slot_count`); 0 for 'dense'


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


def _decode_model(model: CausalLM) -> CausalLM:
    """The model the decode steps run (the prefill keeps `model`): on CPU, attention over blocks of at most
    DECODE_BLOCK_CPU slots (the same parameters; the online softmax only splits differently, float rounding)."""
    block = min(model.cfg.attention_block_size, DECODE_BLOCK_CPU)
    if mesh_platform() != "cpu" or block == model.cfg.attention_block_size:
        return model
    return CausalLM(model.cfg.replace(attention_block_size=block))


def _prefill(model: CausalLM, opts: _Options, variables: Any, prompt_tokens: Array, prompt_mask: Array,
             row_keys: Array, cache: KVCache) -> tuple[KVCache, Array, Array, Array]:
    """All B rows' prompts into an empty [P + R]-column cache at once; the prompt's last column (always real under
    left padding) predicts response token 0 with each row's key for step 0. Returns (cache, kv_mask [B, P + R],
    token [B], its log-prob [B])."""
    b, r = prompt_tokens.shape[0], opts.max_new_tokens
    kv_mask = jnp.concatenate([prompt_mask, jnp.zeros((b, r), bool)], axis=1)
    hidden, cache = model.apply(variables, prompt_tokens, position_ids(prompt_mask), kv_mask, cache, 0)
    logits = model.apply(variables, hidden[:, -1], method=CausalLM.logits)
    token, logp = _choose(logits, jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, 0), opts)
    return _constrain(cache), kv_mask, token, logp


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
    decoder = _decode_model(model)

    cache_dtype = None if opts.kv_cache_dtype == "compute" else jnp.dtype(opts.kv_cache_dtype)
    cache, kv_mask, token, logp = _prefill(model, opts, variables, prompt_tokens, prompt_mask, row_keys,
                                           _constrain(init_cache(model.cfg, b, p + r, cache_dtype)))
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
        hidden, cache = decoder.apply(variables, prev, (n_real + t - 1)[:, None], kv_mask, cache, slot)
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
                        lengths=lengths, logprobs=logprobs * response_mask, num_steps=t - 1, decode_rows=(t - 1) * b)


def slot_count(num_slots: int, batch: int) -> int:
    """Decode slots the 'slots' engine starts with for `batch` rows: `num_slots` (0 = auto: `batch`, i.e. one batched
    prefill, no refills, only tail narrowing), at most `batch`. Auto because on CPU a narrow decode step costs more
    per row than a wide one, so refilling few slots loses more than it saves (experiments/BENCHMARKS.md, "Rollout
    engines": 8 and 32 refilled slots against 64)."""
    return max(1, min(num_slots or batch, batch))


def slot_widths(num_slots: int) -> tuple[int, ...]:
    """The static widths the 'slots' engine decodes at: S, then the multiples of g = max(4, S // 16) below S, then
    halving from the smallest of them to 1 (64 slots: 64, 60, 56, ..., 8, 4, 2, 1). Once no row waits, the live rows
    move into the narrowest width that holds them (tail narrowing), so the batch's last rows stop computing dead slots.
    Steps of g rather than halving: on the long-response workload of experiments/bench_rollout.py (64 rows) the live
    rows fill 87% of the row-steps with g = 8 and 94% with g = 4, which decodes ~7% faster; each width is one more
    compiled loop, so there are at most about 16 + log2(g) of them."""
    step = max(4, num_slots // 16)
    widths = [num_slots, *range((num_slots - 1) // step * step, step - 1, -step)]
    while widths[-1] > 1:
        widths.append(widths[-1] // 2)
    return tuple(widths)


class _SlotState(NamedTuple):
    """The 'slots' decode loop's carry. S = slots, B = rows, P + R = cache length."""

    cache: KVCache  # [L, S, K, P + R, H]
    kv_mask: Array  # [S, P + R] bool: the slot's row's real tokens so far
    live: Array  # [S] bool: the slot holds a row that still decodes
    row: Array  # [S] int32: the row a slot serves
    t: Array  # [S] int32: the response index of the slot's next token
    prev: Array  # [S] int32: the token fed next (response token t - 1)
    n_real: Array  # [S] int32: real prompt tokens of the slot's row (position of response token 0)
    next_row: Array  # [] int32: the first row not yet given a slot (rows are taken in order)
    response: Array  # [B, R] int32
    logprobs: Array  # [B, R] float32
    lengths: Array  # [B] int32
    num_steps: Array  # [] int32: decode steps run
    decode_rows: Array  # [] int32: slots computed by those steps (the sum of their widths)


def _generate_slots(model: CausalLM, opts: _Options, params: Any, prompt_tokens: Array, prompt_mask: Array,
                    rng: Array) -> SampleOutput:
    b, p = prompt_tokens.shape
    r, s = opts.max_new_tokens, slot_count(opts.num_slots, b)
    variables = {"params": params}
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(bool)
    row_keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(b, dtype=jnp.int32))  # as `_generate`
    is_eos = lambda tok: jnp.isin(tok, jnp.asarray(opts.stop_ids, jnp.int32))  # noqa: E731
    cache_dtype = None if opts.kv_cache_dtype == "compute" else jnp.dtype(opts.kv_cache_dtype)
    decoder = _decode_model(model)

    def refill(st: _SlotState) -> _SlotState:
        """Prefills row `next_row` into the first free slot and samples its response token 0 (`_generate`'s
        prefill for one row); a row that ends there (stop token, or R = 1) leaves the slot free."""
        slot, row = jnp.argmin(st.live), st.next_row
        tokens = jax.lax.dynamic_index_in_dim(prompt_tokens, row, keepdims=True)  # [1, P]
        mask = jax.lax.dynamic_index_in_dim(prompt_mask, row, keepdims=True)
        # A P-slot cache at index 0: attention reads only the prompt; then its P columns go into the slot's row.
        hidden, fresh = model.apply(variables, tokens, position_ids(mask), mask, init_cache(model.cfg, 1, p,
                                                                                               cache_dtype), 0)
        cache = KVCache(*(jax.lax.dynamic_update_slice(c, f, (0, slot, 0, 0, 0)) for c, f in zip(st.cache, fresh)))
        logits = model.apply(variables, hidden[:, -1], method=CausalLM.logits)
        token, logp = _choose(logits, jax.random.fold_in(row_keys[row], 0)[None], opts)
        kv_row = jnp.concatenate([mask[0], jnp.zeros((r,), bool)])
        return st._replace(
            cache=_constrain(cache), kv_mask=st.kv_mask.at[slot].set(kv_row),
            live=st.live.at[slot].set(~is_eos(token[0]) & (r > 1)), row=st.row.at[slot].set(row),
            t=st.t.at[slot].set(1), prev=st.prev.at[slot].set(token[0]),
            n_real=st.n_real.at[slot].set(jnp.sum(mask, dtype=jnp.int32)), next_row=row + 1,
            response=st.response.at[row, 0].set(token[0]), logprobs=st.logprobs.at[row, 0].set(logp[0]),
            lengths=st.lengths.at[row].set(1))

    def decode(st: _SlotState) -> _SlotState:
        """Feeds each slot's token t - 1 and samples its token t, as the dense engine does, in one batched step.
        The model writes a step's keys/values at one cache column shared by the batch, while each slot's token
        t - 1 belongs in its own column P + t - 1: the step writes them all at the live slots' largest own column
        m (the later columns are no slot's yet) and attends each slot's real columns plus m; then, where slots are
        refilled (S < B: rows at different steps), each slot's entry moves from m to its own column. Attention is a
        sum over keys, so where a key sits does not matter (positions are the rows' own). Free slots compute too
        (static shapes); what they write is never read: their rows are dropped and a refill resets them."""
        width = st.live.shape[0]
        index = p + st.t - 1  # [S] each slot's own column
        shared = jnp.max(jnp.where(st.live, index, p))
        hidden, cache = decoder.apply(variables, st.prev[:, None], (st.n_real + st.t - 1)[:, None],
                                      st.kv_mask.at[:, shared].set(True), st.cache, shared)
        slots = jnp.arange(width)
        if s < b:
            # [L, S, K, P + R, H] indexed at (slots, index) on axes 1 and 3 -> updates [S, L, K, H].
            cache = KVCache(*(c.at[:, slots, :, index].set(
                jnp.moveaxis(jax.lax.dynamic_index_in_dim(c, shared, 3, False), 1, 0)) for c in cache))
        # else: no refill, so every row started at once and each slot's own column is the shared one.
        logits = model.apply(variables, hidden[:, -1], method=CausalLM.logits)
        keys = jax.vmap(jax.random.fold_in)(row_keys[st.row], st.t)
        token, logp = _choose(logits, keys, opts)
        out_row = jnp.where(st.live, st.row, b)  # b: out of range, dropped
        return st._replace(
            cache=_constrain(cache), kv_mask=st.kv_mask.at[slots, index].set(True),
            live=st.live & ~is_eos(token) & (st.t + 1 < r), t=jnp.minimum(st.t + 1, r), prev=token,
            response=st.response.at[out_row, st.t].set(token, mode="drop"),
            logprobs=st.logprobs.at[out_row, st.t].set(logp, mode="drop"),
            lengths=st.lengths.at[out_row].add(1, mode="drop"), num_steps=st.num_steps + 1,
            decode_rows=st.decode_rows + width)

    def prefill_all(st: _SlotState) -> _SlotState:
        """S = B (no refills): every row's prefill in one batched call, as `_generate`'s, instead of B one-row
        refills; each slot holds its row, and its first column the batch's shared one."""
        cache, kv_mask, token, logp = _prefill(model, opts, variables, prompt_tokens, prompt_mask, row_keys, st.cache)
        return st._replace(
            cache=cache, kv_mask=kv_mask, live=~is_eos(token) & (r > 1),
            row=jnp.arange(b, dtype=jnp.int32), prev=token, n_real=jnp.sum(prompt_mask, axis=1, dtype=jnp.int32),
            next_row=jnp.int32(b), response=st.response.at[:, 0].set(token),
            logprobs=st.logprobs.at[:, 0].set(logp), lengths=jnp.ones((b,), jnp.int32))

    def fill(st: _SlotState) -> _SlotState:
        """Refills free slots while rows wait (a loop of its own: a `lax.cond` choosing refill or decode in one
        loop made the decode steps ~8% slower on CPU)."""
        return jax.lax.while_loop(lambda st: (st.next_row < b) & ~jnp.all(st.live), refill, st)

    def narrow(st: _SlotState, width: int) -> _SlotState:
        """The state with its first `width` slots holding every live slot (stable: live slots first, in order);
        called once no row waits and at most `width` slots are live. Copies those slots' caches, once."""
        keep = jnp.argsort(~st.live, stable=True)[:width]
        take = lambda x, axis=0: jnp.take(x, keep, axis=axis)  # noqa: E731
        return st._replace(cache=_constrain(KVCache(take(st.cache.k, 1), take(st.cache.v, 1))),
                           kv_mask=take(st.kv_mask), live=take(st.live), row=take(st.row), t=take(st.t),
                           prev=take(st.prev), n_real=take(st.n_real))

    def fits(st: _SlotState, width: int) -> Array:
        """[] bool: no row waits and the live slots fit in `width` slots (0: none is live)."""
        return (st.next_row >= b) & (jnp.sum(st.live) <= width)

    zeros = jnp.zeros((s,), jnp.int32)
    init = _SlotState(
        cache=_constrain(init_cache(model.cfg, s, p + r, cache_dtype)), kv_mask=jnp.zeros((s, p + r), bool),
        live=jnp.zeros((s,), bool), row=zeros, t=zeros + 1, prev=zeros, n_real=zeros, next_row=jnp.int32(0),
        response=jnp.full((b, r), opts.pad_id, jnp.int32), logprobs=jnp.zeros((b, r), jnp.float32),
        lengths=jnp.zeros((b,), jnp.int32), num_steps=jnp.int32(0), decode_rows=jnp.int32(0))

    def loop(st: _SlotState, width: int, narrower: int) -> _SlotState:
        """Decodes at `width` slots until the live rows fit `narrower` (or none is live); only the first width
        refills, and with S = B no row ever waits."""
        step = (lambda st: fill(decode(st))) if width == s and s < b else decode
        return jax.lax.while_loop(lambda st: jnp.any(st.live) & ~fits(st, narrower), step, st)

    def rows_out(st: _SlotState) -> tuple[Array, ...]:
        return st.response, st.logprobs, st.lengths, st.num_steps, st.decode_rows

    def narrowing(st: _SlotState) -> tuple[Array, ...]:
        """The tail: each narrower width's loop on the live rows moved into it (a loop per width: static shapes)."""
        for width, narrower in zip(widths[1:], widths[2:] + (0,)):
            st = loop(narrow(st, width), width, narrower)
        return rows_out(st)

    # After `fill` either every slot is live or no row waits: no live slot means every row is done. When every row
    # ends at the full width (equal lengths), the tail is skipped: its narrowing copies of the cache would be waste.
    widths = slot_widths(s)
    st = loop(prefill_all(init) if s == b else fill(init), s, widths[1] if len(widths) > 1 else 0)
    response, logprobs, lengths, num_steps, decode_rows = jax.lax.cond(jnp.any(st.live), narrowing, rows_out, st)
    response_mask = (jnp.arange(r)[None, :] < lengths[:, None]).astype(jnp.float32)
    return SampleOutput(tokens=jnp.concatenate([prompt_tokens, response], axis=1), response_mask=response_mask,
                        lengths=lengths, logprobs=logprobs * response_mask, num_steps=num_steps,
                        decode_rows=decode_rows)


@functools.lru_cache(maxsize=64)
def _compiled(model: CausalLM, opts: _Options) -> Callable[..., SampleOutput]:
    # One jax.jit per (model, options); jit itself then caches one executable per input shapes/shardings.
    generate = _generate_slots if opts.engine == "slots" else _generate
    return jax.jit(functools.partial(generate, model, opts))


# ------------------------------------------------------------------------------------------------ validation
def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def stop_token_ids(eos_id: Any) -> tuple:
    """`eos_id` as a tuple of stop ids: None -> (), an int -> (id,), a sequence -> its items (unchecked)."""
    if eos_id is None:
        return ()
    return tuple(eos_id) if isinstance(eos_id, (tuple, list)) else (eos_id,)


def _check_options(model: Any, max_new_tokens: Any, eos_id: Any, pad_id: Any, temperature: Any, top_k: Any,
                   top_p: Any, kv_cache_dtype: Any, engine: Any, num_slots: Any) -> _Options:
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
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not _is_int(num_slots) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0 (0 = auto), got {num_slots!r}")
    return _Options(int(max_new_tokens), tuple(int(i) for i in stop_ids), int(pad_id), float(temperature),
                    int(top_k), float(top_p), kv_cache_dtype, engine, int(num_slots) if engine == "slots" else 0)


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
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, kv_cache_dtype: str = "compute",
                 engine: str = "dense", num_slots: int = 0) -> Callable[[Any, Array, Array, Array], SampleOutput]:
    """Validated, jitted `fn(params, prompt_tokens [B, P], prompt_mask [B, P], rng) -> SampleOutput`.

    params: the 'params' collection (`model.apply({'params': params}, ...)`). rng: a PRNG key. Options as in
    `sample`. Calls with the same (model, options) share one `jax.jit` (`fn.__wrapped__`), compiled once per
    input shapes and shardings. `fn.stop_ids`: the tokens that end a response (what `decode_responses` cuts).
    """
    opts = _check_options(model, max_new_tokens, eos_id, pad_id, temperature, top_k, top_p, kv_cache_dtype, engine,
                          num_slots)
    jitted = _compiled(model, opts)

    @functools.wraps(jitted)
    def fn(params: Any, prompt_tokens: Array, prompt_mask: Array, rng: Array) -> SampleOutput:
        _check_prompts(prompt_tokens, prompt_mask)
        return jitted(params, prompt_tokens, prompt_mask, rng)

    fn.stop_ids = opts.stop_ids
    return fn


def sampler_from_config(model: CausalLM, sampling: Any, *, max_new_tokens: int,
                        eos_id: int | Sequence[int] | None, pad_id: int, greedy: bool = False
                        ) -> Callable[[Any, Array, Array, Array], SampleOutput]:
    """`make_sampler` with a config's `sampling` section (temperature, top_k, top_p, kv_cache_dtype, engine,
    decode_slots: config.sampling_config): the one place the loops build their samplers. greedy: temperature 0
    without filters (evaluation), the section's cache dtype and engine kept."""
    policy = dict(temperature=0.0) if greedy else dict(temperature=sampling.temperature, top_k=sampling.top_k,
                                                       top_p=sampling.top_p)
    return make_sampler(model, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                        kv_cache_dtype=sampling.kv_cache_dtype, engine=sampling.engine,
                        num_slots=sampling.decode_slots, **policy)


def sample(model: CausalLM, params: Any, prompt_tokens: Array, prompt_mask: Array, rng: Array, *,
           max_new_tokens: int, eos_id: int | Sequence[int] | None, pad_id: int, temperature: float = 1.0,
           top_k: int = 0,
           top_p: float = 1.0, kv_cache_dtype: str = "compute", engine: str = "dense", num_slots: int = 0
           ) -> SampleOutput:
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
      engine: one of ENGINES (module docstring). num_slots: the 'slots' engine's decode slots (0 = auto,
        `slot_count`; ignored by 'dense').
    Returns:
      SampleOutput; the decode loop stops as soon as every row has emitted EOS.
    """
    fn = make_sampler(model, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature,
                      top_k=top_k, top_p=top_p, kv_cache_dtype=kv_cache_dtype, engine=engine, num_slots=num_slots)
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
