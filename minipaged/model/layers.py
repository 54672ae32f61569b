"""Building blocks shared by the model files: RMSNorm, rotary embeddings, activations, and
the base class every paged model derives from.

Mirrors vLLM ``vllm/model_executor/layers/layernorm.py`` (RMSNorm),
``rotary_embedding.py`` (RotaryEmbedding, neox style) and ``activation.py`` (SiluAndMul).
Each is a ``CustomOp``, as in vLLM: a readable ``forward_native`` (torch: the reference) and a
C pass (``minipaged/kernels/csrc/layers_cpu.c``): ``impl="cpu"`` runs the C one. The
model's backend decides (``use_backend``: its ``layer_impl``, "cpu" for ``attention_backend="cpu"``).

Inputs / outputs
    All layers work on the flat token batch of one engine step: ``[T, hidden]`` rows, no
    padding and no batch axis (``minipaged.model.input.ModelInput``). ``RotaryEmbedding``
    takes each token's *position* ``[T]`` explicitly, because the rows of one step belong to
    different sequences at different offsets; ``cos_sin(positions)`` looks the angles up once
    per step and ``rotate(x, cos_sin)`` applies them in each layer.

Invariants
    - ``RMSNorm`` and ``RotaryEmbedding`` compute in fp32 and cast back, as Hugging Face does,
      so fp32 results match transformers to rounding; ``forward_cpu`` equals ``forward_native``
      to rounding (``tests/model/test_layers_cpu.py``).
    - ``RMSNorm(x, residual)`` is vLLM's fused residual add: it returns ``(norm(x + residual),
      x + residual)``, so a pre-norm decoder carries the residual stream beside the hidden state.
    - ``PagedCausalLM.allocate_kv_caches`` returns one ``(k_cache, v_cache)`` pair per layer,
      each ``[num_blocks, block_size, num_kv_heads, head_dim]`` on the model's device, in its
      dtype or, for ``kv_cache_dtype`` "fp8" / "int8", in 8 bits with the attention layers'
      ``k_scale`` / ``v_scale`` calibrated first (``model/kv_scales.py``).
    - ``attn_backend`` is the model's one attention backend (``kernels.selector.attn_backend``);
      ``prepare_attention`` plans a step with it, once for every layer.

Failure mode
    Unsupported RoPE variants raise ``ValueError`` naming the config field.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.config import kv_cache_bytes_per_block
from minipaged.kernels import cpu as cpu_kernels
from minipaged.kernels.quant import kv_cache_torch_dtype
from minipaged.kernels.selector import attn_backend
from minipaged.model.input import ModelInput

LAYER_IMPLS = ("torch", "cpu")


class CustomOp(nn.Module):
    """vLLM's ``CustomOp``: ``forward`` runs ``forward_native`` (torch, the reference) or, with
    ``impl="cpu"``, ``forward_cpu`` (C: ``minipaged/kernels/csrc/layers_cpu.c``)."""

    def __init__(self, impl: str = "torch"):
        super().__init__()
        if impl not in LAYER_IMPLS:
            raise ValueError(f"impl must be one of {LAYER_IMPLS}, got {impl!r}")
        self.impl = impl

    def forward(self, *args, **kwargs):
        return (self.forward_cpu if self.impl == "cpu" else self.forward_native)(*args, **kwargs)


class RMSNorm(CustomOp):
    """y = x / sqrt(mean(x^2) + eps) * weight  (Llama, Mistral, Qwen2).

    ``forward(x)`` -> y; ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``,
    vLLM's fused residual add (``forward_cpu`` updates ``residual`` in place).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, impl: str = "torch"):
        super().__init__(impl)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            residual = x + residual  # [T, hidden]: the residual stream, before the norm
            return self.forward_native(residual), residual
        if x.dtype != torch.float32:  # half precision: compute in fp32, as transformers does
            return self.weight * self.forward_native(x.float()).to(x.dtype)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))  # [T, hidden]

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return cpu_kernels.rms_norm_cpu(x, self.weight, self.eps, residual)  # ``residual`` += x in place


