"""Which attention backend runs, decided in one place.

Mirrors vLLM ``vllm/attention/selector.py`` (``get_attn_backend``) and the platform's
``get_attn_backend_cls`` (``vllm/platforms/cuda.py``, ``cpu.py``): the engine asks once, with the
device, the model dtype and the KV-cache dtype, and gets one backend name back; the model then
holds that backend's object (``attn_backend(name)``, set by ``PagedCausalLM.use_backend``), the
runner has it plan each step and every attention layer calls its ``forward``.

Inputs
    ``get_attn_backend(name, device, dtype, kv_cache_dtype, block_size=None)``: ``name`` one of
    ``ATTENTION_BACKENDS`` or ``"auto"``; ``device`` "cpu" / "cuda[:i]"; ``dtype`` the model
    dtype ("float32", "float16", "bfloat16"); ``kv_cache_dtype`` one of ``KV_CACHE_DTYPES``.
    ``attn_backend(name)``: the backend object of a resolved name.
Output
    the backend name, "auto" resolved: "triton" on a GPU with Triton installed (and a
    ``block_size`` the kernel addresses); "cpu" (the C kernels) on a CPU in float32 where a C
    compiler builds them; else "torch", which runs everywhere.

    The object (``torch_backend.TorchAttentionBackend``, ``triton_backend.TritonAttentionBackend``,
    ``cpu.CPUAttentionBackend``, one per process) has ``name``, ``layer_impl`` (what the small
    layers run: "cpu" = C), ``build_metadata(inp, block_size, row_cost)`` and
    ``forward(layer, q, k, v, kv_cache, inp)``.

Backends and what each runs
    ======== ================================ =========================================
    backend  device / model dtype             kv_cache_dtype
    ======== ================================ =========================================
    torch    any / any                        auto, fp8 (= fp8_e4m3), int8
    triton   CUDA (or TRITON_INTERPRET=1) /   auto, int8; fp8 on compute capability
             any; block_size a power of two   >= 8.9 (Triton has no e4m3 before Ada)
             in 1..256
    cpu      CPU / float32, a C compiler      auto, fp8 (= fp8_e4m3), int8
    ======== ================================ =========================================

Failure mode
    ``ValueError`` naming the argument, and for a combination that cannot run, both the backend
    and what it cannot run (the device, the dtype or the KV-cache dtype). Cheap to call: the C
    library is compiled (once, cached on disk) only when "cpu" or "auto" on a CPU is asked for.
"""

from __future__ import annotations

import importlib.util

from minipaged.kernels.quant import KV_CACHE_DTYPES

ATTENTION_BACKENDS = ("torch", "triton", "cpu")
TRITON_MAX_BLOCK_SIZE = 256  # what the Triton kernel addresses (paged_attention.py, _check_common)


def _triton_block_size_ok(block_size) -> bool:
    return block_size is None or (
        1 <= block_size <= TRITON_MAX_BLOCK_SIZE and not block_size & (block_size - 1)
    )


def _cuda_capability(device: str):
    """(major, minor) of a CUDA device, or None when there is none to ask."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_capability(index)


def get_attn_backend(
    name: str = "auto",
    device: str = "cpu",
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
    block_size=None,
) -> str:
    """The attention backend to run: ``name`` checked against the rest, "auto" resolved."""
    if name not in ATTENTION_BACKENDS + ("auto",):
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS + ('auto',)}, got {name!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    kind = device.split(":")[0]
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if kind == "cuda" and has_triton and _triton_block_size_ok(block_size):
            name = "triton"
            if kv_cache_dtype.startswith("fp8") and (_cuda_capability(device) or (9, 0)) < (8, 9):
                name = "torch"  # no e4m3 in Triton on this GPU
        elif kind == "cpu" and dtype == "float32":
            from minipaged.kernels import cpu as cpu_kernels

            name = "cpu" if cpu_kernels.available() else "torch"
        else:
            name = "torch"
    if name == "triton":
        if not _triton_block_size_ok(block_size):
            raise ValueError(
                f"block_size must be a power of two in 1..{TRITON_MAX_BLOCK_SIZE} with "
                f"attention_backend='triton' (the kernel's requirement), got {block_size}"
            )
        if not has_triton:
            raise ValueError("attention_backend='triton' needs Triton installed (pip install triton)")
        if kv_cache_dtype.startswith("fp8") and kind == "cuda":
            cap = _cuda_capability(device)
            if cap is not None and cap < (8, 9):
                raise ValueError(
                    f"kv_cache_dtype={kv_cache_dtype!r} is not supported by attention_backend='triton' "
                    f"on {device} (compute capability {cap[0]}.{cap[1]}; Triton's e4m3 needs >= 8.9): "
                    "use kv_cache_dtype='int8' or attention_backend='torch'"
                )
    if name == "cpu":
        if kind != "cpu" or dtype != "float32":
            raise ValueError(
                "attention_backend='cpu' runs float32 on the CPU (device='cpu', dtype='float32'), "
                f"got device={device!r}, dtype={dtype!r}"
            )
        from minipaged.kernels import cpu as cpu_kernels

        if not cpu_kernels.available():
            raise ValueError(f"attention_backend='cpu' is unavailable here: {cpu_kernels.build_error()}")
    return name


_BACKENDS: dict = {}


def attn_backend(name: str):
    """The backend object for ``name`` (one of ``ATTENTION_BACKENDS``), made once per process."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name not in _BACKENDS:
        if name == "torch":
            from minipaged.kernels.torch_backend import TorchAttentionBackend as cls
        elif name == "triton":
            from minipaged.kernels.triton_backend import TritonAttentionBackend as cls
        else:
            from minipaged.kernels.cpu import CPUAttentionBackend as cls
        _BACKENDS[name] = cls()
    return _BACKENDS[name]


def keep_triton_out(config) -> bool:
    """In a process that will run no Triton kernel (``config``'s backend, resolved once by
    ``EngineConfig`` with ``get_attn_backend``, is not "triton", and its device is a CPU), make ``import triton`` fail as if Triton were not
    installed (``sys.modules["triton"] = None``); returns whether it did. For processes
    that serve one engine only (``minipaged serve``, its engine core), before any model loads.

    NOTE: minipaged imports Triton only where its kernels run (``kernels/__init__.py``), but
    transformers' model code imports ``torch._dynamo``, which imports Triton whenever it is
    installed: a second of start-up, and dozens of nanobind "leaked" lines at exit. torch
    runs without Triton on a CPU. A no-op once Triton is imported, or on a CUDA device
    (torch may compile there)."""
    import sys

    if not str(config.device).startswith("cpu") or "triton" in sys.modules:
        return False
    if config.attention_backend == "triton":  # NOTE: under TRITON_INTERPRET=1: its kernels run here
        return False
    sys.modules["triton"] = None
    return True
