"""The "cpu" backend: decode attention in C, reading keys and values in place, and the small
layers of a decoder step in C.

Mirrors vLLM's CPU backend (``vllm/v1/attention/backends/cpu_attn.py`` calling the kernels of
``csrc/cpu/attention.cpp``, and ``csrc/cpu/layernorm.cpp``, ``pos_encoding.cpp``,
``activation.cpp``): on a CPU, the torch backend's cost at decode is not arithmetic but data
movement and op count (gather every block, a dozen small ops per layer). One C loop per
sequence reads each key and value once, in place through the block table, and keeps the
logits in a scratch buffer: the structure of the original PagedAttention V1 kernel (chapter 03).
Where a group of four query heads shares a KV head (GQA), it loads each key and value row once
for the four. ``csrc/paged_attention_cpu.c`` holds the attention, ``csrc/layers_cpu.c``
RMSNorm (with vLLM's fused residual add), neox RoPE and SiLU-and-mul, the ``forward_cpu`` of
``minipaged.model.layers``.

Inputs / outputs
    ``paged_attention_decode_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale)``: the
    decode contract of ``reference.paged_attention_ref`` (q [B, H, D] -> [B, H, D]).
    ``paged_attention_cpu(...)``: the varlen contract of ``torch_backend.paged_attention_torch``: decode rows
    go to the C kernel; so do the rows of short prefill chunks (every chunk at most
    ``ROWS_AS_DECODES_MAX_QUERY`` tokens), each as a decode query over its causal prefix
    (``plan_rows_as_decodes``: row i of a sequence attends to its first ``cached + i + 1``
    tokens, which the cache holds since it is written first); longer chunks go to the torch
    backend's padded SDPA buckets.
    ``reshape_and_cache_cpu(...)``: ``cache_ops.reshape_and_cache`` in C.
    ``rms_norm_cpu``, ``rotary_neox_cpu`` (in place), ``silu_and_mul_cpu``: the small layers.
    ``CPUAttentionBackend``: the backend object an attention layer calls (``kernels.selector``).

Invariants
    float32 CPU tensors, caches contiguous ``[num_blocks, block_size, KVH, D]`` (or int8 /
    float8_e4m3fn caches, ``kv_cache_dtype``: the decode kernel reads them through a table of what
    each byte means; their writes go through the torch ``reshape_and_cache``, which quantizes); results equal
    the torch reference to float rounding (``tests/kernels/test_kernels_cpu.py``,
    ``tests/model/test_layers_cpu.py``); an index out of range (block table, slot, RoPE position) is an
    ``IndexError`` raised before anything is read or written out of bounds.

Failure mode
    The library is compiled on first use with the system C compiler (``$CC``, else ``cc``) into
    ``$MINIPAGED_CACHE_DIR`` (default ``~/.cache/minipaged``, else a temporary folder), keyed by
    the sources, the flags and the machine. ``available()`` says whether that works here; when it does not, asking for the
    backend raises ``RuntimeError`` naming the compiler's error (``EngineConfig`` checks it up
    front and raises ``ValueError``). Other dtypes or devices raise ``ValueError``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from minipaged.kernels.cache_ops import reshape_and_cache
from minipaged.kernels.quant import check_kv_scales, is_quantized
from minipaged.kernels.reference import _check_cache, _default_scale
from minipaged.kernels.torch_backend import attend_prefills, build_attn_metadata

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "paged_attention_cpu.c"  # the attention kernel (chapter 03 tours it)
# Everything compiled into the one library: the attention kernel, the small layers
# (``layers_cpu.c``: RMSNorm, RoPE, SiLU-and-mul) and the header they share.
SOURCES = (SOURCE, CSRC / "layers_cpu.c")
HEADERS = (CSRC / "exp_nonpos.h",)
# -ffast-math lets the compiler reorder the sums so that they vectorize; it is given to the
# compile step only: linking with it would pull in crtfastmath.o, which sets flush-to-zero for
# the whole process when the library is loaded.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fPIC", "-std=c99")
NATIVE_FLAGS = ("-march=native",)


def _machine_key() -> str:
    """What a ``-march=native`` binary depends on: the architecture and the CPU model."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith(("model name", "flags"))), cpu)
    except OSError:
        pass
    return f"{platform.machine()}|{sys.platform}|{cpu}"


