"""BlockTable (minipaged/core/kv/block_table.py): the slot formula of chapter 02, checked by
hand, and the table the KV-cache manager keeps, moves on swap and the model runner reads."""

import pytest

from minipaged.core import BlockPool, BlockSpaceManager, BlockTable, Request
from minipaged.sampling_params import SamplingParams


def test_slot_formula_by_hand():
    pool = BlockPool(8)
    # logical blocks 0, 1, 2 live in physical blocks 5, 0, 3; block_size 4; 10 tokens
    t = BlockTable([pool.blocks[5], pool.blocks[0], pool.blocks[3]], 10, 4)
    # token 0 -> 5*4+0, token 5 -> 0*4+1, token 9 -> 3*4+1
    assert [t.slot(i) for i in (0, 3, 4, 5, 8, 9)] == [20, 23, 0, 1, 12, 13]
    assert t.slot_mapping(3, 6) == [23, 0, 1]
    assert t.slot_mapping(4, 4) == []
    assert t.block_ids() == [5, 0, 3]
    for bad in ((0, 11), (-1, 2), (5, 4)):
        with pytest.raises(ValueError, match="outside"):
            t.slot_mapping(*bad)


def test_manager_keeps_one_table_and_swap_moves_it():
    m = BlockSpaceManager(num_blocks=6, block_size=4, num_cpu_blocks=6)
    r = Request("r", list(range(6)), SamplingParams())
    m.allocate_slots(r, 6)
    t = m.get_block_table(r)
    assert m.block_tables["r"] is t and (t.num_tokens, len(t.blocks)) == (6, 2)
    m.allocate_slots(r, 3)  # grows the same table in place
    assert m.get_block_table("r") is t and (t.num_tokens, len(t.blocks)) == (9, 3)
    assert m.get_slot_mapping("r", 0, 9) == t.slot_mapping(0, 9)
    pairs = m.swap_out(r)
    assert "r" not in m.block_tables and m.cpu_block_tables["r"] is t  # the table moved
    assert t.block_ids() == [c for _, c in pairs] and t.num_tokens == 9
    m.check_invariants()
    back = m.swap_in(r)
    assert m.block_tables["r"] is t and t.block_ids() == [d for _, d in back]
    m.check_invariants()
    m.free(r)
    assert not m.block_tables and m.get_num_free_blocks() == 6
    m.check_invariants()
