"""A shared-memory all-reduce and all-gather for the tensor-parallel ranks of one host (CPU).

Mirrors the idea of vLLM's CPU communicator (``vllm/distributed/device_communicators/
cpu_communicator.py`` with its shm all-reduce in ``csrc/cpu/shm.cpp``) and DeepSpeed's
``shm_comm``: ranks on one machine need not send a few kilobytes through gloo's TCP sockets
(about 500 us per all-reduce of [8, 512] fp32 here); they can write them into memory every
rank maps and read each other's. This one is plain Python over ``mmap`` and
``torch.frombuffer`` views (vLLM's is C++ with vector intrinsics): no compiler, no extension.

The segment (one per group, one file in ``/dev/shm``)::

    header   one 64-byte line per rank: its sequence number (int64: how many collectives it
             has published); then one line with the abort flag, one with the driver's
             "still sending the step" flag (``set_sending``, ``wait_until_sent``)
    slots    [2 parities][world_size ranks][slot_bytes]: rank r's part of collective s lies in
             slot (s % 2, r)

One collective (number s, the same on every rank: every rank runs the same layers)::

    1. copy this rank's tensor into its slot (s % 2, rank)
    2. publish: header[rank] = s
    3. wait until header[r] >= s for every rank r: spin a little (about 50 us: on an idle
       machine the peer is usually that close), then poll with ``os.sched_yield`` between
       (0.5 ms: a loaded machine may run something else, perhaps the peer, meanwhile), then
       block in ``select`` on this rank's wake-up pipe, into which every rank writes a byte
       after each publish (so a long wait sleeps in the kernel and is woken like a gloo rank by
       its socket, instead of taking a core from the rank it waits for: 2 cores here, and other
       processes)
    4. all-reduce: out = slot(s%2, 0) + slot(s%2, 1) + ... in rank order;
       all-gather: out = cat(slot(s%2, 0), slot(s%2, 1), ...)

Inputs
    ``create_segment(world_size, slot_bytes)`` in the driver (a path and the driver's map);
    ``ShmCommunicator(path, rank, world_size, slot_bytes, timeout_s, wake)`` in each rank,
    ``wake = (this rank's read fd, every rank's write fd)`` (``make_wake_pipes``);
    ``all_reduce(x)`` / ``all_gather(x, dim)`` with a contiguous CPU tensor of at most
    ``slot_bytes`` bytes, called by every rank in the same order with the same shapes.
Outputs
    ``all_reduce`` sums ``x`` in place over the ranks and returns it; ``all_gather`` returns
    the ranks' ``x`` concatenated along ``dim``; either returns ``None`` without
    communicating when ``x`` does not fit (``fits``): the caller uses gloo for it. Since the
    decision depends only on the shape and every rank has the same shapes, every rank makes it
    the same way.

Invariants
    - every rank gets the bit-identical result: every rank adds the same slots in the same
      (rank) order, so greedy sampling on every rank picks the same token;
    - a slot is never overwritten while a peer still reads it: rank r writes slot (s % 2, r)
      again only at collective s + 2, which it starts only after every rank published s + 1,
      which each does only after it finished reading the slots of s (double buffering);
    - a rank is at most one collective ahead of any other.

Memory ordering (what this relies on)
    step 1's stores must be visible to a peer before step 2's store, and step 4's loads must
    not see older data than the flag of step 3. x86-64 guarantees both for ordinary stores
    (TSO: stores are not reordered with stores, loads not with loads); the sequence number is an
    aligned 8-byte store, which x86 makes atomic. Between the copy and the publish (and between
    the wait and the sum) a Python lock is taken and released: a locked instruction, so also
    non-temporal stores a large ``memcpy`` might use are drained first. On other architectures
    (ARM's weaker model) that lock does not order the later flag store: ``supported()`` is
    False there and the group uses gloo for everything.

Failure mode
    a peer that never publishes (dead, or raised before this collective): the waiting rank
    raises ``RuntimeError`` when the driver sets the abort flag and wakes it (``abort``, done by
    the ``WorkerGroup`` as soon as it sees a rank die or fail) or after ``timeout_s``. The segment's
    name is unlinked by the driver as soon as every rank has mapped it, so nothing is left in
    ``/dev/shm`` however a process ends (the memory is freed when the last map goes: at exit).
"""

