"""PagedAttention decode kernel vs contiguous attention: latency and achieved bandwidth.

Reproduces the kernel half of the vLLM paper: §7.1 (the paged kernel was 20-26% slower
than FasterTransformer's contiguous one) and Fig. 18a (block-size sweep).

    python benchmarks/attention_kernels.py                 # CUDA: full sweep; CPU: interpreter sanity pass
    python benchmarks/attention_kernels.py --quick --json OUT.json [--tune] [--budget-s 150]
    python benchmarks/attention_kernels.py --dry-run       # the GPU code path on tiny shapes, anywhere

On a CUDA GPU, for every (batch, context) it times
    paged    minipaged's Triton ``paged_attention_decode`` (V1 or split-KV V2, chosen by it),
             over a cache whose blocks are shuffled, block_size 16;
    inorder  the same kernel over the same blocks laid out in order (what paging costs
             beyond the kernel itself: the scattered reads);
    sdpa     ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V, as torch
             picks its backend, and each fused backend (flash, efficient, cudnn) forced;
    flash    ``flash_attn_with_kvcache`` on contiguous K/V, where flash-attn is installed;
then a block-size sweep 8..256 at one (batch, context). Achieved bandwidth counts the bytes
a decode step must read at least once (K, V, q) and write (out); the share of peak uses the
data-sheet HBM bandwidth of the device (``PEAK_BANDWIDTH``, matched on its name; unknown
-> null). It prints a table with the ratios (paged over the fastest contiguous), writes a figure (default
``figures/kernel_bench.png``) and, with ``--json``, the numbers, including ``targets``:
paged/contiguous <= 1.2 at block_size 16, and >= 70% of peak HBM bandwidth at batch 64 x
4k context (the paper's kernel was 20-26% slower than FasterTransformer's, section 7.1).
``--tune`` then times the decode kernel's launch options (``block_n``, ``num_warps``,
``num_stages``; split-KV ``partition_size``) at the target shapes; ``--budget-s`` stops
the tuning sweep when the time is spent (the JSON is written before it starts).

On a machine without CUDA the kernels only run in Triton's interpreter, where timings mean
nothing: it checks the kernels against the torch reference on tiny shapes and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

# Peak HBM bandwidth (bytes/s) from the vendors' data sheets, matched on the device name.
PEAK_BANDWIDTH = {
    "B200": 8.0e12,
    "GH200": 4.0e12,
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "L40": 0.864e12,
    "L4": 0.3e12,
    "A10G": 0.6e12,
    "A10": 0.6e12,
    "V100": 0.9e12,
    "RTX 4090": 1.008e12,
    "RTX 3090": 0.936e12,
    "T4": 0.32e12,
}
TARGET_RATIO = 1.2  # paged / best contiguous latency at block_size 16
TARGET_PCT_PEAK = 70.0  # % of peak HBM bandwidth at batch 64 x 4k context


def peak_bandwidth(name: str):
    """Data-sheet peak HBM bandwidth (bytes/s) of the device called ``name``, or None."""
    for key, value in PEAK_BANDWIDTH.items():  # most specific keys first
        if key.lower() in name.lower():
            return value
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--contexts", default="512,1024,2048,4096,8192", help="comma-separated context lengths")
    p.add_argument("--block-sizes", default="8,16,32,64,128,256", help="block-size sweep")
    p.add_argument("--sweep-batch", type=int, default=64, help="batch of the block-size sweep")
    p.add_argument("--sweep-context", type=int, default=4096, help="context of the block-size sweep")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (batches 8,64; contexts 1k,4k)")
    p.add_argument(
        "--figure",
        default=None,
        help="where to write the figure (default figures/kernel_bench.png on a GPU; '' = none)",
    )
    p.add_argument("--json", default="", help="write the results as JSON to this path")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the GPU code path on the CPU with tiny shapes (checks the script; timings meaningless)",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="also time the decode kernel's launch options at the target shapes",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds after which the tuning sweep stops (default: no limit)",
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------- inputs


def make_decode_inputs(batch, context, block_size, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """Shuffled paged cache holding ``context`` tokens per sequence, plus the same K/V contiguous."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, generator=g).reshape(batch, blocks_per_seq).to(torch.int32)
    block_tables = block_tables.to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, block_tables, seq_lens


