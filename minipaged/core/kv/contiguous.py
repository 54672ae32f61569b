"""Contiguous KV reservation: the baselines PagedAttention is measured against.

No vLLM counterpart: these are the "Orca" baselines of the vLLM paper (Kwon et al.,
SOSP 2023, Sec. 3 and Fig. 2), written here so the waste they cause can be measured.

Concept
    Before paging, a serving system stored each request's KV cache in *one contiguous
    region* of a linear address space of ``num_slots`` token slots (one slot = the K and
    V of one token in every layer). The region must be reserved when the request is
    admitted, before anyone knows how long the output will be, so the system reserves
    for the worst case it can afford to assume. The three policies differ only in how
    many slots they reserve for a request whose final length (prompt + output) is ``F``:

    =============  =====================================  ==============================
    policy         reserves                               stands for
    =============  =====================================  ==============================
    ``"max"``      ``max_model_len``                      Orca (Max): knows nothing
    ``"pow2"``     ``min(next_pow2(F), max_model_len)``   Orca (Pow2): knows F within 2x
    ``"oracle"``   ``F``                                  Orca (Oracle): knows F exactly
    =============  =====================================  ==============================

    Regions are placed *first-fit*: in the lowest-addressed free hole large enough.
    Freed regions become holes (merged with free neighbours), so the free space breaks
    into pieces, as in a ``malloc`` heap.

Where the slots of a region go (``usage()``; every slot of the pool is in exactly one)
    - token states: slots already holding a token's K/V (``num_tokens``);
    - reserved for future tokens: ``final_len - num_tokens``, filled later by this request;
    - internal fragmentation: ``size - final_len``, reserved and never used;
    - free: in holes.

External fragmentation (``external_fragmentation(next_final_len)``), defined precisely
    Let ``need`` be the reservation the next waiting request would take. If the largest
    hole is ``>= need`` there is no external fragmentation (it fits). Otherwise, if the
    holes *together* hold ``>= need`` slots, all free slots count as external
    fragmentation: the memory is there, but broken into holes too small for the request,
    and only compaction (moving live KV) would let it in. If the holes together are
    smaller than ``need``, the free slots are simply too few and count as 0 here.
    (Under paging this quantity is always 0: any free blocks can serve any request.)

Inputs / outputs (mirrors ``KVCacheManager`` where it can)
    ``allocate(request, num_tokens, final_len)`` reserves a region holding the first
    ``num_tokens`` tokens (the prompt) and returns it, or ``None`` if no hole fits;
    ``append_tokens(request, n=1)`` records ``n`` more tokens inside the region (never
    allocates); ``free(request)`` turns the region back into a hole;
    ``get_slot_mapping(request_id, start, end)`` -> slots ``region.start + i``.

Invariants (``check_invariants``)
    regions and holes tile ``[0, num_slots)`` exactly, without overlap; holes are sorted,
    non-empty and never adjacent (always merged); every region has
    ``1 <= num_tokens <= final_len <= size == reservation_size(final_len)``.

Failure mode
    no hole fits -> ``allocate`` returns ``None`` and changes nothing. Bad input raises
    ``ValueError`` and changes nothing: non-positive token counts, ``final_len`` below the
    tokens already present or above ``max_model_len``, a reservation larger than the whole
    pool, allocating a request twice, appending past ``final_len``, freeing (or asking
    about) an unknown request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

POLICIES = ("max", "pow2", "oracle")
POLICY_NAMES = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}


def next_power_of_two(n: int) -> int:
    """Smallest power of two ``>= n`` (for ``n >= 1``)."""
    return 1 << (n - 1).bit_length()


@dataclass(slots=True)
class ContiguousRegion:
    """One request's reservation: slots ``start .. start + size - 1``."""

    start: int
    size: int
    num_tokens: int  # slots from ``start`` on that hold a token's K/V
    final_len: int  # prompt + output: how many tokens it will ever hold


