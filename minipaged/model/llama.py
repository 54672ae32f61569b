"""The Llama family (Llama, Mistral, Qwen2) on a paged KV cache.

Mirrors vLLM ``vllm/model_executor/models/llama.py`` (and ``qwen2.py``, which differs only
in its q/k/v biases). Module and parameter names are Hugging Face's
(``model.layers.0.self_attn.o_proj.weight`` ...), except that q/k/v and gate/up are fused
into ``qkv_proj`` and ``gate_up_proj`` as in vLLM: ``load_weights`` copies each checkpoint
matrix into its rows (``STACKED_PARAMS``), so a transformers state dict still loads as is.

One decoder layer, pre-norm::

    q, k, v = split(qkv_proj(norm(h)))                  one matmul for all three
    h = h + o_proj(PagedAttention(RoPE(q), RoPE(k), v))
    gate, up = split(gate_up_proj(norm(h)))             one matmul for both
    h = h + down_proj(silu(gate) * up)

written as vLLM writes it: each layer returns its output and the residual stream apart, and the
next norm adds them (``RMSNorm(x, residual)``), so the add costs no pass of its own on the
``"cpu"`` backend, whose small layers run in C (``minipaged.model.layers``).

Inputs
    ``forward(inp: ModelInput, kv_caches)``: the flat token batch of one step (``input_ids``
    and ``positions`` [T]) and one ``(k_cache, v_cache)`` per layer.
Output
    fp32 logits ``[B, vocab]``: one row per sequence, taken at ``inp.logits_indices`` (its
    last scheduled token). The other T - B rows never reach the LM head.

Invariants
    - Grouped-query attention: ``num_kv_heads`` divides ``num_heads``; the cache holds only
      the KV heads, so it is ``num_heads / num_kv_heads`` times smaller than with MHA.
    - ``head_dim`` is ``config.head_dim`` when the config has one, else hidden / heads.
    - Tied embeddings: ``lm_head.weight`` *is* ``embed_tokens.weight`` (one tensor).

Failure mode
    Features outside the family as written here (Qwen3's q/k norms, sliding-window attention
    beyond the window, an activation other than silu) are not implemented: Qwen3 is refused
    by the loader, a ``hidden_act`` other than silu by ``LlamaMLP`` (as vLLM's), and
    ``max_model_len`` is capped at a Mistral-style ``sliding_window`` so the window never
    matters.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minipaged.model.attention import PagedAttention
from minipaged.model.input import ModelInput
from minipaged.model.layers import PagedCausalLM, RMSNorm, RotaryEmbedding, SiluAndMul
from minipaged.model.parallel import (
    SINGLE,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    VocabParallelEmbedding,
    load_weights,
)

# Projections fused at load time: (fused parameter, checkpoint name, shard). vLLM calls this
# ``stacked_params_mapping``: the checkpoint keeps q/k/v and gate/up apart, the model runs one
# matmul for each group, because one [T, hidden] x [hidden, 3 outs] matmul costs less than three.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class LlamaMLP(nn.Module):
    """SwiGLU: down_proj(act(gate_proj(x)) * up_proj(x)), gate and up as one matmul.

    Tensor-parallel over ``tp.size`` ranks: rank r holds rows r*I/N .. of gate and of up
    (column-parallel, no communication) and the same columns of down_proj (row-parallel: one
    all-reduce)."""

    def __init__(self, config, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):  # as vLLM's LlamaMLP
            raise ValueError(
                f"config.hidden_act {config.hidden_act!r} is not supported: the Llama family uses silu"
            )
        bias = bool(getattr(config, "mlp_bias", False))
        I = config.intermediate_size  # noqa: E741
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [I, I], bias, tp)
        self.down_proj = RowParallelLinear(I, config.hidden_size, bias, tp)
        self.intermediate_size = self.gate_up_proj.local_sizes[0]  # this rank's I / N
        self.act_fn = SiluAndMul()

    def shard_rows(self, shard: str) -> slice:
        """Rows of ``gate_up_proj`` that hold checkpoint shard ``"gate"`` or ``"up"``."""
        return self.gate_up_proj.local_rows({"gate": 0, "up": 1}[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2 * I] -> [T, I] -> [T, hidden]


class LlamaAttention(nn.Module):
    """q/k/v by heads, column-parallel (rank r: its H / N query and KVH / N KV heads), the
    attention over those heads, o_proj row-parallel (one all-reduce)."""

    def __init__(self, config, head_dim: int, rotary_emb: RotaryEmbedding, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim
        # NOTE: Qwen2 always has q/k/v biases (and none on o_proj); Llama has an
        # attention_bias switch for all four; Mistral has none.
        if config.model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        # q, k, v fused; this rank's heads only
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, total_heads, total_kv_heads, qkv_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden, o_bias, tp)
        self.rotary_emb = rotary_emb  # shared by all layers; holds no weights
        self.attn = PagedAttention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5)

    def shard_rows(self, shard: str) -> slice:
        """Rows of ``qkv_proj`` that hold checkpoint shard ``"q"``, ``"k"`` or ``"v"`` (this rank's heads)."""
        return self.qkv_proj.local_rows(shard)

    def forward(self, cos_sin, h, kv_cache, inp: ModelInput) -> torch.Tensor:
        T = h.shape[0]
        qkv = self.qkv_proj(h)  # [T, q_size + 2 * kv_size]
        # q and k sit side by side: one RoPE call rotates both ([T, H + KVH, D])
        qk = self.rotary_emb.rotate_heads(
            qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos_sin, inp.positions
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, KVH, D]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        o = self.attn(q, k, v, kv_cache, inp)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, rotary_emb: RotaryEmbedding, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(config, head_dim, rotary_emb, tp)
        self.mlp = LlamaMLP(config, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, h, residual, kv_cache, inp: ModelInput):
        """h: the previous layer's output; residual: the stream before it (None in layer 0).
        Returns this layer's (output, residual); their sum is the hidden state after the layer."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)  # residual += h, h = norm(residual)
        h = self.self_attn(cos_sin, h, kv_cache, inp)  # [T, hidden]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual  # [T, hidden] x 2


class LlamaModel(nn.Module):
    def __init__(self, config, head_dim: int, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary_emb = RotaryEmbedding(config, head_dim)
        self.rotary_emb = rotary_emb  # one table for all layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, head_dim, rotary_emb, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(PagedCausalLM):
    """Llama / Mistral / Qwen2 causal LM reading and writing a paged KV cache.

    ``tp``: this rank's place in a tensor-parallel group (default: world size 1, the plain
    model). ``num_heads`` / ``num_kv_heads`` are this rank's (``total_num_*`` the model's), so
    ``allocate_kv_caches`` gives each rank ``[num_blocks, block_size, KVH / N, D]``."""

    def __init__(self, config, eos_token_ids=None, tp: Optional[TensorParallelGroup] = None):
        super().__init__()
        tp = tp or SINGLE
        self.config = config
        self.tp = tp
        self.num_layers = config.num_hidden_layers
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        self.vocab_size = config.vocab_size
        self.max_model_len = int(config.max_position_embeddings)
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            self.max_model_len = min(self.max_model_len, int(window))
        self.eos_token_ids = list(eos_token_ids or [])

        self.model = LlamaModel(config, self.head_dim, tp)
        attn = self.model.layers[0].self_attn if self.num_layers else None
        self.num_heads = attn.num_heads if attn else self.total_num_heads // tp.size  # this rank's
        self.num_kv_heads = attn.num_kv_heads if attn else self.total_num_kv_heads // tp.size
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, inp: ModelInput, kv_caches) -> torch.Tensor:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model {self.num_layers}")
        if kv_caches and inp.attn_backend is not self.attn_backend:  # a hand-built input
            self.prepare_attention(inp, kv_caches[0][0].shape[1])
        h = self.model.embed_tokens(inp.input_ids)  # [T, hidden]
        # RoPE angles depend only on the positions: looked up once, rotated in every layer
        cos_sin = self.model.rotary_emb.cos_sin(inp.positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(cos_sin, h, residual, kv_cache, inp)  # [T, hidden] x 2
        if not (inp.is_decode_only and h.shape[0] == inp.num_seqs):  # else every row is a last token
            idx = inp.logits_indices  # only each sequence's last token: [B, hidden] from here
            h, residual = h[idx], residual[idx]
        h, _ = self.model.norm(h, residual)  # [B, hidden]
        return self.lm_head(h).float()  # [B, vocab] (on every tensor-parallel rank)

    def load_weights(self, state_dict) -> None:
        """Copy a transformers state dict in (casts to this model's dtype).

        Names match Hugging Face's, except that ``q_proj`` / ``k_proj`` / ``v_proj`` go into
        rows of ``qkv_proj`` and ``gate_proj`` / ``up_proj`` into rows of ``gate_up_proj``
        (``STACKED_PARAMS``): ``parallel.load_weights``, which copies a tensor-parallel rank's
        shard only."""
        if self.tie_word_embeddings:  # NOTE: Module.to_empty() can untie shared parameters
            self.lm_head.weight = self.model.embed_tokens.weight
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()  # the same tensor as embed_tokens
        load_weights(self, state_dict, STACKED_PARAMS, skip + ("rotary_emb",))  # NOTE: we compute inv_freq
