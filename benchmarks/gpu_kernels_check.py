"""The Triton kernels and cache ops, compiled for the GPU, against the torch reference.

    python benchmarks/gpu_kernels_check.py --json OUT.json [--budget-s 150]   # on a CUDA GPU
    python benchmarks/gpu_kernels_check.py --json OUT.json --dry-run          # tiny, interpreter

Step (a) of ``benchmarks/gpu_check.sh``: the same cases as ``tests/kernels/test_paged_attention.py``
and ``tests/kernels/test_cache_ops.py``, but sized for a GPU (contexts up to 2k tokens, the default
tile sizes) and compiled instead of interpreted. A plain script, not pytest, so that it runs
on a machine that has only torch, triton and transformers.

Cases (each one line of the JSON, run in this order, cheapest and most important first)
    decode V1, split-KV decode V2, varlen prefill over a cached prefix, in fp32/fp16/bf16;
    a cache of more than 2**31 elements (int64 offsets; skipped without the memory);
    ``reshape_and_cache`` (torch and Triton), ``copy_blocks``, ``swap_blocks`` (GPU <->
    pinned CPU); empty sequences; block sizes 1..256 (and 3, 512, which the kernels must
    reject with ``ValueError``); head dims 64/80/96/128; GQA groups 1..32.
Each case: kernel vs the reference in fp32 (``paged_attention_ref`` / ``_prefill_ref``, or a
loop over slots / block pairs for the cache ops) at ``tests/_paged_cases.TOL``.

Output
    JSON ``{"mode", "device", "cases": [{name, op, status, max_abs_err, tol, ...}], "counts",
    "rejected_block_sizes", "ok"}``, rewritten after every case so a killed run leaves what it
    did. ``status``: pass | fail | error | rejected (a ``ValueError`` the case expected) |
    skipped (time budget spent, or the CUDA context was lost by an earlier case).
    Exit status 1 if any case failed or errored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # _paged_cases: the tests' random paged caches and tolerances

if not torch.cuda.is_available():  # before triton is imported through the package
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _paged_cases import TOL, cu_from, make_paged  # noqa: E402

from minipaged.kernels import (  # noqa: E402
    HAS_TRITON,
    copy_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_triton,
    swap_blocks,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------- the cases


def build_cases(dry_run: bool) -> list[dict]:
    """The case list: full sizes on a GPU, tiny ones (same kinds) for the interpreter."""
    if dry_run:
        heads, kv_heads, head_dim = 4, 2, 16
        seq_lens, q_lens = [1, 17, 40], [1, 5, 20]
        tiles = dict(block_n=16, partition_size=16, block_m=16)
        block_sizes, head_dims, dtypes = [1, 16, 256], [16, 80], list(DTYPES)
        groups = [(4, 1)]
        sweep_ops = ("decode_v1", "prefill")  # the interpreter is slow: V2 only in the dtype sweep
    else:
        heads, kv_heads, head_dim = 32, 8, 128
        seq_lens, q_lens = [1, 15, 16, 17, 1000, 2049], [1, 15, 16, 7, 300, 512]
        tiles = {}  # the defaults: what the engine runs
        block_sizes, head_dims, dtypes = [1, 2, 4, 8, 16, 32, 64, 128, 256], [64, 80, 96, 128], list(DTYPES)
        groups = [(32, 32), (32, 8), (32, 4), (32, 1), (8, 1)]
        sweep_ops = ("decode_v1", "decode_v2", "prefill")
    base = dict(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype="bfloat16",
        seq_lens=seq_lens,
        q_lens=q_lens,
        tiles=tiles,
    )
    cases = []

    def add(op, suffix="", **kw):
        case = {**base, "op": op, **kw}
        tag = ",".join(f"{k}={case[k]}" for k in ("dtype", "block_size", "head_dim"))
        case["name"] = f"{op}[{tag},heads={case['num_heads']}/{case['num_kv_heads']}{suffix}]"
        cases.append(case)

    attention_ops = ("decode_v1", "decode_v2", "prefill")
    for dtype in dtypes:
        for op in attention_ops:
            add(op, dtype=dtype)
    for op in ("decode_v1", "prefill"):
        add(
            op, large_pool=True, suffix=",pool > 2**31 elements" if not dry_run else ",large-pool path (tiny)"
        )
    for dtype in dtypes:
        for bs in (1, 16, 256) if dry_run else (1, 16, 64, 256):
            add("reshape_and_cache", dtype=dtype, block_size=bs)
            add("reshape_and_cache_triton", dtype=dtype, block_size=bs)
        add("copy_blocks", dtype=dtype)
        add("swap_blocks", dtype=dtype)
    for op in ("decode_v1", "decode_v2"):
        add(op, seq_lens=[0] + seq_lens[1:], suffix=",empty seq")
    for bs in block_sizes:
        if bs != 16:
            for op in sweep_ops:
                add(op, block_size=bs)
    for bs in (3, 512):  # not a power of two / larger than the kernels support
        add("decode_v1", block_size=bs, expect="rejected")
    for hd in head_dims:
        for dtype in ("bfloat16", "float32"):
            if hd != head_dim:  # the dtype sweep had head_dim
                for op in ("decode_v1", "prefill"):
                    add(op, head_dim=hd, dtype=dtype)
    for h, kvh in groups:
        if (h, kvh) != (heads, kv_heads):
            for op in sweep_ops:
                add(op, num_heads=h, num_kv_heads=kvh)
    return cases


# --------------------------------------------------------------------------- running one case


def _paged_inputs(case, device):
    """(q, k, v, block_tables, seq_lens, cu) for an attention case, with a huge pool if asked."""
    dtype = DTYPES[case["dtype"]]
    bs, kvh, hd = case["block_size"], case["num_kv_heads"], case["head_dim"]
    seq_lens = case["seq_lens"]
    prefill = case["op"] == "prefill"
    q_lens = [min(q, s) for q, s in zip(case["q_lens"], seq_lens)] if prefill else [1] * len(seq_lens)
    seed = hash_seed(case["name"])
    k, v, bt, sl = make_paged(seq_lens, bs, kvh, hd, dtype=dtype, seed=seed, extra_cols=1, device=device)
    if any(n == 0 for n in seq_lens):
        bt[[i for i, n in enumerate(seq_lens) if n == 0]] = 0  # never read
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), case["num_heads"], hd, generator=g).to(dtype).to(device)
    return q, k, v, bt, sl, cu_from(q_lens).to(device)


def _large_pool(k, v, bt, device):
    """The same K/V moved to the top of a pool with more than 2**31 elements per cache.

    Offsets of those blocks overflow int32; the kernels must compute them in int64."""
    per_block = k[0].numel()
    need = k.shape[0]
    if device.type == "cuda":
        total = (2**31 // per_block) + need + 1
        free, _ = torch.cuda.mem_get_info()
        if 2 * total * per_block * k.element_size() > 0.8 * free:
            return None  # not enough memory: caller skips
    else:
        total = need + 5  # the dry run: same code path, tiny pool
    big_k = torch.empty((total, *k.shape[1:]), dtype=k.dtype, device=device)
    big_v = torch.empty_like(big_k)
    offset = total - need  # block i -> block offset + i
    big_k[offset:] = k
    big_v[offset:] = v
    return big_k, big_v, bt + offset


def run_attention(case, device) -> dict:
    q, k, v, bt, sl, cu = _paged_inputs(case, device)
    tiles = dict(case["tiles"])
    ref_k, ref_v, ref_bt = k.float(), v.float(), bt
    if case.get("large_pool"):
        big = _large_pool(k, v, bt, device)
        if big is None:
            return {"status": "skipped", "error": "not enough GPU memory for a 2**31-element pool"}
        k, v, bt = big
        case_info = {"pool_elements": k.numel()}
    else:
        case_info = {}
    op = case["op"]
    if op == "prefill":
        tiles.pop("partition_size", None)
        out = paged_attention_prefill(q, k, v, bt, cu, sl, **tiles)
        want = paged_attention_prefill_ref(q.float(), ref_k, ref_v, ref_bt, cu, sl)
    else:
        tiles.pop("block_m", None)
        out = paged_attention_decode(q, k, v, bt, sl, use_v2=(op == "decode_v2"), **tiles)
        want = paged_attention_ref(q.float(), ref_k, ref_v, ref_bt, sl)
    return {**_compare(out.float(), want, case["dtype"]), **case_info}


def _loop_reshape_and_cache(key, value, k_cache, v_cache, slots):
    bs = k_cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_cache[s // bs, s % bs] = key[t]
            v_cache[s // bs, s % bs] = value[t]


def run_cache_op(case, device) -> dict:
    dtype = DTYPES[case["dtype"]]
    bs, kvh, hd = case["block_size"], case["num_kv_heads"], case["head_dim"]
    g = torch.Generator().manual_seed(hash_seed(case["name"]))
    num_blocks = 12

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    k_cache, v_cache = rand(num_blocks, bs, kvh, hd), rand(num_blocks, bs, kvh, hd)
    op = case["op"]
    if op.startswith("reshape_and_cache"):
        num_tokens = min(40, num_blocks * bs)
        slots = torch.randperm(num_blocks * bs, generator=g)[:num_tokens]
        slots[: num_tokens // 8] = -1  # PAD_SLOT_ID: skipped
        key, value = rand(num_tokens, kvh, hd), rand(num_tokens, kvh, hd)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        _loop_reshape_and_cache(key, value, want_k, want_v, slots)
        fn = reshape_and_cache_triton if op.endswith("triton") else reshape_and_cache
        fn(key, value, k_cache, v_cache, slots.to(device))
        return _exact(k_cache, want_k, v_cache, want_v)
    if op == "copy_blocks":
        layers_k = [k_cache, rand(num_blocks, bs, kvh, hd)]
        layers_v = [v_cache, rand(num_blocks, bs, kvh, hd)]
        want_k = [c.clone() for c in layers_k]
        want_v = [c.clone() for c in layers_v]
        mapping = [(0, 5), (0, 6), (11, 1), (3, 2)]
        for wk, wv, ck, cv in zip(want_k, want_v, layers_k, layers_v):
            for src, dst in mapping:
                wk[dst], wv[dst] = ck[src], cv[src]
        copy_blocks(layers_k, layers_v, mapping)
        ok = all(torch.equal(a, b) for a, b in zip(layers_k + layers_v, want_k + want_v))
        return {"status": "pass" if ok else "fail", "max_abs_err": 0.0 if ok else None, "tol": "exact"}
    if op == "swap_blocks":
        pin = device.type == "cuda"
        cpu_pool = torch.zeros((4, bs, kvh, hd), dtype=dtype, pin_memory=pin)
        swap_blocks(k_cache, cpu_pool, [(7, 0), (2, 3)])  # swap out
        fresh = torch.zeros_like(k_cache)
        swap_blocks(cpu_pool, fresh, [(0, 9), (3, 1)])  # swap in
        if device.type == "cuda":
            torch.cuda.synchronize()
        ok = (
            torch.equal(cpu_pool[0], k_cache[7].cpu())
            and torch.equal(cpu_pool[3], k_cache[2].cpu())
            and torch.equal(fresh[9], k_cache[7])
            and torch.equal(fresh[1], k_cache[2])
        )
        return {"status": "pass" if ok else "fail", "max_abs_err": 0.0 if ok else None, "tol": "exact"}
    raise ValueError(f"unknown op {op!r}")


def _exact(k, want_k, v, want_v) -> dict:
    err = max(
        (k.float() - want_k.float()).abs().max().item(), (v.float() - want_v.float()).abs().max().item()
    )
    ok = torch.equal(k, want_k) and torch.equal(v, want_v)
    return {"status": "pass" if ok else "fail", "max_abs_err": err, "tol": "exact"}


def _compare(out, want, dtype_name) -> dict:
    tol = TOL[DTYPES[dtype_name]]
    err = (out - want).abs()
    max_err = err.max().item() if err.numel() else 0.0
    bound = tol["atol"] + tol["rtol"] * want.abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= bound).all())
    return {"status": "pass" if ok else "fail", "max_abs_err": max_err, "tol": tol}


def hash_seed(name: str) -> int:
    import hashlib

    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)


def run_case(case, device) -> dict:
    start = time.perf_counter()
    try:
        if case["op"] in ("decode_v1", "decode_v2", "prefill"):
            res = run_attention(case, device)
        else:
            res = run_cache_op(case, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if case.get("expect") == "rejected":
            res = {"status": "fail", "error": "expected a ValueError, the kernel accepted the input"}
    except ValueError as e:
        status = "rejected" if case.get("expect") == "rejected" else "error"
        res = {"status": status, "error": f"ValueError: {e}"}
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        res = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    res["seconds"] = round(time.perf_counter() - start, 3)
    return res


def cuda_alive() -> bool:
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - a sticky CUDA error (illegal address...) poisons the context
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes (the Triton interpreter on a CPU)")
    p.add_argument(
        "--budget-s", type=float, default=150.0, help="skip the remaining cases after this many seconds"
    )
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.dry_run:
        print("no CUDA GPU: run with --dry-run (the interpreter) or on a GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true fp32
    torch.backends.cudnn.allow_tf32 = False
    report = {
        "step": "kernel_correctness",
        "mode": "gpu" if device.type == "cuda" else "dry-run",
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (Triton interpreter)",
        "triton": HAS_TRITON,
        "cases": [],
    }
    if not HAS_TRITON:
        report.update(ok=False, error="Triton is not installed")
        _write(args.json, report)
        return 1
    start = time.perf_counter()
    dead_after = None
    for case in build_cases(args.dry_run):
        row = {k: v for k, v in case.items() if k not in ("tiles", "seq_lens", "q_lens")}
        if dead_after is not None:
            row.update(status="skipped", error=f"CUDA context lost after {dead_after}")
        elif time.perf_counter() - start > args.budget_s:
            row.update(status="skipped", error=f"time budget of {args.budget_s:.0f} s spent")
        else:
            row.update(run_case(case, device))
            if row["status"] == "error" and device.type == "cuda" and not cuda_alive():
                dead_after = case["name"]
        report["cases"].append(row)
        print(
            f"{row['status']:>8}  {row['name']}  err={row.get('max_abs_err', '-')}  {row.get('error', '')[:160]}",
            flush=True,
        )
        _finish(report)
        _write(args.json, report)
    report["seconds"] = round(time.perf_counter() - start, 1)
    _finish(report)
    _write(args.json, report)
    c = report["counts"]
    print(f"kernel correctness: {c}  ({report['seconds']} s)")
    return 0 if report["ok"] else 1


def _finish(report) -> None:
    counts: dict[str, int] = {}
    for row in report["cases"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    report["counts"] = counts
    report["rejected_block_sizes"] = sorted(
        {r["block_size"] for r in report["cases"] if r["status"] == "rejected"}
    )
    report["ok"] = counts.get("fail", 0) == 0 and counts.get("error", 0) == 0


def _write(path, report) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
