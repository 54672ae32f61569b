"""Compile the Triton kernels for NVIDIA GPUs on a machine without one: errors and shared memory.

    python benchmarks/gpu_aot_check.py [--arch 80,89,90] [--json OUT.json]

Triton's wheel carries ``ptxas``, so ``triton.compile`` can build a kernel for a GPU target
(``GPUTarget("cuda", 90, 32)``) on any machine: the interpreter hides what only the GPU
compiler sees (``tl.dot`` shape rules, layouts, shared memory). For each launch the wrappers
make (decode V1 / split-KV V2 / prefill at their default tiles, ``NUM_WARPS`` and the
``_num_stages`` rule; ``reshape_and_cache``), in bf16, fp16 and fp32, it prints the shared
memory the compiled kernel asks for against what each architecture allows one program
(sm_80 A100: 163 KiB, sm_86 / sm_89 RTX 30xx/40xx, L4, L40S: 99 KiB, sm_90 H100/H200: 227 KiB).
Output: a table; with ``--json``, the rows. Exit status 1 if a kernel failed to compile or
would not fit. A pre-flight for the GPU check; no numbers here are timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"  # compile, even without a GPU (before minipaged.kernels)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import minipaged.kernels.cache_ops_triton as co  # noqa: E402
import minipaged.kernels.paged_attention as pa  # noqa: E402

SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": (tl.bfloat16, "tf32"), "fp16": (tl.float16, "tf32"), "fp32": (tl.float32, "ieee")}
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
INT_PTRS = ("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr", "slot_mapping_ptr")
FP32_PTRS = ("exp_sums_ptr", "max_logits_ptr", "tmp_out_ptr")
# How the JIT specializes a real launch: an int equal to 1 becomes a constant, and ints that are
# multiples of 16 are marked so. Without this the head_dim stride is unknown, the K/V loads are
# not vectorized and not pipelined, and the shared memory printed would be too small.
UNIT_STRIDES = ("stride_qd", "stride_od", "stride_kd", "stride_vd")


def _multiple_of_16(name: str) -> bool:
    """Strides of q, out and the caches are multiples of head_dim (64..256); head_dim too."""
    return name == "head_dim" or (
        name.startswith("stride_")
        and name not in UNIT_STRIDES
        and not name.startswith(("stride_p", "stride_t", "stride_bt"))
    )


def compile_kernel(fn, dtype: str, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    """``triton.compile`` of JIT function ``fn`` for sm_``arch``, specialized like a launch on
    contiguous tensors: pointers 16-byte aligned, unit head_dim strides, other strides x 16."""
    sig, const = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name in UNIT_STRIDES:
            sig[name] = "constexpr"
            const[(i,)] = constexprs.get(name, 1)
        elif name in INT_PTRS:
            sig[name] = "*i64" if name == "slot_mapping_ptr" else "*i32"
        elif name in FP32_PTRS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        elif name in ("qk_scale", "k_scale", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n.endswith("_ptr") or (_multiple_of_16(n) and n not in constexprs)
    }
    return triton.compile(
        ASTSource(fn, sig, const, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def launches(head_dim: int = 128, group: int = 4, block_size: int = 16):
    """(name, fn, dtype, constexprs, num_stages) for the launches the wrappers make by default."""
    import torch

    d = pa._next_pow2(head_dim)
    for dtype, (cdt, prec) in DTYPES.items():
        tdt = getattr(torch, TORCH_DTYPE[dtype])
        # NOTE: the unquantized cache (KV_QUANT=False), what kv_cache_dtype="auto" launches
        common = dict(block_size=block_size, BLOCK_D=d, COMPUTE_DTYPE=cdt, DOT_PRECISION=prec, KV_QUANT=False)
        dec = dict(common, BLOCK_G=pa._next_pow2(group), BLOCK_N=pa.DECODE_BLOCK_N)
        stages = pa._num_stages(pa.DECODE_BLOCK_N, d, tdt)
        yield "decode_v1", pa._paged_attention_decode_kernel, dtype, dict(dec, PARTITION_SIZE=0), stages
        yield (
            "decode_v2",
            pa._paged_attention_decode_kernel,
            dtype,
            dict(dec, PARTITION_SIZE=pa.PARTITION_SIZE),
            stages,
        )
        pre = dict(common, BLOCK_M=pa.PREFILL_BLOCK_M, BLOCK_N=pa.PREFILL_BLOCK_N)
        yield (
            "prefill",
            pa._paged_attention_prefill_kernel,
            dtype,
            pre,
            pa._num_stages(pa.PREFILL_BLOCK_N, d, tdt),
        )
    yield (
        "reshape_and_cache",
        co._reshape_and_cache_kernel,
        "bf16",
        dict(block_size=block_size, BLOCK_H=8, BLOCK_D=d, QUANT=False),
        3,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="80,89,90", help="comma-separated compute capabilities (80 = sm_80)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--only", default="", help="comma-separated kernel names/dtypes to keep, e.g. decode_v1:bf16"
    )
    p.add_argument(
        "--num-stages",
        type=int,
        default=None,
        help="compile with this many stages instead of the wrappers' _num_stages rule",
    )
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    rows, bad = [], 0
    print(
        f"{'kernel':<18} {'dtype':<5} {'arch':>4} {'warps':>5} {'stages':>6} {'shared KiB':>10} {'limit':>6}  status"
    )
    for name, fn, dtype, constexprs, stages in launches(args.head_dim):
        if only and f"{name}:{dtype}" not in only:
            continue
        stages = stages if args.num_stages is None else args.num_stages
        for arch in (int(a) for a in args.arch.split(",")):
            row = {
                "kernel": name,
                "dtype": dtype,
                "arch": arch,
                "num_warps": pa.NUM_WARPS,
                "num_stages": stages,
                "head_dim": args.head_dim,
            }
            t = time.perf_counter()
            try:
                k = compile_kernel(fn, dtype, constexprs, arch, pa.NUM_WARPS, stages)
                row["shared"] = int(k.metadata.shared)
                row["status"] = "ok" if row["shared"] <= SMEM_LIMIT[arch] else "too much shared memory"
            except Exception as e:  # noqa: BLE001 - a compile error is the finding
                row["status"] = f"{type(e).__name__}: {e}"[:300]
            row["compile_s"] = round(time.perf_counter() - t, 1)
            bad += row["status"] != "ok"
            rows.append(row)
            shared = f"{row['shared'] / 1024:.1f}" if "shared" in row else "-"
            print(
                f"{name:<18} {dtype:<5} {arch:>4} {row['num_warps']:>5} {stages:>6} {shared:>10} "
                f"{SMEM_LIMIT[arch] // 1024:>6}  {row['status']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