def contiguous_kv(k_cache, v_cache, block_tables, context):
    """[B, L, KVH, D] K and V gathered once through the block table (the 'contiguous' layout)."""
    batch = block_tables.shape[0]
    k = k_cache[block_tables.long()].reshape(batch, -1, *k_cache.shape[2:])[:, :context].contiguous()
    v = v_cache[block_tables.long()].reshape(batch, -1, *v_cache.shape[2:])[:, :context].contiguous()
    return k, v


def decode_bytes(q, k_cache, batch, context):
    """Bytes one decode step must move at least once: read K, V and q; write out."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    kv = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
    return kv + 2 * q.numel() * q.element_size()


# --------------------------------------------------------------------------- CPU sanity


def cpu_sanity() -> dict:
    """Tiny interpreter run of every kernel against the reference; no timings."""
    from minipaged.kernels import (
        HAS_TRITON,
        paged_attention_decode,
        paged_attention_prefill,
        paged_attention_prefill_ref,
        paged_attention_ref,
    )

    if not HAS_TRITON:
        print("Triton is not installed here: nothing to check. A CUDA GPU with Triton is needed.")
        return {"mode": "cpu-sanity", "triton": False}
    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.float16):
        q, k, v, bt, sl = make_decode_inputs(3, 40, 8, 4, 2, 64, dtype, "cpu")
        sl = torch.tensor([1, 17, 40], dtype=torch.int32)
        want = paged_attention_ref(q.float(), k.float(), v.float(), bt, sl)
        for name, kw in (
            ("decode_v1", dict(use_v2=False)),
            ("decode_v2", dict(use_v2=True, partition_size=16)),
        ):
            out = paged_attention_decode(q, k, v, bt, sl, block_n=16, **kw)
            results[f"{name}_{str(dtype).split('.')[-1]}"] = (out.float() - want).abs().max().item()
        cu = torch.tensor([0, 1, 9, 29], dtype=torch.int32)
        qp = torch.randn(29, 4, 64).to(dtype)
        want = paged_attention_prefill_ref(qp.float(), k.float(), v.float(), bt, cu, sl)
        out = paged_attention_prefill(qp, k, v, bt, cu, sl, block_m=16, block_n=16)
        results[f"prefill_{str(dtype).split('.')[-1]}"] = (out.float() - want).abs().max().item()
    print("CPU sanity pass (Triton interpreter, tiny shapes): max |kernel - reference|")
    for name, err in results.items():
        tol = 1e-5 if "float32" in name else 3e-3
        print(f"  {name:<20} {err:.2e}  {'ok' if err <= tol else 'FAIL'} (tol {tol:.0e})")
    print("No CUDA GPU here: the interpreter is for correctness only; a GPU is needed for timings.")
    ok = all(err <= (1e-5 if "float32" in n else 3e-3) for n, err in results.items())
    return {"mode": "cpu-sanity", "triton": True, "max_abs_err": results, "ok": ok}


# --------------------------------------------------------------------------- GPU sweep


def gpu_benchmark(args, device: str = "cuda") -> dict:
    import time

    from minipaged.kernels import paged_attention_decode

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None

    start_s = time.perf_counter()
    device = torch.device(device)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run (not a measurement)"
    peak = peak_bandwidth(name) if device.type == "cuda" else None
    H, KVH, D = args.num_heads, args.num_kv_heads, args.head_dim
    batches = [8, 64] if args.quick else [int(x) for x in args.batches.split(",")]
    contexts = [1024, 4096] if args.quick else [int(x) for x in args.contexts.split(",")]
    block_sizes = [int(x) for x in args.block_sizes.split(",")]

    def bench(fn):
        if device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100)  # ms per call
        start = time.perf_counter()  # dry run: one call, just to exercise the code
        fn()
        return (time.perf_counter() - start) * 1e3

    def time_all(batch, context, block_size):
        q, kc, vc, bt, sl = make_decode_inputs(batch, context, block_size, H, KVH, D, dtype, device)
        row = {"batch": batch, "context": context, "block_size": block_size}
        row["paged_ms"] = bench(lambda: paged_attention_decode(q, kc, vc, bt, sl, max_seq_len=context))
        k, v = contiguous_kv(kc, vc, bt, context)  # [B, L, KVH, D]
        # The same kernel over the same blocks in order: sequence b owns blocks b*n .. b*n+n-1.
        kc_in = k.reshape(-1, block_size, KVH, D) if context % block_size == 0 else None
        if kc_in is not None:
            vc_in = v.reshape(-1, block_size, KVH, D)
            bt_in = torch.arange(bt.numel(), dtype=torch.int32, device=device).reshape(bt.shape)
            row["inorder_ms"] = bench(
                lambda: paged_attention_decode(q, kc_in, vc_in, bt_in, sl, max_seq_len=context)
            )
        qs = q[:, :, None, :]  # [B, H, 1, D]
        ks, vs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, KVH, L, D]
        row["sdpa_ms"] = bench(lambda: sdpa_gqa(qs, ks, vs))  # torch's own choice of backend
        fused = {name: bench(fn) for name, fn in sdpa_backends(qs, ks, vs).items()}
        if fused:
            row["sdpa_backends_ms"] = fused  # each fused backend forced, where it takes these inputs
        if flash_attn_with_kvcache is not None and dtype != torch.float32 and device.type == "cuda":
            qf = q[:, None]  # [B, 1, H, D]
            row["flash_ms"] = bench(lambda: flash_attn_with_kvcache(qf, k, v, cache_seqlens=sl))
        nbytes = decode_bytes(q, kc, batch, context)
        row["paged_GBps"] = nbytes / row["paged_ms"] / 1e6
        row["paged_pct_peak"] = 100.0 * nbytes / (row["paged_ms"] * 1e-3) / peak if peak else None
        contiguous = {"sdpa": row["sdpa_ms"], **row.get("sdpa_backends_ms", {})}
        if "flash_ms" in row:
            contiguous["flash_attn"] = row["flash_ms"]
        row["contiguous_best"], best = min(contiguous.items(), key=lambda kv: kv[1])
        row["paged_over_contiguous"] = row["paged_ms"] / best
        if "inorder_ms" in row:
            row["paged_over_inorder"] = row["paged_ms"] / row["inorder_ms"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row

    # Measured device-to-device copy: the bandwidth a kernel can realistically reach.
    buf = torch.empty(1 << (28 if device.type == "cuda" else 20), dtype=torch.uint8, device=device)
    copy_ms = bench(lambda: buf.clone())
    measured_peak = 2 * buf.numel() / (copy_ms * 1e-3)
    buf = None  # free it before the sweep

    sweep = [time_all(b, c, 16) for b in batches for c in contexts]
    blocks = [time_all(args.sweep_batch, args.sweep_context, bs) for bs in block_sizes]
    targets = evaluate_targets(sweep, args.sweep_batch, args.sweep_context)
    if device.type != "cuda":
        targets["note"] = "dry run: CPU timings of the interpreter, not a measurement"

    print(f"\nGPU: {name}   dtype {args.dtype}   heads {H}/{KVH} kv   head_dim {D}")
    print(f"peak HBM (data sheet): {peak / 1e9:.0f} GB/s" if peak else "peak HBM: unknown for this GPU")
    print(f"measured copy bandwidth: {measured_peak / 1e9:.0f} GB/s\n")
    head = (
        f"{'batch':>5} {'ctx':>6} {'paged ms':>9} {'inorder':>8} {'sdpa ms':>8} {'flash ms':>9} "
        f"{'paged/contig':>12} {'GB/s':>7} {'% peak':>7}"
    )
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for r in sweep:
        pct = r["paged_pct_peak"]
        print(
            f"{r['batch']:>5} {r['context']:>6} {r['paged_ms']:>9.3f} {r.get('inorder_ms', nan):>8.3f} "
            f"{r['sdpa_ms']:>8.3f} {r.get('flash_ms', nan):>9.3f} {r['paged_over_contiguous']:>12.2f} "
            f"{r['paged_GBps']:>7.0f} {nan if pct is None else pct:>7.1f}"
        )
    base = next((r["paged_ms"] for r in blocks if r["block_size"] == 16), blocks[0]["paged_ms"])
    print(f"\nblock-size sweep at batch {args.sweep_batch} x context {args.sweep_context} (paper Fig. 18a)")
    print(f"{'block':>5} {'paged ms':>9} {'vs bs16':>8} {'GB/s':>7}")
    for r in blocks:
        print(
            f"{r['block_size']:>5} {r['paged_ms']:>9.3f} {r['paged_ms'] / base:>8.2f} {r['paged_GBps']:>7.0f}"
        )
    print("\n" + format_targets(targets))

    if args.figure:
        try:
            write_figure(args.figure, sweep, blocks, name)
            print(f"\nfigure: {args.figure}")
        except ImportError as e:  # matplotlib missing: the numbers still count
            print(f"\nno figure: {e}")
            args.figure = ""
    return {
        "mode": "gpu" if device.type == "cuda" else "dry-run",
        "gpu": name,
        "dtype": args.dtype,
        "num_heads": H,
        "num_kv_heads": KVH,
        "head_dim": D,
        "peak_bandwidth_Bps": peak,
        "measured_copy_bandwidth_Bps": measured_peak,
        "flash_attn": flash_attn_with_kvcache is not None,
        "sweep": sweep,
        "block_size_sweep": blocks,
        "targets": targets,
        "sdpa_enable_gqa": _SDPA_GQA,
        "figure": args.figure or None,
        "seconds": round(time.perf_counter() - start_s, 1),
        "torch": torch.__version__,
    }


_SDPA_GQA = None  # whether this torch's SDPA takes enable_gqa (torch >= 2.5)


def sdpa_gqa(q, k, v):
    """SDPA of q [B, H, Tq, D] over k, v [B, KVH, L, D]: ``enable_gqa`` where torch has it,
    else K/V repeated to H heads (which reads more memory: the ratio then flatters paging)."""
    global _SDPA_GQA
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if _SDPA_GQA is not False:
        try:
            out = sdpa(q, k, v, enable_gqa=True)
            _SDPA_GQA = True
            return out
        except TypeError:
            _SDPA_GQA = False
    group = q.shape[1] // k.shape[1]
    return sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def sdpa_backends(q, k, v) -> dict:
    """{"sdpa_<backend>": fn} for each fused SDPA backend (flash, efficient, cudnn) that runs
    these inputs when forced with ``torch.nn.attention.sdpa_kernel``; empty off CUDA."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3
        return {}
    if q.device.type != "cuda":
        return {}
    fns = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def fn(backend=backend):
            with sdpa_kernel(backend):
                return sdpa_gqa(q, k, v)

        try:
            fn()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - this backend does not take these inputs
            continue
        fns[f"sdpa_{name.split('_')[0].lower()}"] = fn
    return fns


