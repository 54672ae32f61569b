"""Tensor-parallel (Megatron-style) layers: each rank holds a slice of every weight matrix.

Mirrors vLLM ``vllm/model_executor/layers/linear.py`` (ColumnParallelLinear,
MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear) and
``vocab_parallel_embedding.py`` (VocabParallelEmbedding, ParallelLMHead), and the
communication helpers of ``vllm/distributed/communication_op.py``, cut down to what one
Llama-family decoder needs. The paper's §4.6: every rank runs the same tokens through its
own heads, so one block table serves them all.

How one decoder layer splits over N ranks (r = this rank)::

    qkv_proj      column-parallel by heads: rank r holds query heads r*H/N .. (r+1)*H/N - 1
                  and KV heads r*KVH/N .. (r+1)*KVH/N - 1 (their q, k and v rows)
    attention     on those heads only; the KV cache of rank r holds only its KV heads:
                  [num_blocks, block_size, KVH / N, D], same num_blocks, same block ids
    o_proj        row-parallel: rank r multiplies its heads' columns; ALL-REDUCE (sum)
    gate_up_proj  column-parallel: rank r holds rows r*I/N .. of gate and the same of up
    down_proj     row-parallel over those I/N columns; ALL-REDUCE (sum)
    embed_tokens  vocab-parallel: rank r holds rows r*V'/N .. of the table (V' = V rounded
                  up to a multiple of N); ids outside its range look up 0; ALL-REDUCE
    lm_head       vocab-parallel the same way; its logits are ALL-GATHERED, so every rank
                  has the same [B, V] and samples the same tokens (vLLM v1's way: each
                  worker's model runner appends its own sampled tokens)
    norms         replicated (every rank holds the whole vector)

Inputs
    a ``TensorParallelGroup`` (rank, size, torch.distributed group, and on a CPU the
    shared-memory communicator its all-reduces use) given to each layer at construction; at ``size == 1`` there is no group and every layer *is* its ``nn.Linear``
    / ``nn.Embedding`` (same ``forward``, same speed, same state-dict names).
Outputs
    each layer's ``forward`` returns what the unsharded layer returns, restricted to this
    rank's output columns (column-parallel) or summed over ranks (row-parallel, embedding);
    ``weight_loader(param_name, loaded, rows)`` copies this rank's slice of a checkpoint tensor
    (a ``torch.Tensor``, or a safetensors slice, so only the shard's bytes are read).
    Modules without ``weight_loader`` (the norms) are replicated: every rank copies all.

Invariants
    - the sum over ranks of a row-parallel layer's partial products equals the full matmul
      (up to float rounding: the order of the sum differs);
    - a column-parallel layer's local output is the full output's columns of this rank;
    - a row-parallel bias is added once, after the all-reduce;
    - every rank ends a forward with the same logits (bit for bit: one all-gathered tensor).

Failure mode
    a size that does not divide the heads, the KV heads or the intermediate size, or more
    ranks than devices: ``ValueError`` naming ``tensor_parallel_size``
    (``check_tensor_parallel_size``). NOTE: vLLM replicates KV heads when N > KVH; here N must
    divide KVH. A rank that dies leaves the others blocked in a collective until gloo / NCCL
    notices the closed connection; the executor, not these layers, turns that into an error.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class TensorParallelGroup:
    """Where this rank stands: ``rank`` of ``size``, and the collectives between the ranks.

    ``group`` is a ``torch.distributed`` process group (``None``: the default group, or no
    group at all when ``size == 1``). ``shm``: a ``ShmCommunicator``
    (``minipaged/distributed/shm_comm.py``) when the ranks are CPU processes of one host: an
    all-reduce or all-gather that fits its slots goes through shared memory (tens of
    microseconds), anything else through ``group`` (gloo: about 500 us for a decode step's
    [8, 512] here; NCCL on CUDA, where there is never a segment). ``comm_seconds`` adds up the
    wall time spent in collectives when ``timed`` is set (the benchmark reads it; two
    ``perf_counter`` calls per collective), ``num_collectives`` counts them, ``num_shm`` those
    that went through shared memory.
    """

    __slots__ = ("rank", "size", "group", "timed", "comm_seconds", "num_collectives", "num_shm", "shm")

    def __init__(
        self, rank: int = 0, size: int = 1, group: Any = None, timed: bool = True, shm: Any = None
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank must be in [0, {size}), got {rank!r}")
        self.rank = rank
        self.size = size
        self.group = group
        self.timed = timed
        self.comm_seconds = 0.0
        self.num_collectives = 0
        self.num_shm = 0  # of which through the shared-memory segment
        self.shm = shm  # a ShmCommunicator (ranks on one host, CPU) or None: gloo / NCCL only

    @classmethod
    def from_torch_distributed(
        cls, group: Any = None, timed: bool = True, shm: Any = None
    ) -> TensorParallelGroup:
        """This process's rank and world size in ``group`` (an initialised torch.distributed)."""
        import torch.distributed as dist

        return cls(dist.get_rank(group), dist.get_world_size(group), group, timed, shm)

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size})"

    def comm_stats(self, reset: bool = False) -> dict:
        """This rank's collectives so far: seconds (with ``timed``), count, how many went
        through the shared-memory segment, whether there is one; ``reset`` zeroes the counts."""
        out = {
            "comm_seconds": self.comm_seconds,
            "num_collectives": self.num_collectives,
            "num_shm": self.num_shm,
            "shm": self.shm is not None,
        }
        if reset:
            self.comm_seconds, self.num_collectives, self.num_shm = 0.0, 0, 0
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the sum)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter() if self.timed else 0.0
        if self.shm is not None and self.shm.all_reduce(x) is not None:
            self.num_shm += 1
        else:  # CUDA (NCCL), no segment, or too big for it: torch.distributed
            dist.all_reduce(x, group=self.group)
        self._count(t0)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, on every rank (the same tensor)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter() if self.timed else 0.0
        out = self.shm.all_gather(x, dim) if self.shm is not None else None
        if out is not None:
            self.num_shm += 1
        else:
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            out = torch.cat(parts, dim=dim)
        self._count(t0)
        return out

    def _count(self, t0: float) -> None:
        self.num_collectives += 1
        if self.timed:
            self.comm_seconds += time.perf_counter() - t0