class SiluAndMul(CustomOp):
    """silu(gate) * up for x = [gate, up] side by side ([T, 2n] -> [T, n]), as the fused
    ``gate_up_proj`` writes them."""

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # 2 x [T, n]
        return F.silu(gate) * up  # [T, n]

    @staticmethod
    def forward_cpu(x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul_cpu(x)


def rope_parameters(config) -> dict:
    """The RoPE settings of a config, whichever transformers version wrote it.

    transformers 5.x keeps them in ``config.rope_parameters`` (with ``rope_theta`` inside);
    4.x has ``config.rope_theta`` and an optional ``config.rope_scaling`` dict.
    Returns a dict with at least ``rope_type`` and ``rope_theta``.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if not params and scaling:
        params = dict(scaling)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


# RoPE variants whose frequencies do not depend on the sequence length at run time (within
# max_position_embeddings, which is all minipaged ever runs): transformers computes them once.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


class RotaryEmbedding(CustomOp):
    """Rotary position embedding, neox style (rotate the two halves of each head).

    With ``x = [x1, x2]`` (two halves of a head) and angles ``pos * inv_freq``::

        x' = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin]

    which is transformers' ``x * cos + rotate_half(x) * sin`` term for term (so the same
    floats). ``cos`` and ``sin`` of every position up to ``max_position_embeddings`` are
    computed once (vLLM's ``cos_sin_cache``); a step only looks its positions up.
    """

    def __init__(self, config, head_dim: int, impl: str = "torch"):
        super().__init__(impl)
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type == "default":
            base = float(params["rope_theta"])
            exps = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim  # [D/2]
            inv_freq = 1.0 / (base**exps)  # [D/2]
            attention_scaling = 1.0
        elif rope_type in _STATIC_ROPE_TYPES:
            # NOTE: scaled variants (Llama 3.x "llama3", "linear", "yarn") only reshape the
            # frequencies; borrow transformers' formulas rather than copy them here.
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        else:
            raise ValueError(f"config.rope_parameters: rope_type {rope_type!r} is not supported")
        # NOTE: plain attributes, not buffers: ``model.to(torch.bfloat16)`` must not round
        # the frequencies (transformers keeps them in fp32 too). Moved to x's device on use.
        self.inv_freq = inv_freq.float().cpu()  # [D/2]
        self.attention_scaling = float(attention_scaling)
        self.max_positions = int(getattr(config, "max_position_embeddings", 2048))
        # [P, D/2]; NOTE: device="cpu" even under the loader's meta-device context
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float, device="cpu"), self.inv_freq)
        self.cos_cache = freqs.cos() * self.attention_scaling  # [P, D/2]
        self.sin_cache = freqs.sin() * self.attention_scaling  # [P, D/2]

    def cos_sin(self, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's angles, [T, 1, D/2] each: looked up once per step, used by every layer."""
        if self.cos_cache.device != positions.device:
            self.cos_cache = self.cos_cache.to(positions.device)
            self.sin_cache = self.sin_cache.to(positions.device)
        cos = self.cos_cache[positions].to(dtype)[:, None, :]  # [T, 1, D/2]
        sin = self.sin_cache[positions].to(dtype)[:, None, :]  # [T, 1, D/2]
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, N, D] (any number N of heads: q's, k's, or both) -> rotated x."""
        cos, sin = cos_sin  # [T, 1, D/2] each
        x1, x2 = x.chunk(2, dim=-1)  # [T, N, D/2] each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, N, D]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T]; x [T, N, D] -> rotated x (``rotate(x, cos_sin(positions))``)."""
        return self.rotate(x, self.cos_sin(positions, x.dtype))

    def rotate_heads(self, x: torch.Tensor, num_heads: int, D: int, cos_sin, positions) -> torch.Tensor:
        """The first ``num_heads`` heads of each row of x [T, >= num_heads * D] (the q and k
        columns of a fused qkv output), rotated: [T, num_heads, D]. ``impl="cpu"``: in place, in C."""
        if self.impl == "cpu":
            cpu_kernels.rotary_neox_cpu(x, positions, self.cos_cache, self.sin_cache, num_heads, D)
            return x[:, : num_heads * D].view(x.shape[0], num_heads, D)
        return self.rotate(x[:, : num_heads * D].view(x.shape[0], num_heads, D), cos_sin)


