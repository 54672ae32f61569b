"""A fake paged model whose cache holds *contents*, for sharing tests (no torch).

The "KV cache" is a dict slot -> (position, token): what a real K/V entry depends on.
Unlike ``_fake_paged_model`` it does not record who wrote a slot, because with sharing a
sequence legitimately reads blocks written by its parent (fork) or by an earlier request
(prefix caching). Each step it applies the scheduler's block moves exactly as the engine
does (swap out, swap in, then the copy-on-write copies, all sources read before any
destination is written), writes the scheduled tokens at their slots, and for every
sequence that samples *reads its whole context back through its block table*; a wrong
share, a missing or misdirected copy, a cached block with other contents, or a write into
a block another sequence still reads changes what is read (and trips an assertion).

The next token is a function of the sequence's *sample index* (the part of its id after
the last ``.``, so the n sequences of a group diverge) and of the context it read:
``reference_outputs`` computes the same thing with a plain loop, no scheduler at all.
"""

from __future__ import annotations

from minipaged.core import PaperSchedulerOutput, Request

VOCAB = 50


def sample_index(request_id: str) -> str:
    return request_id.rsplit(".", 1)[-1] if "." in request_id else "0"


def next_token(request_id: str, tokens: list[int]) -> int:
    h = sum(ord(c) for c in sample_index(request_id)) + 17
    for i, t in enumerate(tokens):
        h = (h * 31 + (i + 1) * (t + 7)) % 1_000_003
    return h % VOCAB


def reference_outputs(request: Request, max_model_len: int | None = None) -> list[int]:
    tokens = list(request.prompt_token_ids)
    out: list[int] = []
    p = request.sampling_params
    while True:
        t = next_token(request.request_id, tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= p.max_tokens or (max_model_len is not None and len(tokens) >= max_model_len):
            return out
        if not p.ignore_eos and request.eos_token_id is not None and t == request.eos_token_id:
            return out
        if t in p.stop_token_ids:
            return out


class ContentPagedModel:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.cpu: dict[int, tuple[int, int]] = {}
        self.num_copies = 0
        self.num_computed = 0  # tokens computed (prefill + decode), for cache savings
        self.used_blocks: list[int] = []  # device blocks in use after each step (drive)

    def _copy(self, src: dict, dst: dict, mapping) -> None:
        bs = self.block_size
        # NOTE: simultaneous, as kernels.cache_ops does: read every source first
        blocks = [[src.get(s * bs + o) for o in range(bs)] for s, _ in mapping]
        for (_, d), contents in zip(mapping, blocks):
            for o, entry in enumerate(contents):
                if entry is None:
                    dst.pop(d * bs + o, None)
                else:
                    dst[d * bs + o] = entry

    def execute(self, output, kv_cache_manager) -> dict[str, int]:
        """One step; the sampled token of every sequence that needs one."""
        paper = isinstance(output, PaperSchedulerOutput)  # only the paper's scheduler moves blocks
        if paper:
            self._copy(self.device, self.cpu, output.blocks_to_swap_out)
            self._copy(self.cpu, self.device, output.blocks_to_swap_in)
            self._copy(self.device, self.device, output.blocks_to_copy)
            self.num_copies += len(output.blocks_to_copy)
        bs = self.block_size
        rows: dict[str, list[int]] = {}  # request id -> the context it read
        for req, n in output.scheduled:
            rid, start = req.request_id, req.num_computed_tokens
            tokens = req.all_token_ids
            for pos, slot in zip(
                range(start, start + n), kv_cache_manager.get_slot_mapping(rid, start, start + n)
            ):
                self.device[slot] = (pos, tokens[pos])
            self.num_computed += n
        for req, n in output.scheduled:
            rid, end = req.request_id, req.num_computed_tokens + n
            if end != req.num_tokens:
                continue
            table = kv_cache_manager.get_block_ids(rid)
            seen = []
            for pos in range(end):
                entry = self.device.get(table[pos // bs] * bs + pos % bs)
                assert entry == (pos, req.all_token_ids[pos]), (
                    f"{rid} position {pos}: the cache holds {entry}, expected {(pos, req.all_token_ids[pos])}"
                )
                seen.append(entry[1])
            rows[rid] = seen
        sampled = {rid: next_token(rid, seen) for rid, seen in rows.items()}
        # a sequence forked this step samples from its parent's row (same context)
        for parent, child in output.fork_samples if paper else ():
            sampled[child.request_id] = next_token(child.request_id, rows[parent.request_id])
        return sampled


def drive(scheduler, arrivals: dict, model: ContentPagedModel, max_steps: int = 5000, check=True):
    """Add requests (or groups: lists) at their steps, step to the end; the outputs."""
    step, last = 0, max(arrivals, default=0)
    outputs = []
    while step <= last or scheduler.has_unfinished_requests():
        assert step < max_steps, "no progress"
        for item in arrivals.get(step, ()):
            if isinstance(item, list):
                scheduler.add_request_group(item)
            else:
                scheduler.add_request(item)
        out = scheduler.schedule()
        if check:
            scheduler.check_invariants()
        sampled = model.execute(out, scheduler.kv_cache_manager)
        scheduler.update_from_output(out, sampled)
        model.used_blocks.append(scheduler.kv_cache_manager.get_num_used_blocks())
        if check:
            scheduler.check_invariants()
        outputs.append(out)
        step += 1
    return outputs
