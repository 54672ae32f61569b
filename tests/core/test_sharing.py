"""Sharing blocks: fork, copy-on-write, sequence groups (minipaged/core/kv/kv_cache_manager.py,
minipaged/core/sched/scheduler.py; the engine's n > 1 path).

References, each independent of the code under test:
- hand-worked block tables, ref counts and copies;
- a hypothesis state machine that keeps the *contents* every sequence wrote (a fresh
  value per token) and a simulated memory: after every operation each sequence reads its
  own tokens back through its block table, so a wrong share, a missing copy or a write
  into a shared block shows; ``check_invariants()`` after every rule; no block leaks;
- the scheduler driven by a content-addressed fake model (``tests/_content_model.py``)
  against a plain loop without any scheduler, under preemption (recompute and swap),
  chunked prefill and prefix caching;
- the engine: ``SamplingParams(n > 1)`` with sharing gives the same tokens as the static
  baseline, which serves the n sequences without any sharing, seed for seed.
"""

from __future__ import annotations

import random

import pytest
from _content_model import ContentPagedModel, drive, reference_outputs
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged import SamplingParams
from minipaged.core import BlockSpaceManager, PaperScheduler, Request, RequestStatus, cdiv

# ----------------------------------------------------------------------------- manager, by hand


def test_fork_and_copy_on_write_by_hand():
    m = BlockSpaceManager(num_blocks=8, block_size=4)
    m.allocate_slots("p", 6)  # blocks 0, 1; block 1 holds 2 of 4 tokens
    m.fork("p", "c")
    assert m.get_block_ids("c") == m.get_block_ids("p") == [0, 1]
    assert [m.get_ref_cnt(b) for b in (0, 1)] == [2, 2]
    assert m.get_num_free_blocks() == 6  # a fork takes no block
    assert m.get_num_blocks_needed("c", 1) == 1  # the copy
    m.check_invariants()
    # the child writes token 6 into the shared, partly filled block 1: copy it first
    new = m.allocate_slots("c", 1)
    assert [b.block_id for b in new] == [2]
    assert m.get_block_ids("c") == [0, 2] and m.get_block_ids("p") == [0, 1]
    assert [m.get_ref_cnt(b) for b in (0, 1, 2)] == [2, 1, 1]
    # the parent is now alone in block 1: it writes in place, no copy
    assert m.allocate_slots("p", 1) == []
    assert m.take_pending_copies() == [(1, 2)]
    assert m.take_pending_copies() == []
    m.check_invariants()
    # freeing a shared block only drops its count
    m.free("p")
    assert m.get_ref_cnt(0) == 1 and m.get_ref_cnt(1) == 0
    m.free("c")
    assert m.get_num_free_blocks() == 8
    m.check_invariants()


def test_full_shared_block_is_never_copied():
    m = BlockSpaceManager(num_blocks=8, block_size=4)
    m.allocate_slots("p", 8)  # two full blocks
    m.fork("p", "c")
    assert m.get_num_blocks_needed("c", 1) == 1
    assert [b.block_id for b in m.allocate_slots("c", 1)] == [2]  # a new block, no copy
    assert m.get_block_ids("c") == [0, 1, 2]
    assert m.take_pending_copies() == []
    assert [m.get_ref_cnt(b) for b in (0, 1, 2)] == [2, 2, 1]
    m.check_invariants()


def test_copy_on_write_is_all_or_nothing():
    m = BlockSpaceManager(num_blocks=3, block_size=4)
    m.allocate_slots("p", 6)
    m.fork("p", "c")
    m.allocate_slots("x", 4)  # the last free block
    before = (m.get_block_ids("c"), m.get_num_free_blocks())
    assert m.allocate_slots("c", 1) is None  # the copy needs a block: nothing changes
    assert (m.get_block_ids("c"), m.get_num_free_blocks()) == before
    assert m.take_pending_copies() == []
    m.check_invariants()


