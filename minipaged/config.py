"""EngineConfig: every knob of one engine, validated when it is built.

Mirrors vLLM ``vllm/config.py`` (``CacheConfig``, ``SchedulerConfig``, ``ModelConfig``
folded into one flat dataclass: a course engine has few enough knobs to read at once).

Inputs
    the keyword arguments of ``LLM(...)``, plus a few with defaults:
    ``kv_cache_memory`` (bytes of device memory for K and V when ``num_blocks`` is None),
    ``num_cpu_blocks`` (size of the CPU swap pool; None -> as many as the device pool when
    ``preemption_mode="swap"``, else 0) and ``max_model_len`` (None -> the model's context).

Outputs
    a frozen-after-validation plain object the engine reads; ``num_blocks_for(bytes_per_block)``
    sizes the pool from the memory budget once the model (and so the bytes per block) is known.

Invariants
    every field has the type and range checked in ``__post_init__``; ``check_invariants()``
    re-runs the same checks.

Failure mode
    a bad value raises ``ValueError`` naming the argument: also, at construction, an
    attention backend that cannot run with this device, dtype, block size or KV-cache dtype
    (``minipaged.kernels.selector.get_attn_backend``, which also resolves "auto"); and in
    ``num_blocks_for``, before anything is allocated, a KV cache (device
    pool + CPU swap pool) larger than the memory available (``available_memory``: the
    host's MemAvailable and cgroup limit, or ``torch.cuda.mem_get_info``). Importing this module
    is cheap (no torch); building a config imports ``minipaged.kernels`` to choose the backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

PREEMPTION_MODES = ("recompute", "swap")
# n > 1: "prefix" = vLLM v1 (n child requests sharing the prompt through prefix caching);
# "fork" = the paper's sequence group (prefill once, fork with copy-on-write)
PARALLEL_SAMPLING = ("prefix", "fork")
SCHEDULING_POLICIES = ("continuous", "static")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# bytes per cached element for each kv_cache_dtype (None: the model dtype's), vLLM's names
KV_CACHE_BYTES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "int8": 1}
DEFAULT_KV_CACHE_MEMORY = 64 * 1024 * 1024  # 64 MiB: ample for the course model on a CPU


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_host_memory() -> Optional[int]:
    """Bytes of host memory free for new allocations, or None if unknown: MemAvailable
    (``/proc/meminfo``; else free pages from ``os.sysconf``), capped by a cgroup v2 limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    limit = _read_int("/sys/fs/cgroup/memory.max")
    used = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        avail = min(avail, max(0, limit - used))
    return avail


