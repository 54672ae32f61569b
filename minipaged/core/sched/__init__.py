"""SCHEDULING: which requests run this step, and how many tokens each.

``scheduler.py`` is vLLM v1's rule (``Scheduler``); the paper's mechanisms are layers on
it (``admission.py``, ``swap.py``, ``groups.py``); ``static.py`` and ``orca.py`` are the
baselines the paper measures against. ``EngineScheduler`` stacks the layers: it is what
``LLMEngine`` runs.
"""

from minipaged.core.sched.admission import DEFAULT_WATERMARK, WatermarkAdmission
from minipaged.core.sched.groups import SequenceGroup, SequenceGroups
from minipaged.core.sched.output import SchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus, get_max_num_kv_tokens
from minipaged.core.sched.scheduler import Scheduler
from minipaged.core.sched.static import StaticBatchScheduler, StaticPagedScheduler
from minipaged.core.sched.swap import SwapPreemption


class EngineScheduler(SequenceGroups, SwapPreemption, WatermarkAdmission, Scheduler):
    """vLLM v1's ``Scheduler`` with the paper's layers, each inert unless asked for:
    ``watermark`` (default ``DEFAULT_WATERMARK``; None = v1's first-chunk admission),
    ``preemption_mode="swap"`` + ``num_cpu_blocks``, and ``parallel_sampling="fork"``
    (default; ``add_request_group`` forks a sequence group) or ``"prefix"`` (the base's vLLM
    v1 fan-out into independent requests)."""


__all__ = [
    "DEFAULT_WATERMARK",
    "EngineScheduler",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SequenceGroup",
    "SequenceGroups",
    "StaticBatchScheduler",
    "StaticPagedScheduler",
    "SwapPreemption",
    "WatermarkAdmission",
    "get_max_num_kv_tokens",
]
