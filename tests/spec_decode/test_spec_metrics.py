"""SpecDecodeStats: drafts proposed and accepted, summed over steps (spec_decode/metrics.py)."""

import pytest

from minipaged.spec_decode import SpecDecodeStats


def test_stats():
    s = SpecDecodeStats()
    s.observe(3, 2)
    s.observe(3, 0)
    s.observe(0, 0)  # no drafts: not a verification
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 2)
    assert s.accepted_per_position == [1, 1, 0]
    assert s.acceptance_rate == pytest.approx(2 / 6)
    assert s.mean_acceptance_length == pytest.approx(2.0)
