"""ModelInputs built by hand for the model tests (``tests/model/test_model.py``) and the
forward-breakdown test (``tests/bench/test_profile.py``): block_size 4, shuffled tables,
independent of the engine's ModelRunner."""

from __future__ import annotations

import torch

from minipaged.model import ModelInput

BLOCK_SIZE = 4
NUM_BLOCKS = 32
VOCAB = 96


def shuffled_tables(num_seqs: int, blocks_each: int, seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled block tables (physical block ids in no particular order)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    return [perm[i * blocks_each : (i + 1) * blocks_each] for i in range(num_seqs)]


def build_input(chunks, tables) -> ModelInput:
    """chunks[b] = (new token ids, number of tokens of b already in the cache)."""
    ids, pos, slots, seq_lens, cu, logits_idx = [], [], [], [], [0], []
    for (new_ids, num_computed), table in zip(chunks, tables):
        for j, tok in enumerate(new_ids):
            p = num_computed + j
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        seq_lens.append(num_computed + len(new_ids))
        cu.append(cu[-1] + len(new_ids))
        logits_idx.append(cu[-1] - 1)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    q_lens = [len(c[0]) for c in chunks]
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        logits_indices=torch.tensor(logits_idx, dtype=torch.long),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()
