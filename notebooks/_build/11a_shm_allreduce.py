"""Generate notebooks/11a_shm_allreduce.ipynb, an appendix of chapter 11 (run from the repo root).

    bash notebooks/_build/build_all.sh 11a_shm_allreduce
"""

from _nb import code, md, write

md(r"""
# 11a · Appendix to chapter 11: an all-reduce through shared memory

Chapter 11's workers add their partial sums twice per layer. On CUDA that is NCCL's job; on a
CPU, gloo sends the few kilobytes of a decode step through loopback TCP sockets, which costs
more than the layer itself. vLLM v1's CPU backend has its own shared-memory all-reduce for
that reason (`vllm/distributed/device_communicators/cpu_communicator.py`, the C++ in
`csrc/cpu/shm.cpp`), and so has this package: `minipaged/distributed/shm_comm.py`, about 230
lines of Python over `mmap`. This appendix takes it apart on a tiny example: two ranks as two
threads of this process, one segment, a few collectives, each checked by hand. Nothing in
chapter 11 depends on it.

**You will learn**

1. the segment: a header of sequence numbers and flags, then two sets of one slot per rank;
2. one all-reduce: copy, publish, wait, add the slots **in rank order** (so every rank gets the
   same bits and samples the same token);
3. why two sets of slots (double buffering) are enough for a rank never to overwrite a slot a
   slower peer still reads;
4. what happens when a peer never arrives, and when a tensor does not fit;
5. how the real workers use it: one segment per group, its name unlinked once mapped.
""")

code(r"""
import threading

import torch

from minipaged.distributed import shm_comm

torch.manual_seed(0)
print(f"shared-memory collectives supported here: {shm_comm.supported()} "
      f"(x86-64's store order and a /dev/shm are what it relies on)")
""")

md(r"""
## 1. The segment

`create_segment(world_size, slot_bytes)` makes one zeroed file in `/dev/shm`. Its layout, from
the module docstring: one 64-byte line per rank holding the number of collectives that rank
has published, a line with the abort flag, a line with the driver's "still sending" flag, all
rounded up to a page; then the slots, `[2 parities][world_size ranks][slot_bytes]`. Each rank
opens the same file with its own `ShmCommunicator` and views the slots as tensors
(`torch.frombuffer`): no copy between a rank's view and the memory the other rank reads.
""")

code(r"""
WORLD, SLOT = 2, 256  # two ranks, 256 bytes per slot: 64 fp32 numbers
path, driver_map = shm_comm.create_segment(WORLD, SLOT)
ranks = [shm_comm.ShmCommunicator(path, r, WORLD, SLOT, timeout_s=5.0) for r in range(WORLD)]
data, total = shm_comm._layout(WORLD, SLOT)
print(f"one file in /dev/shm ({path.startswith('/dev/shm/minipaged-tp-')}), {total} bytes:")
print(f"  header: {data} bytes ({WORLD} rank lines + abort + sending, {shm_comm.LINE} bytes each, "
      f"rounded up to a {shm_comm.PAGE}-byte page)")
print(f"  slots : 2 parities x {WORLD} ranks x {SLOT} bytes = {2 * WORLD * SLOT} bytes")
print(f"sequence numbers now: {[c.seq for c in ranks]}")
""")

md(r"""
## 2. One all-reduce, by hand

Collective number `s` (the same on every rank, because every rank runs the same layers in the
same order):

1. copy this rank's tensor into its slot `(s % 2, rank)`;
2. publish: write `s` into this rank's header line;
3. wait until every rank's header says at least `s` (spin, then `sched_yield`, then sleep on a
   wake-up pipe);
4. add slot `(s % 2, 0) + slot (s % 2, 1) + ...` in rank order, into the caller's tensor.

Two threads play the two ranks; rank 0 holds `[1, 2, 3, 4]`, rank 1 `[10, 20, 30, 40]`. Both
must end with `[11, 22, 33, 44]`:
""")

code(r"""
def run_ranks(fn, inputs):
    # every rank calls fn(its communicator, its input) at once, in its own thread
    out = [None] * WORLD
    def body(r):
        out[r] = fn(ranks[r], inputs[r])
    threads = [threading.Thread(target=body, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out

xs = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])]
out = run_ranks(lambda c, x: c.all_reduce(x), xs)
for r, y in enumerate(out):
    print(f"rank {r}: {y.tolist()}  (the same tensor it passed in: {y is xs[r]})")
print(f"sequence numbers: {[c.seq for c in ranks]}; header: {[int(ranks[0]._header[r * ranks[0]._stride]) for r in range(WORLD)]}")
slots = ranks[0]._slots[1, :, :16].view(torch.float32)  # collective 1 used parity 1 % 2
print(f"what parity 1's slots hold now: rank 0 {slots[0].tolist()}, rank 1 {slots[1].tolist()}")
""")

md(r"""
`all_reduce` works in place, as `torch.distributed.all_reduce` does. The slots still hold each
rank's part: the sum was made by each rank from the shared memory, not sent.

**Why rank order.** Floating-point addition is not associative. If each rank started from its
own part and added the others as they arrived, rank 0 might compute `((a + b) + c) + d` and
rank 2 `((c + a) + b) + d`; with three or more ranks those can differ in the last bit, the
ranks' logits would differ, and greedy sampling could pick different tokens on different ranks.
Adding the slots in rank order on every rank makes the result the same bits everywhere. The same four numbers in two orders:
""")

