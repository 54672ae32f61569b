"""The "triton" attention backend: the Triton kernels of ``paged_attention.py`` behind the face
every backend has (``torch_backend.TorchAttentionBackend``).

Mirrors vLLM ``vllm/v1/attention/backends/triton_attn.py`` (its backend, metadata builder and
impl, here one object with no per-step plan).

Inputs / outputs
    ``forward(layer, q, k, v, kv_cache, inp)``: K/V written at ``inp.slot_mapping``
    (``cache_ops.reshape_and_cache``), then the decode kernel when every sequence has exactly
    one query (``inp.is_decode_only``: T == num_seqs, q is already [num_seqs, H, D]), the
    varlen prefill kernel otherwise; -> [T, H, D].

Failure mode
    Without Triton installed, the kernels raise ``RuntimeError`` when called (the selector
    refuses "triton" up front). Triton is imported on the first call only.
"""

from __future__ import annotations

from minipaged.kernels.cache_ops import reshape_and_cache


class TritonAttentionBackend:
    name = "triton"
    layer_impl = "torch"

    def build_metadata(self, inp, block_size: int, row_cost: int):
        return None  # the kernels read the block tables and lengths as they are

    def forward(self, layer, q, k, v, kv_cache, inp):
        from minipaged import kernels  # NOTE: its paged_attention_* load Triton on first use

        k_cache, v_cache = kv_cache
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
        reshape_and_cache(k, v, k_cache, v_cache, inp.slot_mapping, **scales)
        if inp.is_decode_only:
            return kernels.paged_attention_decode(
                q, k_cache, v_cache, inp.block_tables, inp.seq_lens, layer.scale,
                max_seq_len=inp.max_seq_len, **scales,
            )  # fmt: skip
        return kernels.paged_attention_prefill(
            q, k_cache, v_cache, inp.block_tables, inp.cu_seqlens_q, inp.seq_lens, layer.scale,
            max_query_len=inp.max_query_len, **scales,
        )  # fmt: skip
