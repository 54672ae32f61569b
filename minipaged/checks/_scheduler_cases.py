"""Scheduler states for the chapter 04/05 checkers: build the same state twice, compare.

A ``Recipe`` describes a scheduler mid-run (plain data, so a failure message can print
it): pool and budget sizes, and requests in arrival order, each RUNNING (holding blocks
for its ``num_computed`` tokens, decoding or mid-prefill), PREEMPTED (waiting again at
the front, with output so far) or WAITING (fresh). ``build(recipe, cls)`` makes a real
``minipaged.core.Scheduler`` (or a subclass handed to the student) in that state; built
twice, the two are identical down to block ids, because allocation is deterministic.
``snapshot(scheduler)`` is what is compared after the reference and the student acted.
``recipe_data`` / ``recipe_from_data``: a recipe as plain data and back (a graded case
crosses to the student's kernel as JSON); ``snapshot_data``: the snapshot keyed by what
each entry is.

Invariants: every built state passes ``Scheduler.check_invariants()`` (tested in
tests/grading/test_checks.py); no request is refused at ``add_request``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Optional

from minipaged.core import Request, RequestStatus, Scheduler
from minipaged.core.kv.block import cdiv
from minipaged.sampling_params import SamplingParams

EOS = 2  # the eos token id of every request that has one


@dataclass
class ReqSpec:
    request_id: str
    prompt_len: int
    max_tokens: int
    state: str  # "running" | "preempted" | "waiting"
    num_output: int = 0
    num_computed: int = 0  # running only
    eos: bool = True
    ignore_eos: bool = False
    stop_token_ids: tuple = ()

    def __repr__(self) -> str:
        extra = ""
        if self.state == "running":
            decoding = self.num_output > 0 and self.num_computed == self.prompt_len + self.num_output - 1
            kind = "decoding" if decoding else "prefilling"
            extra = f", {kind}, computed={self.num_computed}"
        if self.stop_token_ids or self.ignore_eos or not self.eos:
            extra += (
                f", eos={'none' if not self.eos else EOS}{' (ignored)' if self.ignore_eos else ''}"
                f", stop={list(self.stop_token_ids)}"
            )
        return (
            f"{self.request_id}({self.state}, prompt={self.prompt_len}, out={self.num_output}, "
            f"max_tokens={self.max_tokens}{extra})"
        )


@dataclass
class Recipe:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    max_model_len: Optional[int] = None
    requests: list = field(default_factory=list)  # ReqSpec, in arrival order

    def describe(self) -> str:
        head = (
            f"Scheduler(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens}"
            + ("" if self.enable_chunked_prefill else ", enable_chunked_prefill=False")
            + ("" if self.max_model_len is None else f", max_model_len={self.max_model_len}")
            + ", scheduler_reserve_full_isl=False)"
        )
        return head + "\n  requests in arrival order: " + ", ".join(map(repr, self.requests))

    @property
    def size(self):
        return (len(self.requests), self.num_blocks, self.max_num_batched_tokens)


def arrivals_of(requests) -> dict:
    """``[(rid, prompt_len, max_tokens, step), ...]`` (a workload as plain data) ->
    ``{step: [Request, ...]}`` for ``run_scheduler``; prompts are tokens 10, 11, ..."""
    arrivals: dict = {}
    for rid, prompt, max_tokens, at in requests:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid, [10 + i for i in range(prompt)], sampling_params=params)
        arrivals.setdefault(at, []).append(req)
    return arrivals


def _tokens(rid: str, n: int, start: int = 10) -> list[int]:
    # deterministic, never the EOS id
    base = sum(map(ord, rid))
    return [start + (base + 7 * i) % 50 for i in range(n)]


def build(recipe: Recipe, cls=Scheduler) -> Scheduler:
    s = cls(
        recipe.num_blocks,
        recipe.block_size,
        max_num_seqs=recipe.max_num_seqs,
        max_num_batched_tokens=recipe.max_num_batched_tokens,
        enable_chunked_prefill=recipe.enable_chunked_prefill,
        max_model_len=recipe.max_model_len,
        scheduler_reserve_full_isl=False,
    )  # NOTE: the exercises teach vLLM v1's first-chunk admission
    reqs = []
    for i, spec in enumerate(recipe.requests):
        params = SamplingParams(
            max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos, stop_token_ids=list(spec.stop_token_ids)
        )
        r = Request(
            spec.request_id,
            _tokens(spec.request_id, spec.prompt_len),
            sampling_params=params,
            eos_token_id=EOS if spec.eos else None,
            arrival_time=float(i),
        )
        s.add_request(r)
        reqs.append(r)
    assert len(s.waiting) == len(reqs), "checker bug: a recipe request was refused"
    for spec, r in zip(recipe.requests, reqs):
        r.output_token_ids.extend(_tokens(spec.request_id, spec.num_output, start=60))
        if spec.state == "running":
            assert s.waiting[0] is r, "checker bug: running requests must arrive first"
            s.waiting.popleft()
            r.num_computed_tokens = spec.num_computed
            assert s.kv_cache_manager.allocate_slots(r, spec.num_computed) is not None, "checker bug: pool"
            r.status = RequestStatus.RUNNING
            s.running.append(r)
        elif spec.state == "preempted":
            r.status = RequestStatus.PREEMPTED
            r.num_preemptions = 1
    return s


def snapshot(s: Scheduler) -> dict:
    """Everything the exercises may change, as plain data."""
    kv = s.kv_cache_manager
    return {
        "running": [r.request_id for r in s.running],
        "waiting": [r.request_id for r in s.waiting],
        "finished": sorted(s.finished_req_ids),
        "requests": {
            rid: (r.status.name, r.num_computed_tokens, r.num_output_tokens, r.num_preemptions)
            for rid, r in sorted(s.requests.items())
        },
        "block_tables": {rid: (t.num_tokens, t.block_ids()) for rid, t in sorted(kv.block_tables.items())},
        "free_queue": [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()],
    }


SNAPSHOT_WHAT = {
    "running": "scheduler.running (request ids, in order)",
    "waiting": "scheduler.waiting (request ids, in order)",
    "finished": "scheduler.finished_req_ids (ids finished since the last schedule())",
    "requests": "per request: (status, num_computed_tokens, num_output_tokens, num_preemptions)",
    "block_tables": "per request holding blocks: (num_tokens, block ids)",
    "free_queue": "the free block queue, front to back",
}


def random_recipe(
    rng: random.Random,
    running: tuple[int, int] = (0, 4),
    preempted: tuple[int, int] = (0, 2),
    waiting: tuple[int, int] = (0, 4),
    chunked: Optional[bool] = True,
    stops: bool = False,
) -> Recipe:
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(2, 12)
    max_num_seqs = rng.randint(1, 6)
    mnbt = rng.choice([3, 4, 8, 16, 32])
    chunked = rng.random() < 0.5 if chunked is None else chunked
    cap = num_blocks * block_size  # tokens the whole pool holds
    recipe = Recipe(num_blocks, block_size, max_num_seqs, mnbt, enable_chunked_prefill=chunked)
    free_blocks = num_blocks
    k = 0

    def new_spec(state: str) -> Optional[ReqSpec]:
        nonlocal k, free_blocks
        prompt = rng.randint(1, min(cap, 3 * block_size + 3))
        if not chunked:
            prompt = min(prompt, mnbt)  # else it would be refused
        num_output = 0 if state == "waiting" else rng.randint(0 if state == "running" else 1, 4)
        if state == "running" and not chunked:
            num_output = max(1, num_output)  # without chunking a prompt is never left half done
        max_tokens = num_output + rng.randint(1, 6)
        max_tokens = max(num_output + 1, min(max_tokens, cap - prompt + 1))  # never refused
        if prompt + max_tokens - 1 > cap:
            return None
        spec = ReqSpec(f"r{k}", prompt, max_tokens, state, num_output=num_output)
        if state == "running":
            total = prompt + num_output
            if num_output > 0 or prompt == 1 or not chunked or rng.random() < 0.5:
                spec.num_computed = total - 1  # decoding (or about to finish its prefill)
                if num_output == 0:
                    spec.num_computed = max(1, total - 1)
            else:
                spec.num_computed = rng.randint(1, prompt - 1)  # mid-prefill (chunked)
            if spec.num_computed >= total:
                return None
            need = cdiv(spec.num_computed, block_size)
            if need > free_blocks:
                return None
            free_blocks -= need
        if stops:
            spec.eos = rng.random() < 0.8
            spec.ignore_eos = rng.random() < 0.15
            spec.stop_token_ids = tuple(rng.sample([3, 4, 5], rng.randint(0, 2)))
        k += 1
        return spec

    n_run = rng.randint(*running)
    n_run = min(n_run, max_num_seqs)
    for state, n in (
        ("running", n_run),
        ("preempted", rng.randint(*preempted)),
        ("waiting", rng.randint(*waiting)),
    ):
        for _ in range(n):
            spec = new_spec(state)
            if spec is not None:
                recipe.requests.append(spec)
    if stops and rng.random() < 0.4 and recipe.requests:
        longest = max(s.prompt_len + s.num_output for s in recipe.requests)
        recipe.max_model_len = longest + rng.randint(1, 3)
    return recipe


def recipe_data(recipe: Recipe) -> dict:
    """A recipe as plain data (what crosses to the student's kernel as a case)."""
    d = asdict(recipe)
    for r in d["requests"]:
        r["stop_token_ids"] = list(r["stop_token_ids"])
    return d


def recipe_from_data(data: dict) -> Recipe:
    """The ``Recipe`` of ``recipe_data(...)`` (after a JSON round trip)."""
    d = dict(data)
    reqs = [ReqSpec(**dict(r, stop_token_ids=tuple(r["stop_token_ids"]))) for r in d.pop("requests")]
    return Recipe(**d, requests=reqs)


def snapshot_data(s: Scheduler) -> dict:
    """``snapshot(s)`` keyed by what each entry is (``SNAPSHOT_WHAT``), for messages."""
    return {SNAPSHOT_WHAT[k]: v for k, v in snapshot(s).items()}


__all__ = [
    "EOS",
    "Recipe",
    "ReqSpec",
    "SNAPSHOT_WHAT",
    "build",
    "random_recipe",
    "recipe_data",
    "recipe_from_data",
    "snapshot",
    "snapshot_data",
]
