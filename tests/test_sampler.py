"""Sampler: greedy, temperature, top-k, top-p, per-row seeds (minipaged/engine/sampler.py)."""

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import SamplingParams
from minipaged.engine.sampler import (
    Sampler,
    apply_top_k_top_p,
    derive_seed,
    request_base_seed,
    sample_seed,
)


def _ref_keep_mask(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Independent reference: which vocabulary entries survive top-k then top-p (a loop)."""
    V = row.numel()
    order = sorted(range(V), key=lambda i: (-float(row[i]), i))
    kept = order[: (k if k > 0 else V)]
    vals = torch.tensor([float(row[i]) for i in kept])
    probs = torch.softmax(vals, dim=0).tolist()
    keep, mass = [], 0.0
    for i, pr in zip(kept, probs):
        if mass >= p and keep:
            break
        keep.append(i)
        mass += pr
    mask = torch.zeros(V, dtype=torch.bool)
    mask[keep] = True
    return mask


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=0.0)] * 6
    out = Sampler()(logits, params, [1, 2, 3, 4, 5, 6])
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    params = [SamplingParams(temperature=0.8, top_k=1)] * 2 + [
        SamplingParams(temperature=1.3, top_p=1e-6)
    ] * 2
    out = Sampler()(logits, params, [11, 12, 13, 14])
    assert out.tolist() == logits.argmax(-1).tolist()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    V=st.integers(2, 40),
    k=st.integers(0, 45),
    p=st.floats(0.01, 1.0),
)
def test_top_k_top_p_mask_matches_loop_reference(seed, V, k, p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, V, generator=g) * 3
    masked = apply_top_k_top_p(logits, torch.tensor([k]), torch.tensor([p]))
    got = torch.isfinite(masked[0])
    want = _ref_keep_mask(logits[0], min(k, V), p)
    assert got.tolist() == want.tolist()
    assert torch.equal(masked[0][got], logits[0][got])  # kept logits untouched


def test_samples_stay_in_top_k_and_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sampler = Sampler()
    counts = torch.zeros(6)
    n = 3000
    params = [SamplingParams(temperature=1.0)]
    for s in range(n):
        counts[int(sampler(logits, params, [derive_seed("t", s)])[0])] += 1
    want = torch.softmax(logits[0], 0)
    assert (counts / n - want).abs().max() < 0.03
    # top-k = 2: only the two largest ever appear
    params = [SamplingParams(temperature=1.0, top_k=2)]
    seen = {int(sampler(logits, params, [derive_seed("k", s)])[0]) for s in range(300)}
    assert seen == {0, 1}


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0, -0.5]])
    sampler = Sampler()

    def freq0(t):
        ps = [SamplingParams(temperature=t)]
        return sum(int(sampler(logits, ps, [derive_seed(t, s)])[0]) == 0 for s in range(800)) / 800

    assert freq0(0.2) > freq0(1.0) > freq0(5.0)


def test_a_row_does_not_depend_on_its_batch_mates():
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, 100, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    alone = Sampler()(row, [p], [42])
    for trial in range(5):
        others = torch.randn(trial + 2, 100, generator=g)
        batch = torch.cat([others[: trial + 1], row, others[trial + 1 :]])
        params = [SamplingParams(temperature=0.7, top_k=5)] * batch.shape[0]
        params[trial + 1] = p
        seeds = [trial * 10 + j for j in range(batch.shape[0])]
        seeds[trial + 1] = 42
        assert int(Sampler()(batch, params, seeds)[trial + 1]) == int(alone[0])


def test_seeds_are_sha256_and_stable():
    want = int.from_bytes(hashlib.sha256(b"a:1:2").digest()[:8], "little") & ((1 << 63) - 1)
    assert derive_seed("a", 1, 2) == want
    p = SamplingParams(seed=7)
    # an explicit seed ignores engine seed and request id
    assert request_base_seed(p, 0, "x") == request_base_seed(p, 5, "y")
    q = SamplingParams()
    assert request_base_seed(q, 0, "x") != request_base_seed(q, 0, "y")
    assert request_base_seed(q, 0, "x", 0) != request_base_seed(q, 0, "x", 1)
    assert sample_seed(123, 0) != sample_seed(123, 1)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [1, 2])
