"""minipaged.sim: paper-scale serving experiments on a laptop.

The real schedulers (``minipaged.core``) run against a roofline cost model of a GPU
instead of a model: arrivals (``arrivals``), request lengths (``workloads``), step times
and the KV budget (``cost_model``), the loop and its metrics (``simulator``), the
``minipaged simulate`` command (``cli``), and the memory-waste replay (``memory_waste``).
Pure Python: no torch.
"""

from minipaged.sim.arrivals import (
    TraceRequest,
    load_trace,
    make_requests,
    poisson_arrivals,
    poisson_workload,
    save_trace,
)
from minipaged.sim.cost_model import (
    A100_40GB,
    A100_80GB,
    GPUS,
    H100,
    H200,
    LLAMA_7B,
    MODELS,
    OPT_13B,
    CostModel,
    GPUConfig,
    ModelConfig,
    StepCost,
)
from minipaged.sim.simulator import (
    DEFAULT_LATENCY_FACTOR,
    POLICIES,
    POLICY_NAMES,
    PolicyComparison,
    RateSweep,
    RequestRecord,
    SimMetrics,
    SimResult,
    block_size_sweep,
    compare_policies,
    compute_metrics,
    offline_capacity,
    simulate,
    sustainable_rate,
    sweep_many,
    sweep_rates,
)
from minipaged.sim.workloads import WORKLOADS, sample_requests

__all__ = [
    "A100_40GB",
    "A100_80GB",
    "DEFAULT_LATENCY_FACTOR",
    "GPUS",
    "GPUConfig",
    "H100",
    "H200",
    "LLAMA_7B",
    "MODELS",
    "OPT_13B",
    "POLICIES",
    "POLICY_NAMES",
    "WORKLOADS",
    "CostModel",
    "ModelConfig",
    "PolicyComparison",
    "RateSweep",
    "RequestRecord",
    "SimMetrics",
    "SimResult",
    "StepCost",
    "TraceRequest",
    "block_size_sweep",
    "compare_policies",
    "compute_metrics",
    "load_trace",
    "make_requests",
    "offline_capacity",
    "poisson_arrivals",
    "poisson_workload",
    "sample_requests",
    "save_trace",
    "simulate",
    "sustainable_rate",
    "sweep_many",
    "sweep_rates",
]
