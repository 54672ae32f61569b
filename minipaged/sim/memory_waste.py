"""Where does KV-cache memory go? Paged vs contiguous reservation (the paper's Fig. 2).

No vLLM counterpart: this is the measurement behind Fig. 2 of the vLLM paper (Kwon et
al., SOSP 2023), replayed on the real allocators of this package: ``KVCacheManager``
(paged, ``block_size`` 16) and ``ContiguousAllocator`` (Orca Max / Pow2 / Oracle).

The setting (``DEFAULT_*`` below)
    OPT-13B on one 40 GB A100, as in the paper: 26 GB of weights leave about 12 GiB for
    the KV cache; at 800 KiB per token (40 layers x 2 (K, V) x 5120 x 2 bytes) that is
    ``12 GiB / 800 KiB = 15,728`` token slots, i.e. 983 blocks of 16.
    ``max_model_len = 2048`` (OPT's context). The same slot budget for every policy.

The replay (one loop, the same for every policy)
    All requests of a seeded workload (``minipaged.sim.workloads``) wait in FCFS order at
    step 0. Each step:

    1. admit: while the head of the waiting queue fits, admit it with its prompt fully
       present (paged: blocks for the prompt; contiguous: one region reserved for its
       whole final length under the policy). Strict FCFS: nobody overtakes the head.
    2. snapshot: sort every slot of the pool into one category (below).
    3. grow: every running request appends one token. Paged allocates a new block when
       the last one is full; if the pool is empty it preempts the latest-arrived running
       request (recompute: its blocks are freed and it goes back to the front of the
       queue, to be re-admitted with prompt + output so far). Contiguous never allocates
       here: the region was reserved up front. NOTE: paged admission is greedy (no
       watermark of spare blocks, unlike vLLM), so it preempts often; the count is reported.
    4. finish: requests that reached their final length free their memory.

The categories (every slot of the pool is in exactly one; they add up to 100%)
    - token states: slots holding a token's K/V;
    - reserved: allocated slots the request *will* fill with later tokens (contiguous:
      ``final_len - num_tokens``; paged: the rest of the last block, up to ``final_len``);
    - internal fragmentation: allocated slots the request will never fill (contiguous:
      ``size - final_len``; paged: the part of the last block past ``final_len``);
    - external fragmentation: free slots that cannot take the head-of-line request although
      together they could (see ``ContiguousAllocator.external_fragmentation``; always 0
      under paging, where any free block serves any request);
    - free: the remaining free slots (too few, even together, for the next request).

Averaging, defined precisely
    A step is *loaded* when, after admission, the waiting queue is not empty: memory, not
    demand, is what limits the batch. Each figure is the mean over loaded steps of that
    category's share of the whole pool. The tail of the run, when the last requests drain
    and memory empties, is not loaded and not averaged. ``peak_running`` is the largest
    number of requests running at once over the whole run.

Inputs / outputs
    ``run_memory_experiment(workload, ...)`` -> ``MemoryWasteResult``; ``format_table``,
    ``plot_memory_waste`` (a matplotlib Figure), ``MemoryWasteResult.to_dict`` (JSON).
    CLI: ``minipaged memory [--workload sharegpt|alpaca] [--json] [--out-dir figures]``.

Invariants
    per policy the five fractions sum to 1; ``check_invariants()`` of the allocator holds
    after every step (tests run the replay with ``check=True``).

Failure mode
    bad arguments (unknown workload or policy, a budget smaller than ``max_model_len``)
    raise ``ValueError``.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minipaged.cli import dumps_json
from minipaged.core.kv.contiguous import POLICIES, POLICY_NAMES, ContiguousAllocator
from minipaged.core.kv.kv_cache_manager import KVCacheManager
from minipaged.sim.workloads import WORKLOADS, sample_requests

DEFAULT_NUM_SLOTS = 15_728  # 12 GiB / 800 KiB per token (OPT-13B, A100-40GB)
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_NUM_REQUESTS = 1000

ALL_POLICIES = ("paged",) + POLICIES
DISPLAY_NAMES = {"paged": "vLLM (paged)", **POLICY_NAMES}
CATEGORIES = (
    "token_states",
    "reserved",
    "internal_fragmentation",
    "external_fragmentation",
    "free",
)
CATEGORY_LABELS = {
    "token_states": "token states",
    "reserved": "reserved (future tokens)",
    "internal_fragmentation": "internal fragmentation",
    "external_fragmentation": "external fragmentation",
    "free": "free (too little for next request)",
}


@dataclass
class PolicyStats:
    """One policy's memory breakdown (fractions of the pool, mean over loaded steps)."""

    policy: str
    name: str
    token_states: float
    reserved: float
    internal_fragmentation: float
    external_fragmentation: float
    free: float
    peak_running: int
    mean_running_loaded: float  # mean number of running requests over loaded steps
    num_loaded_steps: int
    num_steps: int  # until the last request finished
    num_preemptions: int


