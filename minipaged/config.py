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
    a bad value raises ``ValueError`` naming the argument. Pure Python: no torch import, so
    the CLI and the simulator can build a config cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

PREEMPTION_MODES = ("recompute", "swap")
# n > 1: "prefix" = vLLM v1 (n child requests sharing the prompt through prefix caching);
# "fork" = the paper's sequence group (prefill once, fork with copy-on-write)
PARALLEL_SAMPLING = ("prefix", "fork")
SCHEDULING_POLICIES = ("continuous", "static")
ATTENTION_BACKENDS = ("torch", "triton")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_KV_CACHE_MEMORY = 64 * 1024 * 1024  # 64 MiB: ample for the course model on a CPU


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
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    num_cpu_blocks: Optional[int] = None  # swap pool; None -> num_blocks if swapping else 0
    max_model_len: Optional[int] = None  # None -> the model's own context length
    parallel_sampling: str = "prefix"  # how n > 1 shares the prompt (PARALLEL_SAMPLING)

    def __post_init__(self) -> None:
        self.check_invariants()

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
        if self.num_cpu_blocks is not None and (
            not _is_int(self.num_cpu_blocks) or self.num_cpu_blocks < 0
        ):
            raise ValueError(f"num_cpu_blocks must be None or an int >= 0, got {self.num_cpu_blocks!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, allowed in (
            ("preemption_mode", PREEMPTION_MODES),
            ("parallel_sampling", PARALLEL_SAMPLING),
            ("scheduling", SCHEDULING_POLICIES),
            ("attention_backend", ATTENTION_BACKENDS),
            ("dtype", DTYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda', got {self.device!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    # -- derived -------------------------------------------------------------------
    def num_blocks_for(self, bytes_per_block: int) -> int:
        """The device pool size: ``num_blocks`` if given, else the memory budget's worth."""
        if self.num_blocks is not None:
            return self.num_blocks
        n = self.kv_cache_memory // bytes_per_block
        if n < 1:
            raise ValueError(
                f"kv_cache_memory={self.kv_cache_memory} bytes is less than one block "
                f"({bytes_per_block} bytes)"
            )
        return n

    def cpu_blocks_for(self, num_blocks: int) -> int:
        """The CPU swap pool size (0 unless ``preemption_mode='swap'`` or set explicitly)."""
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        return num_blocks if self.preemption_mode == "swap" else 0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str
) -> int:
    """Bytes of one block across all layers, K and V: 2 * L * bs * H_kv * D * bytes."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
