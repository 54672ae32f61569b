"""A roofline cost model of one engine step on a GPU: the simulator's stand-in for the model.

The simulator runs the real scheduler; only the *time* a step takes is modelled, here.
vLLM has no such file; the nearest thing is the analytic reasoning of the paper's §2-§3
(decode is memory-bound, the KV cache is what limits the batch) and the profiling run in
``vllm/worker/worker.py::determine_num_available_blocks`` that sizes the KV cache.

Inputs
    a ``ModelConfig`` (``OPT_13B``, ``LLAMA_7B`` presets), a ``GPUConfig`` (``A100_40GB``,
    ``A100_80GB``, ``H100``, ``H200`` presets, in ``GPUS``), and per step the batch as
    ``(num_new_tokens, num_computed_tokens)`` per scheduled sequence: a prefill chunk has
    ``num_new_tokens > 1``, a decode step ``num_new_tokens == 1``; ``num_computed_tokens``
    is the context already in the KV cache before the step.

Outputs
    ``step_time(batch)`` in seconds; ``breakdown(batch)`` with FLOPs, bytes, the compute and
    memory times and which one bounds the step (both read ``step_costs(batch)``, the model); ``kv_cache_bytes()`` and
    ``num_gpu_blocks(block_size)``: the KV budget,
    ``GPU memory * utilization - weights - activation reserve``; ``swap_time(num_tokens)``:
    copying that much KV over PCIe.

Tensor parallelism (``tensor_parallel_size=N``, the paper's §4.6: OPT-66B on 4 A100s,
OPT-175B on 8; ``PAPER_TP_SETTINGS``): every GPU holds 1/N of the weights and 1/N of every
token's KV (its heads), and does 1/N of the FLOPs and bytes; each layer adds two all-reduces
of the step's ``[T, hidden]`` activations over NVLink (ring: ``2 (N - 1) / N`` of the bytes
each way, plus a fixed latency per all-reduce), not overlapped with compute::

    time  = max(flops / N / (peak * mfu), bytes / N / (bw * mbu))
          + 2 * L * (2 (N-1)/N * T * hidden * dtype / nvlink_bw + allreduce_latency)
          + step_overhead
    KV    = N * (GPU memory * util - weights / N - activation reserve)   (all GPUs together)

The model of one step::

    flops = 2 * P_layers * T                     # every linear layer, every new token
          + 2 * hidden * vocab * S               # LM head, one sampled position per sequence
          + 4 * L * H * D * sum_i attn_i         # QK^T and AV: attn_i = keys each query sees
    bytes = weights                              # all weights read once per step
          + kv_bytes_per_token * sum_i ctx_i     # the KV context each sequence attends to
          + kv_bytes_per_token * T               # the new K/V written
    time  = max(flops / (peak_flops * mfu), bytes / (bandwidth * mbu)) + step_overhead

    T = new tokens in the step, S = sequences, L layers, H query heads of size D.

Where it simplifies (say so when quoting its numbers)
    - compute and memory overlap perfectly (a pure roofline); real kernels do not, so the
      ``*_efficiency`` factors stand in for it (one number each for every kernel);
    - activations are not counted in the bytes moved (they stay in L2/SRAM for decode and
      the prefill is compute-bound anyway); sampling, the all-reduce of tensor parallelism
      (one GPU only), CUDA-graph/launch effects and Python overhead are one fixed
      ``step_overhead_s`` per step;
    - attention reads each sequence's context once per step, as a fused (Flash/Paged)
      kernel does; the block size does not change the cost (the paper's Fig. 18 kernel
      slowdown for tiny blocks is not modelled; the sweep shows the memory side only);
    - swap preemption costs ``swap_time``: the blocks' bytes over PCIe, added to the step
      (no overlap with compute);
    - the activation reserve is a fixed number in place of vLLM's profiling run;
    - one dtype (fp16/bf16, 2 bytes) for weights and KV; no quantization;
    - tensor parallelism splits every matrix evenly (N divides the heads) and the LM head too;
      the embedding's all-reduce and the logits gather are left out (one [T, hidden] and one
      [S, vocab / N] message per step, small beside 2 L all-reduces).

Invariants
    step time is positive, non-decreasing in every sequence's new tokens and context, and
    at least ``step_overhead_s``; decode with a small batch is memory-bound and a long
    prefill compute-bound (``check_invariants``).

Failure mode
    a model whose weights do not fit the GPU's usable memory -> ``ValueError`` from
    ``kv_cache_bytes`` (and so from ``num_gpu_blocks``) naming both sizes; a negative token
    count -> ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import mul

GiB = 1024**3


@dataclass(frozen=True)
class ModelConfig:
    """The shapes that decide a decoder-only transformer's FLOPs and bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool = False  # Llama: gate, up, down (3 matrices); OPT: fc1, fc2 (2)
    tie_word_embeddings: bool = True
    dtype_bytes: int = 2  # fp16 / bf16

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_model_len",
            "dtype_bytes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def layer_params(self) -> int:
        """Parameters of the linear layers of all blocks (biases and norms left out)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h  # W_q, W_k, W_v, W_o
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def num_params(self) -> int:
        """All parameters: blocks + token embedding (+ LM head when untied; + OPT's
        learned positions, which are small and left out)."""
        emb = self.vocab_size * self.hidden_size
        return self.layer_params + emb * (1 if self.tie_word_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer: ``2 * L * kv_heads * head_dim * dtype``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GPUConfig:
    """Datasheet peaks of one GPU (dense fp16/bf16 tensor-core FLOP/s, HBM bytes/s)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float
    pcie_bandwidth: float = 25e9  # host<->GPU bytes/s actually reached (swap preemption)
    # NOTE: NVLink bytes/s one way an all-reduce reaches (NCCL's "bus bandwidth"): A100 NVLink 3
    # is 300 GB/s per direction, NCCL reaches roughly 230; H100 NVLink 4: 450 and roughly 360.
    nvlink_bandwidth: float = 230e9

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth", "memory_bytes", "pcie_bandwidth", "nvlink_bandwidth"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")


