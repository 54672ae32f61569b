"""Sampler: greedy, temperature, top-k, top-p, per-row seeds (minipaged/sample/sampler.py)."""

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import SamplingParams
from minipaged.sample.sampler import (
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


# -- issue 30: batched logprobs, and no NaN from numbers at float32's edges ------------------
class _Req:
    def __init__(self, params, prompt=(1, 2), out=()):
        self.sampling_params = params
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(out)
        self.eos_token_id = None


def test_batched_logprobs_equal_a_per_row_reference():
    """One top-k over the batch: each row's top k, sampled logprob and rank equal a per-row
    log-softmax computed on its own, whatever the other rows' k."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g)
    ks = [None, 0, 3, 7, None]
    reqs = [_Req(SamplingParams(temperature=0.0 if i % 2 else 1.0, logprobs=k)) for i, k in enumerate(ks)]
    tokens, out = Sampler().sample(logits, reqs, seeds=[11, 12, 13, 14, 15])
    for i, k in enumerate(ks):
        if k is None:
            assert out[i] is None
            continue
        lp = torch.log_softmax(logits[i].double(), dim=-1)
        order = sorted(range(40), key=lambda t: -float(lp[t]))
        assert out[i].token_ids == order[:k]
        assert out[i].logprobs == pytest.approx([float(lp[t]) for t in order[:k]], abs=1e-5)
        assert out[i].sampled_token_id == tokens[i]
        assert out[i].sampled_logprob == pytest.approx(float(lp[tokens[i]]), abs=1e-5)
        assert out[i].sampled_rank == order.index(tokens[i]) + 1


def test_a_top_p_that_is_zero_in_float32_keeps_the_top_token():
    """vLLM keeps at least one token: top_p=1e-320 (0.0 in float32) samples greedily."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 30, generator=g)
    params = [SamplingParams(temperature=1.0, top_p=1e-320)] * 4
    got = Sampler()(logits, params, seeds=[1, 2, 3, 4])
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_a_huge_top_k_is_clamped_before_it_becomes_a_tensor():
    params = SamplingParams(temperature=1.0)
    params.top_k = 2**63  # past validation (verify_sampling_params refuses it): no overflow here
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(5))
    got = Sampler()(logits, [params, params], seeds=[1, 2])
    want = Sampler()(logits, [SamplingParams(temperature=1.0)] * 2, seeds=[1, 2])
    assert got.tolist() == want.tolist()


def test_overflowing_logits_never_give_nan_probabilities():
    """A logit of +inf (a tiny repetition penalty, a tiny temperature) is the row's top
    token; NaN is never sampled; the row's token is a real one."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(6))
    logits[0, 7] = float("inf")
    logits[1, :] = float("nan")
    logits[1, 4] = 1.0
    params = [SamplingParams(temperature=1.0)] * 3
    got = Sampler()(logits, params, seeds=[1, 2, 3]).tolist()
    assert got[0] == 7 and got[1] == 4 and 0 <= got[2] < 20
    rp = SamplingParams(temperature=1.0, repetition_penalty=2e-38)  # 5 / 2e-38 overflows float32
    row = torch.full((1, 20), -1.0)
    row[0, 2] = 5.0
    assert Sampler()(row, [rp], seeds=[9], reqs=[_Req(rp, prompt=[2])]).tolist() == [2]
