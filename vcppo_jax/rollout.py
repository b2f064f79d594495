"""Host side of a rollout: prompts -> sampled responses -> verifier rewards -> the RL batch layout; evaluation.

The sampler and every network call are jitted elsewhere; this module only moves numpy arrays and strings.

Multi-host: every process builds the same global prompt batch, feeds its own rows of it (`HostIO.local_rows`),
decodes and scores only those, and gathers what a statistic needs over the whole batch. `HostIO` is that interface
(`runtime.Runtime` implements it over a mesh); the default, `SINGLE_HOST`, is the identity for one process.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from vcppo_jax import hooks
from vcppo_jax.data import RecordSource
from vcppo_jax.data.batching import encode_prompts
from vcppo_jax.rewards import score_batch
from vcppo_jax.rl import Rollout
from vcppo_jax.sampling import SampleOutput, decode_responses


@dataclasses.dataclass
class PromptBatch:
    tokens: np.ndarray  # [B, P] int32, left-padded
    mask: np.ndarray  # [B, P] int32
    answers: list[str]  # [B]

    def rows(self, rows: slice) -> "PromptBatch":
        return PromptBatch(tokens=self.tokens[rows], mask=self.mask[rows], answers=self.answers[rows])


class HostIO(Protocol):
    """Moves batches between this process and the devices (see the module docstring)."""

    def place_batch(self, tree: Any) -> Any: ...  # this process's rows -> global device arrays

    def fetch(self, tree: Any) -> Any: ...  # device results -> numpy, this process's rows

    def local_rows(self, batch_size: int) -> slice: ...

    def gather(self, tree: Any, rows: slice) -> Any: ...  # this process's rows -> the whole batch (collective)


class SingleHost:
    """`HostIO` of one process holding the whole batch (numpy in, `jax.device_get` out)."""

    def place_batch(self, tree: Any) -> Any:
        return tree

    def fetch(self, tree: Any) -> Any:
        return jax.device_get(tree)

    def local_rows(self, batch_size: int) -> slice:
        return slice(0, batch_size)

    def gather(self, tree: Any, rows: slice) -> Any:
        return tree


SINGLE_HOST = SingleHost()


def prompt_batch(source: RecordSource, indices: Sequence[int], tokenizer, *, max_prompt_len: int,
                 group_size: int = 1) -> PromptBatch:
    """Records at `indices`, each repeated `group_size` times in a row (a GRPO group is a consecutive block)."""
    records = source.get_batch(indices)
    records = [r for r in records for _ in range(group_size)]
    tokens, mask = encode_prompts(tokenizer, [r["prompt"] for r in records], max_prompt_len, truncate=True,
                                  add_special_tokens=not getattr(source, "prompts_have_special_tokens", False))
    return PromptBatch(tokens=tokens, mask=mask, answers=[r["answer"] for r in records])


def place_rewards(seq_rewards: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Token rewards [B, R]: each sequence reward [B] at its response's last token (the EOS when there is one)."""
    batch, resp_len = response_mask.shape
    lengths = np.asarray(response_mask).sum(axis=1).astype(np.int64)
    rewards = np.zeros((batch, resp_len), np.float32)
    rewards[np.arange(batch), np.maximum(lengths, 1) - 1] = seq_rewards
    return rewards


def to_rollout(out: SampleOutput, prompt_mask: np.ndarray, seq_rewards: np.ndarray) -> Rollout:
    """The RL batch (numpy): each sequence reward [B] placed at its response's last token."""
    response_mask = np.asarray(out.response_mask, np.float32)
    attn_mask = np.concatenate([np.asarray(prompt_mask, bool), response_mask > 0], axis=1)
    return Rollout(tokens=np.asarray(out.tokens, np.int32), attn_mask=attn_mask, response_mask=response_mask,
                   rewards=place_rewards(seq_rewards, response_mask), seq_rewards=np.asarray(seq_rewards, np.float32),
                   sample_logp=np.asarray(out.logprobs, np.float32))


def with_seq_rewards(rollout: Rollout, seq_rewards: np.ndarray) -> Rollout:
    """`rollout` training on other sequence rewards [B], each placed at its row's own last token."""
    seq_rewards = np.asarray(seq_rewards, np.float32)
    return rollout.replace(seq_rewards=seq_rewards, rewards=place_rewards(seq_rewards, rollout.response_mask))


