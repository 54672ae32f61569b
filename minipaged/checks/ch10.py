"""Checkers for chapter 10 exercises: speculative decoding on a paged KV cache.

Exercises (notebooks/exercises/ch10_speculative_decoding.ipynb)
    ex10.1 ``greedy_verify(drafts, target_argmax)``: greedy verification (vLLM v1's
           ``RejectionSampler`` at temperature 0): accept while the draft is the argmax.
    ex10.2 ``rejection_sample(drafts, p, q, gen)``: the rejection rule of Leviathan et al.
           (``RejectionSampler._random``), judged statistically: over thousands of seeded
           trials per case, the distribution of the returned token sequences must be the
           exact one the rule implies (total variation distance under a stated bound) and
           no impossible sequence may appear.
    ex10.3 ``predict_spec_steps()`` -> per step ``{"scheduled", "lookahead", "blocks",
           "computed"}`` of one request decoded with a draft model on the v1 scheduler (a
           prediction, worked on paper; one workload per student).
    ex10.4 ``best_k(acceptance_rate, step_cost)``: the number of drafts that maximises
           tokens per unit of time (measure: the check prints the choice on the cost model).
    ex10.5 ``concept_answers()``: questions with a number or a choice (the instructor's key).

Each exercise is a spec (``minipaged.checks._spec``). ex10.2's ``observe`` runs the student's
sampler in the student's kernel on the case's distributions and returns only counts (which
token sequence came back how often, and the first malformed return); the trusted side
computes the exact distribution of the rule from the case and applies the bound
(``judge_rejection``). ex10.3 is judged against the v1 ``Scheduler`` run with scripted
acceptances on the trusted side; its messages name the first wrong step, never the answer.

Failure mode: the student's code raising becomes data (the message shows it); a return that
is not plain data of the stated shape is wrong.
"""

from __future__ import annotations

import math
import operator

from minipaged.checks._spec import Spec, attempt, concept_spec, register, set_answered_by
from minipaged.core import Request, Scheduler
from minipaged.core.sched.request import get_max_num_kv_tokens
from minipaged.sample.rejection_sampler import RejectionSampler
from minipaged.sampling_params import SamplingParams

SPECS: dict = {}


# -- ex10.1: greedy verification ------------------------------------------------------------


def _greedy_cases(rng):
    cases = [([], [3]), ([1], [1, 2]), ([1], [2, 2]), ([4, 4], [4, 4, 0])]
    for _ in range(200):
        vocab = rng.randint(2, 6)
        m = rng.randint(0, 5)
        drafts = [rng.randrange(vocab) for _ in range(m)]
        agree = rng.randint(0, m)
        target = drafts[:agree] + [rng.randrange(vocab) for _ in range(m + 1 - agree)]
        cases.append((drafts, target))
    # a caller's bug: target_argmax must have one row per draft plus the bonus row
    return cases + [([1, 2], [1, 2]), ([3], [3, 1, 0]), ([], [])]


def ref_greedy_verify(drafts, target_argmax) -> list[int]:
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target rows, got {len(target_argmax)}")
    return RejectionSampler._greedy(list(drafts), list(target_argmax))


register(
    SPECS,
    Spec(
        "ex10.1",
        "greedy verification: accept while the draft is the argmax",
        "greedy_verify(drafts, target_argmax)",
        cases=_greedy_cases,
        observe=lambda c, fn: attempt(lambda: fn(list(c[0]), list(c[1]))),
        reference=lambda: (ref_greedy_verify,),
        describe=lambda c: f"greedy_verify(drafts={c[0]}, target_argmax={c[1]})",
        size=lambda c: (len(c[1]), len(c[0])),
    ),
)


# -- ex10.2: the rejection sampler, judged by its distribution ------------------------------

REJECTION_TRIALS = 3000  # trials per case
REJECTION_DELTA = 1e-7  # a correct sampler fails a case with a probability below this


def _distribution(rng, vocab: int, zero: bool) -> list[float]:
    weights = [rng.randint(1, 9) for _ in range(vocab)]
    if zero:
        weights[rng.randrange(vocab)] = 0
    total = sum(weights)
    return [w / total for w in weights]


