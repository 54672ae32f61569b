"""PagedAttention decode kernel vs contiguous attention: latency and achieved bandwidth.

Reproduces the kernel half of the vLLM paper: §7.1 (the paged kernel was 20-26% slower
than FasterTransformer's contiguous one) and Fig. 18a (block-size sweep).

    python benchmarks/kernels.py                 # CUDA: full sweep; CPU: interpreter sanity pass
    python benchmarks/kernels.py --quick --json benchmarks/results/kernels_<gpu>.json
    python benchmarks/kernels.py --dry-run       # the GPU code path on tiny shapes, anywhere

On a CUDA GPU, for every (batch, context) it times
    paged    minipaged's Triton ``paged_attention_decode`` (V1 or split-KV V2, chosen by it),
             over a cache whose blocks are shuffled, block_size 16;
    sdpa     ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V;
    flash    ``flash_attn_with_kvcache`` on contiguous K/V, where flash-attn is installed;
then a block-size sweep 8..256 at one (batch, context). Achieved bandwidth counts the bytes
a decode step must read at least once (K, V, q) and write (out). It prints a table with
the ratios, writes a figure (default ``figures/kernel_bench.png``) and, with ``--json``, the
numbers. Targets on a Hopper GPU: paged/contiguous <= 1.2 at block_size 16, and >= 70% of
peak HBM bandwidth at batch 64 x 4k context.

On a machine without CUDA the kernels only run in Triton's interpreter, where timings mean
nothing: it checks the kernels against the torch reference on tiny shapes and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

# Peak HBM bandwidth (bytes/s) from the vendors' data sheets, matched on the device name.
PEAK_BANDWIDTH = {
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
    "L4": 0.3e12,
    "A10G": 0.6e12,
    "RTX 4090": 1.008e12,
    "RTX 3090": 0.936e12,
    "T4": 0.32e12,
}


def peak_bandwidth(name: str):
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
    p.add_argument("--figure", default=None,
                   help="where to write the figure (default figures/kernel_bench.png on a GPU; '' = none)")
    p.add_argument("--json", default="", help="write the results as JSON to this path")
    p.add_argument("--dry-run", action="store_true",
                   help="run the GPU code path on the CPU with tiny shapes (checks the script; timings meaningless)")
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
        for name, kw in (("decode_v1", dict(use_v2=False)), ("decode_v2", dict(use_v2=True, partition_size=16))):
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

    device = torch.device(device)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run (not a measurement)"
    peak = peak_bandwidth(name)
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
        qs = q[:, :, None, :]  # [B, H, 1, D]
        ks, vs = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, KVH, L, D]
        row["sdpa_ms"] = bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        )
        if flash_attn_with_kvcache is not None and dtype != torch.float32 and device.type == "cuda":
            qf = q[:, None]  # [B, 1, H, D]
            row["flash_ms"] = bench(lambda: flash_attn_with_kvcache(qf, k, v, cache_seqlens=sl))
        nbytes = decode_bytes(q, kc, batch, context)
        row["paged_GBps"] = nbytes / row["paged_ms"] / 1e6
        if peak:
            row["paged_pct_peak"] = 100.0 * nbytes / (row["paged_ms"] * 1e-3) / peak
        best = min(row[k] for k in ("sdpa_ms", "flash_ms") if k in row)
        row["paged_over_contiguous"] = row["paged_ms"] / best
        del q, kc, vc, bt, sl, k, v, ks, vs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row

    # Measured device-to-device copy: the bandwidth a kernel can realistically reach.
    buf = torch.empty(1 << (28 if device.type == "cuda" else 20), dtype=torch.uint8, device=device)
    copy_ms = bench(lambda: buf.clone())
    measured_peak = 2 * buf.numel() / (copy_ms * 1e-3)
    del buf

    sweep = [time_all(b, c, 16) for b in batches for c in contexts]
    blocks = [time_all(args.sweep_batch, args.sweep_context, bs) for bs in block_sizes]

    print(f"\nGPU: {name}   dtype {args.dtype}   heads {H}/{KVH} kv   head_dim {D}")
    print(f"peak HBM (data sheet): {peak / 1e9:.0f} GB/s" if peak else "peak HBM: unknown for this GPU")
    print(f"measured copy bandwidth: {measured_peak / 1e9:.0f} GB/s\n")
    head = f"{'batch':>5} {'ctx':>6} {'paged ms':>9} {'sdpa ms':>8} {'flash ms':>9} {'paged/contig':>12} {'GB/s':>7} {'% peak':>7}"
    print(head)
    print("-" * len(head))
    for r in sweep:
        print(
            f"{r['batch']:>5} {r['context']:>6} {r['paged_ms']:>9.3f} {r['sdpa_ms']:>8.3f} "
            f"{r.get('flash_ms', float('nan')):>9.3f} {r['paged_over_contiguous']:>12.2f} "
            f"{r['paged_GBps']:>7.0f} {r.get('paged_pct_peak', float('nan')):>7.1f}"
        )
    base = next((r["paged_ms"] for r in blocks if r["block_size"] == 16), blocks[0]["paged_ms"])
    print(f"\nblock-size sweep at batch {args.sweep_batch} x context {args.sweep_context} (paper Fig. 18a)")
    print(f"{'block':>5} {'paged ms':>9} {'vs bs16':>8} {'GB/s':>7}")
    for r in blocks:
        print(f"{r['block_size']:>5} {r['paged_ms']:>9.3f} {r['paged_ms'] / base:>8.2f} {r['paged_GBps']:>7.0f}")

    if args.figure:
        write_figure(args.figure, sweep, blocks, name)
        print(f"\nfigure: {args.figure}")
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
        "torch": torch.__version__,
    }


def write_figure(path, sweep, blocks, gpu_name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in sweep}):
        rows = [r for r in sweep if r["batch"] == batch]
        ax1.plot([r["context"] for r in rows], [r["paged_over_contiguous"] for r in rows], marker="o",
                 label=f"batch {batch}")
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
        results = gpu_benchmark(args, device="cuda" if torch.cuda.is_available() else "cpu")
    elif torch.cuda.is_available():
        results = gpu_benchmark(args)
    else:
        results = cpu_sanity()
    results["python"] = platform.python_version()
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"json: {args.json}")
    return 0 if results.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
