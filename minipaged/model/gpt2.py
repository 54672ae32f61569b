"""GPT-2 on a paged KV cache.

Mirrors vLLM ``vllm/model_executor/models/gpt2.py``. Differences from the Llama family:
learned absolute position embeddings (``wpe``) instead of RoPE, LayerNorm with bias instead
of RMSNorm, a GELU MLP (``gelu_new``, the tanh approximation) instead of SwiGLU, one fused
``c_attn`` projection for q, k and v, and full multi-head attention (``num_kv_heads ==
num_heads``). Module names are Hugging Face's (``transformer.h.0.attn.c_attn``...).

Inputs / output: as in ``minipaged.model.llama``: ``forward(inp, kv_caches)`` -> fp32
logits ``[B, vocab]`` at ``inp.logits_indices``.

Invariants
    - Hugging Face stores GPT-2's projections as ``Conv1D`` with weight ``[in, out]``;
      ``load_weights`` transposes them once into ``nn.Linear``'s ``[out, in]``.
    - ``lm_head`` is tied to ``wte`` (GPT-2 always ties).
    - ``max_model_len`` is ``n_positions``: there is no position embedding beyond it.

Failure mode
    ``reorder_and_upcast_attn`` only changes rounding in transformers and is ignored here;
    any other unknown weight name raises ``ValueError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.model.attention import PagedAttention
from minipaged.model.input import ModelInput
from minipaged.model.layers import PagedCausalLM

# Conv1D weights in a Hugging Face GPT-2 checkpoint, stored [in, out].
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def get_act_fn(name: str):
    """The activation called ``name`` in a transformers config (``activation_function``)."""
    acts = {
        "silu": F.silu,
        "gelu": F.gelu,
        "relu": F.relu,
        # gelu_new (GPT-2) is the tanh approximation of GELU.
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }
    if name not in acts:
        raise ValueError(f"config.activation_function {name!r} is not supported")
    return acts[name]


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)  # q, k, v fused
        self.c_proj = nn.Linear(hidden, hidden)
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_heads, scale)

    def forward(self, h, kv_cache, inp: ModelInput) -> torch.Tensor:
        T = h.shape[0]
        q, k, v = self.c_attn(h).split(h.shape[1], dim=-1)  # 3 x [T, hidden]
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        v = v.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        o = self.attn(q, k, v, kv_cache, inp)  # [T, H, D]
        return self.c_proj(o.reshape(T, -1))  # [T, hidden]


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = nn.Linear(config.hidden_size, inner)
        self.c_proj = nn.Linear(inner, config.hidden_size)
        self.act = get_act_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # [T, hidden]


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, h, kv_cache, inp: ModelInput) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), kv_cache, inp)  # [T, hidden]
        return h + self.mlp(self.ln_2(h))  # [T, hidden]


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.n_positions, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(PagedCausalLM):
    """GPT-2 causal LM reading and writing a paged KV cache."""

    def __init__(self, config, eos_token_ids=None):
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = self.num_heads  # multi-head attention: one KV head per query head
        self.head_dim = config.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        self.max_model_len = int(config.n_positions)
        self.eos_token_ids = list(eos_token_ids or [])

        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied

    def forward(self, inp: ModelInput, kv_caches) -> torch.Tensor:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model {self.num_layers}")
        if kv_caches and inp.attn_backend is not self.attn_backend:  # a hand-built input
            self.prepare_attention(inp, kv_caches[0][0].shape[1])
        t = self.transformer
        h = t.wte(inp.input_ids) + t.wpe(inp.positions)  # [T, hidden]
        for block, kv_cache in zip(t.h, kv_caches):
            h = block(h, kv_cache, inp)  # [T, hidden]
        h = t.ln_f(h[inp.logits_indices])  # [B, hidden]
        return self.lm_head(h).float()  # [B, vocab]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a transformers GPT-2 state dict in, transposing the Conv1D weights."""
        self.lm_head.weight = self.transformer.wte.weight  # NOTE: to_empty() can untie
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in state_dict.items():
            if name == "lm_head.weight":
                continue  # tied to transformer.wte.weight
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # old checkpoints store the causal mask as a buffer
            if name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            if name.endswith(_CONV1D):
                tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(params[name].shape)}"
                )
            with torch.no_grad():
                params[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