def _tv(a: list[float], b: list[float]) -> float:
    return 0.5 * sum(abs(x - y) for x, y in zip(a, b))


def _rejection_case(rng, m: int, one_hot: bool) -> dict:
    """Distributions far enough apart that the rule's parts show: every draft row far from its
    target row (the residual matters), the bonus row far from the row before it, and each
    draft accepted often enough that the later positions are reached."""
    while True:
        vocab = rng.randint(3, 4)
        p = [_distribution(rng, vocab, rng.random() < 0.3) for _ in range(m + 1)]
        if m and _tv(p[m], p[m - 1]) < 0.3:
            continue
        if one_hot:
            drafts = [rng.randrange(vocab) for _ in range(m)]
            if all(0.3 <= p[j][drafts[j]] <= 0.8 for j in range(m)):
                return {"p": p, "q": None, "drafts": drafts, "seed": rng.randrange(2**31)}
            continue
        q = [_distribution(rng, vocab, rng.random() < 0.4) for _ in range(m)]
        if all(_tv(p[j], q[j]) >= 0.3 and 1 - _tv(p[j], q[j]) >= 0.3 for j in range(m)):
            return {"p": p, "q": q, "drafts": None, "seed": rng.randrange(2**31)}


def _rejection_cases(rng):
    return [
        _rejection_case(rng, 0, False),  # no drafts: the bonus token alone
        _rejection_case(rng, 1, True),  # an n-gram draft: q one-hot at the draft
        _rejection_case(rng, 1, False),
        _rejection_case(rng, 2, False),
    ]


def _as_token(t, vocab: int):
    if type(t) is bool:
        return None
    try:
        i = operator.index(t)
    except TypeError:
        return None
    return i if 0 <= i < vocab else None


def _well_formed(out, drafts: list[int], vocab: int) -> tuple | None:
    """``out`` as a tuple of ints when it is drafts[:a] + [one token], else None."""
    if type(out) not in (list, tuple) or not 1 <= len(out) <= len(drafts) + 1:
        return None
    toks = [_as_token(t, vocab) for t in out]
    if any(t is None for t in toks) or toks[:-1] != list(drafts[: len(toks) - 1]):
        return None
    return tuple(toks)


def observe_rejection(case, fn) -> dict:
    """Run the student's sampler ``REJECTION_TRIALS`` times: drafts drawn from ``q`` (or the
    case's fixed n-gram drafts), one generator for the sampler's own draws. Only counts come back."""
    import torch

    p = torch.tensor(case["p"], dtype=torch.float32)  # [m + 1, V]
    m, vocab = p.shape[0] - 1, p.shape[1]
    q = (
        None if case["q"] is None else torch.tensor(case["q"], dtype=torch.float32).reshape(m, vocab)
    )  # [m, V]
    n = REJECTION_TRIALS
    if q is None:
        all_drafts = [list(case["drafts"])] * n
    else:
        g = torch.Generator().manual_seed(case["seed"])
        cols = [torch.multinomial(q[j], n, replacement=True, generator=g).tolist() for j in range(m)]
        all_drafts = [list(d) for d in zip(*cols)] if m else [[]] * n
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    counts: dict = {}
    malformed, num_malformed = None, 0
    for drafts in all_drafts:
        out = fn(list(drafts), p.clone(), None if q is None else q.clone(), gen)
        toks = _well_formed(out, drafts, vocab)
        if toks is None:
            num_malformed += 1
            if malformed is None:
                malformed = {"drafts": list(drafts), "returned": repr(out)[:200]}
            continue
        key = ",".join(map(str, toks))
        counts[key] = counts.get(key, 0) + 1
    return {"counts": counts, "num_malformed": num_malformed, "malformed": malformed}


