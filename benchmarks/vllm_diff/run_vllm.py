"""vLLM's side of the differential test: per-step records of vLLM v1's own Scheduler.

Runs ONLY inside the vLLM virtual environment (``scripts/setup_vllm_venv.sh``; vLLM is
never a dependency of the course). It builds ``vllm.v1.core.sched.scheduler.Scheduler``
on CPU from the course model's HF directory through vLLM's config objects, as vLLM's own
tests do (``tests/v1/core/utils.py: create_scheduler``), and drives it with a fake model:
each step, every request whose prefill completes gets ``workloads.fake_token``; the
others (prefill chunks) get no token, as vLLM's model runner discards theirs.

Config (to compare with minipaged's v1 scheduler, see ``run_minipaged.py``)
    Sync ``Scheduler`` (no async scheduling), FCFS policy, the workload's chunked prefill
    and ``max_model_len``, no spec
    decode, no KV connector, ``long_prefill_token_threshold=0``. The admission rule
    follows ``--admission`` (``workloads.ADMISSIONS``): ``first-chunk`` ->
    ``scheduler_reserve_full_isl=False``; ``full-sequence`` -> vLLM's default
    (``scheduler_reserve_full_isl=True``, ``watermark=0``); ``watermark`` -> full sequence
    plus vLLM's ``watermark``, set so that it keeps exactly minipaged's
    ``int(WATERMARK * num_blocks)`` blocks free (vLLM counts its null block in the pool).
    The pool has ``num_blocks + 1`` blocks: vLLM keeps one as its null block, so both
    sides have ``num_blocks`` usable.

usage: .venv-vllm/bin/python benchmarks/vllm_diff/run_vllm.py --ids 0:100,cases --out DIR
        [--admission first-chunk [full-sequence ...]]
    writes DIR/vllm_<admission>_<id>.json (the workload and its step records).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COURSE_MODEL = os.path.join(REPO, "minipaged", "data", "course_model")
_MODEL_CONFIGS: dict = {}  # max_model_len -> vLLM ModelConfig (it reads the HF dir once)


class VllmSide:
    """Adapter: builds vLLM v1's Scheduler for a workload config and steps it."""

    def __init__(self, config: dict, admission: str) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        bs = config["block_size"]
        num_blocks = config["num_blocks"] + 1  # + vLLM's null block
        watermark = 0.0
        if admission == "watermark":
            # vLLM keeps int(watermark * num_blocks) free: make that minipaged's count
            watermark = (int(WATERMARK * config["num_blocks"]) + 0.5) / num_blocks
        mml = config["max_model_len"]
        if mml not in _MODEL_CONFIGS:
            _MODEL_CONFIGS[mml] = ModelConfig(
                model=COURSE_MODEL, dtype="float32", seed=0, max_model_len=mml, skip_tokenizer_init=True
            )
        scheduler_config = SchedulerConfig(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            max_model_len=mml,
            is_encoder_decoder=False,
            enable_chunked_prefill=config["enable_chunked_prefill"],
            long_prefill_token_threshold=0,
            async_scheduling=False,
            policy="fcfs",
            scheduler_reserve_full_isl=(admission != "first-chunk"),
            watermark=watermark,
        )
        cache_config = CacheConfig(
            block_size=bs, cache_dtype="auto", enable_prefix_caching=config["enable_prefix_caching"]
        )
        vllm_config = VllmConfig(
            scheduler_config=scheduler_config, model_config=_MODEL_CONFIGS[mml], cache_config=cache_config
        )
        # VllmConfig's platform hook may rewrite the block size; the scheduler must use ours.
        vllm_config.cache_config.block_size = bs
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32),
                )
            ],
        )
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=bs,
            log_stats=False,
        )
        # NOTE: VllmConfig's platform hooks may rewrite settings; fail if they did
        got = (
            self.scheduler.kv_cache_manager.enable_caching,
            self.scheduler.block_size,
            vllm_config.scheduler_config.enable_chunked_prefill,
            vllm_config.scheduler_config.max_num_batched_tokens,
            vllm_config.scheduler_config.max_num_seqs,
            self.scheduler.max_model_len,
        )
        want = (
            config["enable_prefix_caching"],
            bs,
            config["enable_chunked_prefill"],
            config["max_num_batched_tokens"],
            config["max_num_seqs"],
            mml,
        )
        if got != want:
            raise RuntimeError(f"vLLM changed the config: got {got}, asked for {want}")
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(bs, sha256)
        self.requests = {}

    def add_request(self, r: dict) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"])
        params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)  # as the engine does
        request = Request(
            request_id=r["request_id"],
            prompt_token_ids=list(r["prompt_token_ids"]),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.requests[request.request_id] = request  # vLLM forgets finished requests
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.get_num_unfinished_requests() > 0

    def step(self) -> dict:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        sched = self.scheduler
        before = {rid: r.status for rid, r in sched.requests.items()}
        out = sched.schedule()
        # vLLM advances num_computed_tokens inside schedule(): subtract this step's share
        scheduled = {}
        for rid, n in out.num_scheduled_tokens.items():
            scheduled[rid] = [sched.requests[rid].num_computed_tokens - n, n]
        admitted = {
            rid: scheduled[rid][0]
            for rid in scheduled
            if before[rid] in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        }
        preempted = sorted(
            rid
            for rid, s in before.items()
            if s == RequestStatus.RUNNING and sched.requests[rid].status == RequestStatus.PREEMPTED
        )
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = sched.requests[rid]
            done = r.num_computed_tokens >= r.num_tokens  # its prefill completes this step
            sampled.append([fake_token(rid, r.num_tokens)] if done else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        engine_outputs = sched.update_from_output(out, mro)
        finished = {
            o.request_id: self.requests[o.request_id].num_output_tokens
            for eco in engine_outputs.values()
            for o in eco.outputs
            if o.finish_reason is not None
        }
        return {"scheduled": scheduled, "admitted": admitted, "preempted": preempted, "finished": finished}


def run_one(wid, admission: str) -> dict:
    workload = make_workload(wid)
    side = VllmSide(workload["config"], admission)
    return {"workload": workload, "admission": admission, "steps": run_workload(side, workload)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", default="0:100,cases", help="workload ids (workloads.parse_ids)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--admission", choices=ADMISSIONS, nargs="+", default=["first-chunk"])
    args = ap.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    os.makedirs(args.out, exist_ok=True)
    for admission in args.admission:
        for wid in parse_ids(args.ids):
            with open(os.path.join(args.out, f"vllm_{admission}_{wid}.json"), "w") as f:
                json.dump(run_one(wid, admission), f)


if __name__ == "__main__":
    main()