def evaluate_targets(sweep, batch=64, context=4096) -> dict:
    """The two targets, from the block_size-16 sweep: None where the row was not measured."""
    row = next((r for r in sweep if r["batch"] == batch and r["context"] == context), None)
    worst = max((r["paged_over_contiguous"] for r in sweep), default=None)
    pct = None if row is None else row.get("paged_pct_peak")
    return {
        "shape": f"batch {batch} x context {context}",
        "paged_over_contiguous": None if row is None else round(row["paged_over_contiguous"], 3),
        "paged_over_contiguous_worst": None if worst is None else round(worst, 3),
        "ratio_target": TARGET_RATIO,
        "ratio_met": None if row is None else bool(row["paged_over_contiguous"] <= TARGET_RATIO),
        "pct_peak": None if pct is None else round(pct, 1),
        "pct_peak_target": TARGET_PCT_PEAK,
        "pct_peak_met": None if pct is None else bool(pct >= TARGET_PCT_PEAK),
    }


def format_targets(t: dict) -> str:
    def met(x):
        return "n/a" if x is None else ("met" if x else "MISSED")

    ratio = "-" if t["paged_over_contiguous"] is None else f"{t['paged_over_contiguous']:.2f}x"
    pct = "unknown peak" if t["pct_peak"] is None else f"{t['pct_peak']:.0f}% of peak"
    note = f" ({t['note']})" if t.get("note") else ""
    return (
        f"targets at {t['shape']}, block_size 16: paged/contiguous {ratio} (target <= {t['ratio_target']}x: "
        f"{met(t['ratio_met'])}); bandwidth {pct} (target >= {t['pct_peak_target']:.0f}%: "
        f"{met(t['pct_peak_met'])}); worst ratio over the sweep {t['paged_over_contiguous_worst']}{note}"
    )


