"""NgramProposer against a brute-force reference (every n-gram length, every position)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.spec_decode import NgramProposer


def brute_force(tokens, min_n, max_n, k, max_model_len=None):
    """The longest n in [min_n, max_n] whose suffix n-gram occurs earlier (followed by at
    least one token); its earliest occurrence; the <= k tokens after it."""
    if max_model_len is not None:
        k = min(k, max_model_len - len(tokens))
    if k <= 0:
        return []
    best = None  # (n, start)
    for n in range(min_n, max_n + 1):
        if n >= len(tokens):
            break
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            best = (n, starts[0])
    if best is None:
        return []
    n, s = best
    return tokens[s + n : s + n + k]


def test_vllm_docstring_example():
    assert NgramProposer(2, 3, 4).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_hand_examples():
    p = NgramProposer(1, 3, 2)
    assert p.propose([5, 6, 7, 5, 6]) == [7, 5]  # [5, 6] found at 0
    assert p.propose([1, 2, 3]) == []  # nothing repeats
    assert p.propose([9]) == []  # too short to match
    assert p.propose([4, 4, 4, 4]) == [4]  # [4, 4, 4] at 0: only one token follows it
    # the earliest occurrence wins over a later one of the same length
    assert NgramProposer(2, 2, 1).propose([1, 2, 8, 1, 2, 9, 1, 2]) == [8]
    # the longest n wins over an earlier shorter match
    assert NgramProposer(1, 2, 1).propose([3, 7, 1, 3, 5, 1, 3]) == [5]


def test_caps():
    p = NgramProposer(1, 2, 5, max_model_len=7)
    assert p.propose([1, 2, 3, 1, 2]) == [3, 1]  # two positions left before max_model_len
    assert NgramProposer(1, 2, 5).propose([1, 2, 3, 1, 2], max_num_drafts=1) == [3]
    assert NgramProposer(1, 2, 5).propose([1, 2, 3, 1, 2], max_num_drafts=0) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 5),
)
def test_matches_brute_force(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert NgramProposer(min_n, max_n, k).propose(tokens) == brute_force(tokens, min_n, max_n, k)


@pytest.mark.parametrize("args", [(0, 2, 1), (3, 2, 1), (1, 2, 0), (1, True, 1)])
def test_bad_bounds(args):
    with pytest.raises(ValueError, match="prompt_lookup|num_speculative_tokens"):
        NgramProposer(*args)
