"""Building blocks shared by the model files: RMSNorm, rotary embeddings, activations, and
the base class every paged model derives from.

Mirrors vLLM ``vllm/model_executor/layers/layernorm.py`` (RMSNorm),
``rotary_embedding.py`` (RotaryEmbedding, neox style) and ``activation.py`` (SiluAndMul).
As vLLM's ``CustomOp`` layers do, each has a readable ``forward_native`` (torch: the reference)
and a ``forward_cpu`` (one C pass, ``minipaged/kernels/csrc/layers_cpu.c``), chosen once when the
layer is built: ``impl="cpu"`` is what ``attention_backend="cpu"`` builds, ``"torch"`` the rest.

Inputs / outputs
    All layers work on the flat token batch of one engine step: ``[T, hidden]`` rows, no
    padding and no batch axis (``minipaged.model.input.ModelInput``). ``RotaryEmbedding``
    takes each token's *position* ``[T]`` explicitly, because the rows of one step belong to
    different sequences at different offsets; ``cos_sin(positions)`` looks the angles up once
    per step and ``rotate(x, cos_sin)`` applies them in each layer.

Invariants
    - ``RMSNorm`` and ``RotaryEmbedding`` compute in fp32 and cast back, as Hugging Face does,
      so fp32 results match transformers to rounding; ``forward_cpu`` equals ``forward_native``
      to rounding (``tests/test_layers_cpu.py``).
    - ``RMSNorm(x, residual)`` is vLLM's fused residual add: it returns ``(norm(x + residual),
      x + residual)``, so a pre-norm decoder carries the residual stream beside the hidden state.
    - ``PagedCausalLM.allocate_kv_caches`` returns one ``(k_cache, v_cache)`` pair per layer,
      each ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model's dtype/device.

Failure mode
    Unsupported RoPE variants or activations raise ``ValueError`` naming the config field.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.config import kv_cache_bytes_per_block
from minipaged.kernels import cpu as cpu_kernels
from minipaged.kernels.selector import ATTENTION_BACKENDS

LAYER_IMPLS = ("torch", "cpu")


def _check_impl(impl: str) -> str:
    if impl not in LAYER_IMPLS:
        raise ValueError(f"impl must be one of {LAYER_IMPLS}, got {impl!r}")
    return impl


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight  (Llama, Mistral, Qwen2).

    ``forward(x)`` -> y; ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``,
    vLLM's fused residual add (``forward_cpu`` updates ``residual`` in place).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, impl: str = "torch"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.impl = _check_impl(impl)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.impl == "cpu":
            return self.forward_cpu(x, residual)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            residual = x + residual  # [T, hidden]: the residual stream, before the norm
            return self.forward_native(residual), residual
        if x.dtype != torch.float32:  # half precision: compute in fp32, as transformers does
            return self.weight * self.forward_native(x.float()).to(x.dtype)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))  # [T, hidden]

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return cpu_kernels.rms_norm_cpu(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate, up] side by side ([T, 2n] -> [T, n]), as the fused
    ``gate_up_proj`` writes them."""

    def __init__(self, impl: str = "torch"):
        super().__init__()
        self.impl = _check_impl(impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "cpu":
            return cpu_kernels.silu_and_mul_cpu(x)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # 2 x [T, n]
        return F.silu(gate) * up  # [T, n]


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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, neox style (rotate the two halves of each head).

    With ``x = [x1, x2]`` (two halves of a head) and angles ``pos * inv_freq``::

        x' = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin]

    which is transformers' ``x * cos + rotate_half(x) * sin`` term for term (so the same
    floats). ``cos`` and ``sin`` of every position up to ``max_position_embeddings`` are
    computed once (vLLM's ``cos_sin_cache``); a step only looks its positions up.
    """

    def __init__(self, config, head_dim: int):
        super().__init__()
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
        freqs = (
            torch.arange(self.max_positions, dtype=torch.float, device="cpu")[:, None]
            * self.inv_freq[None, :]
        )  # [P, D/2]
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

    def rotate_cpu_(self, x: torch.Tensor, positions: torch.Tensor, num_heads: int, head_dim: int) -> None:
        """``forward_cpu``: rotate the first ``num_heads`` heads of each row of x [T, >=] in
        place, in C (the q and k columns of a fused qkv output; neox style only)."""
        cpu_kernels.rotary_neox_cpu(x, positions, self.cos_cache, self.sin_cache, num_heads, head_dim)


def get_act_fn(name: str):
    """The activation called ``name`` in a transformers config (``hidden_act``)."""
    acts = {
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "relu": F.relu,
        # gelu_new (GPT-2) is the tanh approximation of GELU.
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }
    if name not in acts:
        raise ValueError(f"config.hidden_act / activation_function {name!r} is not supported")
    return acts[name]


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype) -> torch.dtype:
    """'float32' | 'float16' | 'bfloat16' (or a torch.dtype) -> torch.dtype."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of 'float32', 'float16', 'bfloat16', got {dtype!r}")


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

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed (k_cache, v_cache) per layer, each [num_blocks, block_size, KVH, D]."""
        for name, val in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kw = dict(dtype=self.dtype, device=self.device)
        return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in range(self.num_layers)]

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes across all layers, keys and values
        (``minipaged.config.kv_cache_bytes_per_block`` with this model's shape and dtype)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return kv_cache_bytes_per_block(self.num_layers, block_size, self.num_kv_heads, self.head_dim, dtype)

    def check_invariants(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}"
        )
        assert self.max_model_len >= 1, f"max_model_len {self.max_model_len} < 1"
        assert self.num_layers == len(self.attention_layers()), "one attention layer per layer"
        backends = {m.backend for m in self.attention_layers()}
        impls = {m.impl for m in self.modules() if isinstance(m, (RMSNorm, SiluAndMul))}
        assert len(backends) <= 1, f"attention layers on different backends: {sorted(backends)}"
        want = {"cpu" if backends == {"cpu"} else "torch"} if backends else impls
        assert impls <= want, f"small layers on {sorted(impls)} with attention on {sorted(backends)}"

    def use_backend(self, backend: str) -> str:
        """Set every layer to ``backend`` ("torch", "triton" or "cpu"): the attention layers, and
        the layers that have a ``forward_cpu`` (C on "cpu", torch otherwise). The loader calls it
        once with the engine's backend (``minipaged.kernels.selector.get_attn_backend`` chose it);
        models are built on "torch". Returns the backend it had, to switch back (the profile
        compares backends on one model this way)."""
        from minipaged.model.attention import PagedAttention

        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        layers = self.attention_layers()
        before = layers[0].backend if layers else backend
        impl = "cpu" if backend == "cpu" else "torch"
        for m in self.modules():
            if isinstance(m, PagedAttention):
                m.backend = backend
            elif isinstance(m, (RMSNorm, SiluAndMul)):
                m.impl = impl
        return before

    def attention_layers(self) -> list:
        """The model's ``PagedAttention`` modules, in layer order."""
        from minipaged.model.attention import PagedAttention

        return [m for m in self.modules() if isinstance(m, PagedAttention)]