def outcome_probs(p: list, q, drafts) -> dict:
    """The exact probability of each returned sequence under the rule (``q`` None: one-hot at
    ``drafts``): accepted drafts t_0..t_{a-1} each with probability min(p_j, q_j)(t_j), then a
    recovered token with max(0, p_a - q_a)(t), or (a == m) the bonus token with p_m(t)."""
    m, vocab = len(p) - 1, len(p[0])
    if q is None:
        q = [[1.0 if t == drafts[j] else 0.0 for t in range(vocab)] for j in range(m)]
    probs: dict = {}

    def walk(prefix: tuple, j: int, mass: float) -> None:
        if j == m:
            for t in range(vocab):
                if p[m][t] > 0:
                    probs[prefix + (t,)] = probs.get(prefix + (t,), 0.0) + mass * p[m][t]
            return
        for t in range(vocab):
            rejected = max(0.0, p[j][t] - q[j][t])
            if rejected > 0:
                probs[prefix + (t,)] = probs.get(prefix + (t,), 0.0) + mass * rejected
            accepted = min(p[j][t], q[j][t])
            if accepted > 0:
                walk(prefix + (t,), j + 1, mass * accepted)

    walk((), 0, 1.0)
    return {",".join(map(str, k)): v for k, v in probs.items()}


def tv_bound(probs: dict, n: int, delta: float = REJECTION_DELTA) -> float:
    """A bound the total variation distance of ``n`` draws from ``probs`` exceeds with
    probability below ``delta``: its mean (at most sum sqrt(p(1-p)/n) / 2) plus McDiarmid's
    sqrt(ln(1/delta) / 2n) (one draw moves the distance by at most 1/n)."""
    mean = 0.5 * sum(math.sqrt(x * (1 - x) / n) for x in probs.values())
    return mean + math.sqrt(math.log(1 / delta) / (2 * n))


def _describe_rejection(case) -> str:
    p, q = case["p"], case["q"]
    rows = lambda rs: "[" + ", ".join("[" + ", ".join(f"{x:.3f}" for x in r) + "]" for r in rs) + "]"  # noqa: E731
    m = len(p) - 1
    where = (
        f"drafts={case['drafts']} (n-gram: q=None, one-hot at each draft)"
        if q is None
        else f"q={rows(q)} (each draft d_j drawn from q[j])"
        if m
        else "no drafts (q is a [0, V] tensor)"
    )
    return f"p={rows(p)}, {where}; {REJECTION_TRIALS} trials"


def _seq(key: str, m: int) -> str:
    """A returned sequence and what it means under the rule."""
    toks = [int(x) for x in key.split(",")]
    a = len(toks) - 1
    if a == m:
        lead = "" if m == 0 else "the draft accepted, then " if m == 1 else f"all {m} drafts accepted, then "
        what = f"{lead}bonus token {toks[-1]}"
    else:
        what = f"{a} draft{'' if a == 1 else 's'} accepted, then {toks[-1]} drawn in place of draft {a + 1}"
    return f"{toks} ({what})"


def judge_rejection(cases, expected, got) -> str | None:
    """Per case (fewest drafts first): every return well formed, no sequence the rule cannot
    produce, then the total variation distance to the rule's exact distribution under
    ``tv_bound``."""
    n = REJECTION_TRIALS
    order = sorted(range(len(cases)), key=lambda i: (len(cases[i]["p"]), i))
    for pos, i in enumerate(order):
        head = f"ex10.2 failed on case {pos + 1} of {len(cases)} (cases run smallest first):\n    {_describe_rejection(cases[i])}"
        rec = got[i]
        if "raised" in rec:
            return f"{head}\n  your code raised {rec['raised']}: {rec.get('_message', '')}"
        v = rec.get("value")
        counts = v.get("counts") if type(v) is dict else None
        if type(counts) is not dict or any(type(c) is not int or c < 0 for c in counts.values()):
            return f"{head}\n  the results of your sampler did not come back as counts"
        if v.get("num_malformed"):
            bad = v.get("malformed") or {}
            return (
                f"{head}\n  on drafts {bad.get('drafts')} your function returned {bad.get('returned')}: "
                "return a list of Python ints, the accepted drafts d_1..d_a and then one more token "
                f"(1 to m + 1 tokens) ({v['num_malformed']} of {n} returns were not of that form)"
            )
        if sum(counts.values()) != n:
            return f"{head}\n  the counts add up to {sum(counts.values())}, not {n} trials"
        exact = expected[i]["value"]
        m = len(cases[i]["p"]) - 1
        impossible = sorted((k for k in counts if exact.get(k, 0.0) <= 0.0), key=lambda k: -counts[k])
        if impossible:
            k = impossible[0]
            return (
                f"{head}\n  your sampler returned {_seq(k, m)} ({counts[k]} of {n} times), which the rule "
                "never returns: an accepted draft needs min(p, q) > 0 at it, a recovered token "
                "max(0, p - q) > 0, a bonus token p > 0"
            )
        tv = 0.5 * sum(abs(counts.get(k, 0) / n - x) for k, x in exact.items())
        bound = tv_bound(exact, n)
        if tv > bound:
            worst = max(exact, key=lambda k: abs(counts.get(k, 0) / n - exact[k]))
            return (
                f"{head}\n  the sequences your sampler returns are not distributed as the rule's: "
                f"total variation distance {tv:.3f} over {n} trials, a correct sampler stays under "
                f"{bound:.3f} (it goes over with probability below {REJECTION_DELTA:g}); the largest gap: "
                f"{_seq(worst, m)} has probability {exact[worst]:.3f}, yours came {counts.get(worst, 0) / n:.3f}"
            )
    return None