@dataclass
class MemoryWasteResult:
    workload: str
    num_requests: int
    seed: int
    num_slots: int
    block_size: int
    max_model_len: int
    mean_prompt_len: float
    mean_output_len: float
    policies: dict[str, PolicyStats] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["policies"] = {k: asdict(v) for k, v in self.policies.items()}
        return d


class _Accumulator:
    """Sums the per-step category shares over loaded steps."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.sums = dict.fromkeys(CATEGORIES, 0.0)
        self.running_sum = 0
        self.num_loaded = 0
        self.peak_running = 0

    def add(self, loaded: bool, num_running: int, **slots: int) -> None:
        self.peak_running = max(self.peak_running, num_running)
        if not loaded:
            return
        assert sum(slots.values()) == self.num_slots, f"categories do not tile the pool: {slots}"
        for k in CATEGORIES:
            self.sums[k] += slots[k] / self.num_slots
        self.running_sum += num_running
        self.num_loaded += 1

    def stats(self, policy: str, num_steps: int, num_preemptions: int) -> PolicyStats:
        n = max(self.num_loaded, 1)
        return PolicyStats(
            policy=policy,
            name=DISPLAY_NAMES[policy],
            **{k: self.sums[k] / n for k in CATEGORIES},
            peak_running=self.peak_running,
            mean_running_loaded=self.running_sum / n,
            num_loaded_steps=self.num_loaded,
            num_steps=num_steps,
            num_preemptions=num_preemptions,
        )


def replay_paged(
    requests: list[tuple[int, int]], num_slots: int, block_size: int, check: bool = False
) -> PolicyStats:
    """Replay ``requests`` through a ``KVCacheManager`` of ``num_slots // block_size`` blocks."""
    num_blocks = num_slots // block_size
    mgr = KVCacheManager(num_blocks, block_size)
    final = [p + o for p, o in requests]
    progress = [p for p, _ in requests]  # prompt + output generated so far
    waiting = deque(range(len(requests)))
    running: set[int] = set()
    acc = _Accumulator(num_slots)
    step = num_preemptions = 0

    def preempt(victim: int) -> None:
        nonlocal num_preemptions
        mgr.free(str(victim))
        running.discard(victim)
        waiting.appendleft(victim)  # NOTE: later victims arrived earlier: FCFS is kept
        num_preemptions += 1

    while waiting or running:
        # 1. admit (FCFS): the head needs blocks for everything it holds so far
        while waiting and mgr.allocate_slots(str(waiting[0]), progress[waiting[0]]) is not None:
            running.add(waiting.popleft())
        # 2. snapshot
        tokens = reserved = allocated = 0
        for i in running:
            held = len(mgr.block_tables[str(i)].blocks) * block_size
            tokens += progress[i]
            reserved += min(held, final[i]) - progress[i]
            allocated += held
        free = mgr.get_num_free_blocks() * block_size + (num_slots - num_blocks * block_size)
        acc.add(
            bool(waiting),
            len(running),
            token_states=tokens,
            reserved=reserved,
            internal_fragmentation=allocated - tokens - reserved,
            external_fragmentation=0,
            free=free,
        )
        # 3. grow by one token, earliest arrival first; preempt the latest when full
        for i in sorted(running):
            if i not in running:
                continue  # preempted earlier in this loop
            while mgr.allocate_slots(str(i), 1) is None:
                preempt(max(running))
                if i not in running:
                    break
            else:
                progress[i] += 1
        # 4. finish
        for i in [i for i in running if progress[i] == final[i]]:
            mgr.free(str(i))
            running.discard(i)
        if check:
            mgr.check_invariants()
        step += 1
    return acc.stats("paged", step, num_preemptions)


