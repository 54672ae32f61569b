"""``FlatLogprobs``: a completion's logprobs stored flat, read as vLLM's list of dicts.

A hand-checked example (the sampled token inside the top k, and outside it), slices and
negative indices as a list's, equality with the list of dicts, pickling; and the memory it
saves: no Python object per candidate (the unread-streams case of issue 37).
"""

from __future__ import annotations

import pickle

import pytest

from minipaged.engine.outputs import FlatLogprobs, Logprob
from minipaged.sample.logprobs import Logprobs

PIECES = {5: "a", 7: "b", 9: "c", 11: "d"}


def _flat(*entries) -> FlatLogprobs:
    flat = FlatLogprobs()
    for e in entries:
        flat.append_position(e, PIECES.get)
    return flat


def test_positions_read_as_vllms_dicts_sampled_token_first():
    inside = Logprobs(
        token_ids=[7, 5], logprobs=[-0.1, -2.0], sampled_token_id=5, sampled_logprob=-2.0, sampled_rank=2
    )
    outside = Logprobs(
        token_ids=[9, 7], logprobs=[-0.5, -1.0], sampled_token_id=11, sampled_logprob=-4.0, sampled_rank=6
    )
    flat = _flat(inside, outside)
    want = [
        {5: Logprob(-2.0, 2, "a"), 7: Logprob(-0.1, 1, "b")},  # k entries: the sampled one is in the top k
        {11: Logprob(-4.0, 6, "d"), 9: Logprob(-0.5, 1, "c"), 7: Logprob(-1.0, 2, "b")},  # k + 1
    ]
    assert len(flat) == 2 and flat == want and list(flat) == want
    assert [list(d) for d in flat] == [[5, 7], [11, 9, 7]]  # the sampled token first, as vLLM
    assert flat[-1] == want[1] and flat[1:] == want[1:] and flat[5:] == []
    with pytest.raises(IndexError):
        flat[2]
    assert pickle.loads(pickle.dumps(flat)) == want
    assert len(flat.token_ids) == len(flat.logprobs) == len(flat.ranks) == len(flat.decoded) == 5


def test_no_python_object_per_candidate():
    """480 tokens of 21 candidates: the numbers sit in 3 typed arrays (and one list of
    shared token texts), not in 10,080 ``Logprob`` objects."""
    entry = Logprobs(
        token_ids=list(range(20)),
        logprobs=[-1.0] * 20,
        sampled_token_id=99,
        sampled_logprob=-9.0,
        sampled_rank=40,
    )
    flat = _flat(*[entry] * 480)
    assert len(flat) == 480 and len(flat.token_ids) == 480 * 21
    assert {type(a).__name__ for a in (flat.start, flat.token_ids, flat.logprobs, flat.ranks)} == {"array"}
    assert flat[479][99] == Logprob(-9.0, 40, None) and flat[0][3] == Logprob(-1.0, 4, None)