def test_fork_errors_and_chained_copies():
    m = BlockSpaceManager(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="unknown parent"):
        m.fork("nobody", "c")
    m.allocate_slots("p", 2)
    m.allocate_slots("q", 1)
    with pytest.raises(ValueError, match="already holds"):
        m.fork("p", "q")
    # copy-on-write, then a fork of the copy and another write, all before the engine
    # copies anything: the second copy must come from the first copy's source
    m.fork("p", "c")
    m.allocate_slots("c", 1)  # c: block 0 (2 of 4 tokens) -> copy into 2
    m.fork("c", "d")
    m.allocate_slots("d", 1)  # d: block 2 (still empty on the device) -> copy into 3
    assert m.take_pending_copies() == [(0, 2), (0, 3)]
    m.check_invariants()


def test_group_swap_keeps_sharing():
    m = BlockSpaceManager(num_blocks=10, block_size=4, num_cpu_blocks=10)
    m.allocate_slots("a", 9)  # 3 blocks
    m.fork("a", "b")
    m.allocate_slots("b", 1)  # b copies block 2
    m.take_pending_copies()
    out = m.swap_out_group(["a", "b"])
    # 4 distinct device blocks -> 4 CPU blocks; a and b still share their first two
    assert len(out) == 4 and m.get_num_free_cpu_blocks() == 6
    assert m.get_cpu_block_ids("a")[:2] == m.get_cpu_block_ids("b")[:2]
    assert m.get_num_free_blocks() == 10
    m.check_invariants()
    assert m.can_swap_in_group(["a", "b"], [1, 1])
    back = m.swap_in_group(["a", "b"])
    assert len(back) == 4 and m.get_num_free_blocks() == 6
    assert m.get_block_ids("a")[:2] == m.get_block_ids("b")[:2]
    assert m.get_ref_cnt(m.get_block_ids("a")[0]) == 2
    m.check_invariants()


# ----------------------------------------------------------------------------- state machine

SEQ_IDS = [f"s{i}" for i in range(6)]