code(r"""
a, b, c = (torch.tensor(v, dtype=torch.float32) for v in (1e8, 1.0, -1e8))
print(f"(a + b) + c = {((a + b) + c).item()}   (c + a) + b = {((c + a) + b).item()}   (fp32, a = 1e8, b = 1, c = -1e8)")
four = [torch.randn(4096) for _ in range(4)]
in_order = ((four[0] + four[1]) + four[2]) + four[3]
other = ((four[2] + four[0]) + four[1]) + four[3]
print(f"4096 random sums, rank order vs another order: {int((in_order != other).sum())} differ in some bit")
""")

md(r"""
## 3. Double buffering: why two sets of slots suffice

Rank r writes slot `(s % 2, r)` for collective `s`, and writes it again only at collective
`s + 2`. It starts collective `s + 2` only after collective `s + 1` finished, which needs every
rank to have *published* `s + 1`, which each rank does only after it finished *reading* the slots
of `s`. So by the time a slot is overwritten, every peer is done with it; a rank is never more
than one collective ahead of another. Many collectives in a row, with changing values, every
rank checked against the sum computed here:
""")

code(r"""
ok = True
for step in range(20):
    parts = [torch.randn(64) for _ in range(WORLD)]
    want = parts[0] + parts[1]  # rank order
    got = run_ranks(lambda c, x: c.all_reduce(x.clone()), parts)
    ok &= all(torch.equal(g, want) for g in got)
print(f"20 more all-reduces: every rank has the exact rank-order sum: {ok}; sequence numbers {[c.seq for c in ranks]}")
gathered = run_ranks(lambda c, x: c.all_gather(x, dim=0), [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
print(f"all-gather (the logits' collective): {[g.tolist() for g in gathered]}")
""")

md(r"""
## 4. Failure modes

**A peer that never arrives.** Rank 0 alone starts a collective; rank 1 never publishes. Rank 0
waits until its timeout (in the engine, until the driver sees the dead worker and sets the
abort flag, which wakes it at once) and raises, naming who never came. **A tensor bigger than a
slot** is not sent at all: `all_reduce` returns `None` and the caller (the worker group) sends
that one through gloo. Every rank has the same shapes, so every rank decides the same way.
""")

code(r"""
import time

late = shm_comm.ShmCommunicator(path, 0, WORLD, SLOT, timeout_s=0.2)
late.seq = ranks[0].seq  # as far as rank 0 got
t0 = time.monotonic()
try:
    late.all_reduce(torch.ones(4))
except RuntimeError as e:
    print(f"RuntimeError after about {round(time.monotonic() - t0, 1)} s: {e}")
late.close()
print(f"a tensor of {SLOT // 4 + 1} fp32 numbers (one more than a slot holds): "
      f"all_reduce returns {ranks[0].all_reduce(torch.ones(SLOT // 4 + 1))}")
shm_comm.abort(driver_map, WORLD)  # what the driver does when a worker dies
try:
    ranks[0].all_reduce(torch.ones(4))
except RuntimeError as e:
    print(f"after the abort flag: RuntimeError: {e}")
for c in ranks:
    c.close()
shm_comm.unlink_segment(path)
driver_map.close()
""")

md(r"""
## 5. In the real workers

`LLM(tensor_parallel_size=2)` on a CPU makes one segment per worker group (1 MiB slots: a
prefill all-reduce of `[512, 512]` fp32 still fits) and hands each worker its path and a wake-up
pipe. As soon as every rank has mapped the segment, the driver **unlinks its name**: the memory
lives as long as some process maps it, and nothing is left in `/dev/shm` however the processes
end. Linux's `/proc/PID/maps` shows each worker's mapping, its name marked `(deleted)`:
""")

code(r"""
from minipaged import LLM, SamplingParams

torch.set_num_threads(1)
two = LLM(tensor_parallel_size=2, block_size=4, num_blocks=8, seed=0)
workers, executor = two.llm_engine.executor.workers, two.llm_engine.executor

def mapped_segments(pid):
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if "minipaged-tp-" in line})

executor.comm_stats(reset=True)
two.generate(["Once upon a time there was a little"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
for rank, st in enumerate(executor.comm_stats()):
    print(f"rank {rank}: {st['num_collectives']} collectives, {st['num_shm']} of them through the segment")
for rank, proc in enumerate(workers.procs):
    segs = mapped_segments(proc.pid)
    print(f"rank {rank} maps {len(segs)} segment, its name unlinked: {all(s.endswith('(deleted)') for s in segs)}")
two.shutdown()
""")

md(r"""
What one all-reduce costs each way is measured by `python benchmarks/tensor_parallel.py --level
comm` (the README's results table has the numbers and the load they were taken under): on a
CPU, gloo's loopback sockets take hundreds of microseconds for a decode step's `[8, 512]`, the
segment tens.

## Recap

- One file in `/dev/shm` per group: a header of per-rank sequence numbers and two flags, then
  two sets of one slot per rank.
- An all-reduce is copy, publish, wait, add the slots in rank order: every rank computes the
  same bits, so every rank samples the same token.
- Two sets of slots, alternated, are enough: a rank is at most one collective ahead.
- A missing peer ends the wait with an error (abort flag or timeout); a tensor bigger than a
  slot goes through gloo, decided the same way on every rank.
- The driver unlinks the segment's name once every rank mapped it: nothing is left behind.
- Code: `minipaged/distributed/shm_comm.py`; its tests `tests/distributed/test_shm_comm.py`;
  vLLM's CPU communicator `vllm/distributed/device_communicators/cpu_communicator.py`.
""")

write("11a_shm_allreduce")
