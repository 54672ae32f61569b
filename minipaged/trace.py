"""EngineTrace: what happened at every engine step, as plain data.

The pictures (``minipaged.viz``), the widgets and the notebooks are drawn from a trace,
never from live engine state, so everything they show can be tested, saved as JSON,
reloaded and compared. The engine and the simulator record the same ``StepRecord``.

Invariants (``EngineTrace.check_invariants``)
    steps are numbered 0, 1, 2, ...; per step the scheduled tokens fit the token budget
    and the running requests fit ``max_num_seqs``; every block id in a block table is in
    ``range(num_blocks)`` and is not listed as free; a block held by k tables has
    ``ref_cnt`` k (shared blocks are listed in ``shared_blocks``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional


def count_holders(block_tables: dict[str, list[int]]) -> dict[int, int]:
    """Block id -> how many of these block tables hold it (its ref_cnt, when the tables
    are all of them); blocks held by more than one are the shared ones."""
    holders: dict[int, int] = {}
    for table in block_tables.values():
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    return holders


@dataclass(slots=True)
class StepRecord:
    step: int
    # request_id -> number of tokens computed for it this step (prefill chunk or 1)
    scheduled: dict[str, int] = field(default_factory=dict)
    prefill_ids: list[str] = field(default_factory=list)  # scheduled and still prefilling
    decode_ids: list[str] = field(default_factory=list)  # scheduled for one decode token
    waiting_ids: list[str] = field(default_factory=list)  # arrived, not running, after the step
    preempted_ids: list[str] = field(default_factory=list)  # preempted this step (recompute)
    swapped_out_ids: list[str] = field(default_factory=list)
    swapped_in_ids: list[str] = field(default_factory=list)
    swapped_ids: list[str] = field(default_factory=list)  # in the CPU pool after the step
    finished_ids: list[str] = field(default_factory=list)  # finished at the end of the step
    arrived_ids: list[str] = field(default_factory=list)  # arrived before this step
    # request_id -> its block table (physical block ids) after allocation this step
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> tokens held in its blocks after the step
    num_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: list[int] = field(default_factory=list)  # allocated this step
    shared_blocks: dict[int, int] = field(default_factory=dict)  # block id -> ref_cnt (> 1)
    num_free_blocks: int = 0
    time: Optional[float] = None  # simulated seconds (simulator); None for the engine


@dataclass
class EngineTrace:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    steps: list[StepRecord] = field(default_factory=list)
    # request_id -> {"prompt_len", "output_len", "arrival_step", "finish_step", ...}
    requests: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # free-form: scheduling, model, workload

    def record(self, rec: StepRecord) -> None:
        if rec.step != len(self.steps):
            raise RuntimeError(f"step {rec.step} recorded out of order (have {len(self.steps)})")
        self.steps.append(rec)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> StepRecord:
        return self.steps[i]

    # -- JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        for s in d["steps"]:  # JSON object keys are strings
            s["shared_blocks"] = {str(k): v for k, v in s["shared_blocks"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineTrace":
        steps = []
        for s in d["steps"]:
            s = dict(s)
            s["shared_blocks"] = {int(k): v for k, v in s.get("shared_blocks", {}).items()}
            steps.append(StepRecord(**s))
        return cls(
            num_blocks=d["num_blocks"],
            block_size=d["block_size"],
            max_num_seqs=d["max_num_seqs"],
            max_num_batched_tokens=d["max_num_batched_tokens"],
            steps=steps,
            requests=d.get("requests", {}),
            meta=d.get("meta", {}),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "EngineTrace":
        return cls.from_dict(json.loads(s))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "EngineTrace":
        return cls.from_json(Path(path).read_text())

    def check_invariants(self) -> None:
        for i, s in enumerate(self.steps):
            assert s.step == i, f"step {i} is numbered {s.step}"
            total = sum(s.scheduled.values())
            assert total <= self.max_num_batched_tokens, (
                f"step {i}: {total} tokens > budget {self.max_num_batched_tokens}"
            )
            assert len(s.scheduled) <= self.max_num_seqs, (
                f"step {i}: {len(s.scheduled)} sequences > max_num_seqs {self.max_num_seqs}"
            )
            for rid, table in s.block_tables.items():
                for b in table:
                    assert 0 <= b < self.num_blocks, f"step {i}: {rid} holds block {b}"
            holders = count_holders(s.block_tables)
            for b, n in holders.items():
                if n > 1:
                    assert s.shared_blocks.get(b) == n, (
                        f"step {i}: block {b} held by {n} tables, shared_blocks says "
                        f"{s.shared_blocks.get(b)}"
                    )
            assert len(holders) + s.num_free_blocks <= self.num_blocks, (
                f"step {i}: {len(holders)} held + {s.num_free_blocks} free > {self.num_blocks}"
            )
