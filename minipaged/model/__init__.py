"""minipaged.model: a minimal Llama-family and GPT-2 forward on a paged KV cache.

- ``load_model(model=None, dtype="float32", device="cpu", attention_backend="torch")``
  -> ``(model, tokenizer)``; ``None`` loads the course model shipped in
  ``minipaged/data/course_model``.
- ``model.allocate_kv_caches(num_blocks, block_size)`` -> one ``(k_cache, v_cache)`` per
  layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- ``model.forward(inp: ModelInput, kv_caches)`` -> fp32 logits ``[num_seqs, vocab]``.

Files: ``input.py`` (ModelInput, the slot formula), ``layers.py`` (RMSNorm, RoPE, base class),
``attention.py`` (PagedAttention: its backend writes the cache, then reads through block tables),
``llama.py`` (Llama / Mistral / Qwen2), ``gpt2.py`` (GPT-2), ``loader.py`` (HF weights),
``parallel.py`` (tensor-parallel layers, weight loading), ``kv_scales.py`` (int8 / fp8 cache scales).
Mirrors vLLM ``vllm/model_executor/models/``.
"""

from minipaged.kernels.selector import ATTENTION_BACKENDS
from minipaged.model.attention import PagedAttention
from minipaged.model.gpt2 import GPT2LMHeadModel
from minipaged.model.input import ModelInput
from minipaged.model.layers import PagedCausalLM
from minipaged.model.llama import LlamaForCausalLM
from minipaged.model.loader import COURSE_MODEL_DIR, load_model, resolve_model_path

__all__ = [
    "ATTENTION_BACKENDS",
    "COURSE_MODEL_DIR",
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "ModelInput",
    "PagedAttention",
    "PagedCausalLM",
    "load_model",
    "resolve_model_path",
]
