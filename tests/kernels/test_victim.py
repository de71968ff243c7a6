"""The victim of a full bucket (``index_numba.victim``) against its definition, by brute force.

The fused lookup and the staged one share this kernel, so their property tests cannot tell a
wrong victim from a right one: here every bucket is checked against a plain Python reading of
the rule, "the lowest score among the slots no lookup holds, the first such slot on ties",
with scores that tie, that are negative or too large for the LRU path's packed minimum, and
pins of every kind.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.kernels.index_numba import (
    _MAX_SCORE, P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION, P_STEP, PIN_CACHED, PIN_FREE, PIN_HELD,
    PIN_LOCKED, victim,
)

POLICIES = [P_LRU, P_LFU, P_STEP, P_CUSTOM, P_NO_EVICTION]
PINS = [PIN_FREE] * 4 + [PIN_HELD, PIN_CACHED, PIN_LOCKED, PIN_LOCKED - 3]  # mostly free
SCORES = st.one_of(st.integers(0, 6), st.integers(-3, 3), st.integers(2**55, 2**57),
                   st.sampled_from([-(2**63), 2**63 - 1, 2**56 - 1, 2**56]))


def expected(scores: list[int], pins: list[int], base: int, policy: int,
             score: int) -> tuple[int, int]:
    if policy == P_NO_EVICTION:
        return -1, _MAX_SCORE
    free = [j for j, p in enumerate(pins) if p == PIN_FREE]
    if not free:
        return -1, _MAX_SCORE
    lowest = min(scores[j] for j in free)
    first = next(j for j in free if scores[j] == lowest)
    if policy == P_CUSTOM and score < lowest:
        return -1, lowest
    return base + first, lowest


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([1, 2, 8, 32, 128]), st.data(), st.sampled_from(POLICIES),
       st.integers(0, 8), st.integers(-2, 8))
def test_the_victim_is_the_first_lowest_unpinned_slot(width, data, policy, step, score):
    scores = data.draw(st.lists(SCORES, min_size=width, max_size=width))
    pins = data.draw(st.lists(st.sampled_from(PINS), min_size=width, max_size=width))
    base = width  # the second of two buckets: the first one holds other scores
    iscores = np.array([7] * width + scores, np.int64)
    ipins = np.array([PIN_FREE] * width + pins, np.int32)
    got = victim(iscores, ipins, base, width, policy, step, score)
    assert tuple(int(x) for x in got) == expected(scores, pins, base, policy, score)


def test_under_lru_a_slot_pinned_at_the_lowest_score_is_passed_over():
    """The LRU fast path's first candidate is pinned: the next slot of that score is taken, not
    the pinned one and not a later slot of a higher score."""
    iscores = np.array([5, 3, 9, 3, 3, 4, 8, 3], np.int64)
    ipins = np.array([PIN_FREE, PIN_CACHED, PIN_FREE, PIN_HELD, PIN_FREE, PIN_FREE, PIN_FREE,
                      PIN_FREE], np.int32)
    assert tuple(victim(iscores, ipins, 0, 8, P_LRU, 10, 10)) == (4, 3)
    ipins[4] = ipins[7] = PIN_LOCKED  # every slot of score 3 held: the next lowest
    assert tuple(victim(iscores, ipins, 0, 8, P_LRU, 10, 10)) == (5, 4)


def test_scores_too_large_for_the_packed_minimum_do_not_win():
    """Under LRU the fast path packs score·width + slot into an int64: a score of 2**56 or more
    (width 128) would wrap to a negative number and look lowest, as would the most negative
    scores; such a bucket takes the plain scans. Several slots hold it in turn, in buckets of
    128 and narrower ones (which pack larger scores)."""
    for width, low, at in ((128, 70, range(40, 48)), (4, 1, (0, 2, 3)), (2, 0, (1,))):
        for pos in at:
            for huge in (2**56, 2**57 + 5, 2**63 - 1, -(2**63)):
                if width < 128 and 0 <= huge < 2**62:
                    huge = 2**62  # (a narrower bucket packs larger scores)
                iscores = np.full(width, 9, np.int64)
                iscores[pos] = huge
                iscores[low] = 4
                ipins = np.full(width, PIN_FREE, np.int32)
                want = (pos, huge) if huge < 0 else (low, 4)
                got = victim(iscores, ipins, 0, width, P_LRU, 10, 10)
                assert tuple(int(x) for x in got) == want


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([8, 16, 64, 128]), st.data(), st.integers(0, 30))
def test_lru_scores_that_pack_take_the_packed_minimum(width, data, step):
    """Steps as scores (what LRU writes): every bucket takes the packed pass, which must give
    the first lowest slot, wherever in the bucket it is."""
    scores = data.draw(st.lists(st.integers(0, 30), min_size=width, max_size=width))
    pins = data.draw(st.lists(st.sampled_from(PINS), min_size=width, max_size=width))
    iscores = np.array([7] * width + scores, np.int64)
    ipins = np.array([PIN_FREE] * width + pins, np.int32)
    got = victim(iscores, ipins, width, width, P_LRU, step, step)
    assert tuple(int(x) for x in got) == expected(scores, pins, width, P_LRU, step)


def test_every_slot_of_a_bucket_can_be_the_victim():
    """Slot j alone lowest, then tied with every later slot: j is taken, for each j (the
    packed pass's slot number, and its order on ties)."""
    for width in (8, 128):
        ipins = np.full(width, PIN_FREE, np.int32)
        for j in range(width):
            iscores = np.full(width, 9, np.int64)
            iscores[j] = 2
            assert tuple(int(x) for x in victim(iscores, ipins, 0, width, P_LRU, 10, 10)) == (j, 2)
            iscores[j:] = 2
            assert tuple(int(x) for x in victim(iscores, ipins, 0, width, P_LRU, 10, 10)) == (j, 2)