def _cache_dir() -> Path:
    """``$MINIPAGED_CACHE_DIR``, else ``~/.cache/minipaged``; a temporary folder of this user's
    where the home folder cannot be written (a sandboxed grader, a read-only container)."""
    if os.environ.get("MINIPAGED_CACHE_DIR"):
        return Path(os.environ["MINIPAGED_CACHE_DIR"])
    home = Path.home() / ".cache" / "minipaged"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"minipaged-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _compile(out: Path) -> None:
    """Compile SOURCES into the shared library ``out``; -march=native when the compiler takes it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (NATIVE_FLAGS, ()):
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            objs = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
            lib = Path(tmp) / "k.so"
            steps = [
                [cc, *COMPILE_FLAGS, *extra, "-I", str(CSRC), "-c", str(src), "-o", str(obj)]
                for src, obj in zip(SOURCES, objs)
            ] + [[cc, "-shared", *map(str, objs), "-o", str(lib)]]
            for cmd in steps:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if res.returncode != 0:
                    errors.append(f"{' '.join(cmd)}: {res.stderr.strip()[:500]}")
                    break
            else:
                os.replace(lib, out)  # atomic: concurrent builders never see half a library
                return
    raise RuntimeError("could not compile the cpu kernels: " + " | ".join(errors))


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """The compiled kernel library, built once per (source, flags, machine) and cached on disk."""
    key = hashlib.sha256(
        b"".join(f.read_bytes() for f in SOURCES + HEADERS)
        + repr((COMPILE_FLAGS, NATIVE_FLAGS, _machine_key())).encode()
    ).hexdigest()[:16]
    path = _cache_dir() / f"paged_attention_cpu_{key}.so"
    if not path.exists():
        _compile(path)
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_attention_decode_f32.argtypes = [p, i64, p, p, i64, p, p, p] + [i64] * 6 + [ctypes.c_float]
    lib.paged_attention_decode_f32.restype = i64
    lib.paged_attention_decode_q8.argtypes = [p, i64, p, p, p, p, i64, p, p, p] + [i64] * 6 + [ctypes.c_float]
    lib.paged_attention_decode_q8.restype = i64
    lib.reshape_and_cache_f32.argtypes = [p, i64, p, i64, p, p, i64, p, i64, i64]
    lib.reshape_and_cache_f32.restype = i64
    lib.rms_norm_f32.argtypes = [p, p, p, p, i64, i64, ctypes.c_float]
    lib.rms_norm_f32.restype = None
    lib.rotary_neox_f32.argtypes = [p, i64, i64, i64, i64, p, p, p, i64]
    lib.rotary_neox_f32.restype = i64
    lib.silu_and_mul_f32.argtypes = [p, p, i64, i64]
    lib.silu_and_mul_f32.restype = None
    return lib


@lru_cache(maxsize=1)
def build_error() -> Optional[str]:
    """None when the kernel compiles and loads here, else why not (one line)."""
    try:
        _library()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None


def available() -> bool:
    """Whether the "cpu" backend can run here (a C compiler that builds the kernel)."""
    return build_error() is None


def _lib() -> ctypes.CDLL:
    err = build_error()
    if err is not None:
        raise RuntimeError(f"attention_backend='cpu' is unavailable here: {err}")
    return _library()


def _check(name: str, t: torch.Tensor, dtype=torch.float32) -> None:
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(
            f"{name} must be a {dtype} CPU tensor for the cpu kernel, got {t.dtype} on {t.device}"
        )


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, A, D] (float32, CPU) with each row's A x D floats contiguous; rows may be apart."""
    _check(name, t)
    if t.dim() != 3:
        raise ValueError(f"{name} must be [rows, heads, head_dim], got shape {tuple(t.shape)}")
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping) -> None:
    """``cache_ops.reshape_and_cache`` in C: token i's K/V into slot ``slot_mapping[i]`` (< 0: skip)."""
    key, value = _rows("key", key), _rows("value", value)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, t)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the cpu kernel")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)}: want two [N, bs, KVH, D]"
        )
    if key.shape[1:] != k_cache.shape[2:] or value.shape != key.shape:
        raise ValueError(f"key/value {tuple(key.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    slots = slot_mapping.to(torch.int64).contiguous()
    bad = _lib().reshape_and_cache_f32(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.shape[0] * k_cache.shape[1], slots.data_ptr(), key.shape[0],
        k_cache.shape[2] * k_cache.shape[3],
    )  # fmt: skip
    if bad:
        raise IndexError(f"slot_mapping[{bad - 1}] = {int(slots[bad - 1])} is outside the cache")


def _byte_table(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What each of the 256 bytes of an int8 / float8_e4m3fn cache stands for, times ``scale``:
    [256] float32, decoded by torch itself (so the C kernel reads what the reference reads)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float() * scale


def paged_attention_decode_cpu(
    q, k_cache, v_cache, block_tables, seq_lens, scale=None, k_scale=1.0, v_scale=1.0
) -> torch.Tensor:
    """Decode attention through block tables, in C. q [B, H, D] -> [B, H, D] (float32, CPU).
    An int8 / float8_e4m3fn cache (``quant.py``) is read through two 256-entry tables of what
    each byte means times ``k_scale`` / ``v_scale`` (``paged_attention_decode_q8``)."""
    _check_cache(q, k_cache, v_cache)
    check_kv_scales("paged_attention_decode_cpu", k_cache, k_scale, v_scale)
    q = _rows("q", q)
    quantized = is_quantized(k_cache.dtype) and v_cache.dtype == k_cache.dtype
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if quantized:
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor for the cpu kernel, got {t.device}")
        else:
            _check(name, t)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the cpu kernel")
    num_seqs, num_heads, head_dim = q.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    tables, lens = tables.contiguous(), lens.contiguous()
    out = q.new_empty(q.shape)
    geometry = (num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], tables.shape[1])
    if quantized:
        k_table, v_table = _byte_table(k_cache.dtype, k_scale), _byte_table(v_cache.dtype, v_scale)
        bad = _lib().paged_attention_decode_q8(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_table.data_ptr(),
            v_table.data_ptr(), k_cache.shape[0], tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
            *geometry, _default_scale(head_dim, scale),
        )  # fmt: skip
    else:
        bad = _lib().paged_attention_decode_f32(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), *geometry, _default_scale(head_dim, scale),
        )  # fmt: skip
    if bad < 0:
        raise MemoryError("the cpu attention kernel could not allocate its logits buffer")
    if bad:
        raise IndexError(
            f"sequence {bad - 1}: seq_len {int(lens[bad - 1])} reads a block outside the cache "
            "or beyond its block table"
        )
    return out


