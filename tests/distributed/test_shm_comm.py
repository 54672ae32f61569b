"""The shared-memory collectives of a CPU group (``minipaged/distributed/shm_comm.py``).

Reference: the sum (in rank order) and the concatenation of the ranks' seeded inputs,
recomputed here in one process: every rank must get those exact bits (greedy sampling on
every rank relies on it), through the segment or, for a tensor too big for it, through gloo,
over enough collectives of changing shapes that both parities of the double buffer are
reused many times. Also: the segment's name is gone once the group started, a rank that
dies while a peer waits in a collective ends the call naming it, the waits abort and time out
with an error, and bad arguments are ``ValueError``s naming them.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from _tp_cases import rank_part, shm_segments

from minipaged.distributed import WorkerDiedError, WorkerGroup, shm_comm
from minipaged.model.parallel import available_devices

TP = 2
needs_two = pytest.mark.skipif(available_devices("cpu") < TP, reason="needs 2 CPU cores")
needs_shm = pytest.mark.skipif(not shm_comm.supported(), reason="shared-memory collectives need x86-64")
FACTORY = "_tp_cases:CollectiveWorker"
BIG = shm_comm.DEFAULT_SLOT_BYTES // 4 + 1  # fp32 elements: one more than a slot holds


def _expected(kind, shape, dtype, seed):
    parts = [rank_part([abs(n) for n in shape], dtype, seed, r) for r in range(TP)]
    if shape[0] < 0:
        parts = [p.t() for p in parts]
    if kind == "sum":
        return torch.add(parts[0], parts[1])
    return torch.cat(parts, -1)


@needs_two
@needs_shm
@pytest.mark.parametrize("inference", [False, True])
def test_every_rank_gets_the_exact_sum_and_concatenation(inference):
    ops = []
    for seed in range(40):  # decode- and prefill-like shapes, both kinds, interleaved
        shape = [[8, 512], [3, 64], [512, 512], [-64, 8], [1]][seed % 5]
        ops.append(("sum" if seed % 3 else "gather", shape, torch.float32, seed))
    ops += [("sum", [4, 16], torch.bfloat16, 90), ("gather", [2, 8], torch.float16, 91)]
    ops += [("sum", [BIG], torch.float32, 92), ("gather", [1, BIG], torch.float32, 93)]  # gloo
    with WorkerGroup(TP, FACTORY, {}, comm="shm") as group:
        assert group.comm == "shm"
        results = group.call("run", ops, inference)
        stats = group.call("stats")
    for (kind, shape, dtype, seed), r0, r1 in zip(ops, *results):
        want = _expected(kind, shape, dtype, seed)
        assert r0.dtype == dtype and tuple(r0.shape) == tuple(want.shape), (kind, shape)
        assert torch.equal(r0, want) and torch.equal(r1, want), (kind, shape, dtype)
    for s in stats:  # the two big ones went through gloo, everything else through the segment
        assert s["shm"] and s["num_collectives"] == len(ops) and s["num_shm"] == len(ops) - 2


@needs_two
def test_comm_torch_uses_gloo_only():
    ops = [("sum", [8, 512], torch.float32, 1), ("gather", [8, 64], torch.float32, 2)]
    with WorkerGroup(TP, FACTORY, {}, comm="torch") as group:
        assert group.comm == "torch"
        results = group.call("run", ops)
        stats = group.call("stats")
    for (kind, shape, dtype, seed), r0, r1 in zip(ops, *results):
        want = _expected(kind, shape, dtype, seed)
        torch.testing.assert_close(r0, want)
        assert torch.equal(r0, r1)
    assert all(not s["shm"] and s["num_shm"] == 0 for s in stats)


@needs_two
@needs_shm
def test_the_segment_name_is_gone_once_every_rank_mapped_it():
    with WorkerGroup(TP, FACTORY, {}, comm="shm") as group:
        mapped = shm_segments(p.pid for p in group.procs)
        ours = {s for s in mapped if "minipaged-tp-" in s}
        assert len(ours) == 1, mapped  # one segment, mapped by both ranks
        assert not any(os.path.exists(s) for s in ours)


@needs_two
@needs_shm
def test_a_rank_killed_while_its_peer_waits_ends_the_call_naming_it():
    group = WorkerGroup(TP, FACTORY, {}, comm="shm")
    pid = group.procs[1].pid
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()  # rank 1 sleeps, then dies
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 died \(signal 9") as err:
        group.call("wait_in_all_reduce", 1, 30.0)  # rank 0 waits in the all-reduce meanwhile
    assert err.value.rank == 1
    assert time.monotonic() - t0 < 10.0, "rank 0 must stop waiting within seconds"
    assert not any(group.alive())
    assert group.procs[0].exitcode == 0, "rank 0 left its wait (the abort) and exited itself"


@needs_shm
def test_a_wait_aborts_and_times_out_with_an_error(tmp_path):
    path, mm = shm_comm.create_segment(2, 4096)
    try:
        comm = shm_comm.ShmCommunicator(path, 0, 2, 4096, timeout_s=0.3)
        with pytest.raises(RuntimeError, match="timed out on rank 0 .* rank 1 never arrived"):
            comm.all_reduce(torch.ones(8))
        shm_comm.abort(mm, 2)
        with pytest.raises(RuntimeError, match="aborted on rank 0"):
            comm.all_reduce(torch.ones(8))
        assert comm.all_reduce(torch.ones(4096)) is None  # too big: for gloo, nothing sent
        comm.close()
    finally:
        shm_comm.unlink_segment(path)
        mm.close()
    assert not os.path.exists(path)


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="world_size"):
        shm_comm.create_segment(1)
    with pytest.raises(ValueError, match="slot_bytes"):
        shm_comm.create_segment(2, 100)
    with pytest.raises(ValueError, match="MINIPAGED_TP_COMM"):
        WorkerGroup(TP, FACTORY, {}, comm="mpi")
    if shm_comm.supported():
        path, mm = shm_comm.create_segment(2, 4096)
        try:
            with pytest.raises(ValueError, match="rank"):
                shm_comm.ShmCommunicator(path, 2, 2, 4096)
            with pytest.raises(ValueError, match="is not"):
                shm_comm.ShmCommunicator(path, 0, 2, 8192)
        finally:
            shm_comm.unlink_segment(path)
            mm.close()