def shuffle_rewards(rollout: Rollout, rng: np.random.Generator, rows: slice | None = None,
                    io: HostIO = SINGLE_HOST) -> Rollout:
    """The shuffled-reward control: sequence rewards permuted across the rows of the (global) batch, then placed at
    each row's own last token. Keeps the reward distribution and every length; removes any link to the response.
    rows: which rows of the global batch `rollout` holds (None: all of it)."""
    rows = slice(0, len(rollout.seq_rewards)) if rows is None else rows
    seq_rewards = io.gather(rollout.seq_rewards, rows)
    return with_seq_rewards(rollout, seq_rewards[rng.permutation(len(seq_rewards))][rows])


def sample_filtered(sample_round: Callable[[int], Rollout], group_filter: str, group_size: int, max_rounds: int,
                    rows: slice, io: HostIO = SINGLE_HOST) -> tuple[Rollout, Rollout, dict[str, float]]:
    """A batch of groups that pass `group_filter` (`hooks.keep_groups`; DAPO's dynamic sampling).

    sample_round(k) -> this process's rows of round k's rollout (a fresh prompt batch of the same shape; round 0 is
    the step's usual one). Rounds run until the kept groups fill a batch or `max_rounds` were sampled; a batch still
    short is filled with rejected groups in sampling order (the shapes stay fixed, nothing recompiles).
    Returns (round 0's rollout, the training rollout, metrics), rollouts as this process's `rows`; with
    group_filter 'none' both are round 0's and the metrics are empty; otherwise they hold `rollout/sampled_tokens`,
    the real tokens (prompts included) of every round sampled, which the step's throughput counts.
    """
    first = sample_round(0)
    if group_filter == "none":
        return first, first, {}
    kept, rejected, num_kept, local, sampled_tokens = [], [], 0, first, 0
    for k in range(max_rounds):
        if k:
            local = sample_round(k)
        whole = io.gather(local, rows)  # every process takes the same decision
        sampled_tokens += int(whole.attn_mask.sum())
        keep = hooks.keep_groups(group_filter, whole.seq_rewards, group_size)
        groups = jax.tree.map(lambda v: v.reshape(len(keep), group_size, *v.shape[1:]), whole)
        kept.append(jax.tree.map(lambda v: v[keep], groups))
        rejected.append(jax.tree.map(lambda v: v[~keep], groups))
        num_kept += int(keep.sum())
        if k == 0:
            first_kept = float(keep.mean())
        if num_kept >= len(keep):
            break
    num_groups = len(keep)
    batch = jax.tree.map(lambda *vs: np.concatenate(vs)[:num_groups].reshape(-1, *vs[0].shape[2:]),
                         *kept, *rejected)
    return first, jax.tree.map(lambda v: v[rows], batch), {
        "rollout/groups_kept_first_round": first_kept, "rollout/sampling_rounds": float(k + 1),
        "rollout/groups_filled": max(num_groups - num_kept, 0) / num_groups,
        "rollout/sampled_tokens": float(sampled_tokens)}


def generate_and_score(sampler: Callable, params, batch: PromptBatch, rng: jax.Array, tokenizer,
                       verifier: Callable, io: HostIO = SINGLE_HOST) -> tuple[Rollout, list[str]]:
    """Samples one response per row of the global `batch`, scores this process's rows (`io.local_rows`), returns
    (rollout, response texts) of those rows."""
    local = batch.rows(io.local_rows(len(batch.answers)))
    out = io.fetch(sampler(params, io.place_batch(local.tokens), io.place_batch(local.mask), rng))
    texts = decode_responses(tokenizer, out, eos_id=getattr(sampler, "stop_ids", None))
    seq_rewards = score_batch(verifier, texts, local.answers)
    return to_rollout(out, local.mask, seq_rewards), texts


def rollout_stats(seq_rewards: np.ndarray, lengths: np.ndarray, correct: float, max_len: int) -> dict[str, float]:
    """Reward, accuracy and length statistics of a batch: seq_rewards [B], response lengths [B]."""
    return {
        "rollout/reward_mean": float(seq_rewards.mean()),
        "rollout/accuracy": float((seq_rewards >= correct).mean()),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/clip_ratio": float((lengths >= max_len).mean()),
    }


