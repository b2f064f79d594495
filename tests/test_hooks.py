"""Host hooks of the RL loop (DAPO's overlong shaping and dynamic sampling) against hand-computed answers."""

import numpy as np
import pytest

from vcppo_jax import hooks
from vcppo_jax.rl import Rollout
from vcppo_jax.rollout import place_rewards, sample_filtered, with_seq_rewards


def test_overlong_penalty_closed_form():
    lengths = np.array([0, 20, 21, 24, 28])
    got = hooks.overlong_penalty(lengths, max_len=28, buffer=8, penalty=0.5)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5 / 8, -0.25, -0.5])
    # No buffer: only a response cut off at the cap is penalized.
    np.testing.assert_allclose(hooks.overlong_penalty(lengths, max_len=28, buffer=0), [0, 0, 0, 0, -1.0])


def test_shape_rewards_adds_the_penalty_to_the_verifier_reward():
    rewards, lengths = np.array([1.0, 1.0, -1.0]), np.array([10, 27, 28])
    got = hooks.shape_rewards("overlong", rewards, lengths, max_len=28, buffer=4, penalty=1.0)
    np.testing.assert_allclose(got, [1.0, 1.0 - 3 / 4, -2.0])
    np.testing.assert_array_equal(hooks.shape_rewards("none", rewards, lengths, max_len=28, buffer=4, penalty=1.0),
                                  rewards)
    with pytest.raises(ValueError, match="reward_shaping='typo'"):
        hooks.shape_rewards("typo", rewards, lengths, max_len=28, buffer=4, penalty=1.0)


def test_with_seq_rewards_places_each_reward_at_its_rows_last_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    rollout = Rollout(tokens=np.ones((3, 6), np.int32), attn_mask=np.ones((3, 6), bool), response_mask=mask,
                      rewards=np.zeros((3, 4), np.float32), seq_rewards=np.zeros(3, np.float32))
    out = with_seq_rewards(rollout, [0.5, -1.0, 2.0])
    want = np.zeros((3, 4), np.float32)
    want[0, 2], want[1, 0], want[2, 3] = 0.5, -1.0, 2.0
    np.testing.assert_array_equal(out.rewards, want)
    np.testing.assert_array_equal(out.rewards, place_rewards(out.seq_rewards, mask))


def test_keep_groups_mixed_keeps_groups_neither_all_right_nor_all_wrong():
    rewards = np.array([1, 1, 1, -1, -1, -1, -1, 1], np.float32)
    np.testing.assert_array_equal(hooks.keep_groups("mixed", rewards, 2), [False, True, False, True])
    np.testing.assert_array_equal(hooks.keep_groups("none", rewards, 2), [True] * 4)
    np.testing.assert_array_equal(hooks.keep_groups("mixed", rewards, 4), [True, True])


MIXED, SAME = [1.0, -1.0], [-1.0, -1.0]
ROUNDS = [[MIXED, SAME, SAME, MIXED], [SAME, MIXED, SAME, SAME], [MIXED, MIXED, SAME, SAME]]


def fake_round(k: int) -> Rollout:
    """Round k's rollout of 4 groups of 2: `tokens` [8, 3] names each row (round, row, 0), rewards from ROUNDS."""
    seq = np.asarray(ROUNDS[k], np.float32).reshape(-1)
    tokens = np.stack([np.full(8, k), np.arange(8), np.zeros(8)], axis=1).astype(np.int32)
    mask = np.ones((8, 2), np.float32)
    return Rollout(tokens=tokens, attn_mask=np.ones((8, 3), bool), response_mask=mask, rewards=place_rewards(seq, mask),
                   seq_rewards=seq)


def rows_of(rollout) -> list[tuple[int, int]]:
    return [(int(r), int(i)) for r, i, _ in rollout.tokens]


def test_sample_filtered_collects_kept_groups_in_sampling_order():
    calls = []
    first, train, m = sample_filtered(lambda k: calls.append(k) or fake_round(k), "mixed", 2, 3, slice(0, 8))
    assert calls == [0, 1, 2]  # 2 kept in round 0, 3 after round 1, 5 >= 4 after round 2
    assert rows_of(first) == rows_of(fake_round(0))
    assert rows_of(train) == [(0, 0), (0, 1), (0, 6), (0, 7), (1, 2), (1, 3), (2, 0), (2, 1)]
    np.testing.assert_array_equal(train.seq_rewards, MIXED * 4)
    np.testing.assert_array_equal(train.rewards, place_rewards(train.seq_rewards, train.response_mask))
    assert m == {"rollout/groups_kept_first_round": 0.5, "rollout/sampling_rounds": 3.0, "rollout/groups_filled": 0.0,
                 "rollout/sampled_tokens": 3 * 8 * 3.0}  # every round's real tokens: the step's throughput


def test_sample_filtered_fills_a_short_batch_with_rejected_groups_and_keeps_its_rows():
    _, train, m = sample_filtered(fake_round, "mixed", 2, 2, slice(0, 8))
    # 3 kept groups in 2 rounds; the 4th slot takes the first rejected group (round 0, group 1).
    assert rows_of(train) == [(0, 0), (0, 1), (0, 6), (0, 7), (1, 2), (1, 3), (0, 2), (0, 3)]
    assert m["rollout/sampling_rounds"] == 2.0 and m["rollout/groups_filled"] == 0.25
    assert m["rollout/sampled_tokens"] == 2 * 8 * 3.0
    _, local, _ = sample_filtered(fake_round, "mixed", 2, 2, slice(4, 8))  # a process holding rows 4..7
    assert rows_of(local) == rows_of(train)[4:]


def test_sample_filtered_off_samples_once():
    calls = []
    first, train, m = sample_filtered(lambda k: calls.append(k) or fake_round(k), "none", 2, 3, slice(0, 8))
    assert calls == [0] and train is first and m == {}