register(
    SPECS,
    Spec(
        "ex10.2",
        "the rejection sampler, judged by its output distribution",
        "rejection_sample(drafts, p, q, gen)",
        cases=_rejection_cases,
        observe=observe_rejection,
        expected=lambda c, key: outcome_probs(c["p"], c["q"], c["drafts"]),
        describe=_describe_rejection,
        verdict=judge_rejection,
    ),
)


# -- ex10.3: predict the block table of a speculative request (one workload per student) ----

# one request decoded with a draft model of k drafts (k lookahead slots) on the v1 scheduler
SPEC_KNOBS = {"block_size": 4, "num_blocks": 32, "max_num_batched_tokens": 64, "k": 3}
# (request id, prompt tokens, max_tokens, accepted drafts at each verification step, in order)
SPEC_REQUESTS = [("A", 6, 10, (2, 0, 3, 1))]
_SPEC_MAX_STEPS = 7


def reference_spec_steps(requests=SPEC_REQUESTS, knobs=SPEC_KNOBS) -> list[dict]:
    """Per step of the v1 ``Scheduler``: tokens scheduled, lookahead slots, blocks in the
    table during the step, ``num_computed_tokens`` after it. The draft model proposes ``k``
    drafts after every step; verification step ``i`` accepts ``accepted[i]`` of them (at most
    the drafts it scheduled)."""
    ((rid, prompt, max_tokens, accepted),) = requests
    k = knobs["k"]
    sched = Scheduler(
        knobs["num_blocks"],
        knobs["block_size"],
        max_num_batched_tokens=knobs["max_num_batched_tokens"],
        num_lookahead_tokens=k,
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    r = Request(rid, list(range(100, 100 + prompt)), sampling_params=params)
    sched.add_request(r)
    steps, verified = [], 0
    while sched.has_unfinished_requests():
        if len(steps) > 50:
            raise RuntimeError("checker bug: the speculative run does not end")
        out = sched.schedule()
        ((_, n),) = out.scheduled
        # the slots reserved past the step's tokens (the scheduler's rule: k, capped by the
        # request's last possible token), read before the step advances the request
        lookahead = min(k, get_max_num_kv_tokens(r) - r.num_computed_tokens - n)
        blocks = len(sched.kv_cache_manager.block_tables[rid].blocks)
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        if drafts:
            a = min(accepted[verified] if verified < len(accepted) else 0, len(drafts))
            verified += 1
            sampled = list(drafts[:a]) + [7]
        else:
            sampled = 7
        sched.update_from_output(out, {rid: sampled})
        steps.append(
            {"scheduled": n, "lookahead": lookahead, "blocks": blocks, "computed": r.num_computed_tokens}
        )
        sched.update_draft_token_ids({rid: [7] * k})
    return steps


def spec_request_row(request) -> str:
    rid, prompt, max_tokens, accepted = request
    return f"| {rid} | {prompt} | {max_tokens} | {', '.join(str(a) for a in accepted)} |"


def spec_requests_variant(rng) -> list:
    """One request drawn by ``rng`` whose run takes 4 to ``_SPEC_MAX_STEPS`` steps and
    verifies drafts at least three times."""
    while True:
        accepted = tuple(rng.randint(0, SPEC_KNOBS["k"]) for _ in range(5))
        requests = [("A", rng.randint(2, 9), rng.randint(6, 12), accepted)]
        steps = reference_spec_steps(requests)
        if 4 <= len(steps) <= _SPEC_MAX_STEPS and sum(s["scheduled"] > 1 for s in steps[1:]) >= 3:
            return requests


def _spec_prediction_cases(rng):
    # NOTE: rng is None for the shipped notebook (the request of its setup cell); a student
    # copy made with --seed gets the request its seed draws, written into its setup cell
    return [SPEC_REQUESTS if rng is None else spec_requests_variant(rng)]


register(
    SPECS,
    Spec(
        "ex10.3",
        "predict a speculative request's slots and blocks, step by step",
        "predict_spec_steps()",
        cases=_spec_prediction_cases,
        observe=lambda case, fn: fn(),
        expected=lambda case, key: reference_spec_steps([tuple(r) for r in case]),
        describe=lambda c: (
            f"predict_spec_steps() for SPEC_REQUESTS = {[tuple(r) for r in c]} (id, prompt, max_tokens, "
            f"accepted drafts per verification) on SPEC_KNOBS = {SPEC_KNOBS}; [i] is step i"
        ),
        kind="prediction",
    ),
)
VARIANTS = {
    "ex10.3": (
        "SPEC_REQUESTS",
        spec_request_row,
        "| request | prompt tokens | max_tokens | accepted drafts at each verification step |\n|---|---|---|---|",
    )
}


# -- ex10.4: how many drafts pay (measure) ------------------------------------------------


def ref_tokens_per_step(acceptance_rate: float, k: int) -> float:
    a = acceptance_rate
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def ref_best_k(acceptance_rate: float, step_cost: list) -> int:
    """The k (0 = no speculation) with the most tokens per unit of time; the smallest on a tie."""
    if not (type(acceptance_rate) in (int, float) and 0.0 <= acceptance_rate <= 1.0):
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate!r}")
    if not step_cost or any(not (type(c) in (int, float) and c > 0) for c in step_cost):
        raise ValueError(f"step_cost must be a non-empty list of positive costs, got {step_cost!r}")
    rates = [ref_tokens_per_step(acceptance_rate, k) / c for k, c in enumerate(step_cost)]
    best = max(rates)
    return next(k for k, r in enumerate(rates) if r >= best * (1 - 1e-12))


