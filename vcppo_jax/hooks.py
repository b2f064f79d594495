"""Host-side hooks of the RL loop, each a plain numpy function chosen by config (DAPO's two host-side changes).

- Reward shaping (`config.reward_shaping`): changes the sequence rewards the update trains on; the reported
  accuracy and the verifier's outcome stay untouched. 'overlong': DAPO's soft overlong punishment.
- Group filtering (`config.group_filter`): which prompt groups of a rollout the update keeps. 'mixed': DAPO's dynamic
  sampling, keeping only groups whose responses are neither all right nor all wrong (the others have zero
  group-relative advantage and only dilute the batch); the loop samples more prompts until the batch is full
  (`rollout.sample_filtered`).

Adding a hook: a function here, its name in the list, and a config file that selects it.
"""

from __future__ import annotations

import numpy as np

REWARD_SHAPINGS = ("none", "overlong")
GROUP_FILTERS = ("none", "mixed")


def overlong_penalty(lengths: np.ndarray, *, max_len: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment: [B] float32 in [-penalty, 0].

    0 up to `max_len - buffer` tokens, then falling linearly to -penalty at `max_len` (the sampler's cap, where a
    response is cut off): a response is told it is getting long before it is truncated.
    """
    lengths = np.asarray(lengths, np.float32)
    if buffer <= 0:
        return np.where(lengths >= max_len, -penalty, 0.0).astype(np.float32)
    over = np.clip((lengths - (max_len - buffer)) / buffer, 0.0, 1.0)
    return (-penalty * over).astype(np.float32)


def shape_rewards(kind: str, seq_rewards: np.ndarray, lengths: np.ndarray, *, max_len: int, buffer: int,
                  penalty: float) -> np.ndarray:
    """The sequence rewards [B] the update trains on, from the verifier's `seq_rewards` [B] and `lengths` [B]."""
    if kind == "none":
        return np.asarray(seq_rewards, np.float32)
    if kind == "overlong":
        return (np.asarray(seq_rewards, np.float32)
                + overlong_penalty(lengths, max_len=max_len, buffer=buffer, penalty=penalty))
    raise ValueError(f"reward_shaping={kind!r}; allowed: {REWARD_SHAPINGS}")


def keep_groups(kind: str, seq_rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Which groups to keep: bool [B // group_size], from the verifier's `seq_rewards` [B] (a group is
    `group_size` consecutive rows)."""
    groups = np.asarray(seq_rewards).reshape(-1, group_size)
    if kind == "none":
        return np.ones(len(groups), bool)
    if kind == "mixed":
        return groups.max(axis=1) > groups.min(axis=1)
    raise ValueError(f"group_filter={kind!r}; allowed: {GROUP_FILTERS}")
