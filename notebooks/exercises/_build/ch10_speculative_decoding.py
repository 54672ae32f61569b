"""Generator of notebooks/exercises/ch10_speculative_decoding.ipynb (chapter 10 exercises)."""

from _common import ExerciseNotebook

from minipaged.checks.ch10 import (
    REJECTION_TRIALS,
    SPEC_KNOBS,
    SPEC_REQUESTS,
    SPEEDUP_BATCHES,
    SPEEDUP_RATES,
    spec_request_row,
)

# the table of ex10.3 (a student copy made with --seed gets its own request, written in)
SPEC_TABLE = "\n".join(f"    {spec_request_row(r)}" for r in SPEC_REQUESTS)

nb = ExerciseNotebook(
    chapter="ch10",
    filename="ch10_speculative_decoding.ipynb",
    title="Chapter 10 exercises: verification, the rejection sampler, lookahead slots",
    minutes=70,
    intro="""
    Companion to `notebooks/10_speculative_decoding.ipynb`. You will write the two halves of
    vLLM v1's `RejectionSampler` (greedy verification, and the rejection rule that keeps the
    target's distribution), predict what a speculative request asks of its block table step
    by step, and measure how many drafts pay on the chapter's cost model. The sampler is
    checked by its *distribution*: thousands of seeded trials per case, compared with the
    exact distribution the rule implies.
    """,
)

# NOTE: the setup cell holds the data as literals: a submission may not import minipaged.checks
nb.setup(f"""
import torch

from minipaged.core import cdiv

torch.set_num_threads(1)
# ex10.3: the scheduler's knobs (k drafts per step, k lookahead slots) and the request:
# (request id, prompt tokens, max_tokens, accepted drafts at each verification step, in order)
SPEC_KNOBS = {SPEC_KNOBS!r}
SPEC_REQUESTS = {SPEC_REQUESTS!r}
""")

nb.exercise(
    "ex10.1",
    "greedy verification",
    """
    A request was scheduled its last token `x` and `m` drafts `d_1 .. d_m`; the target ran on
    all of them in one forward and its argmax at each of the `m + 1` positions is
    `target_argmax` (position `j` is the target's choice for the token after `x, d_1 .. d_j`).
    At temperature 0 a draft is accepted while it equals the target's choice; at the first
    disagreement the target's own choice is emitted instead, and if every draft was accepted
    the last position gives one more (the *bonus* token).

    Write `greedy_verify(drafts, target_argmax)`: the tokens the step appends (`1` to `m + 1`
    of them). Raise `ValueError` unless `len(target_argmax) == len(drafts) + 1`.

    Hand check: drafts `[4, 9]`, argmaxes `[4, 2, 7]`: `4` is accepted, `9` is not, the
    target's `2` replaces it: `[4, 2]`.
    """,
    """
    def greedy_verify(drafts: list[int], target_argmax: list[int]) -> list[int]:
        \"\"\"The tokens a greedy verification step appends.\"\"\"
        ### BEGIN SOLUTION
        if len(target_argmax) != len(drafts) + 1:
            raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target rows, got {len(target_argmax)}")
        out = []
        for d, t in zip(drafts, target_argmax):
            out.append(t)
            if d != t:
                return out
        return out + [target_argmax[-1]]
        ### END SOLUTION
    """,
    ["greedy_verify"],
)

