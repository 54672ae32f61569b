"""A fake paged model for scheduler tests (no torch).

The "KV cache" is a dict slot -> (request_id, position, token). Each step the fake model
writes the scheduled tokens at the slots the KVCacheManager gives, then, for every
request that samples, *reads its whole context back through its block table* and derives
the next token from what it read. A block handed to two requests at once, a swap copied
to the wrong place, or a recompute that skips a token all change what is read, so the
outputs then differ from ``reference_outputs`` (a plain loop, no scheduler at all).
"""

from __future__ import annotations

from minipaged.core import PaperSchedulerOutput, Request

VOCAB = 50


def next_token_from_context(request_id: str, tokens: list[int]) -> int:
    """The fake model: a deterministic function of the request and its whole context."""
    h = sum(ord(c) for c in request_id)
    for i, t in enumerate(tokens):
        h = (h * 31 + (i + 1) * (t + 7)) % 1_000_003
    return h % VOCAB


def reference_outputs(request: Request, max_model_len: int | None) -> tuple[list[int], str]:
    """The output tokens and finish kind of ``request`` run alone, without any scheduler."""
    tokens = list(request.prompt_token_ids)
    out: list[int] = []
    p = request.sampling_params
    while True:
        t = next_token_from_context(request.request_id, tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= p.max_tokens or (max_model_len is not None and len(tokens) >= max_model_len):
            return out, "length"
        if not p.ignore_eos and request.eos_token_id is not None and t == request.eos_token_id:
            return out, "stop"
        if t in p.stop_token_ids:
            return out, "stop"


class FakePagedModel:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, tuple] = {}  # slot -> (request_id, position, token)
        self.cpu: dict[int, tuple] = {}

    def _copy(self, src: dict, dst: dict, mapping) -> None:
        bs = self.block_size
        for s, d in mapping:
            for o in range(bs):
                if s * bs + o in src:
                    dst[d * bs + o] = src[s * bs + o]
                else:
                    dst.pop(d * bs + o, None)

    def execute(self, output, kv_cache_manager) -> dict[str, int]:
        """Run one step; return the sampled token of each request that completes prefill."""
        if isinstance(output, PaperSchedulerOutput):  # only the paper's scheduler swaps
            self._copy(self.device, self.cpu, output.blocks_to_swap_out)
            self._copy(self.cpu, self.device, output.blocks_to_swap_in)
        sampled = {}
        bs = self.block_size
        for req, n in output.scheduled:
            rid, start = req.request_id, req.num_computed_tokens
            tokens = req.all_token_ids
            slots = kv_cache_manager.get_slot_mapping(rid, start, start + n)
            for pos, slot in zip(range(start, start + n), slots):
                self.device[slot] = (rid, pos, tokens[pos])
            if start + n == req.num_tokens:  # prefill complete: attend over everything
                table = kv_cache_manager.get_block_ids(rid)
                seen = []
                for pos in range(start + n):
                    entry = self.device.get(table[pos // bs] * bs + pos % bs)
                    assert entry is not None and entry[:2] == (rid, pos), (
                        f"{rid} position {pos}: the cache holds {entry}"
                    )
                    seen.append(entry[2])
                sampled[rid] = next_token_from_context(rid, seen)
        return sampled
