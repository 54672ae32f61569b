"""SCHEDULING: which requests run this step, and how many tokens each.

``scheduler.py`` is vLLM v1's loop (``Scheduler``); ``paper.py`` the paper's (vLLM v0's:
sequence groups, swap, copy-on-write fork), its own loop beside it, with its own output
(``paper_output.py``); ``utils.py`` what all of them share; ``static.py`` and ``orca.py``
the baselines the paper measures against.
"""

from minipaged.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minipaged.core.sched.paper import DEFAULT_WATERMARK, PaperScheduler, SequenceGroup
from minipaged.core.sched.paper_output import PaperSchedulerOutput
from minipaged.core.sched.request import Request, RequestStatus, get_max_num_kv_tokens
from minipaged.core.sched.scheduler import Scheduler
from minipaged.core.sched.static import StaticBatchScheduler, StaticPagedScheduler
from minipaged.core.sched.utils import check_stop

__all__ = [
    "DEFAULT_WATERMARK",
    "CachedRequestData",
    "NewRequestData",
    "PaperScheduler",
    "PaperSchedulerOutput",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SequenceGroup",
    "StaticBatchScheduler",
    "StaticPagedScheduler",
    "check_stop",
    "get_max_num_kv_tokens",
]