def _best_k_cases(rng):
    cases = [(0.0, [1.0, 1.1]), (1.0, [1.0, 1.0, 1.0]), (0.5, [2.0]), (0.9, [1.0, 1.2, 1.5, 1.9])]
    while len(cases) < 150:
        a = rng.choice([0.0, 1.0, round(rng.random(), 3), round(rng.random(), 3)])
        cost, c = [], round(rng.uniform(0.5, 2.0), 3)
        for _ in range(rng.randint(1, 9)):
            cost.append(c)
            c = round(c * rng.uniform(1.0, 1.6), 3)
        rates = sorted((ref_tokens_per_step(a, k) / x for k, x in enumerate(cost)), reverse=True)
        if len(rates) > 1 and rates[0] != rates[1] and rates[1] > rates[0] * (1 - 1e-6):
            continue  # a near tie: an honest float rounding could pick either
        cases.append((a, cost))
    return cases + [(1.5, [1.0]), (-0.1, [1.0]), (0.5, []), (0.5, [1.0, 0.0])]


def _speedup_costs() -> dict:
    """Relative step costs of Llama-2-7B on an H200 at context 512 (the chapter's cost model):
    ``{batch: [cost of a step verifying k drafts per request, k = 0..8]}``, k = 0 a plain decode."""
    from minipaged.sim.cost_model import H200, LLAMA_7B, CostModel

    cost = CostModel(LLAMA_7B, H200)
    out = {}
    for batch in SPEEDUP_BATCHES:
        plain = cost.step_time([(1, 512)] * batch)
        out[batch] = [round(cost.step_time([(1 + k, 512)] * batch) / plain, 4) for k in range(9)]
    return out


SPEEDUP_BATCHES = (1, 32, 128, 256)  # 256 x 512 tokens of 7B KV: 64 GiB, within an H200
SPEEDUP_RATES = (0.3, 0.9)