def available_memory(device: str) -> Optional[int]:
    """Bytes free on ``device`` ("cpu" -> the host; "cuda[:i]" -> that GPU), None if unknown."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None  # NOTE: the model loader says so in one sentence
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return None
        return int(torch.cuda.mem_get_info(index)[0])
    if device == "cpu":
        return available_host_memory()
    return None


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class EngineConfig:
    model: Optional[str] = None  # None -> the shipped course model
    block_size: int = 16
    num_blocks: Optional[int] = None  # None -> kv_cache_memory // bytes per block
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling: str = "continuous"
    attention_backend: str = "torch"
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "fp8" (= "fp8_e4m3") or "int8"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    num_cpu_blocks: Optional[int] = None  # swap pool; None -> num_blocks if swapping else 0
    max_model_len: Optional[int] = None  # None -> the model's own context length
    parallel_sampling: str = "prefix"  # how n > 1 shares the prompt (PARALLEL_SAMPLING)
    # vLLM's admission options (vLLM 0.32's defaults); the paper's scheduler reads watermark
    # only (None -> its own default, core.sched.paper.DEFAULT_WATERMARK; v1's is 0.0)
    scheduler_reserve_full_isl: bool = True
    watermark: Optional[float] = None
    # N tensor-parallel worker processes over torch.distributed (minipaged/executor/multiproc.py);
    # the heads, KV heads and devices are checked against the model when the engine loads it
    tensor_parallel_size: int = 1
    # speculative decoding: None, or {"method": "ngram" | "draft_model", ...} (vLLM's names;
    # minipaged.spec_decode.config.SpeculativeConfig, which it becomes here)
    speculative_config: Optional[object] = None

    def __post_init__(self) -> None:
        from minipaged.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        self.check_invariants()
        if self.attention_backend == "auto":
            self.attention_backend = self._attn_backend()  # resolved once, here

    def _attn_backend(self) -> str:
        """``attention_backend`` checked against the device and dtypes, "auto" resolved
        (``minipaged.kernels.selector.get_attn_backend``: the one place a backend is chosen)."""
        from minipaged.kernels.selector import get_attn_backend

        return get_attn_backend(
            self.attention_backend, self.device, self.dtype, self.kv_cache_dtype, self.block_size
        )

    def check_invariants(self) -> None:
        """Validate every field; ``ValueError`` names the first bad argument."""
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be None or a path / hub id string, got {self.model!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("num_blocks", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{name} must be None or a positive int, got {v!r}")
        if self.num_cpu_blocks is not None and (not _is_int(self.num_cpu_blocks) or self.num_cpu_blocks < 0):
            raise ValueError(f"num_cpu_blocks must be None or an int >= 0, got {self.num_cpu_blocks!r}")
        w = self.watermark
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < 1):
            raise ValueError(f"watermark must be None or a fraction in [0, 1), got {w!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "scheduler_reserve_full_isl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, allowed in (
            ("preemption_mode", PREEMPTION_MODES),
            ("parallel_sampling", PARALLEL_SAMPLING),
            ("scheduling", SCHEDULING_POLICIES),
            ("dtype", DTYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda', got {self.device!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}"
            )
        spec = self.speculative_config
        if spec is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config with tensor_parallel_size > 1 is not built")
        if spec is not None:
            spec.verify_budget(self.max_num_batched_tokens)
            for name, v1 in (
                ("scheduling", "continuous"),
                ("preemption_mode", "recompute"),
                ("parallel_sampling", "prefix"),
            ):
                if getattr(self, name) != v1:
                    raise ValueError(
                        f"speculative_config runs on vLLM v1's scheduler ({name}={v1!r}), got {name}={getattr(self, name)!r}"
                    )
        if not isinstance(self.attention_backend, str):
            raise ValueError(f"attention_backend must be a string, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_BYTES:
            raise ValueError(
                f"kv_cache_dtype must be one of {tuple(KV_CACHE_BYTES)}, got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend != "auto":
            self._attn_backend()  # ValueError for a backend that cannot run here

    # -- derived -------------------------------------------------------------------
    def num_blocks_for(self, bytes_per_block: int) -> int:
        """The device pool size: ``num_blocks`` if given, else the memory budget's worth."""
        if self.num_blocks is not None:
            n = self.num_blocks
        else:
            n = self.kv_cache_memory // bytes_per_block
            if n < 1:
                raise ValueError(
                    f"kv_cache_memory={self.kv_cache_memory} bytes is less than one block "
                    f"({bytes_per_block} bytes)"
                )
        self.check_cache_fits(n, bytes_per_block)
        return n

    def check_cache_fits(
        self,
        num_blocks: int,
        bytes_per_block: int,
        device_free: Optional[int] = None,
        host_free: Optional[int] = None,
    ) -> None:
        """``ValueError`` if the device pool, or the host's share (the CPU swap pool, and the
        device pool too when the device is the CPU), is larger than the memory available
        (``device_free`` / ``host_free``: None -> measured now). Unknown memory: no check."""
        on_host = self.device == "cpu"
        cpu_blocks = self.cpu_blocks_for(num_blocks)
        name = "num_blocks" if self.num_blocks is not None else "kv_cache_memory"
        value = self.num_blocks if self.num_blocks is not None else self.kv_cache_memory
        if not on_host:
            free = available_memory(self.device) if device_free is None else device_free
            need = num_blocks * bytes_per_block
            if free is not None and need > free:
                raise ValueError(
                    f"{name}={value}: the KV cache needs {_fmt_bytes(need)} ({num_blocks} blocks x "
                    f"{bytes_per_block} bytes) but {self.device} has {_fmt_bytes(free)} free"
                )
        host_need = (cpu_blocks + (num_blocks if on_host else 0)) * bytes_per_block
        free = available_host_memory() if host_free is None else host_free
        if free is not None and host_need > free:
            if not on_host or (self.num_cpu_blocks is not None and cpu_blocks > num_blocks):
                name, value = "num_cpu_blocks", cpu_blocks
            raise ValueError(
                f"{name}={value}: the KV cache needs {_fmt_bytes(host_need)} of host memory "
                f"({num_blocks if on_host else 0} device + {cpu_blocks} CPU swap blocks x "
                f"{bytes_per_block} bytes) but {_fmt_bytes(free)} is available"
            )

    def cpu_blocks_for(self, num_blocks: int) -> int:
        """The CPU swap pool size (0 unless ``preemption_mode='swap'`` or set explicitly)."""
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        return num_blocks if self.preemption_mode == "swap" else 0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def kv_cache_bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes of one block across all layers, K and V: 2 * L * bs * H_kv * D * bytes, with the
    bytes of ``kv_cache_dtype`` (1 for "fp8" / "int8"; the model ``dtype``'s for "auto"). The one
    place a block's size is computed (the engine, the model and the benchmarks call it). The
    per-layer scales of a quantized cache are two floats per layer, not per block: not counted."""
    if kv_cache_dtype not in KV_CACHE_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_BYTES)}, got {kv_cache_dtype!r}")
    elem = KV_CACHE_BYTES[kv_cache_dtype] or DTYPE_BYTES[dtype]
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