# NOTE: the paper's models: OPT-13B on one A100 (40 GB) is its single-GPU setting.
OPT_13B = ModelConfig(
    name="OPT-13B",
    num_layers=40,
    hidden_size=5120,
    num_heads=40,
    num_kv_heads=40,
    head_dim=128,
    intermediate_size=20480,
    vocab_size=50272,
    max_model_len=2048,
)
LLAMA_7B = ModelConfig(  # Llama-2-7B
    name="Llama-7B",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    intermediate_size=11008,
    vocab_size=32000,
    max_model_len=4096,
    gated_mlp=True,
    tie_word_embeddings=False,
)
# NOTE: the paper's multi-GPU models (Table 1): OPT-66B on 4 A100s, OPT-175B on 8 A100-80GB.
OPT_66B = ModelConfig(
    name="OPT-66B",
    num_layers=64,
    hidden_size=9216,
    num_heads=72,
    num_kv_heads=72,
    head_dim=128,
    intermediate_size=36864,
    vocab_size=50272,
    max_model_len=2048,
)
OPT_175B = ModelConfig(
    name="OPT-175B",
    num_layers=96,
    hidden_size=12288,
    num_heads=96,
    num_kv_heads=96,
    head_dim=128,
    intermediate_size=49152,
    vocab_size=50272,
    max_model_len=2048,
)
MODELS = {m.name: m for m in (OPT_13B, LLAMA_7B, OPT_66B, OPT_175B)}