def _best_k_report(best_k) -> str:
    costs = _speedup_costs()
    lines = []
    for a in SPEEDUP_RATES:
        picks = ", ".join(f"batch {b}: k = {best_k(a, list(costs[b]))}" for b in SPEEDUP_BATCHES)
        lines.append(f"acceptance {a}: {picks}\n")
    return "".join(lines)


register(
    SPECS,
    Spec(
        "ex10.4",
        "how many drafts pay (measure)",
        "best_k(acceptance_rate, step_cost)",
        cases=_best_k_cases,
        observe=lambda c, fn: attempt(lambda: fn(c[0], list(c[1]))),
        reference=lambda: (ref_best_k,),
        describe=lambda c: f"best_k(acceptance_rate={c[0]}, step_cost={c[1]})",
        size=lambda c: (len(c[1]), c[0]),
        report=_best_k_report,
    ),
)


# -- ex10.5: concept questions ---------------------------------------------------------------

# NOTE: a list is one question's variants, one drawn per student (variant 0: the shipped
# notebook's); the key holds one answer per variant
QUESTIONS = {
    "q1": [
        (
            "the probability that a draft drawn from `q = [0.1, 0.6, 0.1, 0.2]` is accepted by a target `p = [0.5, 0.3, 0.15, 0.05]`",
            None,
        ),
        (
            "the probability that a draft drawn from `q = [0.2, 0.3, 0.5]` is accepted by a target `p = [0.5, 0.5, 0.0]`",
            None,
        ),
        (
            "the probability that a draft drawn from `q = [0.6, 0.2, 0.2]` is accepted by a target `p = [0.3, 0.3, 0.4]`",
            None,
        ),
    ],
    "q2": [
        (
            "greedy verification of drafts `[5, 7, 2]` with target argmaxes `[5, 7, 9, 4]`: how many tokens does the step append?",
            None,
        ),
        (
            "greedy verification of drafts `[3, 3, 8, 1]` with target argmaxes `[3, 4, 8, 1, 6]`: how many tokens does the step append?",
            None,
        ),
        (
            "greedy verification of drafts `[2, 6]` with target argmaxes `[2, 6, 5]`: how many tokens does the step append?",
            None,
        ),
    ],
    "q3": (
        'which proposer needs lookahead KV slots: `"ngram"` or `"draft_model"`?',
        ("ngram", "draft_model"),
    ),
    "q4": [
        (
            "the expected tokens one step yields with `k = 2` drafts, each accepted independently with probability 0.5",
            None,
        ),
        (
            "the expected tokens one step yields with `k = 3` drafts, each accepted independently with probability 0.5",
            None,
        ),
        ("the expected tokens one step yields with `k = 1` draft, accepted with probability 0.8", None),
    ],
}
register(SPECS, concept_spec("ex10.5", "concept questions (numbers and choices)", QUESTIONS))


__all__ = [
    "QUESTIONS",
    "REJECTION_TRIALS",
    "SPECS",
    "SPEC_KNOBS",
    "SPEC_REQUESTS",
    "SPEEDUP_BATCHES",
    "SPEEDUP_RATES",
    "VARIANTS",
    "outcome_probs",
    "reference_spec_steps",
    "tv_bound",
]


# what the package itself computes for each exercise: stripped from the student build
ANSWERED_BY = {
    "ex10.1": (
        "minipaged.sample.rejection_sampler:RejectionSampler._greedy",
        "minipaged.sample.rejection_sampler:RejectionSampler.__call__",
    ),
    "ex10.2": (
        "minipaged.sample.rejection_sampler:RejectionSampler._random",
        "minipaged.sample.rejection_sampler:RejectionSampler.__call__",
    ),
    "ex10.3": (  # the drafts' token count and lookahead, and the advance (inline, as vLLM's)
        "minipaged.core.sched.scheduler:Scheduler.schedule",
        "minipaged.core.sched.scheduler:Scheduler.update_from_output",
    ),
    "ex10.4": (
        "minipaged.spec_decode.analysis:expected_tokens_per_step",
        "minipaged.spec_decode.analysis:cost_model_speedup",
    ),
}
set_answered_by(SPECS, ANSWERED_BY)
