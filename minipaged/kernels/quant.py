"""A quantized KV cache: keys and values stored in 8 bits, with one scale per layer for K and one for V.

Mirrors vLLM's ``kv_cache_dtype`` (``vllm/config/cache.py``), the per-layer ``k_scale`` /
``v_scale`` of ``vllm/attention/layer.py`` and the quantizing ``reshape_and_cache`` of
``csrc/cache_kernels.cu`` (``Fp8KVCacheDataType``, ``scaled_convert``).

Concept
    The cache is memory, not compute: a key is written once and read at every later step, so
    storing it in fewer bits means more tokens per byte of KV budget (chapter 01). Each layer
    keeps two scales, ``k_scale`` and ``v_scale``. Writing a row ``x`` stores ``x / scale``
    rounded to the cache dtype; reading gives back ``stored * scale`` (fp32), and attention
    runs on that in the model's dtype. FP8 here is a *memory format*: the matmuls stay in
    fp32 / bf16, nothing runs on FP8 tensor cores.

    ============ ===================== ============= ==========================================
    kv dtype     stored as             quantize      levels
    ============ ===================== ============= ==========================================
    "fp8"        torch.float8_e4m3fn   x / s, round  e4m3: 3 mantissa bits, |x / s| <= 448
    "fp8_e4m3"   the same (vLLM's "fp8" means e4m3)
    "int8"       torch.int8            x / s, round  integers -127 .. 127 (-128 unused: symmetric)
    ============ ===================== ============= ==========================================

    Scales are per tensor (one float per layer and K or V), as vLLM's are: the cache stays one
    plain tensor per layer, so block copies, swaps and prefix caching move bytes without knowing
    they are quantized, and every kernel takes two floats. The price: one outlier in a layer
    sets the step size of every value in it; int8 feels that (uniform levels), fp8 much less
    (its levels are relative). vLLM reads the scales from the checkpoint or computes them from
    the first batch (``calculate_kv_scales``); ``model/kv_scales.py`` computes
    them once, from a fixed calibration forward, so outputs never depend on which request
    came first: ``scale = max|x| / QUANT_MAX[dtype]``. Values beyond the calibrated range
    saturate (are clamped), they never overflow to inf / NaN.

Inputs / outputs
    ``kv_cache_torch_dtype(kv_cache_dtype, model_dtype)``: the torch dtype the cache is stored in.
    ``quantize(x, dtype, scale)``: float rows -> the cache dtype. ``dequantize(x, scale)``:
    stored rows -> fp32. ``scale_for(amax, dtype)``: the scale that maps ``amax`` to the top level.
    ``check_kv_scales(name, k_cache, k_scale, v_scale)``: ``ValueError`` for a bad scale.

Invariants
    ``dequantize(quantize(x, d, s), s)`` is within half a level of ``x`` for int8
    (``s / 2``) and within 2^-4 relative (plus ``s * 2^-10`` near zero) for fp8, for
    ``|x| <= s * QUANT_MAX[d]``. An unquantized cache (``kv_cache_dtype="auto"``) is stored and
    read as is; its scales must be 1.0.

Failure mode
    ``ValueError`` naming the argument: an unknown ``kv_cache_dtype``, a scale that is not a
    positive finite number, or a scale other than 1.0 with an unquantized cache.
"""

from __future__ import annotations

import math

import torch

# The largest level of each 8-bit cache dtype (symmetric: int8 leaves -128 unused).
QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
# vLLM's names: "auto" = the model dtype; "fp8" is an alias of "fp8_e4m3" (what vLLM's "fp8" means)
KV_CACHE_DTYPES = ("auto", *KV_CACHE_TORCH_DTYPES)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache tensors are stored in: ``model_dtype`` for "auto"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_TORCH_DTYPES[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds quantized values (read back through a scale)."""
    return dtype in QUANT_MAX


def scale_for(amax: float, dtype: torch.dtype) -> float:
    """The scale that maps ``amax`` (the largest |value| seen) to the top level of ``dtype``."""
    return float(amax) / QUANT_MAX[dtype] if amax > 0 else 1.0


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x / scale`` in ``dtype``, clamped to its levels. int8 rounds half up (floor(y + 0.5)),
    the same rule as the Triton writer; fp8 rounds to nearest even (torch's cast)."""
    qmax = QUANT_MAX[dtype]
    y = (x.float() / scale).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a quantized cache holds, in fp32: ``stored * scale``."""
    return x.float() * scale


def check_kv_scales(name: str, k_cache: torch.Tensor, k_scale, v_scale) -> None:
    """``ValueError`` unless both scales are positive finite numbers, and 1.0 for an unquantized cache."""
    for arg, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"{name}: {arg} must be a positive finite float, got {s!r}")
        if s != 1.0 and not is_quantized(k_cache.dtype):
            raise ValueError(
                f"{name}: {arg}={s} applies to a quantized cache (int8 / float8_e4m3fn); "
                f"this cache is {k_cache.dtype} and is read as is (scale 1.0)"
            )