nb.exercise(
    "ex10.2",
    "the rejection sampler",
    f"""
    Now with sampling. `p` is a `[m + 1, V]` tensor: row `j` is the target's distribution at
    position `j` (rows `0 .. m-1` judge the drafts, row `m` is the bonus row). `q` is the
    `[m, V]` tensor of the distributions the drafts were drawn from, or `None` for n-gram
    drafts (then `q[j]` is one-hot at `d_j`, vLLM's convention). `gen` is a
    `torch.Generator`: draw every random number from it (`torch.rand(1, generator=gen)`,
    `torch.multinomial(w, 1, generator=gen)`), so a run is reproducible.

    Write `rejection_sample(drafts, p, q, gen)`, the rule of chapter 10:

    - for `j = 0, 1, ...`: accept `d_j` with probability `min(1, p[j, d_j] / q[j, d_j])`;
    - at the first rejection, draw the next token from the residual `max(0, p[j] - q[j])`
      (renormalised; for `q = None` that is `p[j]` with `d_j` set to zero), and stop;
    - if all `m` are accepted, draw the bonus token from `p[m]`.

    Return the accepted drafts and the one token after them, a list of 1 to `m + 1` ints.

    The check runs your sampler {REJECTION_TRIALS} times per case (drafts drawn from `q` by
    the check) and compares how often each returned sequence came with the exact
    probability the rule gives it. It fails if a sequence the rule can never return comes
    back, or if the total variation distance between the two distributions is larger than a
    correct sampler ever gets (the bound is printed in the message). Predict first: which
    mistakes does each of these two tests catch?
    """,
    """
    def rejection_sample(drafts: list[int], p: torch.Tensor, q, gen: torch.Generator) -> list[int]:
        \"\"\"Accepted drafts, then one token: distributed as the target's p.\"\"\"
        ### BEGIN SOLUTION
        m = len(drafts)
        for j, d in enumerate(drafts):
            q_d = 1.0 if q is None else float(q[j, d])
            if float(torch.rand(1, generator=gen)) * q_d < float(p[j, d]):
                continue  # accepted with probability min(1, p/q)
            if q is None:
                residual = p[j].clone()
                residual[d] = 0.0
            else:
                residual = (p[j] - q[j]).clamp(min=0.0)
            return list(drafts[:j]) + [int(torch.multinomial(residual, 1, generator=gen))]
        return list(drafts) + [int(torch.multinomial(p[m], 1, generator=gen))]
        ### END SOLUTION
    """,
    ["rejection_sample"],
)

nb.exercise(
    "ex10.3",
    "predict a speculative request's slots and blocks (on paper first)",
    f"""
    A v1 `Scheduler` with `block_size = {SPEC_KNOBS["block_size"]}` and
    `max_num_batched_tokens = {SPEC_KNOBS["max_num_batched_tokens"]}` serves one request
    with a draft model proposing `k = {SPEC_KNOBS["k"]}` drafts after every step, so each
    step also reserves up to `k` *lookahead* slots for the draft's next passes
    (`SPEC_REQUESTS`; your copy's request may differ from a classmate's):

    | request | prompt tokens | max_tokens | accepted drafts at each verification step |
    |---|---|---|---|
{{SPEC_TABLE}}

    What you need from chapter 10 (and `Scheduler.schedule` in `minipaged/core/sched/scheduler.py`):

    - step 0 is the prefill: the whole prompt, no drafts;
    - a decoding step is scheduled its last token and the drafts, but never more drafts
      than the request may still emit: a request holds at most `prompt + max_tokens - 1`
      tokens' K/V, and the drafts must fit under that beside the tokens it already has;
    - every step reserves `min(k, room)` lookahead slots past the tokens it schedules, where
      `room` is what is left under that same bound;
    - the block table holds `cdiv(num_computed_tokens + scheduled + lookahead, block_size)`
      blocks during the step, and keeps them after it: rejected drafts give no block back;
    - the `i`-th step that verifies drafts accepts the `i`-th number of the table (never more
      than the drafts it had); `num_computed_tokens` then advances by the scheduled tokens
      minus the rejected drafts. The request stops when it has `max_tokens` output tokens.

    Write `predict_spec_steps()`: one dict per step until the request finishes,
    `{{"scheduled": tokens, "lookahead": slots, "blocks": blocks in its table during the step,
    "computed": num_computed_tokens after the step}}`. Example: a request of prompt 5 and
    `max_tokens` 8 would start with `{{"scheduled": 5, "lookahead": 3, "blocks": 2,
    "computed": 5}}`. The check says which step is wrong and what you gave, not the answer.
    """.replace("{SPEC_TABLE}\n", SPEC_TABLE + "\n"),
    """
    def predict_spec_steps() -> list[dict]:
        \"\"\"Per step: scheduled tokens, lookahead slots, blocks held, num_computed_tokens after.\"\"\"
        ### BEGIN SOLUTION
        return [
            {"scheduled": 6, "lookahead": 3, "blocks": 3, "computed": 6},
            {"scheduled": 4, "lookahead": 3, "blocks": 4, "computed": 9},
            {"scheduled": 4, "lookahead": 2, "blocks": 4, "computed": 10},
            {"scheduled": 4, "lookahead": 1, "blocks": 4, "computed": 14},
            {"scheduled": 1, "lookahead": 0, "blocks": 4, "computed": 15},
        ]
        ### END SOLUTION
    """,
    ["predict_spec_steps"],
)