class PagedCausalLM(nn.Module):
    """What every minipaged model exposes to the engine, besides ``forward``.

    Subclasses set ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``vocab_size``, ``max_model_len`` and ``eos_token_ids`` in ``__init__`` and implement
    ``forward(inp: ModelInput, kv_caches) -> logits [B, vocab]`` (fp32) and
    ``load_weights(state_dict)``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    kv_cache_dtype: str = "auto"  # what the attention layers' k_scale / v_scale were set for
    calibration_ids: Optional[list[int]] = None  # CALIBRATION_TEXT in this model's tokens (the loader)
    attn_backend = attn_backend("torch")  # the one attention backend of every layer (use_backend)

    @property
    def eos_token_id(self):
        """The first EOS id (``None`` if the checkpoint names none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed (k_cache, v_cache) per layer, each [num_blocks, block_size, KVH, D], in the
        model's dtype ("auto") or 8 bits ("fp8", "fp8_e4m3", "int8"). A quantized cache needs its
        scales: as vLLM's worker runs a profiling forward before it allocates the caches, this
        runs one calibration forward (``calibrate_kv_scales``) unless the scales were already set
        for this ``kv_cache_dtype``."""
        for name, val in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        if kv_cache_dtype != self.kv_cache_dtype:
            self.calibrate_kv_scales(kv_cache_dtype)
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kw = dict(dtype=dtype, device=self.device)
        return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in range(self.num_layers)]

    def calibrate_kv_scales(self, kv_cache_dtype: str, input_ids: Optional[torch.Tensor] = None) -> None:
        """Set every attention layer's ``k_scale`` / ``v_scale`` for a ``kv_cache_dtype`` cache
        (one calibration forward: ``model/kv_scales.py``)."""
        from minipaged.model.kv_scales import calibrate_kv_scales

        calibrate_kv_scales(self, kv_cache_dtype, input_ids)

    def kv_cache_bytes_per_block(self, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes one block takes across all layers, keys and values
        (``minipaged.config.kv_cache_bytes_per_block`` with this model's shape and dtype)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return kv_cache_bytes_per_block(
            self.num_layers, block_size, self.num_kv_heads, self.head_dim, dtype, kv_cache_dtype
        )

    def check_invariants(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}"
        )
        assert self.max_model_len >= 1, f"max_model_len {self.max_model_len} < 1"
        assert self.num_layers == len(self.attention_layers()), "one attention layer per layer"
        impls = {m.impl for m in self.modules() if isinstance(m, CustomOp)}
        want = self.attn_backend.layer_impl
        assert impls <= {want}, f"small layers on {sorted(impls)} with the {self.attn_backend.name!r} backend"

    def use_backend(self, backend: str) -> str:
        """Run ``backend`` ("torch", "triton" or "cpu"): the model holds its object
        (``kernels.selector.attn_backend``) and the layers that have a C pass take its
        ``layer_impl``. The loader calls it once with the engine's backend; models are built on
        "torch". Returns the backend it had, to switch back (the profile compares backends this way)."""
        before, self.attn_backend = self.attn_backend.name, attn_backend(backend)
        for m in self.modules():
            if isinstance(m, CustomOp):
                m.impl = self.attn_backend.layer_impl
        return before

    def prepare_attention(self, inp: ModelInput, block_size: int) -> ModelInput:
        """Plan the step's attention once, for every layer, after the flat batch is built (vLLM:
        the runner's attention-metadata builder): ``inp.attn_backend`` = this model's backend,
        ``inp.attn_metadata`` = its plan. Returns ``inp``, on the device it will run on."""
        inp.attn_backend = self.attn_backend
        inp.attn_metadata = self.attn_backend.build_metadata(inp, block_size, self.num_heads * self.head_dim)
        return inp

    def attention_layers(self) -> list:
        """The model's ``PagedAttention`` modules, in layer order."""
        from minipaged.model.attention import PagedAttention

        return [m for m in self.modules() if isinstance(m, PagedAttention)]