class SharingMachine(RuleBasedStateMachine):
    """Allocate, fork, step (several sequences write, copies done at once), free, swap."""

    @initialize(
        num_blocks=st.integers(2, 14),
        block_size=st.integers(1, 4),
        num_cpu_blocks=st.sampled_from([0, 6, 16]),
    )
    def init(self, num_blocks, block_size, num_cpu_blocks):
        self.bs = block_size
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.m = BlockSpaceManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks)
        self.tokens: dict[str, list[int]] = {}  # live on the device: the values it wrote
        self.swapped: dict[str, list[int]] = {}
        self.mem: dict[int, int] = {}  # device slot -> value
        self.cpu: dict[int, int] = {}
        self.next_value = 1

    def _copy(self, src, dst, mapping):
        bs = self.bs
        contents = [[src.get(s * bs + o) for o in range(bs)] for s, _ in mapping]
        for (_, d), c in zip(mapping, contents):
            for o, v in enumerate(c):
                if v is None:
                    dst.pop(d * bs + o, None)
                else:
                    dst[d * bs + o] = v

    def _write(self, rid, k):
        slots = self.m.get_slot_mapping(rid, len(self.tokens[rid]), len(self.tokens[rid]) + k)
        for s in slots:
            self.mem[s] = self.next_value
            self.tokens[rid].append(self.next_value)
            self.next_value += 1

    def _expected_need(self, rid, k):
        n = len(self.tokens.get(rid, []))
        grow = cdiv(n + k, self.bs) - cdiv(n, self.bs)
        cow = 0
        if n % self.bs and rid in self.tokens:
            last = self.m.get_block_ids(rid)[-1]
            holders = sum(t[-1] == last for t in (self.m.get_block_ids(r) for r in self.tokens))
            cow = int(holders > 1)
        return grow + cow

    @rule(rid=st.sampled_from(SEQ_IDS), k=st.integers(1, 9))
    def new(self, rid, k):
        if rid in self.tokens or rid in self.swapped:
            return
        if cdiv(k, self.bs) > self.num_blocks:
            with pytest.raises(ValueError):
                self.m.allocate_slots(rid, k)
            return
        if self.m.allocate_slots(rid, k) is None:
            assert cdiv(k, self.bs) > self.m.get_num_free_blocks()
            return
        self.tokens[rid] = []
        self._write(rid, k)

    @rule(parent=st.sampled_from(SEQ_IDS), child=st.sampled_from(SEQ_IDS))
    def fork(self, parent, child):
        if parent not in self.tokens or child in self.tokens or child in self.swapped:
            with pytest.raises(ValueError):
                self.m.fork(parent, child)
            return
        free = self.m.get_num_free_blocks()
        self.m.fork(parent, child)
        assert self.m.get_num_free_blocks() == free  # sharing takes no block
        self.tokens[child] = list(self.tokens[parent])

    @rule(data=st.data())
    def step(self, data):
        """Several sequences each get k more tokens; copies first (at once), then writes."""
        live = sorted(self.tokens)
        if not live:
            return
        batch = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
        done = []
        for rid in batch:
            k = data.draw(st.integers(1, 5))
            if cdiv(len(self.tokens[rid]) + k, self.bs) > self.num_blocks:
                continue
            need = self._expected_need(rid, k)
            free = self.m.get_num_free_blocks()
            new = self.m.allocate_slots(rid, k)
            if need > free:
                assert new is None
                continue
            assert new is not None and len(new) == need
            done.append((rid, k))
        self._copy(self.mem, self.mem, self.m.take_pending_copies())
        for rid, k in done:
            self._write(rid, k)

    @rule(rid=st.sampled_from(SEQ_IDS))
    def free(self, rid):
        if rid not in self.tokens:
            return
        self.m.free(rid)
        del self.tokens[rid]

    @precondition(lambda self: self.num_cpu_blocks > 0)
    @rule(data=st.data())
    def swap_out(self, data):
        live = sorted(self.tokens)
        if not live:
            return
        group = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
        distinct = {b for r in group for b in self.m.get_block_ids(r)}
        free_cpu = self.m.get_num_free_cpu_blocks()
        mapping = self.m.swap_out_group(group)
        assert (mapping is None) == (len(distinct) > free_cpu)
        if mapping is None:
            return
        assert self.m.get_num_free_cpu_blocks() == free_cpu - len(distinct)
        assert sorted(d for d, _ in mapping) == sorted(distinct)
        self._copy(self.mem, self.cpu, mapping)
        for r in group:
            self.swapped[r] = self.tokens.pop(r)

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.swapped:
            return
        group = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), unique=True, min_size=1))
        fits = self.m.can_swap_in_group(group, [0] * len(group))
        mapping = self.m.swap_in_group(group)
        assert (mapping is not None) == fits
        if mapping is None:
            return
        self._copy(self.cpu, self.mem, mapping)
        for r in group:
            self.tokens[r] = self.swapped.pop(r)

    @invariant()
    def contents_read_back(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        assert not self.m.pending_copies
        for rid, values in self.tokens.items():
            slots = self.m.get_slot_mapping(rid, 0, len(values))
            assert [self.mem.get(s) for s in slots] == values, f"{rid} reads back other contents"
        held = {b for r in self.tokens for b in self.m.get_block_ids(r)}
        assert self.m.get_num_free_blocks() == self.num_blocks - len(held)

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for rid in list(self.tokens):
            self.m.free(rid)
        for rid in list(self.swapped):
            self.m.free_swapped(rid)
        assert self.m.get_num_free_blocks() == self.num_blocks, "device blocks leaked"
        assert self.m.get_num_free_cpu_blocks() == self.num_cpu_blocks, "CPU blocks leaked"
        self.m.check_invariants()


TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


# ----------------------------------------------------------------------------- scheduler groups


def _group(name, prompt, n, max_tokens=10, eos=None):
    params = SamplingParams(max_tokens=max_tokens)
    return [Request(f"{name}.{j}", prompt, params, eos_token_id=eos) for j in range(n)]


def test_group_prefills_once_then_forks_by_hand():
    s = PaperScheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    seqs = _group("g", [5, 6, 7, 8, 9, 10], 3, max_tokens=4)
    s.add_request_group(seqs)
    out = s.schedule()
    s.check_invariants()
    # only the leader is scheduled: the prompt once
    assert out.num_scheduled_tokens == {"g.0": 6}
    assert [(p.request_id, c.request_id) for p, c in out.forks] == [("g.0", "g.1"), ("g.0", "g.2")]
    assert out.fork_samples == out.forks  # no output yet: first tokens from the leader's row
    kv = s.kv_cache_manager
    assert kv.get_block_ids("g.0") == kv.get_block_ids("g.1") == kv.get_block_ids("g.2") == [0, 1]
    assert kv.get_ref_cnt(0) == kv.get_ref_cnt(1) == 3
    s.update_from_output(out, {"g.0": 1, "g.1": 2, "g.2": 3})
    s.check_invariants()
    assert [r.output_token_ids for r in seqs] == [[1], [2], [3]]
    # step 1: three decodes; block 1 holds 2 of 4 tokens and is shared by 3:
    # g.0 copies it into 2, g.1 into 3, g.2 (now alone) writes in place
    out = s.schedule()
    assert out.num_scheduled_tokens == {"g.0": 1, "g.1": 1, "g.2": 1}
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [kv.get_block_ids(f"g.{j}") for j in range(3)] == [[0, 2], [0, 3], [0, 1]]
    assert [kv.get_ref_cnt(b) for b in range(4)] == [3, 1, 1, 1]
    s.update_from_output(out, {"g.0": 4, "g.1": 5, "g.2": 6})
    s.check_invariants()


def test_group_refusals_and_abort():
    s = PaperScheduler(num_blocks=8, block_size=4, max_num_seqs=2)
    big = _group("big", [1, 2, 3], 3)
    s.add_request_group(big)
    assert all(r.status == RequestStatus.FINISHED_IGNORED for r in big)
    assert "max_num_seqs" in big[0].stop_reason
    s = PaperScheduler(num_blocks=8, block_size=4)
    long = _group("long", list(range(8)), 4, max_tokens=12)  # 2 shared + 4 x 3 private > 8
    s.add_request_group(long)
    assert all(r.status == RequestStatus.FINISHED_IGNORED for r in long)
    # aborting a sequence of a group that has not forked yet aborts the group
    s = PaperScheduler(num_blocks=8, block_size=4, max_num_batched_tokens=3)  # chunks of 3
    g = _group("g", [1, 2, 3, 4, 5], 2)
    s.add_request_group(g)
    out = s.schedule()
    s.update_from_output(out, {})
    s.abort_request("g.1")
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in g)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.get_num_free_blocks() == 8
    s.check_invariants()
    with pytest.raises(ValueError, match="share one prompt"):
        s.add_request_group([Request("x.0", [1]), Request("x.1", [2])])