from __future__ import annotations

import mmap
import os
import platform
import select
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Optional

import torch

LINE = 64  # bytes per header line: one cache line per rank's sequence number
PAGE = 4096
DEFAULT_SLOT_BYTES = 1 << 20  # 1 MiB: a prefill all-reduce of [512, 512] fp32 still fits
SPIN = 1000  # polls of the peer's sequence number before yielding (about 50 us)
YIELD_S = 0.5e-3  # then os.sched_yield() between polls for this long, then block
BLOCK_S = 0.05  # one select() on the wake-up pipe; the abort flag and the deadline between


def supported() -> bool:
    """True where the ordering this module relies on holds (x86-64's TSO) and /dev/shm exists."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def _layout(world_size: int, slot_bytes: int) -> tuple[int, int]:
    """(offset of the slots, total bytes) of a segment."""
    data = -(-LINE * (world_size + 2) // PAGE) * PAGE
    return data, data + 2 * world_size * slot_bytes


def create_segment(world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> tuple[str, mmap.mmap]:
    """A new zeroed segment for ``world_size`` ranks: its path and the creator's map of it
    (the creator keeps it to set the abort flag; it must ``unlink_segment`` the path)."""
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
    if not isinstance(slot_bytes, int) or slot_bytes < LINE or slot_bytes % LINE:
        raise ValueError(f"slot_bytes must be a positive multiple of {LINE}, got {slot_bytes!r}")
    path = f"/dev/shm/minipaged-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    _, total = _layout(world_size, slot_bytes)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)  # a new file reads as zeros: every sequence number 0, no abort
        mm = mmap.mmap(fd, total)
    except BaseException:
        os.close(fd)
        unlink_segment(path)
        raise
    os.close(fd)
    return path, mm


def unlink_segment(path: Optional[str]) -> None:
    """Remove the segment's name (a no-op if it is already gone)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def abort(mm: Optional[mmap.mmap], world_size: int, wake_fds: Sequence[int] = ()) -> None:
    """Set the abort flag and wake every rank (``wake_fds``: their pipes' write ends): a rank
    waiting in a collective raises ``RuntimeError``."""
    if mm is not None and not mm.closed:
        memoryview(mm)[LINE * world_size : LINE * world_size + 8].cast("q")[0] = 1
    for fd in wake_fds:
        _poke(fd)


def set_sending(mm: Optional[mmap.mmap], world_size: int, sending: bool) -> None:
    """The driver's flag: it is writing a step's message to the ranks' pipes (``True``) or done."""
    if mm is not None and not mm.closed:
        memoryview(mm)[LINE * (world_size + 1) : LINE * (world_size + 1) + 8].cast("q")[0] = int(sending)


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, BrokenPipeError, OSError):
        pass  # full (the reader wakes anyway) or gone


def make_wake_pipes(ctx, world_size: int) -> tuple[list, list]:
    """One pipe per rank, from a multiprocessing context (its ends can be handed to spawned
    processes): (read ends, write ends), non-blocking; rank r reads ``[r]``, writes every other."""
    readers, writers = [], []
    for _ in range(world_size):
        r, w = ctx.Pipe(duplex=False)
        os.set_blocking(r.fileno(), False)
        os.set_blocking(w.fileno(), False)
        readers.append(r)
        writers.append(w)
    return readers, writers