nb.exercise(
    "ex10.4",
    "how many drafts pay (measure)",
    f"""
    With each draft accepted independently with probability `a`, a step with `k` drafts
    yields `1 + a + a^2 + ... + a^k` tokens on average (`k = 0`: one token, no speculation).
    Such a step costs `step_cost[k]` (relative to a plain decode, or in ms: any unit).

    - **Write** `best_k(acceptance_rate, step_cost)`: the `k` in `0 .. len(step_cost) - 1`
      with the most tokens per unit of cost; the smallest such `k` on a tie.
    - **Failure mode**: `acceptance_rate` outside `[0, 1]`, an empty `step_cost` or a cost
      that is not positive -> `ValueError`.

    The check then prints your choice for acceptance rates {", ".join(map(str, SPEEDUP_RATES))} on the
    chapter's cost model (Llama-2-7B on an H200, context 512, n-gram drafts: free to
    propose) at batch sizes {", ".join(map(str, SPEEDUP_BATCHES))}. Predict first: how does the best
    `k` move as the batch grows (chapter 10, section 4), and how much does the acceptance rate
    move it?
    """,
    """
    def best_k(acceptance_rate: float, step_cost: list[float]) -> int:
        \"\"\"The number of drafts with the most expected tokens per unit of cost.\"\"\"
        ### BEGIN SOLUTION
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        if not step_cost or min(step_cost) <= 0:
            raise ValueError(f"step_cost must be non-empty and positive, got {step_cost}")
        rates = [sum(acceptance_rate**i for i in range(k + 1)) / c for k, c in enumerate(step_cost)]
        top = max(rates)
        return next(k for k, r in enumerate(rates) if r >= top * (1 - 1e-12))
        ### END SOLUTION
    """,
    ["best_k"],
)

nb.exercise(
    "ex10.5",
    "concept questions",
    """
    Answer with a number or one of the given choices (strings exactly as written). The
    answers are graded once, by the instructor's key: the check here only makes sure every
    question has an answer of the right kind, and a graded failure says how many are wrong,
    never which.

    - `q1`: the probability that a draft drawn from `q = [0.1, 0.6, 0.1, 0.2]` is accepted by a target `p = [0.5, 0.3, 0.15, 0.05]`
    - `q2`: greedy verification of drafts `[5, 7, 2]` with target argmaxes `[5, 7, 9, 4]`: how many tokens does the step append?
    - `q3`: which proposer needs lookahead KV slots: `"ngram"` or `"draft_model"`?
    - `q4`: the expected tokens one step yields with `k = 2` drafts, each accepted independently with probability 0.5

    Write `concept_answers()` returning `{"q1": ..., ..., "q4": ...}`.
    """,
    """
    def concept_answers() -> dict:
        \"\"\"Answers to q1..q4.\"\"\"
        ### BEGIN SOLUTION
        return {"q1": 0.55, "q2": 3, "q3": "draft_model", "q4": 1.75}
        ### END SOLUTION
    """,
    ["concept_answers"],
)

nb.outro("""
## Questions to discuss (short answers, not auto-checked)

1. ex10.2 checks a sampler by running it thousands of times. Why can no check of one
   call tell a right sampler from a wrong one, and which wrong samplers would a check of
   only the *first* token's distribution miss?
2. In ex10.3 the rejected drafts' slots are written again by the next step. Why is the K/V
   the target wrote there never read before it is overwritten?
3. ex10.4's costs are for n-gram drafts, which cost nothing to propose. How would a draft
   model's `k` passes per step change the best `k`?

## Recap

Greedy verification keeps the longest prefix the target agrees with, then the target's own
token; the rejection rule keeps exactly the target's distribution by accepting with
`min(1, p/q)` and resampling from `max(0, p - q)`. On paged memory the drafts and the
lookahead are ordinary slots of the request's block table, bounded by what the request may
still emit; speculation pays while the step is memory-bound and the drafts are accepted.
""")

if __name__ == "__main__":
    nb.build()