def tune_decode(args, device: str = "cuda", budget_s=None) -> dict:
    """Time the decode kernel's launch options at the target shapes; the fastest of each.

    V1 at (sweep batch x context): block_n x num_warps x num_stages. Split-KV V2 at batch 8:
    partition_size x block_n. Each config is timed after one warm-up call (its compile);
    ``budget_s`` stops the sweep early (the rows done so far are kept).
    """
    import time

    import triton.testing

    from minipaged.kernels import paged_attention_decode

    start = time.perf_counter()
    device = torch.device(device)
    dtype = getattr(torch, args.dtype)
    H, KVH, D = args.num_heads, args.num_kv_heads, args.head_dim
    if args.dry_run:
        v1_grid = [dict(block_n=16, num_warps=2, num_stages=1), dict(block_n=32, num_warps=4, num_stages=2)]
        v2_grid = [dict(partition_size=16, block_n=16), dict(partition_size=32, block_n=16)]
        v2_batch = 1
    else:
        v1_grid = [
            dict(block_n=n, num_warps=w, num_stages=st)
            for n in (32, 64, 128)
            for w in (2, 4, 8)
            for st in (1, 2, 3)
        ]
        v2_grid = [dict(partition_size=p, block_n=n) for p in (256, 512, 1024) for n in (32, 64)]
        v2_batch = 8
    rows, stopped = [], None

    def timed(fn):
        if device.type != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=50)

    for kind, batch, grid in (("v1", args.sweep_batch, v1_grid), ("v2", v2_batch, v2_grid)):
        q, kc, vc, bt, sl = make_decode_inputs(batch, args.sweep_context, 16, H, KVH, D, dtype, device)
        nbytes = decode_bytes(q, kc, batch, args.sweep_context)
        for cfg in grid:
            if budget_s is not None and time.perf_counter() - start > budget_s:
                stopped = f"budget of {budget_s:.0f} s spent"
                break
            kw = dict(cfg, use_v2=(kind == "v2"), max_seq_len=args.sweep_context)
            row = {"kernel": kind, "batch": batch, "context": args.sweep_context, **cfg}
            try:
                paged_attention_decode(q, kc, vc, bt, sl, **kw)  # compile
                row["ms"] = timed(lambda: paged_attention_decode(q, kc, vc, bt, sl, **kw))
                row["GBps"] = nbytes / row["ms"] / 1e6
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: recorded
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    best = {}
    for kind in ("v1", "v2"):
        ok = [r for r in rows if r["kernel"] == kind and "ms" in r]
        if ok:
            best[kind] = min(ok, key=lambda r: r["ms"])
    print(f"\ntuning sweep ({len(rows)} configs{'; ' + stopped if stopped else ''}):")
    for kind, r in best.items():
        cfg = {k: v for k, v in r.items() if k not in ("kernel", "ms", "GBps", "batch", "context")}
        print(
            f"  fastest {kind} at batch {r['batch']} x {r['context']}: {r['ms']:.3f} ms, "
            f"{r['GBps']:.0f} GB/s with {cfg}"
        )
    return {"rows": rows, "best": best, "stopped": stopped, "seconds": round(time.perf_counter() - start, 1)}