def _workload(rng, n_groups, block_size):
    arrivals: dict[int, list] = {}
    all_seqs = []
    for i in range(n_groups):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 3 * block_size + 2))]
        n = rng.choice([1, 2, 3, 4])
        params = SamplingParams(max_tokens=rng.randint(1, 12), stop_token_ids=[rng.randrange(50)])
        seqs = [Request(f"r{i}.{j}", prompt, params, eos_token_id=rng.choice([None, 7])) for j in range(n)]
        arrivals.setdefault(rng.randint(0, 6), []).append(seqs if n > 1 else seqs[0])
        all_seqs += seqs
    return arrivals, all_seqs


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    mode=st.sampled_from(["recompute", "swap"]),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4]),
    chunked=st.booleans(),
    caching=st.booleans(),
    budget=st.sampled_from([6, 16, 64]),
)
def test_groups_equal_plain_loop_under_pressure(seed, mode, num_blocks, block_size, chunked, caching, budget):
    rng = random.Random(seed)
    arrivals, seqs = _workload(rng, rng.randint(1, 6), block_size)
    s = PaperScheduler(
        num_blocks,
        block_size,
        max_num_seqs=rng.choice([4, 8]),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        num_cpu_blocks=12 if mode == "swap" else 0,
        enable_prefix_caching=caching,
    )
    model = ContentPagedModel(block_size)
    drive(s, arrivals, model)
    for r in seqs:
        assert r.is_finished
        if r.status == RequestStatus.FINISHED_IGNORED:
            continue
        assert r.output_token_ids == reference_outputs(r), r.request_id
    kv = s.kv_cache_manager
    assert kv.get_num_free_blocks() == num_blocks, "device blocks leaked"
    assert kv.get_num_free_cpu_blocks() == kv.num_cpu_blocks, "CPU blocks leaked"
    assert not s.seq_groups