def replay_contiguous(
    requests: list[tuple[int, int]],
    num_slots: int,
    max_model_len: int,
    policy: str,
    check: bool = False,
) -> PolicyStats:
    """Replay ``requests`` through a first-fit ``ContiguousAllocator`` with ``policy``."""
    alloc = ContiguousAllocator(num_slots, max_model_len, policy)
    final = [p + o for p, o in requests]
    waiting = deque(range(len(requests)))
    running: list[int] = []
    acc = _Accumulator(num_slots)
    step = 0
    while waiting or running:
        # 1. admit (FCFS): one region for the whole final length
        while waiting and alloc.allocate(str(waiting[0]), requests[waiting[0]][0], final[waiting[0]]):
            running.append(waiting.popleft())
        # 2. snapshot
        u = alloc.usage()
        external = alloc.external_fragmentation(final[waiting[0]]) if waiting else 0
        acc.add(
            bool(waiting),
            len(running),
            token_states=u.num_token_slots,
            reserved=u.num_future_slots,
            internal_fragmentation=u.internal_fragmentation,
            external_fragmentation=external,
            free=u.num_free_slots - external,
        )
        # 3. grow (inside the region) and 4. finish
        still_running = []
        for i in running:
            alloc.append_tokens(str(i), 1)
            if alloc.regions[str(i)].num_tokens == final[i]:
                alloc.free(str(i))
            else:
                still_running.append(i)
        running = still_running
        if check:
            alloc.check_invariants()
        step += 1
    return acc.stats(policy, step, 0)