def whole_batch_stats(rollout: Rollout, correct: float, max_len: int, rows: slice,
                      io: HostIO = SINGLE_HOST) -> tuple[dict[str, float], int]:
    """`rollout_stats` of the whole batch (this process holds `rows` of it; one gather over the processes) and the
    batch's number of real tokens, prompts included."""
    whole = io.gather({"seq_rewards": rollout.seq_rewards, "lengths": rollout.response_mask.sum(axis=1),
                       "num_tokens": rollout.attn_mask.sum(axis=1)}, rows)
    return rollout_stats(whole["seq_rewards"], whole["lengths"], correct, max_len), int(whole["num_tokens"].sum())


def evaluate(sampler: Callable, params, source: RecordSource, tokenizer, verifier: Callable, *, num_prompts: int,
             batch_size: int, max_prompt_len: int, correct: float, rng: jax.Array, prefix: str = "eval",
             io: HostIO = SINGLE_HOST, ref_logprobs: Callable | None = None,
             extract_answer: Callable[[str], str | None] | None = None) -> dict[str, float]:
    """pass@1 (one sample per prompt from `sampler`) and response length on the first `num_prompts` records
    (each process scores its rows of each batch; the numbers are over all of them).

    `direct_fraction` counts single-line answers (no scratchpad): the short style a collapsing policy falls into;
    `clip_ratio` the responses that reached the sampler's length cap (as `rollout/clip_ratio`).
    extract_answer: `rewards.answer_extractor(task)`; adds `answer_rate`, the responses it finds a final answer in
    (the format rate: a policy can learn the format before the arithmetic).
    ref_logprobs: `fn(tokens [B, P+R], attn_mask [B, P+R]) -> [B, R]` log-probs of the response tokens under a
    reference policy (at the sampler's temperature); adds `kl_to_ref`, the per-token Monte-Carlo estimate of
    KL(sampler || reference) = E[log q(y) - log p_ref(y)] over the sampled tokens.
    """
    num_prompts = min(num_prompts, len(source))
    num_prompts -= num_prompts % batch_size
    if num_prompts < batch_size:
        raise ValueError(f"evaluation needs at least one batch of {batch_size} prompts; the split has {len(source)}")
    rows = io.local_rows(batch_size)
    per_row: list[dict[str, np.ndarray]] = []
    for start in range(0, num_prompts, batch_size):
        batch = prompt_batch(source, range(start, start + batch_size), tokenizer, max_prompt_len=max_prompt_len)
        rollout, texts = generate_and_score(sampler, params, batch, jax.random.fold_in(rng, start), tokenizer,
                                            verifier, io)
        length = rollout.response_mask.sum(axis=1)
        row = {"reward": rollout.seq_rewards, "length": length,
               "single_line": np.array(["\n" not in t.strip() for t in texts]),
               "clipped": length >= rollout.response_mask.shape[1]}
        if extract_answer is not None:
            row["answered"] = np.array([extract_answer(t) is not None for t in texts])
        if ref_logprobs is not None:
            ref = io.fetch(ref_logprobs(io.place_batch(rollout.tokens), io.place_batch(rollout.attn_mask)))
            row["log_ratio"] = ((rollout.sample_logp - ref) * rollout.response_mask).sum(axis=1)
        per_row.append(io.gather(row, rows))
    r = {k: np.concatenate([b[k] for b in per_row]) for k in per_row[0]}
    out = {f"{prefix}/pass@1": float((r["reward"] >= correct).mean()),
           f"{prefix}/response_length_mean": float(r["length"].mean()),
           f"{prefix}/direct_fraction": float(np.mean(r["single_line"])),
           f"{prefix}/clip_ratio": float(np.mean(r["clipped"]))}
    if extract_answer is not None:
        out[f"{prefix}/answer_rate"] = float(np.mean(r["answered"]))
    if ref_logprobs is not None:
        out[f"{prefix}/kl_to_ref"] = float(r["log_ratio"].sum()) / max(float(r["length"].sum()), 1.0)
    return out