@dataclass(frozen=True, slots=True)
class ContiguousUsage:
    """Occupancy of a contiguous pool, in token slots."""

    num_slots: int  # all slots in the pool
    num_token_slots: int  # holding a token's K/V
    num_future_slots: int  # reserved for tokens the request will still produce
    num_reserved_slots: int  # in some region (token + future + internal fragmentation)
    num_free_slots: int  # in holes
    largest_hole: int  # size of the largest hole (0 if none)

    @property
    def internal_fragmentation(self) -> int:
        """Reserved and never used: ``size - final_len`` summed over regions.

        NOTE: ``KVCacheUsage.internal_fragmentation`` (paged) counts every reserved slot
        not holding a token; the analogue here is ``num_future_slots + this``.
        """
        return self.num_reserved_slots - self.num_token_slots - self.num_future_slots

    @property
    def token_fraction(self) -> float:
        """Fraction of *reserved* memory holding token states."""
        return self.num_token_slots / self.num_reserved_slots if self.num_reserved_slots else 1.0


def _request_id(request) -> str:
    return request if isinstance(request, str) else request.request_id


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class ContiguousAllocator:
    """A linear pool of ``num_slots`` token slots, one contiguous region per request."""

    def __init__(self, num_slots: int, max_model_len: int, policy: str = "max") -> None:
        _check_positive_int("num_slots", num_slots)
        _check_positive_int("max_model_len", max_model_len)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.policy = policy
        # request_id -> its region; holes as sorted, merged [start, size] pairs
        self.regions: dict[str, ContiguousRegion] = {}
        self.holes: list[list[int]] = [[0, num_slots]]

    @property
    def name(self) -> str:
        return POLICY_NAMES[self.policy]

    def reservation_size(self, final_len: int) -> int:
        """Slots this policy reserves for a request that will hold ``final_len`` tokens."""
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":
            return min(next_power_of_two(final_len), self.max_model_len)
        return final_len

    # -- allocation ---------------------------------------------------------------
    def _find_hole(self, size: int) -> int | None:
        """Index of the first (lowest-address) hole with at least ``size`` slots."""
        for i, (_, hole_size) in enumerate(self.holes):
            if hole_size >= size:
                return i
        return None

    def can_allocate(self, final_len: int) -> bool:
        return self._find_hole(self.reservation_size(final_len)) is not None

    def allocate(self, request, num_tokens: int, final_len: int) -> ContiguousRegion | None:
        """Reserve a region for ``request`` holding ``num_tokens`` now; None if no hole fits."""
        rid = _request_id(request)
        _check_positive_int("num_tokens", num_tokens)
        _check_positive_int("final_len", final_len)
        if final_len < num_tokens:
            raise ValueError(f"final_len {final_len} is below num_tokens {num_tokens}")
        if final_len > self.max_model_len:
            raise ValueError(f"final_len {final_len} exceeds max_model_len {self.max_model_len}")
        if rid in self.regions:
            raise ValueError(f"request {rid!r} already holds a region")
        size = self.reservation_size(final_len)
        if size > self.num_slots:
            raise ValueError(f"request {rid!r} needs {size} slots but the pool has only {self.num_slots}")
        i = self._find_hole(size)
        if i is None:
            return None  # NOTE: nothing changed; the caller waits for a region to be freed
        start, hole_size = self.holes[i]
        if hole_size == size:
            del self.holes[i]
        else:
            self.holes[i] = [start + size, hole_size - size]
        region = ContiguousRegion(start, size, num_tokens, final_len)
        self.regions[rid] = region
        return region

    def append_tokens(self, request, num_new_tokens: int = 1) -> None:
        """Record ``num_new_tokens`` more tokens in the request's region (no allocation)."""
        rid = _request_id(request)
        if not (type(num_new_tokens) is int and num_new_tokens > 0):  # NOTE: per decode: checked inline
            _check_positive_int("num_new_tokens", num_new_tokens)
        region = self.regions.get(rid) or self._get_region(rid)
        if region.num_tokens + num_new_tokens > region.final_len:
            raise ValueError(
                f"request {rid!r}: {region.num_tokens} + {num_new_tokens} tokens exceed its "
                f"final_len {region.final_len}"
            )
        region.num_tokens += num_new_tokens

    def free(self, request) -> None:
        """Turn the request's region back into a hole, merged with free neighbours."""
        rid = _request_id(request)
        region = self._get_region(rid)
        del self.regions[rid]
        i = bisect.bisect_left(self.holes, [region.start, 0])
        self.holes.insert(i, [region.start, region.size])
        # merge with the next hole, then with the previous one
        if i + 1 < len(self.holes) and self.holes[i][0] + self.holes[i][1] == self.holes[i + 1][0]:
            self.holes[i][1] += self.holes.pop(i + 1)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == self.holes[i][0]:
            self.holes[i - 1][1] += self.holes.pop(i)[1]

    # -- addressing ---------------------------------------------------------------
    def _get_region(self, rid: str) -> ContiguousRegion:
        if rid not in self.regions:
            raise ValueError(f"unknown request {rid!r}: it holds no region")
        return self.regions[rid]

    def get_region(self, request_id: str) -> ContiguousRegion:
        return self._get_region(request_id)

    def get_slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of the request's tokens ``start .. end-1``: consecutive, from the region start."""
        region = self._get_region(request_id)
        if not 0 <= start <= end <= region.num_tokens:
            raise ValueError(f"token span [{start}, {end}) outside the {region.num_tokens} tokens held")
        return list(range(region.start + start, region.start + end))

    # -- reporting ----------------------------------------------------------------
    def get_num_free_slots(self) -> int:
        return sum(size for _, size in self.holes)

    def get_holes(self) -> list[tuple[int, int]]:
        """Free holes as ``(start, size)``, in address order."""
        return [(start, size) for start, size in self.holes]

    def usage(self) -> ContiguousUsage:
        regions = self.regions.values()
        return ContiguousUsage(
            num_slots=self.num_slots,
            num_token_slots=sum(r.num_tokens for r in regions),
            num_future_slots=sum(r.final_len - r.num_tokens for r in regions),
            num_reserved_slots=sum(r.size for r in regions),
            num_free_slots=self.get_num_free_slots(),
            largest_hole=max((size for _, size in self.holes), default=0),
        )

    def external_fragmentation(self, next_final_len: int) -> int:
        """Free slots lost to fragmentation for the next request (see the module docstring)."""
        _check_positive_int("next_final_len", next_final_len)
        need = self.reservation_size(next_final_len)
        free = self.get_num_free_slots()
        largest = max((size for _, size in self.holes), default=0)
        return free if largest < need <= free else 0

    def check_invariants(self) -> None:
        pieces = [(r.start, r.size, f"region of {rid!r}") for rid, r in self.regions.items()]
        pieces += [(start, size, "hole") for start, size in self.holes]
        pieces.sort()
        pos = 0
        for start, size, what in pieces:
            assert size > 0, f"{what} at {start} has size {size}"
            assert start == pos, f"{what} at {start}: expected it to start at {pos} (gap or overlap)"
            pos = start + size
        assert pos == self.num_slots, f"pieces end at {pos}, pool has {self.num_slots} slots"
        for (s0, n0), (s1, _) in zip(self.holes, self.holes[1:]):
            assert s0 + n0 < s1, f"holes at {s0} and {s1} are unsorted or not merged"
        for rid, r in self.regions.items():
            assert 1 <= r.num_tokens <= r.final_len <= r.size, (
                f"region of {rid!r}: num_tokens={r.num_tokens}, final_len={r.final_len}, size={r.size}"
            )
            assert r.size == self.reservation_size(r.final_len), (
                f"region of {rid!r}: size {r.size} but policy {self.policy!r} reserves "
                f"{self.reservation_size(r.final_len)} for final_len {r.final_len}"
            )

    def __repr__(self) -> str:
        return (
            f"ContiguousAllocator(policy={self.policy!r}, num_slots={self.num_slots}, "
            f"regions={len(self.regions)}, holes={len(self.holes)})"
        )