SINGLE = TensorParallelGroup()  # world size 1: no collectives at all


def divide(n: int, size: int, what: str) -> int:
    """n / size, or ``ValueError`` naming ``tensor_parallel_size`` and ``what`` it must divide."""
    if n % size != 0:
        raise ValueError(f"tensor_parallel_size={size} does not divide {what} ({n})")
    return n // size


def available_devices(device: str | torch.device = "cpu") -> int:
    """How many ranks this machine can hold: CUDA devices on ``cuda``, CPU cores on ``cpu``
    (one thread per rank)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def check_tensor_parallel_size(size, config, device: str | torch.device = "cpu") -> int:
    """``size`` if the model's shapes split into ``size`` equal shards on this machine; else
    ``ValueError`` naming ``tensor_parallel_size`` and what it must divide (the heads, the
    KV heads, the intermediate size) or the devices it exceeds."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    if size == 1:
        return 1
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    divide(heads, size, "num_attention_heads")
    divide(kv_heads, size, "num_key_value_heads")
    divide(config.intermediate_size, size, "intermediate_size")
    have = available_devices(device)
    if size > have:
        kind = "CUDA devices" if torch.device(device).type == "cuda" else "CPU cores"
        raise ValueError(f"tensor_parallel_size={size} exceeds the {have} {kind} of this machine")
    return size


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank's part of a dimension of ``total``, split into ``size`` parts of
    ceil(total / size) (the last may be shorter, or empty: vLLM pads the vocabulary the same way)."""
    per = -(-total // size)
    start = min(rank * per, total)
    return start, min(per, total - start)


def take_shard(loaded, dim: Optional[int], rank: int, size: int) -> torch.Tensor:
    """Rank's slice of a checkpoint tensor along ``dim`` (``None``: all of it).

    ``loaded`` is a ``torch.Tensor`` or a safetensors slice (``safe_open(...).get_slice``),
    whose indexing reads only the requested bytes from the file."""
    if isinstance(loaded, torch.Tensor):
        if dim is None or size == 1:
            return loaded
        start, length = shard_range(loaded.shape[dim], rank, size)
        return loaded.narrow(dim, start, length)
    shape = loaded.get_shape()
    index = [slice(None)] * len(shape)
    if dim is not None and size > 1:
        start, length = shard_range(shape[dim], rank, size)
        index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def load_into(
    param: torch.Tensor,
    loaded,
    rows: slice = slice(None),
    dim: Optional[int] = None,
    tp: TensorParallelGroup = SINGLE,
    padded: bool = False,
) -> None:
    """Copy rank ``tp.rank``'s shard of ``loaded`` along ``dim`` into ``param[rows]``, casting
    to its dtype (``dim=None``: a replicated parameter, all of it). ``padded``: a vocab-parallel
    shard shorter than its rows fills the first rows and zeroes the rest."""
    src = take_shard(loaded, dim, tp.rank, tp.size)
    dst = param[rows]
    with torch.no_grad():
        if padded:
            dst[src.shape[0] :].zero_()  # rows past the vocabulary: zero logits, cut off anyway
            dst = dst[: src.shape[0]]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(
                f"checkpoint shard shape {tuple(src.shape)} != parameter shape {tuple(dst.shape)}"
            )
        dst.copy_(src)


class _Sharded:
    """What a parallel layer knows about its parameters: the dimension each is split along
    (``TP_DIMS``; absent: replicated). Kept on the module, not the tensor: ``to_empty`` and
    ``.to`` may replace a parameter object, never a module."""

    TP_DIMS: dict[str, Optional[int]] = {}
    PADDED = False
    tp: TensorParallelGroup

    def weight_loader(self, param_name: str, loaded, rows: slice = slice(None)) -> None:
        """Copy this rank's shard of checkpoint tensor ``loaded`` into ``param_name[rows]``."""
        dim = self.TP_DIMS.get(param_name)
        padded = self.PADDED and dim == 0 and self.tp.size > 1
        load_into(getattr(self, param_name), loaded, rows, dim, self.tp, padded)


