"""``/metrics``: the server's state in Prometheus text format, under vLLM v1's names.

Mirrors vLLM ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``): the same metric
names, label names (``model_name``, ``engine``) and histogram buckets, for the metrics
minipaged has. Counters get Prometheus' ``_total`` suffix, as in vLLM.

=========================================  ==============================================
``vllm:num_requests_running``              sequences holding KV blocks after the last step
``vllm:num_requests_waiting``              sequences waiting (scheduler + not yet added)
``vllm:kv_cache_usage_perc``               1 - free blocks / all blocks (0..1)
``vllm:num_preemptions_total``             preemptions (recompute or swap-out)
``vllm:prefix_cache_queries_total``        prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``           of those, found cached
``vllm:prompt_tokens_total``               prompt tokens of requests that got a token
``vllm:generation_tokens_total``           tokens generated
``vllm:request_success_total``             finished requests, by ``finished_reason``
``vllm:time_to_first_token_seconds``       histogram, arrival at the server -> first token
``vllm:inter_token_latency_seconds``       histogram, between a request's token batches
``vllm:e2e_request_latency_seconds``       histogram, arrival -> finished
``minipaged:engine_steps_total``           engine steps (no vLLM counterpart)
``minipaged:engine_errors_total``          steps that raised (should stay 0)
``minipaged:unread_streams_dropped_total`` streams whose output waited unread too long or
                                           too big: dropped, connection closed
=========================================  ==============================================

Inputs: ``AsyncLLM``'s step events (``StepRecord`` dicts) and request events. Output:
``render()`` -> bytes. Failure mode: none; a metric never blocks serving.

NOTE: the values are plain Python numbers, counted in the event-loop thread (the only one
that calls these methods or ``render``), and handed to ``prometheus_client`` as metric
families only when ``/metrics`` is read (``collect``): a ``prometheus_client`` histogram
takes a lock and walks its buckets on every ``observe``, once per streamed token, which
was a tenth of a saturated server's event-loop time. The text is the same.
Prefix-cache queries and hits are counted at a sequence's first admission (its prompt);
vLLM counts re-admissions after a preemption too.
"""

from __future__ import annotations

from bisect import bisect_left

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# NOTE: as vLLM does: no *_created samples beside every counter and histogram.
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


class _Histogram:
    """Bucket counts (``counts[i]``: observations <= ``buckets[i]``, the last one +Inf, not
    cumulative), their sum and count."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: list[float]) -> None:
        self.buckets = list(buckets)
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]):
        fam = HistogramMetricFamily(name, doc, labels=labels)
        cum, rows = 0, []
        for le, c in zip(self.buckets + [float("inf")], self.counts):
            cum += c
            rows.append((floatToGoString(le), cum))
        fam.add_metric(values, rows, self.sum)
        return fam


# (attribute, kind, name, help): the order /metrics lists them in
_METRICS = [
    ("running", "gauge", "vllm:num_requests_running", "Number of requests in model execution batches."),
    ("waiting", "gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_usage", "gauge", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("preemptions", "counter", "vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    (
        "prefix_queries",
        "counter",
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    (
        "prefix_hits",
        "counter",
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    ("prompt_tokens", "counter", "vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "counter", "vllm:generation_tokens", "Number of generation tokens processed."),
    ("success", "success", "vllm:request_success", "Count of successfully processed requests."),
    (
        "ttft",
        "histogram",
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
    ),
    ("itl", "histogram", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("e2e", "histogram", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("steps", "counter", "minipaged:engine_steps", "Engine steps taken."),
    (
        "errors",
        "counter",
        "minipaged:engine_errors",
        "Engine steps that raised an exception (should stay 0).",
    ),
    (
        "unread_dropped",
        "counter",
        "minipaged:unread_streams_dropped",
        "Streams whose output waited unread too long or too big, dropped with their connection.",
    ),
]


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self._labels = ["model_name", "engine"]
        self._values = [model_name, "0"]
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.preemptions = self.prefix_queries = self.prefix_hits = 0
        self.prompt_tokens = self.generation_tokens = self.steps = self.errors = 0
        self.unread_dropped = 0
        self.success: dict[str, int] = {}  # finished_reason -> requests, in first-seen order
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self._prompt_len: dict[str, int] = {}  # sequence id -> prompt length (until admitted)
        self._held: set[str] = set()  # sequences holding blocks after the previous step
        self.registry = CollectorRegistry()
        self.registry.register(self)

    # -- events from the loop ------------------------------------------------------------
    def on_step(self, event: dict, num_blocks: int, num_pending: int) -> None:
        self.steps += 1
        self.running = len(event["block_tables"])
        self.waiting = len(event["waiting_ids"]) + num_pending
        self.kv_usage = 1.0 - event["num_free_blocks"] / num_blocks if num_blocks else 0.0
        self.preemptions += len(event["preempted_ids"]) + len(event["swapped_out_ids"])
        for rid, info in event["requests"].items():
            if info.get("finish_step") is None:
                self._prompt_len[rid] = info["prompt_len"]
        if self._prompt_len:
            for rid, n in event["scheduled"].items():
                if rid in self._held or rid not in self._prompt_len:
                    continue
                prompt_len = self._prompt_len.pop(rid)  # first admission
                computed_before = event["num_tokens"].get(rid, n) - n
                self.prefix_queries += prompt_len
                self.prefix_hits += max(0, computed_before)
        self._held = set(event["block_tables"])
        for rid in event["finished_ids"]:
            self._prompt_len.pop(rid, None)

    def on_idle(self, num_free_blocks: int, num_blocks: int) -> None:
        """The engine holds no request (after aborts no step reports it)."""
        self.running = self.waiting = 0
        self.kv_usage = 1.0 - num_free_blocks / num_blocks if num_blocks else 0.0
        self._held = set()

    def on_first_token(self, seconds: float, prompt_len: int, num_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens += prompt_len
        self.generation_tokens += num_tokens

    def on_next_token(self, seconds: float, num_tokens: int) -> None:
        self.itl.observe(seconds)
        self.generation_tokens += num_tokens

    def on_request_finished(self, out, seconds: float) -> None:
        reasons = {c.finish_reason for c in out.outputs}
        reason = "length" if reasons == {"length"} else sorted(reasons)[0] if reasons else "stop"
        self.success[reason] = self.success.get(reason, 0) + 1
        self.e2e.observe(seconds)

    def on_request_aborted(self, rid: str) -> None:
        self.success["abort"] = self.success.get("abort", 0) + 1

    def on_engine_error(self) -> None:
        self.errors += 1

    def on_unread_dropped(self) -> None:
        self.unread_dropped += 1

    # -- /metrics ----------------------------------------------------------------------
    def collect(self):
        """The metric families, as ``prometheus_client`` renders them (a collector)."""
        labels, values = self._labels, self._values
        for attr, kind, name, doc in _METRICS:
            v = getattr(self, attr)
            if kind == "histogram":
                yield v.family(name, doc, labels, values)
                continue
            if kind == "success":
                fam = CounterMetricFamily(name, doc, labels=labels + ["finished_reason"])
                for reason, count in v.items():
                    fam.add_metric(values + [reason], count)
                yield fam
                continue
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)
            fam.add_metric(values, float(v))
            yield fam

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
