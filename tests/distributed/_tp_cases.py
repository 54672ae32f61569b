"""Shared by the tensor-parallel tests: tiny checkpoints, hand-built ModelInputs, a worker
that holds several models' shards (one process group start for all of them)."""

from __future__ import annotations

import os

import torch

from minipaged.model import ModelInput

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def make_qwen2(path) -> str:
    """A tiny random Qwen2 (q/k/v biases, GQA, tied embeddings), perturbed so biases are not 0."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(path)
    return str(path)


def build_input(chunks, tables, block_size: int = BLOCK_SIZE) -> ModelInput:
    """chunks[b] = (new token ids of sequence b, number of its tokens already in the cache)."""
    ids, pos, slots, seq_lens, cu, last = [], [], [], [], [0], []
    for (new_ids, num_computed), table in zip(chunks, tables):
        for j, tok in enumerate(new_ids):
            p = num_computed + j
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        seq_lens.append(num_computed + len(new_ids))
        cu.append(cu[-1] + len(new_ids))
        last.append(cu[-1] - 1)
    width = max(len(t) for t in tables)
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        logits_indices=torch.tensor(last, dtype=torch.long),
        max_query_len=max(len(c[0]) for c in chunks),
        max_seq_len=max(seq_lens),
    )


class MultiModelWorker:
    """One rank's ``ModelShardWorker`` for each of several models (test helper)."""

    def __init__(self, rank, tp, device, models: dict, **kwargs) -> None:
        from minipaged.distributed.shard_worker import ModelShardWorker

        self.workers = {
            name: ModelShardWorker(rank, tp, device, model=path, **kwargs) for name, path in models.items()
        }

    def run(self, name: str, method: str, *args):
        return getattr(self.workers[name], method)(*args)


def shm_segments(pids) -> set[str]:
    """The /dev/shm files these processes map or hold open (other sessions' files on a shared
    machine do not count: only what our processes use)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                out.update(line.split()[-1] for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    out.add(target.split(" (deleted)")[0])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def left_behind(segments) -> set[str]:
    """Those of ``segments`` still in /dev/shm."""
    return {s for s in segments if os.path.exists(s)}


def rank_part(shape, dtype, seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input to collective ``seed``: seeded, so the test recomputes it."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g).to(dtype)


class CollectiveWorker:
    """A rank that runs a list of collectives through its group (shared memory where it has a
    segment and the tensor fits, else gloo) on seeded inputs (``rank_part``)."""

    def __init__(self, rank, tp, device) -> None:
        self.rank, self.tp = rank, tp

    def run(self, ops, inference: bool = False):
        """``ops``: ``(kind, shape, dtype, seed)`` with kind ``"sum"`` or ``"gather"``;
        a shape whose first entry is negative means the transposed (non-contiguous) tensor."""
        out = []
        with torch.inference_mode(inference):
            for kind, shape, dtype, seed in ops:
                x = rank_part([abs(n) for n in shape], dtype, seed, self.rank)
                if shape[0] < 0:
                    x = x.t()
                out.append(self.tp.all_reduce(x) if kind == "sum" else self.tp.all_gather(x, -1))
        return [t.clone() for t in out]

    def wait_in_all_reduce(self, sleeping_rank: int, seconds: float) -> str:
        """Every rank but ``sleeping_rank`` enters an all-reduce; that one sleeps first."""
        import time

        if self.rank == sleeping_rank:
            time.sleep(seconds)
        self.tp.all_reduce(torch.ones(4))
        return "done"

    def stats(self) -> dict:
        return {
            "num_collectives": self.tp.num_collectives,
            "num_shm": self.tp.num_shm,
            "shm": self.tp.shm is not None,
        }