class ColumnParallelLinear(_Sharded, nn.Linear):
    """y[:, rank's columns] = x @ W[rank's rows].T (+ b): no communication.

    ``out_features`` is the full width; this rank holds ``out_features / size`` rows of W."""

    TP_DIMS = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup = SINGLE):
        super().__init__(in_features, divide(out_features, tp.size, "the output features"), bias=bias)
        self.tp = tp


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (vLLM: gate and up).

    ``output_sizes`` are the full sizes; rank r holds its slice of *each*, side by side:
    ``[gate_r, up_r]``, so ``SiluAndMul`` on the local output is the local part of the result."""

    def __init__(self, in_features: int, output_sizes, bias: bool, tp: TensorParallelGroup = SINGLE):
        self.local_sizes = [divide(n, tp.size, "the intermediate size") for n in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def local_rows(self, index: int) -> slice:
        """Rows of this rank's weight that hold output ``index`` (0 = gate, 1 = up)."""
        start = sum(self.local_sizes[:index])
        return slice(start, start + self.local_sizes[index])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused and split by heads: rank r holds H/N query heads and KVH/N KV heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup = SINGLE,
    ):
        self.num_heads = divide(total_num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp.size, "num_key_value_heads")
        self.head_dim = head_dim
        total = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, total, bias, tp)

    def local_rows(self, shard: str) -> slice:
        """Rows of this rank's weight that hold its heads of ``"q"``, ``"k"`` or ``"v"``."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]


class RowParallelLinear(_Sharded, nn.Linear):
    """y = all_reduce(x[:, rank's columns] @ W[:, rank's columns].T) + b.

    ``in_features`` is the full width; this rank holds ``in_features / size`` columns of W.
    The bias is replicated and added after the sum (once, not N times)."""

    TP_DIMS = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup = SINGLE):
        super().__init__(divide(in_features, tp.size, "the input features"), out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight))  # [T, out]: the sum of every rank's part
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_Sharded, nn.Embedding):
    """Rank r holds rows [start, start + ceil(V / N)) of the table; ids outside look up zeros;
    the all-reduce sums the one rank that had each id."""

    TP_DIMS = {"weight": 0}
    PADDED = True

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup = SINGLE):
        self.org_vocab_size = num_embeddings
        self.vocab_start, self.vocab_len = shard_range(num_embeddings, tp.rank, tp.size)
        per = -(-num_embeddings // tp.size)  # padded rows per rank
        super().__init__(per, embedding_dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        start, end = self.vocab_start, self.vocab_start + self.vocab_len
        mine = (ids >= start) & (ids < end)  # [T]
        h = F.embedding((ids - start) * mine, self.weight)  # [T, hidden]
        h = h * mine.unsqueeze(-1).to(h.dtype)
        return self.tp.all_reduce(h)  # [T, hidden]


class ParallelLMHead(_Sharded, nn.Linear):
    """logits = h @ E.T over rank r's vocabulary rows, all-gathered and cut back to V (vLLM
    v1's ``LogitsProcessor`` all-gathers the same way): every rank gets the same logits."""

    TP_DIMS = {"weight": 0}
    PADDED = True

    def __init__(self, embedding_dim: int, num_embeddings: int, tp: TensorParallelGroup = SINGLE):
        self.org_vocab_size = num_embeddings
        per = -(-num_embeddings // tp.size)
        super().__init__(embedding_dim, per, bias=False)
        self.tp = tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(h)
        logits = self.tp.all_gather(F.linear(h, self.weight))  # [B, N * ceil(V / N)]
        return logits[:, : self.org_vocab_size]  # [B, V]


def load_weights(model: nn.Module, state_dict, stacked_params, skip=()) -> None:
    """Copy a transformers state dict into ``model`` (cast to its dtype), this rank's shard of
    each tensor (vLLM's ``load_weights`` with its ``stacked_params_mapping``).

    Names match Hugging Face's, except the fused ones: ``stacked_params`` holds ``(fused,
    checkpoint name, shard)`` triples (``q_proj`` goes into the ``"q"`` rows of ``qkv_proj``,
    found by the owning module's ``shard_rows``); every shard must be found exactly once.
    ``state_dict``: a mapping or an iterable of ``(name, tensor)`` pairs; a tensor may be a
    safetensors slice, so a rank reads only its shard. Names containing one of ``skip`` are
    neither loaded nor expected. Unknown or missing weights: ``ValueError`` naming them."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    missing = set()  # checkpoint names we still expect
    for name in params:
        fused = [(f, ckpt) for f, ckpt, _ in stacked_params if f".{f}." in name]
        missing.update(name.replace(f".{f}.", f".{ckpt}.") for f, ckpt in fused)
        if not fused:
            missing.add(name)
    items = state_dict.items() if hasattr(state_dict, "items") else state_dict
    for name, tensor in items:
        if any(s in name for s in skip):
            continue
        target, rows = name, slice(None)
        for fused, ckpt, shard in stacked_params:
            if f".{ckpt}." in name:
                target = name.replace(f".{ckpt}.", f".{fused}.")
                rows = modules[target.rsplit(".", 2)[0]].shard_rows(shard)
                break
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in {type(model).__name__}")
        module_name, _, param_name = target.rpartition(".")
        module = modules[module_name]
        try:  # this rank's shard, into its rows (replicated: all of it)
            if hasattr(module, "weight_loader"):
                module.weight_loader(param_name, tensor, rows)
            else:
                load_into(params[target], tensor, rows)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        missing.discard(name)
    missing = {m for m in missing if not any(s in m for s in skip)}
    if missing:
        raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