def write_figure(path, sweep, blocks, gpu_name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in sweep}):
        rows = [r for r in sweep if r["batch"] == batch]
        ax1.plot(
            [r["context"] for r in rows],
            [r["paged_over_contiguous"] for r in rows],
            marker="o",
            label=f"batch {batch}",
        )
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.axhline(1.2, color="gray", lw=0.8, ls="--")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("context length (tokens)")
    ax1.set_ylabel("paged / best contiguous latency")
    ax1.set_title("decode: paged vs contiguous (block_size 16)")
    ax1.legend()
    ax2.plot([r["block_size"] for r in blocks], [r["paged_ms"] * 1e3 for r in blocks], marker="o")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("block size (tokens)")
    ax2.set_ylabel("paged decode latency (us)")
    ax2.set_title("block-size sweep (cf. paper Fig. 18a)")
    fig.suptitle(gpu_name)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.figure is None:
        args.figure = "" if args.dry_run else "figures/kernel_bench.png"
    if args.dry_run:
        args.batches, args.contexts, args.block_sizes = "1,2", "16,48", "8,16,32"
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 16
        args.sweep_batch, args.sweep_context, args.quick = 2, 48, False
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        device = None
    start = time.perf_counter()
    results = gpu_benchmark(args, device=device) if device else cpu_sanity()
    results["python"] = platform.python_version()
    write_json(args.json, results)
    if args.tune and device:
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
        results["tuning"] = tune_decode(args, device=device, budget_s=left)
        write_json(args.json, results)
    return 0 if results.get("ok", True) else 1


def write_json(path: str, results: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"json: {path}")


if __name__ == "__main__":
    sys.exit(main())