A100_40GB = GPUConfig("A100-40GB", peak_flops=312e12, mem_bandwidth=1.555e12, memory_bytes=40 * GiB)
A100_80GB = GPUConfig("A100-80GB", peak_flops=312e12, mem_bandwidth=2.039e12, memory_bytes=80 * GiB)
# NOTE: PCIe 4.0 x16 peaks at 32 GB/s (A100), PCIe 5.0 x16 at 64 GB/s (H100, H200);
# pinned-memory copies reach roughly 80% of that.
H100 = GPUConfig(
    "H100",
    peak_flops=989e12,
    mem_bandwidth=3.35e12,
    memory_bytes=80 * GiB,
    pcie_bandwidth=50e9,
    nvlink_bandwidth=360e9,
)  # SXM
H200 = GPUConfig(
    "H200",
    peak_flops=989e12,
    mem_bandwidth=4.8e12,
    memory_bytes=141e9,
    pcie_bandwidth=50e9,
    nvlink_bandwidth=360e9,
)
GPUS = {g.name: g for g in (A100_40GB, A100_80GB, H100, H200)}


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    time_s: float  # max(compute_s, memory_s) + comm_s + overhead
    comm_s: float = 0.0  # tensor parallelism's all-reduces (0 on one GPU)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class CostModel:
    """Step time and KV budget of ``model`` on ``gpu`` (see the module docstring)."""

    def __init__(
        self,
        model: ModelConfig = OPT_13B,
        gpu: GPUConfig = A100_40GB,
        gpu_memory_utilization: float = 0.9,
        activation_reserve_bytes: float = 1 * GiB,
        flops_efficiency: float = 0.5,
        bandwidth_efficiency: float = 0.8,
        step_overhead_s: float = 0.003,
        tensor_parallel_size: int = 1,
        allreduce_latency_s: float = 10e-6,
    ) -> None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if not 0 < flops_efficiency <= 1:
            raise ValueError(f"flops_efficiency must be in (0, 1], got {flops_efficiency!r}")
        if not 0 < bandwidth_efficiency <= 1:
            raise ValueError(f"bandwidth_efficiency must be in (0, 1], got {bandwidth_efficiency!r}")
        if step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s!r}")
        if activation_reserve_bytes < 0:
            raise ValueError(f"activation_reserve_bytes must be >= 0, got {activation_reserve_bytes!r}")
        tp = tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
        if model.num_heads % tp or model.num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide {model.name}'s {model.num_heads} heads "
                f"/ {model.num_kv_heads} KV heads"
            )
        if allreduce_latency_s < 0:
            raise ValueError(f"allreduce_latency_s must be >= 0, got {allreduce_latency_s!r}")
        self.tensor_parallel_size = tp
        self.allreduce_latency_s = allreduce_latency_s
        self.model = model
        self.gpu = gpu
        self.gpu_memory_utilization = gpu_memory_utilization
        self.activation_reserve_bytes = activation_reserve_bytes
        self.flops_efficiency = flops_efficiency
        self.bandwidth_efficiency = bandwidth_efficiency
        self.step_overhead_s = step_overhead_s
        # Per-unit constants, per GPU, precomputed: step_time runs once per simulated step.
        m = model
        self._flops_per_token = 2.0 * m.layer_params / tp
        self._flops_per_seq = 2.0 * m.hidden_size * m.vocab_size / tp  # LM head on one position
        self._flops_per_attn = 4.0 * m.num_layers * m.num_heads * m.head_dim / tp
        self._kv_bytes = float(m.kv_bytes_per_token) / tp  # this GPU's heads of a token
        self._weight_bytes = m.weight_bytes / tp
        # ring all-reduce of [T, hidden]: 2 (N-1)/N of the bytes cross each link, 2 per layer
        self._comm_per_token = (
            2 * m.num_layers * 2 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes / gpu.nvlink_bandwidth
        )
        self._comm_per_step = 2 * m.num_layers * allreduce_latency_s if tp > 1 else 0.0
        self._eff_flops = gpu.peak_flops * flops_efficiency
        self._eff_bw = gpu.mem_bandwidth * bandwidth_efficiency

    def __repr__(self) -> str:
        return (
            f"CostModel({self.model.name} on {self.gpu.name}, util={self.gpu_memory_utilization}, "
            f"mfu={self.flops_efficiency}, mbu={self.bandwidth_efficiency}, "
            f"overhead={self.step_overhead_s * 1e3:g} ms"
            + (f", tp={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else "")
            + ")"
        )

    # -- memory -------------------------------------------------------------------
    def kv_cache_bytes(self) -> float:
        """GPU memory left for the KV cache: ``memory * util - weights - activations``, on all
        ``tensor_parallel_size`` GPUs together (each holds 1/N of the weights)."""
        usable = self.gpu.memory_bytes * self.gpu_memory_utilization
        left = usable - self._weight_bytes - self.activation_reserve_bytes
        if left <= 0:
            per = f" (1/{self.tensor_parallel_size} per GPU)" if self.tensor_parallel_size > 1 else ""
            raise ValueError(
                f"{self.model.name} weights ({self.model.weight_bytes / GiB:.1f} GiB{per}) + activation "
                f"reserve ({self.activation_reserve_bytes / GiB:.1f} GiB) do not fit the "
                f"{usable / GiB:.1f} GiB usable on {self.gpu.name}"
            )
        return left * self.tensor_parallel_size

    def num_kv_tokens(self) -> int:
        """Token slots the KV budget holds."""
        return int(self.kv_cache_bytes() // self.model.kv_bytes_per_token)

    def num_gpu_blocks(self, block_size: int) -> int:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        return self.num_kv_tokens() // block_size

    # -- time ---------------------------------------------------------------------
    def breakdown(self, batch: Iterable[tuple[int, int]]) -> StepCost:
        """FLOPs, bytes (per GPU) and time of one step; ``batch`` = ``(num_new, num_computed)`` pairs."""
        return StepCost(*self.step_costs(batch))

    def step_time(self, batch: Iterable[tuple[int, int]]) -> float:
        """Seconds one engine step over ``batch`` takes."""
        return self.step_costs(batch)[4]  # NOTE: the simulator's once-per-step call: no StepCost

    def step_costs(self, batch: Iterable[tuple[int, int]]) -> tuple[float, float, float, float, float, float]:
        """The model of one step: ``(flops, bytes, compute_s, memory_s, time_s, comm_s)``, the
        fields of ``StepCost`` (``breakdown``; ``step_time`` is ``time_s``)."""
        # NOTE: the sums over the batch run in C (zip, sum, map): the simulator calls this once
        # per simulated step, for batches of hundreds of sequences. Integer sums: exact.
        pairs = batch if isinstance(batch, list) else list(batch)
        qs, cs = tuple(zip(*pairs)) or ((), ())  # new tokens q, context c, of each sequence
        if qs and (min(qs) < 0 or min(cs) < 0):
            q, c = next((q, c) for q, c in pairs if q < 0 or c < 0)
            raise ValueError(f"token counts must be >= 0, got (num_new={q}, num_computed={c})")
        if 0 in qs:  # a sequence with no new token costs nothing
            qs, cs = tuple(zip(*[(q, c) for q, c in pairs if q])) or ((), ())
        num_tokens, num_seqs, ctx = sum(qs), len(qs), sum(cs)
        # query j (0-based) of a chunk sees c + j + 1 keys (causal): q * c + q (q + 1) / 2 in all
        attn = sum(map(mul, qs, cs)) + (sum(map(mul, qs, qs)) + num_tokens) // 2
        flops = (
            self._flops_per_token * num_tokens + self._flops_per_seq * num_seqs + self._flops_per_attn * attn
        )
        nbytes = self._weight_bytes + self._kv_bytes * (ctx + num_tokens)
        comm_s = self._comm_per_step + self._comm_per_token * num_tokens
        if num_tokens == 0:  # an empty step costs only the overhead
            flops = nbytes = comm_s = 0.0
        compute_s = flops / self._eff_flops
        memory_s = nbytes / self._eff_bw
        time_s = max(compute_s, memory_s) + comm_s + self.step_overhead_s
        return flops, nbytes, compute_s, memory_s, time_s, comm_s

    def swap_time(self, num_tokens: int) -> float:
        """Seconds to copy the K/V of ``num_tokens`` token slots over PCIe (one direction).

        NOTE: added to the step time, as vLLM v0 waits for the swap copies before the model
        runs; overlap with compute is not modelled.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
        # NOTE: with tensor parallelism each GPU copies its own heads over its own PCIe link
        return num_tokens * self._kv_bytes / self.gpu.pcie_bandwidth

    def decode_ridge_batch(self, context_len: int = 0) -> float:
        """Decode batch size at which compute time equals memory time (the roofline ridge),
        every sequence with ``context_len`` tokens of context."""
        per_seq_flops = self._flops_per_token + self._flops_per_seq + self._flops_per_attn * (context_len + 1)
        per_seq_bytes = self._kv_bytes * (context_len + 1)
        # b * f / F = (W + b * k) / B  ->  b = W / B / (f / F - k / B)
        denom = per_seq_flops / self._eff_flops - per_seq_bytes / self._eff_bw
        if denom <= 0:
            return float("inf")  # attention reads grow as fast as compute: never compute-bound
        return self._weight_bytes / self._eff_bw / denom

    def check_invariants(self) -> None:
        base = self.step_time([(1, 100)])
        assert base >= self.step_overhead_s, "a step is cheaper than the fixed overhead"
        assert self.step_time([(1, 100), (1, 100)]) >= base, "a bigger batch got cheaper"
        assert self.step_time([(1, 1000)]) >= base, "a longer context got cheaper"
        assert self.breakdown([(1, 100)]).bound == "memory", "single-sequence decode not memory-bound"
        assert self.breakdown([(self.model.max_model_len, 0)]).bound == "compute", (
            "a max-length prefill is not compute-bound"
        )


def batch_from_lengths(num_new: Sequence[int], num_computed: Sequence[int]) -> list[tuple[int, int]]:
    """Zip two lists into the ``(num_new, num_computed)`` pairs ``step_time`` takes."""
    if len(num_new) != len(num_computed):
        raise ValueError(f"num_new ({len(num_new)}) and num_computed ({len(num_computed)}) differ in length")
    return list(zip(num_new, num_computed))


def paper_tp_settings(**kwargs) -> dict[str, CostModel]:
    """The paper's multi-GPU settings (§6, Table 1): OPT-66B on 4 A100-40GB and OPT-175B on 8
    A100-80GB, tensor-parallel across the GPUs of one node; ``kwargs`` go to ``CostModel``."""
    return {
        "OPT-66B, 4 x A100": CostModel(OPT_66B, A100_40GB, tensor_parallel_size=4, **kwargs),
        "OPT-175B, 8 x A100-80GB": CostModel(OPT_175B, A100_80GB, tensor_parallel_size=8, **kwargs),
    }