def run_memory_experiment(
    workload: str = "sharegpt",
    num_requests: int = DEFAULT_NUM_REQUESTS,
    seed: int = 0,
    num_slots: int = DEFAULT_NUM_SLOTS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    policies: tuple[str, ...] = ALL_POLICIES,
    check: bool = False,
) -> MemoryWasteResult:
    """Replay one seeded workload under each policy; see the module docstring."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    for p in policies:
        if p not in ALL_POLICIES:
            raise ValueError(f"policies: unknown policy {p!r}; choose from {ALL_POLICIES}")
    if not isinstance(num_slots, int) or num_slots < max_model_len:
        raise ValueError(f"num_slots must be an int >= max_model_len, got {num_slots!r}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    requests = sample_requests(workload, num_requests, seed, max_model_len)
    result = MemoryWasteResult(
        workload=workload,
        num_requests=num_requests,
        seed=seed,
        num_slots=num_slots,
        block_size=block_size,
        max_model_len=max_model_len,
        mean_prompt_len=sum(p for p, _ in requests) / num_requests,
        mean_output_len=sum(o for _, o in requests) / num_requests,
    )
    for p in policies:
        if p == "paged":
            stats = replay_paged(requests, num_slots, block_size, check=check)
        else:
            stats = replay_contiguous(requests, num_slots, max_model_len, p, check=check)
        result.policies[p] = stats
    return result


# -- output -----------------------------------------------------------------------
def format_table(result: MemoryWasteResult) -> str:
    r = result
    lines = [
        f"KV memory waste: {r.workload}-like workload, {r.num_requests} requests "
        f"(mean input {r.mean_prompt_len:.1f}, output {r.mean_output_len:.1f} tokens), seed {r.seed}",
        f"KV budget {r.num_slots} token slots ({r.num_slots // r.block_size} blocks of "
        f"{r.block_size} when paged), max_model_len {r.max_model_len}",
        "share of the whole KV pool, mean over loaded steps (requests waiting for memory)",
        "",
        f"{'policy':<15}{'tokens':>8}{'reserved':>10}{'internal':>10}{'external':>10}"
        f"{'free':>7}{'peak reqs':>11}{'loaded/steps':>14}{'preempt':>9}",
    ]
    for s in r.policies.values():
        lines.append(
            f"{s.name:<15}{s.token_states:>8.1%}{s.reserved:>10.1%}"
            f"{s.internal_fragmentation:>10.1%}{s.external_fragmentation:>10.1%}{s.free:>7.1%}"
            f"{s.peak_running:>11d}{f'{s.num_loaded_steps}/{s.num_steps}':>14}"
            f"{s.num_preemptions:>9d}"
        )
    return "\n".join(lines)


# Okabe-Ito colours (safe for the common colour-vision deficiencies), one per category.
COLORS = {
    "token_states": "#0072B2",  # blue
    "reserved": "#56B4E9",  # sky blue
    "internal_fragmentation": "#E69F00",  # orange
    "external_fragmentation": "#D55E00",  # vermillion
    "free": "#BBBBBB",  # grey
}
HATCHES = {"reserved": "//", "external_fragmentation": "xx"}


def plot_memory_waste(result: MemoryWasteResult):
    """Stacked bars, one per policy: where the KV pool's slots go. Returns a Figure."""
    import matplotlib.pyplot as plt

    stats = list(result.policies.values())
    fig, ax = plt.subplots(figsize=(8.5, 5.0), dpi=120)
    x = range(len(stats))
    bottom = [0.0] * len(stats)
    for cat in CATEGORIES:
        vals = [getattr(s, cat) * 100 for s in stats]
        ax.bar(
            x,
            vals,
            bottom=bottom,
            width=0.6,
            color=COLORS[cat],
            hatch=HATCHES.get(cat),
            edgecolor="white",
            linewidth=0.8,
            label=CATEGORY_LABELS[cat],
        )
        for xi, (b, v) in enumerate(zip(bottom, vals)):
            if v >= 4:
                dark = cat in ("token_states", "external_fragmentation")
                # NOTE: a box in the segment's colour keeps the label readable over hatching
                ax.text(
                    xi,
                    b + v / 2,
                    f"{v:.1f}%",
                    ha="center",
                    va="center",
                    fontsize=10,
                    color="white" if dark else "black",
                    fontweight="bold",
                    bbox=dict(boxstyle="round,pad=0.2", fc=COLORS[cat], ec="none"),
                )
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{s.name}\npeak {s.peak_running} requests" for s in stats], fontsize=10)
    ax.set_ylabel("share of KV cache memory (%)", fontsize=11)
    ax.set_ylim(0, 100)
    ax.set_title(
        f"Where KV memory goes: {result.workload}-like workload, {result.num_requests} requests\n"
        f"{result.num_slots} token slots, block size {result.block_size}, "
        f"mean over steps with requests waiting for memory",
        fontsize=11,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def figure_path(out_dir: str | Path, workload: str) -> Path:
    name = "memory_waste.png" if workload == "sharegpt" else f"memory_waste_{workload}.png"
    return Path(out_dir) / name


# -- CLI ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from minipaged.cli import positive_int

    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--out-dir", default="figures", help="where to write the PNG")
    parser.add_argument("--no-figure", action="store_true", help="do not write the PNG")
    parser.add_argument("--num-requests", type=positive_int, default=DEFAULT_NUM_REQUESTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-slots",
        type=positive_int,
        default=DEFAULT_NUM_SLOTS,
        help="KV budget in token slots (default: OPT-13B on an A100-40GB)",
    )
    parser.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--max-model-len", type=positive_int, default=DEFAULT_MAX_MODEL_LEN)


def run(args: argparse.Namespace) -> int:
    result = run_memory_experiment(
        workload=args.workload,
        num_requests=args.num_requests,
        seed=args.seed,
        num_slots=args.num_slots,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
    )
    if args.json:
        print(dumps_json(result.to_dict(), indent=2))
    else:
        print(format_table(result))
    if not args.no_figure:
        import matplotlib.pyplot as plt

        from minipaged.viz._draw import save_png

        path = figure_path(args.out_dir, args.workload)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig = plot_memory_waste(result)
        save_png(fig, path)  # the same bytes as `minipaged figures` writes
        plt.close(fig)
        # NOTE: stderr, so that --json output stays valid JSON on stdout
        print(f"wrote {path}", file=sys.stderr)
    return 0
