"""A shared-memory all-reduce and all-gather for the tensor-parallel ranks of one host (CPU).

Mirrors the idea of vLLM's CPU communicator (``vllm/distributed/device_communicators/
cpu_communicator.py`` with its shm all-reduce in ``csrc/cpu/shm.cpp``) and DeepSpeed's
``shm_comm``: ranks on one machine need not send a few kilobytes through gloo's TCP sockets
(about 500 us per all-reduce of [8, 512] fp32 here); they can write them into memory every
rank maps and read each other's. This one is plain Python over ``mmap`` and
``torch.frombuffer`` views (vLLM's is C++ with vector intrinsics): no compiler, no extension.

The segment (one per group, one file in ``/dev/shm``)::

    header   one 64-byte line per rank: its sequence number (int64: how many collectives it
             has published); then one line with the abort flag
    slots    [2 parities][world_size ranks][slot_bytes]: rank r's part of collective s lies in
             slot (s % 2, r)

One collective (number s, the same on every rank: every rank runs the same layers)::

    1. copy this rank's tensor into its slot (s % 2, rank)
    2. publish: header[rank] = s
    3. wait until header[r] >= s for every rank r (spin a little, then yield, then sleep)
    4. all-reduce: out = slot(s%2, 0) + slot(s%2, 1) + ... in rank order;
       all-gather: out = cat(slot(s%2, 0), slot(s%2, 1), ...)

Inputs
    ``create_segment(world_size, slot_bytes)`` in the driver (a path and the driver's map);
    ``ShmCommunicator(path, rank, world_size, slot_bytes, timeout_s)`` in each rank;
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
    raises ``RuntimeError`` when the driver sets the abort flag (``abort``, done by the
    ``WorkerGroup`` as soon as it sees a rank die or fail) or after ``timeout_s``. The segment's
    name is unlinked by the driver as soon as every rank has mapped it, so nothing is left in
    ``/dev/shm`` however a process ends (the memory is freed when the last map goes: at exit).
"""

from __future__ import annotations

import mmap
import os
import platform
import threading
import time
import uuid
from typing import Optional

import torch

LINE = 64  # bytes per header line: one cache line per rank's sequence number
PAGE = 4096
DEFAULT_SLOT_BYTES = 1 << 20  # 1 MiB: a prefill all-reduce of [512, 512] fp32 still fits
SPIN = 400  # polls before yielding (a few tens of microseconds)
YIELDS = 2000  # os.sched_yield() polls before sleeping
SLEEP_S = 50e-6


def supported() -> bool:
    """True where the ordering this module relies on holds (x86-64's TSO) and /dev/shm exists."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def _layout(world_size: int, slot_bytes: int) -> tuple[int, int]:
    """(offset of the slots, total bytes) of a segment."""
    data = -(-LINE * (world_size + 1) // PAGE) * PAGE
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


def abort(mm: Optional[mmap.mmap], world_size: int) -> None:
    """Set the abort flag: every rank waiting in a collective raises ``RuntimeError``."""
    if mm is not None and not mm.closed:
        memoryview(mm)[LINE * world_size : LINE * world_size + 8].cast("q")[0] = 1


class ShmCommunicator:
    """One rank's map of the group's segment, and the collectives over it (module docstring)."""

    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 60.0,
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
        slots = torch.frombuffer(self._mm, dtype=torch.uint8, offset=data, count=2 * world_size * slot_bytes)
        self._slots = slots.view(2, world_size, slot_bytes)  # [parity, rank, bytes]
        self._views: dict = {}  # (parity, dtype, shape) -> the ranks' slots as tensors of that shape
        self._fence = threading.Lock()
        self.seq = 0
        self.num_waits = 0  # collectives in which this rank had to wait past the spin

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the segment (else the caller uses gloo)."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _slot_views(self, parity: int, x: torch.Tensor) -> list[torch.Tensor]:
        key = (parity, x.dtype, tuple(x.shape))
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
        polls = 0
        while header[at] < seq:
            if header[self._abort_at]:
                raise RuntimeError(
                    f"shared-memory collective {seq} aborted on rank {self.rank}: a peer rank failed"
                )
            polls += 1
            if polls < YIELDS:
                os.sched_yield()  # 2 cores, 3 processes: give the peer the core
            else:
                time.sleep(SLEEP_S)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"shared-memory collective {seq} timed out on rank {self.rank} after "
                        f"{self.timeout_s:.0f} s: rank {at // self._stride} never arrived"
                    )

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
