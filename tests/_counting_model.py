"""The counting model: a fake paged model whose next token is a function of the whole
context as it reads it back from the paged cache (shared by the engine and worker tests)."""

from __future__ import annotations

import torch

from minipaged.kernels import reshape_and_cache


class CountingModel:
    """next token = (31 * sum(context) + len(context)) % V, context read from the cache."""

    num_layers = 1
    num_kv_heads = 1
    head_dim = 2
    eos_token_id = None

    def __init__(self, vocab_size: int = 97, max_model_len: int = 256):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.calls = 0

    def allocate_kv_caches(self, num_blocks, block_size):
        return [(torch.zeros(num_blocks, block_size, 1, 2), torch.zeros(num_blocks, block_size, 1, 2))]

    def prepare_attention(self, inp, block_size):
        return inp  # no attention backend: forward reads the cache itself

    def forward(self, inp, kv_caches):
        self.calls += 1
        k, v = kv_caches[0]
        key = torch.stack([inp.input_ids.float(), inp.positions.float() + 1], -1)[:, None, :]
        reshape_and_cache(key, key, k, v, inp.slot_mapping)
        bs = k.shape[1]
        out = torch.full((inp.num_seqs, self.vocab_size), -1.0)
        for b in range(inp.num_seqs):
            L = int(inp.seq_lens[b])
            nb = -(-L // bs)
            ctx = k[inp.block_tables[b, :nb].long()].reshape(-1, 2)[:L]  # [L, 2]
            assert torch.equal(ctx[:, 1], torch.arange(1, L + 1).float()), "cache holds wrong tokens"
            out[b, int((ctx[:, 0].sum() * 31 + L) % self.vocab_size)] = 1.0
        return out


def counting_reference(prompt, n, V=97):
    ctx, out = list(prompt), []
    for _ in range(n):
        t = (sum(ctx) * 31 + len(ctx)) % V
        out.append(t)
        ctx.append(t)
    return out