def test_groups_share_prompt_blocks_and_copy():
    """A roomy pool: fewer blocks than n independent sequences, and copies were made."""
    rng = random.Random(3)
    prompt = [rng.randrange(50) for _ in range(10)]  # 2 full blocks + 2 tokens (block_size 4)
    shared, alone = PaperScheduler(64, 4), PaperScheduler(64, 4)
    m1, m2 = ContentPagedModel(4), ContentPagedModel(4)
    outs1 = drive(shared, {0: [_group("g", prompt, 4, max_tokens=6)]}, m1)
    outs2 = drive(alone, {0: [Request(f"g.{j}", prompt, SamplingParams(max_tokens=6)) for j in range(4)]}, m2)
    # peak: 2 shared full blocks + 4 private tails of (10 + 5) tokens -> 2 + 4 x 2 = 10,
    # against 4 x 4 = 16 without sharing
    assert max(m1.used_blocks) == 10 and max(m2.used_blocks) == 16
    assert m1.used_blocks[-1] == m2.used_blocks[-1] == 0
    assert m1.num_copies == 3  # the partly filled prompt block, once per extra sequence
    assert m1.num_computed == 10 + 4 * 5 < m2.num_computed == 4 * (10 + 5)
    assert sum(len(o.blocks_to_copy) for o in outs1) == 3
    assert not any(o.blocks_to_copy for o in outs2)


# ----------------------------------------------------------------------------- engine: n > 1


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("sharing_llama")
    hf.save_pretrained(path)
    return str(path)


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20] * 9, [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]]