# A prefill chunk of at most this many tokens is attended in C, row by row: each row reads its
# prefix once, which on one thread costs less than gathering, padding and masking the chunk
# for SDPA; longer chunks keep SDPA, whose matmuls use every torch thread.
# ``tests/kernels/test_kernels_cpu.py`` holds both paths to the reference.
ROWS_AS_DECODES_MAX_QUERY = 128


@dataclass
class RowsAsDecodes:
    """The plan of a step whose every row goes to the C decode kernel: per query row, its
    sequence's block table and the length of its causal prefix (``plan_rows_as_decodes``)."""

    block_tables: torch.Tensor  # [T, max_blocks] int32: row t's sequence's table
    seq_lens: torch.Tensor  # [T] int32: cached tokens before the chunk + t's place in it + 1


def plan_rows_as_decodes(block_tables, cu_seqlens_q, seq_lens) -> RowsAsDecodes:
    """Row t of sequence b (``cu[b] <= t < cu[b + 1]``) as a decode query: table ``block_tables[b]``,
    length ``seq_lens[b] - (cu[b + 1] - t) + 1``."""
    cu = cu_seqlens_q.to(torch.long)
    q_lens = cu[1:] - cu[:-1]  # [B]
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)  # [T]
    ends = seq_lens.to(torch.long) - cu[1:]  # [B]: row t's length is t + ends[b] + 1
    lens = torch.arange(seq_of_row.shape[0]) + ends[seq_of_row] + 1  # [T]
    tables = block_tables.to(torch.int32).index_select(0, seq_of_row).contiguous()
    return RowsAsDecodes(tables, lens.to(torch.int32).contiguous())


def plan_attention(block_tables, cu_seqlens_q, seq_lens, max_query_len: int, block_size: int, row_cost: int):
    """The step's plan for ``paged_attention_cpu`` (built once per step, shared by every layer):
    ``RowsAsDecodes`` when every chunk is short, else the SDPA buckets of the prefill rows
    (``build_attn_metadata(..., decodes=False)``; ``row_cost`` = heads * head_dim)."""
    if max_query_len <= ROWS_AS_DECODES_MAX_QUERY:
        return plan_rows_as_decodes(block_tables, cu_seqlens_q, seq_lens)
    return build_attn_metadata(block_tables, cu_seqlens_q, seq_lens, block_size, row_cost, decodes=False)


def paged_attention_cpu(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, max_seq_len, scale=None,
    metadata=None, k_scale=1.0, v_scale=1.0,
) -> torch.Tensor:  # fmt: skip
    """``paged_attention_torch``'s contract (q [T, H, D] -> [T, H, D]): decode rows in C; prefill
    rows in C too when every chunk is short, else in the torch backend's padded SDPA buckets.
    ``metadata``: ``plan_attention(...)`` for this step, built here when None."""
    if max_query_len == 1:  # decode only: every row is its sequence's one query
        return paged_attention_decode_cpu(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale
        )
    if metadata is None:
        metadata = plan_attention(
            block_tables, cu_seqlens_q, seq_lens, max_query_len, k_cache.shape[1], q.shape[1] * q.shape[2]
        )
    if isinstance(metadata, RowsAsDecodes):
        return paged_attention_decode_cpu(
            q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, k_scale, v_scale
        )
    scale = _default_scale(q.shape[2], scale)
    out = torch.empty_like(q)  # [T, H, D]
    rows = metadata.decode_rows
    if rows is not None and rows.shape[0] > 0:
        seqs = metadata.decode_seqs
        out[rows] = paged_attention_decode_cpu(
            q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale, k_scale, v_scale
        )  # [Bd, H, D]
    attend_prefills(q, k_cache, v_cache, block_tables, seq_lens, metadata, scale, out, k_scale, v_scale)
    return out


