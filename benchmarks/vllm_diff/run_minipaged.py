"""minipaged's side of the vLLM differential test: per-step records of its v1 scheduler.

Runs in the course's environment. ``MinipagedSide`` is the only code that knows how to
build and drive minipaged's scheduler (re-point it here when the core moves); the step
loop and the record format are ``workloads.run_workload``'s, shared with ``run_vllm.py``.

Settings (what vLLM v1 has): the workload's chunked prefill, recompute preemption, no swap and no
sequence groups (vLLM v1 has neither), and ``Scheduler``'s own defaults otherwise (its free
order is vLLM 0.32's: freed blocks without a hash to the front of the free queue);
``free_uncached_first=False`` (every freed block to the back) is the negative control. The
admission rule follows ``--admission``
(``workloads.ADMISSIONS``), each an option of ``Scheduler`` alone, by vLLM's name:
``first-chunk`` -> ``scheduler_reserve_full_isl=False``; ``full-sequence`` -> vLLM 0.32's
defaults (``scheduler_reserve_full_isl=True``, ``watermark=0.0``); ``watermark`` -> the
full-sequence rule with ``watermark=WATERMARK``.

usage: python benchmarks/vllm_diff/run_minipaged.py --ids 0:100,cases --out DIR
        [--admission first-chunk]
    writes DIR/minipaged_<admission>_<id>.json (the workload and its step records).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import (  # noqa: E402
    ADMISSIONS,
    EOS_TOKEN_ID,
    WATERMARK,
    fake_token,
    make_workload,
    parse_ids,
    run_workload,
)

_OPTIONS = {
    "first-chunk": {"scheduler_reserve_full_isl": False},
    "full-sequence": {},  # vLLM 0.32's defaults
    "watermark": {"watermark": WATERMARK},
}


class MinipagedSide:
    """Adapter: builds minipaged's v1 scheduler for a workload config and steps it."""

    def __init__(
        self, config: dict, admission: str = "first-chunk", free_uncached_first: Optional[bool] = None
    ) -> None:
        from minipaged.core import Scheduler

        kwargs = dict(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            enable_chunked_prefill=config["enable_chunked_prefill"],
            max_model_len=config["max_model_len"],
            enable_prefix_caching=config["enable_prefix_caching"],
        )
        if free_uncached_first is not None:  # None: the default, vLLM 0.32's free order
            kwargs["free_uncached_first"] = free_uncached_first
        self.scheduler = Scheduler(
            config["num_blocks"], config["block_size"], **kwargs, **_OPTIONS[admission]
        )

    def add_request(self, r: dict) -> None:
        from minipaged.core import Request
        from minipaged.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"])
        self.scheduler.add_request(
            Request(r["request_id"], list(r["prompt_token_ids"]), params, eos_token_id=EOS_TOKEN_ID)
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> dict:
        sched = self.scheduler
        out = sched.schedule()
        sched.check_invariants()
        scheduled = {r.request_id: [r.num_computed_tokens, n] for r, n in out.scheduled}
        admitted = {r.request_id: out.num_cached_tokens.get(r.request_id, 0) for r in out.admitted}
        sampled = {
            r.request_id: fake_token(r.request_id, r.num_tokens)
            for r, n in out.scheduled
            if r.num_computed_tokens + n == r.num_tokens
        }
        finished = sched.update_from_output(out, sampled)
        sched.check_invariants()
        if out.refused:
            raise RuntimeError(
                f"refused {[r.request_id for r in out.refused]}: the "
                "workload generator promises every request fits"
            )
        return {
            "scheduled": scheduled,
            "admitted": admitted,
            "preempted": sorted(r.request_id for r in out.preempted),
            "finished": {r.request_id: r.num_output_tokens for r in finished},
        }


def run_one(wid, admission: str = "first-chunk", free_uncached_first: Optional[bool] = None) -> dict:
    workload = make_workload(wid)
    side = MinipagedSide(workload["config"], admission, free_uncached_first)
    return {"workload": workload, "admission": admission, "steps": run_workload(side, workload)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", default="0:100,cases", help="workload ids (workloads.parse_ids)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--admission", choices=ADMISSIONS, default="first-chunk")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for wid in parse_ids(args.ids):
        with open(os.path.join(args.out, f"minipaged_{args.admission}_{wid}.json"), "w") as f:
            json.dump(run_one(wid, args.admission), f)


if __name__ == "__main__":
    main()
