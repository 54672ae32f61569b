"""RejectionSampler: greedy acceptance equals step-by-step greedy sampling (exact); sampling
preserves the target's distribution (statistical, fixed seed, stated tolerance).

Tolerance: with T trials a frequency's standard error is at most sqrt(0.25 / T); each
empirical frequency must lie within TOL of its target probability and the total variation
distance within TV_TOL. The draft distribution q is chosen far from p (TV(p, q) > 0.3), and
the test checks that the same statistic computed against q fails: the tolerance separates
"distributed as p" from "distributed as the draft".
"""

import pytest
import torch

from minipaged.sample import RejectionSampler, RowContext, Sampler, row_contexts
from minipaged.sampling_params import SamplingParams

V = 6
T = 20_000
TOL = 0.015  # >= 4 standard errors at T = 20000
TV_TOL = 0.02


def _req(params, output=(), prompt=(1,)):
    return RowContext(list(prompt), list(output), params, eos_token_id=None)


def _dists(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, V, generator=g) * 1.5  # p_1, p_2, p_3 (bonus)
    q_logits = torch.randn(2, V, generator=g) * 1.5  # q_1, q_2
    return logits, logits.softmax(-1), q_logits.softmax(-1)


def _freq(tokens):
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V).double() / max(len(tokens), 1)


def _close(freq, p, tol=TOL, tv_tol=TV_TOL):
    err = (freq - p.double()).abs()
    return float(err.max()) <= tol and 0.5 * float(err.sum()) <= tv_tol


def _run_draft_model_trials(params, logits, q):
    g = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(q[j], T, replacement=True, generator=g) for j in range(2)], 1)
    reqs = [_req(params)] * T
    target = logits.repeat(T, 1)  # [3T, V]: rows d1, d2, bonus per trial
    draft_probs = q.repeat(T, 1)  # [2T, V]
    outs = RejectionSampler()(target, drafts.tolist(), reqs, list(range(T)), draft_probs)
    return drafts.tolist(), outs


def test_draft_model_sampling_preserves_the_target_distribution():
    logits, p, q = _dists()
    assert 0.5 * float((p[0] - q[0]).abs().sum()) > 0.3, "q must be far from p for the test to mean anything"
    drafts, outs = _run_draft_model_trials(SamplingParams(temperature=1.0), logits, q)
    assert all(1 <= len(o) <= 3 for o in outs)
    first = _freq([o[0] for o in outs])
    assert _close(first, p[0]), (first, p[0])
    assert not _close(first, q[0]), "the statistic cannot tell p from q"
    # given d_1 accepted, the second token is distributed as p_2 (the rows are independent here)
    second = [o[1] for o, d in zip(outs, drafts) if len(o) >= 2]
    assert _close(_freq(second), p[1], tol=2 * TOL, tv_tol=2 * TV_TOL)
    # the first draft is accepted with probability sum_i min(p_i, q_i) (Leviathan et al., 3.3)
    accept_1 = sum(len(o) >= 2 for o in outs) / T
    assert abs(accept_1 - float(torch.minimum(p[0], q[0]).sum())) <= TOL
    # every accepted token is the draft itself
    for o, d in zip(outs, drafts):
        assert o[: len(o) - 1] == d[: len(o) - 1]


def test_bonus_token_follows_the_last_row():
    logits, p, _ = _dists()
    # the draft proposes p itself: every draft is accepted with probability 1 (min(1, p/p))
    q = p[:2].clone()
    drafts, outs = _run_draft_model_trials(SamplingParams(temperature=1.0), logits, q)
    assert all(len(o) == 3 for o in outs)
    assert _close(_freq([o[2] for o in outs]), p[2])


def test_ngram_sampling_preserves_the_target_distribution():
    logits, p, _ = _dists(seed=3)
    d = int(p[0].argmin())  # a poor one-hot draft: usually rejected
    reqs = [_req(SamplingParams(temperature=1.0))] * T
    target = logits[[0, 1]].repeat(T, 1)  # one draft + bonus row per trial
    outs = RejectionSampler()(target, [[d]] * T, reqs, list(range(T)))
    first = _freq([o[0] for o in outs])
    assert _close(first, p[0]), (first, p[0])
    accept = sum(len(o) == 2 for o in outs) / T  # q one-hot at d: accept with probability p(d)
    assert abs(accept - float(p[0, d])) <= TOL


def test_temperature_and_top_k_are_the_target_distribution():
    logits, _, q = _dists(seed=5)
    params = SamplingParams(temperature=0.7, top_k=3)
    x = logits / 0.7
    keep = x.topk(3, dim=-1).indices
    masked = torch.full_like(x, float("-inf")).scatter(-1, keep, x.gather(-1, keep))
    p = masked.softmax(-1)
    _, outs = _run_draft_model_trials(params, logits, q)
    first = _freq([o[0] for o in outs])
    assert float(first[p[0] == 0].sum()) == 0.0  # never outside the top 3
    assert _close(first, p[0])


def test_greedy_equals_sequential_greedy_sampling_with_penalties():
    g = torch.Generator().manual_seed(7)
    sampler = Sampler()
    for trial in range(30):
        m = trial % 4
        logits = torch.randn(m + 1, V, generator=g)
        params = SamplingParams(temperature=0.0, repetition_penalty=1.8, min_tokens=2)
        req = RowContext([1, 2], [3], params, eos_token_id=4)
        ref_argmax = [int(a) for a in logits.argmax(-1)]
        # half the trials draft the target's own raw argmax, half random tokens
        drafts = ref_argmax[:m] if trial % 2 else torch.randint(0, V, (m,), generator=g).tolist()
        (out,) = RejectionSampler()(logits, [drafts], [req], [0])
        # reference: the engine's Sampler, one row at a time, the drafts before it as output
        want = []
        for j, row in enumerate(row_contexts(req, drafts)):
            tok = int(sampler(logits[j : j + 1], [params], [0], [row])[0])
            want.append(tok)
            if j == m or tok != drafts[j]:
                break
        assert out == want, (trial, drafts, out, want)


def test_deterministic_and_independent_of_the_batch():
    logits, _, q = _dists()
    params = SamplingParams(temperature=1.0)
    reqs = [_req(params), _req(SamplingParams(temperature=0.0)), _req(params)]
    drafts = [[0, 1], [2], [3, 4]]
    target = torch.cat([logits, logits[[0, 2]], logits])  # 3 + 2 + 3 rows
    qs = torch.cat([q, q[:1], q])  # 2 + 1 + 2 rows
    rs = RejectionSampler()
    a = rs(target, drafts, reqs, [11, 12, 13], qs)
    assert a == rs(target, drafts, reqs, [11, 12, 13], qs)
    alone = rs(logits, [drafts[2]], [reqs[2]], [13], q)
    assert a[2] == alone[0]


def test_no_drafts_is_an_ordinary_decode():
    logits, p, _ = _dists()
    reqs = [_req(SamplingParams(temperature=0.0)), _req(SamplingParams(temperature=1.0))]
    out = RejectionSampler()(logits[:2], [[], []], reqs, [0, 1])
    assert out[0] == [int(logits[0].argmax())] and len(out[1]) == 1


def test_bad_shapes():
    logits, _, q = _dists()
    rs = RejectionSampler()
    req = _req(SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="target_logits"):
        rs(logits, [[0]], [req], [0])  # 3 rows for one draft
    with pytest.raises(ValueError, match="draft_probs"):
        rs(logits, [[0, 1]], [req], [0], q[:1])
    with pytest.raises(ValueError, match="seeds"):
        rs(logits, [[0, 1]], [req], [], q)