class CPUAttentionBackend:
    """The "cpu" backend (``torch_backend.TorchAttentionBackend`` has the face every backend has):
    K/V written in C (the torch writer quantizes an int8 / fp8 cache), attention through
    ``paged_attention_cpu``; the small layers run in C too (``layer_impl``)."""

    name = "cpu"
    layer_impl = "cpu"

    def build_metadata(self, inp, block_size: int, row_cost: int):
        if inp.is_decode_only:  # every row goes to the C decode kernel: nothing to plan
            return None
        return plan_attention(
            inp.block_tables, inp.cu_seqlens_q, inp.seq_lens, inp.max_query_len, block_size, row_cost
        )

    def forward(self, layer, q, k, v, kv_cache, inp):
        k_cache, v_cache = kv_cache
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
        if is_quantized(k_cache.dtype):
            reshape_and_cache(k, v, k_cache, v_cache, inp.slot_mapping, **scales)
        else:
            reshape_and_cache_cpu(k, v, k_cache, v_cache, inp.slot_mapping)
        return paged_attention_cpu(
            q, k_cache, v_cache, inp.block_tables, inp.cu_seqlens_q, inp.seq_lens,
            inp.max_query_len, inp.max_seq_len, layer.scale, inp.attn_metadata, **scales,
        )  # fmt: skip


# -- the small layers (csrc/layers_cpu.c): forward_cpu of RMSNorm, RoPE, SiLU-and-mul -------
def _contiguous_2d(name: str, t: torch.Tensor) -> None:
    _check(name, t)
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous [rows, n] tensor, got shape {tuple(t.shape)}")


def rms_norm_cpu(x, weight, eps: float, residual=None):
    """RMSNorm of x [T, hidden] in C. With ``residual``: ``residual += x`` in place first and the
    sum is normalised (vLLM's ``fused_add_rms_norm``); returns ``(out, residual)`` then, else out."""
    _contiguous_2d("x", x)
    _check("weight", weight)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None:
        _contiguous_2d("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    out = torch.empty_like(x)
    _lib().rms_norm_f32(
        out.data_ptr(), x.data_ptr(), None if residual is None else residual.data_ptr(),
        weight.data_ptr(), x.shape[0], x.shape[1], eps,
    )  # fmt: skip
    return out if residual is None else (out, residual)


def rotary_neox_cpu(x, positions, cos_cache, sin_cache, num_heads: int, head_dim: int) -> None:
    """Neox RoPE in place on the first ``num_heads * head_dim`` columns of x [T, >=] (rows may be
    apart, e.g. the q and k columns of a fused qkv output), at ``positions`` [T] (int64), with
    cos/sin caches [max_positions, head_dim / 2] (``RotaryEmbedding.cos_cache``)."""
    _check("x", x)
    for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        _check(name, t)
        if t.dim() != 2 or t.shape[1] != head_dim // 2 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [max_positions, {head_dim // 2}], got {tuple(t.shape)}"
            )
    if head_dim % 2 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < num_heads * head_dim:
        raise ValueError(
            f"x must be [T, >= {num_heads} * {head_dim}] with contiguous rows and head_dim even, "
            f"got shape {tuple(x.shape)}"
        )
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be [{x.shape[0]}], got {tuple(positions.shape)}")
    pos = positions.to(torch.int64).contiguous()
    bad = _lib().rotary_neox_f32(
        x.data_ptr(), x.stride(0), x.shape[0], num_heads, head_dim, pos.data_ptr(),
        cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0],
    )  # fmt: skip
    if bad:
        raise IndexError(
            f"positions[{bad - 1}] = {int(pos[bad - 1])} is outside the RoPE table "
            f"(0 .. {cos_cache.shape[0] - 1}); nothing was rotated"
        )


def silu_and_mul_cpu(x):
    """silu(x[:, :n]) * x[:, n:] in C for x [T, 2n] (the fused gate_up output) -> [T, n]."""
    _contiguous_2d("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even number of columns (gate, up), got {x.shape[1]}")
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    _lib().silu_and_mul_f32(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1] // 2)
    return out
