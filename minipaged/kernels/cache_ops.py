"""Cache operations: write new K/V into the paged cache, copy blocks, swap blocks.

Mirrors vLLM ``csrc/cache_kernels.cu`` (``reshape_and_cache``, ``copy_blocks``,
``swap_blocks``) and its Python face ``vllm/_custom_ops.py``.

Concept
    The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads,
    head_dim]``. The scheduler hands out *slots* (``slot = block_id * block_size + offset``);
    these ops are the only code that moves K/V between slots:

    ``reshape_and_cache``  the model's new K/V rows -> their slots (every layer, every step)
    ``copy_blocks``        block -> block inside each layer's cache (copy-on-write, forks)
    ``swap_blocks``        block -> block between two pools, e.g. GPU <-> CPU (preemption)

Inputs / outputs
    ``reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0)``
        key, value [T, num_kv_heads, head_dim]; slot_mapping [T] int64; writes in place. A
        quantized cache (int8 / float8_e4m3fn, ``quant.py``) stores ``key / k_scale`` and
        ``value / v_scale`` rounded to its dtype (vLLM's fp8 ``reshape_and_cache``).
    ``copy_blocks(k_caches, v_caches, block_mapping)``
        per-layer lists of caches (or one cache each); block_mapping [N, 2] (src, dst).
    ``swap_blocks(src, dst, block_mapping)``
        two caches of the same block shape on any devices; block_mapping [N, 2] (src, dst).

Invariants
    - slot ``s >= 0`` lands at ``block = s // block_size``, ``offset = s % block_size``;
      ``s < 0`` (``PAD_SLOT_ID = -1``) is skipped: nothing is written.
    - copies are simultaneous: all sources are read before any destination is written,
      so a destination must not also be a source in the same call (the manager never
      asks for that).
    - caches keep their dtype; the rows written must already have it, or be float rows for a
      quantized cache (they are quantized on the way in). Copies and swaps move the stored
      bytes: a quantized block stays quantized with the same per-layer scales.

Failure mode
    ``ValueError`` naming the argument for wrong ranks, shapes, dtypes or devices. Slot
    and block ids are checked against the cache size when they live on the CPU (a check
    on a GPU tensor would cost a device sync); out of range on a GPU is the caller's bug.

Two implementations of ``reshape_and_cache`` sit behind the same test: the torch one
(default, any device) and a Triton kernel (``reshape_and_cache_triton``), one program per
token, written like Triton's ``01-vector-add`` tutorial (in ``cache_ops_triton.py``, imported
on its first call).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Union

import torch

from minipaged.kernels.quant import check_kv_scales, is_quantized, quantize

# NOTE: whether Triton is installed (absent on macOS), found without importing it: Triton
# is imported only when a Triton kernel runs (``cache_ops_triton.py``, ``paged_attention.py``),
# never by a CPU server (its import costs a second and prints nanobind warnings at exit)
HAS_TRITON = importlib.util.find_spec("triton") is not None

BlockMapping = Union[torch.Tensor, Sequence[Sequence[int]]]


# --------------------------------------------------------------------------- checks


def _check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    if key.dim() != 3:
        raise ValueError(f"key must be [T, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"key [T, num_kv_heads, head_dim] = {tuple(key.shape)} does not match the cache's "
            f"(num_kv_heads, head_dim) = {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    for name, t in (("key", key), ("value", value)):
        if is_quantized(k_cache.dtype) and not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float tensor to quantize into {k_cache.dtype}, got {t.dtype}")
        if not is_quantized(k_cache.dtype) and t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != k_cache dtype {k_cache.dtype}")
    check_kv_scales("reshape_and_cache", k_cache, k_scale, v_scale)
    for name, t in (
        ("value", value),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device} but key is on {key.device}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() > 0:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if int(slot_mapping.max()) >= num_slots:
            raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())} >= num_slots {num_slots}")


def _as_pairs(block_mapping: BlockMapping, device: torch.device) -> torch.Tensor:
    """(src, dst) pairs as an int64 tensor [N, 2] on ``device``."""
    pairs = torch.as_tensor(block_mapping, dtype=torch.int64)
    if pairs.numel() == 0:
        return pairs.reshape(0, 2).to(device)
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"block_mapping must be (src, dst) pairs [N, 2], got shape {tuple(pairs.shape)}")
    if int(pairs.min()) < 0:
        raise ValueError("block_mapping holds a negative block id")
    return pairs.to(device)


# --------------------------------------------------------------------------- torch ops


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key[i]``/``value[i]`` into slot ``slot_mapping[i]`` of the caches, in place.

    key, value [T, KVH, D]; caches [num_blocks, block_size, KVH, D]; slot_mapping [T].
    Slots < 0 (``PAD_SLOT_ID``) are skipped. A quantized cache gets ``quantize(key, dtype,
    k_scale)`` and ``quantize(value, dtype, v_scale)``.
    """
    _check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()  # [T]
    keep = slots >= 0  # [T] False for padding tokens
    slots = slots[keep]  # [T']
    block_ids = slots // block_size  # [T'] physical block
    offsets = slots % block_size  # [T'] slot inside the block
    key, value = key[keep], value[keep]  # [T', KVH, D] each
    if is_quantized(k_cache.dtype):
        key, value = quantize(key, k_cache.dtype, k_scale), quantize(value, v_cache.dtype, v_scale)
    k_cache[block_ids, offsets] = key  # [T', KVH, D]
    v_cache[block_ids, offsets] = value  # [T', KVH, D]