class ShmCommunicator:
    """One rank's map of the group's segment, and the collectives over it (module docstring)."""

    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 60.0,
        wake: Optional[tuple[int, Sequence[int]]] = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.timeout_s = timeout_s
        data, total = _layout(world_size, slot_bytes)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != total:
                raise ValueError(f"shared-memory segment {path} is not {total} bytes")
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        # header[r * 8]: rank r's sequence number; header[world_size * 8]: the abort flag
        self._header = memoryview(self._mm)[:data].cast("q")
        self._stride = LINE // 8
        self._abort_at = world_size * self._stride
        self._sending_at = (world_size + 1) * self._stride
        slots = torch.frombuffer(self._mm, dtype=torch.uint8, offset=data, count=2 * world_size * slot_bytes)
        self._slots = slots.view(2, world_size, slot_bytes)  # [parity, rank, bytes]
        self._views: dict = {}  # (parity, dtype, shape, inference) -> the ranks' slots as tensors of that shape
        self._fence = threading.Lock()
        # wake-up pipes: this rank's read end, the write ends of the peers it wakes (no pipes:
        # wait by polling and sched_yield, for a group made by hand)
        self._wake_r = None if wake is None else wake[0]
        self._wake_w = [] if wake is None else [fd for r, fd in enumerate(wake[1]) if r != rank]
        self.seq = 0
        self.num_waits = 0  # collectives in which this rank blocked (the peer was not there)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the segment (else the caller uses gloo)."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _slot_views(self, parity: int, x: torch.Tensor) -> list[torch.Tensor]:
        # NOTE: a view made under inference_mode is an inference tensor, which cannot be written
        # outside it: the views made in each mode are kept apart
        key = (parity, x.dtype, tuple(x.shape), torch.is_inference_mode_enabled())
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:  # many prefill shapes: start over
                self._views.clear()
            n = x.numel() * x.element_size()
            views = [self._slots[parity, r, :n].view(x.dtype).view(x.shape) for r in range(self.world_size)]
            self._views[key] = views
        return views

    def _publish_and_wait(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Steps 1 to 3: write ``x`` into this rank's slot, publish, wait for every rank."""
        self.seq += 1
        seq = self.seq
        views = self._slot_views(seq & 1, x)
        views[self.rank].copy_(x)
        with self._fence:  # a locked instruction: the copy is visible before the flag
            pass
        header, stride = self._header, self._stride
        header[self.rank * stride] = seq
        for fd in self._wake_w:  # a peer that already waits in select() wakes up
            _poke(fd)
        for r in range(self.world_size):
            if r != self.rank and header[r * stride] < seq:
                self._wait(r * stride, seq)
        with self._fence:
            pass
        return views

    def _wait(self, at: int, seq: int) -> None:
        header = self._header
        for _ in range(SPIN):
            if header[at] >= seq:
                return
        self.num_waits += 1
        deadline = time.monotonic() + self.timeout_s
        fd = self._wake_r
        yield_until = time.perf_counter() + YIELD_S
        while True:
            if fd is not None:
                self._drain(fd)  # NOTE: before the check: a byte written after it wakes select
            if header[at] >= seq:
                return
            if header[self._abort_at]:
                raise RuntimeError(
                    f"shared-memory collective {seq} aborted on rank {self.rank}: a peer rank failed"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"shared-memory collective {seq} timed out on rank {self.rank} after "
                    f"{self.timeout_s:.0f} s: rank {at // self._stride} never arrived"
                )
            if fd is None or time.perf_counter() < yield_until:
                os.sched_yield()  # a core for whoever needs it (the peer, on a loaded machine)
            else:
                select.select([fd], [], [], BLOCK_S)  # sleep in the kernel until a peer writes

    def wait_until_sent(self, limit_s: float = 0.01) -> None:
        """Yield the core while the driver is still writing the step to the ranks' pipes (at
        most ``limit_s``): a rank woken on the driver's core must not keep it from the rest."""
        header, at = self._header, self._sending_at
        if header[at]:
            deadline = time.perf_counter() + limit_s
            while header[at] and time.perf_counter() < deadline:
                os.sched_yield()

    @staticmethod
    def _drain(fd: int) -> None:
        try:
            while len(os.read(fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``x`` summed over the ranks, in place, bit-identical on every rank; ``None`` (and no
        communication) if ``x`` does not fit."""
        if not self.fits(x):
            return None
        if not x.is_contiguous():
            y = self.all_reduce(x.contiguous())
            return x.copy_(y)
        views = self._publish_and_wait(x)
        torch.add(views[0], views[1], out=x)  # rank order, on every rank: the same bits
        for r in range(2, self.world_size):
            x.add_(views[r])
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> Optional[torch.Tensor]:
        """Every rank's ``x`` concatenated along ``dim`` (rank 0 first); ``None`` if it does not
        fit."""
        if not self.fits(x):
            return None
        views = self._publish_and_wait(x.contiguous())
        return torch.cat(views, dim=dim)  # a copy: the slots are reused two collectives later

    def close(self) -> None:
        self._views.clear()
        self._header.release()
        self._slots = None
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it; the map goes with the process
            pass