@pytest.mark.parametrize(
    "variant",
    [
        dict(block_size=4, num_blocks=64, parallel_sampling="fork"),
        # preemption (recompute)
        dict(block_size=2, num_blocks=30, max_num_batched_tokens=16, parallel_sampling="fork"),
        dict(
            block_size=2,
            num_blocks=30,
            max_num_batched_tokens=16,
            preemption_mode="swap",
            parallel_sampling="fork",
        ),
        # vLLM v1: n child requests sharing the prompt through prefix caching (the default)
        dict(block_size=4, num_blocks=64, enable_prefix_caching=True),
        dict(block_size=2, num_blocks=30, max_num_batched_tokens=16, enable_prefix_caching=True),
    ],
)
def test_engine_n_samples_equal_unshared_baseline(tiny_llama, variant):
    """n > 1 with sharing (fork or prefix caching) == the static baseline (no sharing),
    seed for seed."""
    from minipaged import LLM

    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    base = LLM(model=tiny_llama, block_size=4, num_blocks=96, scheduling="static", max_num_seqs=12)
    want = [[c.token_ids for c in o.outputs] for o in base.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(model=tiny_llama, **variant)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = [[c.token_ids for c in o.outputs] for o in outs]
    assert got == want
    assert all(len(o.outputs) == 3 and [c.index for c in o.outputs] == [0, 1, 2] for o in outs)
    assert len({tuple(t) for t in got[0]}) > 1, "samples should differ"
    trace = llm.trace
    trace.check_invariants()
    assert any(s.shared_blocks for s in trace.steps), "the prompt blocks should be shared"
    fork = variant.get("parallel_sampling") == "fork"
    if variant["num_blocks"] == 30:  # small pool: preemption (groups whole)
        assert any(s.preempted_ids or s.swapped_out_ids for s in trace.steps)
    if not fork:  # the children hit the prompt blocks cached by the first one
        assert llm.llm_engine.scheduler.prefix_cache_hits > 0
    # the prompt is prefilled once per request (absent preemption)
    if fork and "preemption_mode" not in variant and variant["num_blocks"] == 64:
        prefill = sum(n for s in trace.steps for rid, n in s.scheduled.items() if rid in s.prefill_ids)
        assert prefill == sum(len(p) for p in PROMPTS)
    assert llm.llm_engine.kv_cache_manager.get_num_free_blocks() == llm.llm_engine.num_blocks
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == want  # deterministic


# ----------------------------------------------------------------------------- minipaged sharing


def test_parallel_sampling_block_steps_match_a_formula():
    """Independent count: at step t every live sample holds the full prompt blocks (shared)
    plus its private tail, ceil((p + t) / bs) - p // bs blocks."""
    from minipaged.sim.sharing import MAX_MODEL_LEN, measure_parallel_sampling
    from minipaged.sim.workloads import sample_requests

    bs, n, num = 16, 3, 12
    res = measure_parallel_sampling("sharegpt", n, num, seed=4, block_size=bs, check=True)
    reqs = sample_requests("sharegpt", num, 4, MAX_MODEL_LEN)
    extra = sample_requests("sharegpt", num * n, 5, MAX_MODEL_LEN)
    without = with_ = copies = 0
    for i, (p, _) in enumerate(reqs):
        lens = [min(o, MAX_MODEL_LEN - p) for _, o in extra[i * n : (i + 1) * n]]
        without += n * cdiv(p, bs)
        with_ += cdiv(p, bs)
        for t in range(1, max(lens)):
            live = [L for L in lens if t < L]
            without += sum(cdiv(p + t, bs) for _ in live)
            with_ += (p // bs) * bool(live) + sum(cdiv(p + t, bs) - p // bs for _ in live)
        # the partly filled prompt block is copied once per extra sample alive at step 1
        if p % bs:
            copies += max(0, sum(1 < L for L in lens) - 1)
    assert (res.blocks_without, res.blocks_with, res.num_copies) == (without, with_, copies)


def test_sharing_experiment_report():
    from minipaged.sim.sharing import format_report, measure_beam_search, run_sharing_experiment

    r = run_sharing_experiment(num_requests=6, seed=1, widths=(2, 4))
    for kind in ("parallel_sampling", "beam_search"):
        for w in ("alpaca", "sharegpt"):
            rows = r[kind][w]
            assert [x["width"] for x in rows] == [2, 4]
            assert all(0 < x["blocks_with"] <= x["blocks_without"] for x in rows)
            assert rows[0]["saved_pct"] <= rows[1]["saved_pct"]  # wider, more sharing
    for w in ("alpaca", "sharegpt"):  # beams share far more than independent samples
        assert r["beam_search"][w][1]["saved_pct"] > r["parallel_sampling"][w][1]["saved_pct"]
    for p in r["prefix_caching"]:
        assert p["with_caching"]["prefill_tokens"] < p["without_caching"]["prefill_tokens"]
        assert p["without_caching"]["prefill_tokens"] == p["prompt_tokens"]
    text = format_report(r)
    assert "parallel sampling" in text and "beam search" in text and "prefix caching" in text
    b = measure_beam_search("alpaca", 3, 5, seed=2, check=True)
    assert b.to_dict()["saved_pct"] == round(b.saved_pct, 2)
    with pytest.raises(ValueError, match="workload"):
        measure_beam_search("nope", 2, 5)
    with pytest.raises(ValueError, match="width"):
        measure_beam_search("alpaca", 0, 5)


def test_sharing_cli_json(capsys):
    import json

    from minipaged.cli import main

    assert main(["sharing", "--json", "--num-requests", "3", "--block-size", "8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["block_size"] == 8 and d["config"]["num_requests"] == 3
    assert set(d["parallel_sampling"]) == {"alpaca", "sharegpt"}
    assert [x["width"] for x in d["beam_search"]["alpaca"]] == [2, 3, 4, 5, 6]


def test_parallel_sampling_option_is_validated():
    from minipaged.config import EngineConfig
    from minipaged.core import PaperScheduler

    with pytest.raises(ValueError, match="parallel_sampling"):
        EngineConfig(parallel_sampling="beam")
    with pytest.raises(ValueError, match="parallel_sampling"):
        PaperScheduler(num_blocks=8, block_size=4, parallel_sampling="copy")