def copy_blocks(
    k_caches: Union[torch.Tensor, Sequence[torch.Tensor]],
    v_caches: Union[torch.Tensor, Sequence[torch.Tensor]],
    block_mapping: BlockMapping,
) -> None:
    """Copy-on-write: for each (src, dst) pair copy block ``src`` to ``dst`` in every layer.

    k_caches / v_caches: one cache per layer (a single tensor counts as one layer), each
    [num_blocks, block_size, KVH, D]; block_mapping [N, 2].
    """
    if isinstance(k_caches, torch.Tensor):
        k_caches = [k_caches]
    if isinstance(v_caches, torch.Tensor):
        v_caches = [v_caches]
    if len(k_caches) != len(v_caches):
        raise ValueError(f"k_caches has {len(k_caches)} layers but v_caches has {len(v_caches)}")
    if len(k_caches) == 0:
        return
    pairs = _as_pairs(block_mapping, k_caches[0].device)  # [N, 2]
    if pairs.shape[0] == 0:
        return
    num_blocks = k_caches[0].shape[0]
    if int(pairs.max()) >= num_blocks:
        raise ValueError(f"block_mapping holds block {int(pairs.max())} >= num_blocks {num_blocks}")
    src, dst = pairs[:, 0], pairs[:, 1]  # [N], [N]
    for layer, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches)):
        if k_cache.shape != v_cache.shape or k_cache.shape[0] != num_blocks:
            raise ValueError(
                f"layer {layer}: k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} "
                f"do not match layer 0's {num_blocks} blocks"
            )
        if k_cache.device != pairs.device or v_cache.device != pairs.device:
            raise ValueError(f"layer {layer}: caches must all be on {pairs.device}")
        # NOTE: k_cache[src] is gathered into a new tensor before the write, so a pair
        # list is applied as one simultaneous copy.
        k_cache[dst] = k_cache[src]  # [N, bs, KVH, D]
        v_cache[dst] = v_cache[src]  # [N, bs, KVH, D]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: BlockMapping) -> None:
    """Copy block ``s`` of ``src`` to block ``d`` of ``dst`` for each pair, across devices.

    src [num_src_blocks, bs, KVH, D] and dst [num_dst_blocks, bs, KVH, D] may live on
    different devices (swap out: GPU -> CPU; swap in: CPU -> GPU). One gather, one
    transfer, one scatter.
    """
    if src.dim() < 2 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must share the block shape")
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    pairs = _as_pairs(block_mapping, torch.device("cpu"))  # [N, 2]
    if pairs.shape[0] == 0:
        return
    if int(pairs[:, 0].max()) >= src.shape[0]:
        raise ValueError(f"block_mapping src block {int(pairs[:, 0].max())} >= src blocks {src.shape[0]}")
    if int(pairs[:, 1].max()) >= dst.shape[0]:
        raise ValueError(f"block_mapping dst block {int(pairs[:, 1].max())} >= dst blocks {dst.shape[0]}")
    blocks = src[pairs[:, 0].to(src.device)]  # [N, bs, KVH, D] on src's device
    dst[pairs[:, 1].to(dst.device)] = blocks.to(dst.device)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of ``reshape_and_cache``: same arguments, same result (for a quantized cache,
    to one level: a GPU's fp32 division may round the last bit differently)."""
    if not HAS_TRITON:
        raise RuntimeError(
            "reshape_and_cache_triton needs Triton, which is not installed here; "
            "use reshape_and_cache (torch) instead"
        )
    _check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
    if key.shape[0] == 0:
        return
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    from minipaged.kernels.cache_ops_triton import launch_reshape_and_cache

    launch_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
