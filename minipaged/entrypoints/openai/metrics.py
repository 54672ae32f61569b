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
=========================================  ==============================================

Inputs: the loop's step events (``StepRecord`` dicts) and request events. Output:
``render()`` -> bytes. Failure mode: none; a metric never blocks serving.
Prefix-cache queries and hits are counted at a sequence's first admission (its prompt);
vLLM counts re-admissions after a preemption too.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, "0")

        def make(cls, name, doc, **kw):
            return cls(name, doc, labelnames=labels, registry=self.registry, **kw).labels(*values)

        self.running = make(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = make(
            Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_queries = make(
            Counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = make(
            Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=labels + ["finished_reason"],
            registry=self.registry,
        )
        self._values = values
        self.ttft = make(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.itl = make(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
        )
        self.e2e = make(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=E2E_BUCKETS,
        )
        self.steps = make(Counter, "minipaged:engine_steps", "Engine steps taken.")
        self.errors = make(
            Counter, "minipaged:engine_errors", "Engine steps that raised an exception (should stay 0)."
        )
        self._prompt_len: dict[str, int] = {}  # sequence id -> prompt length (until admitted)
        self._held: set[str] = set()  # sequences holding blocks after the previous step

    # -- events from the loop ------------------------------------------------------------
    def on_step(self, event: dict, num_blocks: int, num_pending: int) -> None:
        self.steps.inc()
        self.running.set(len(event["block_tables"]))
        self.waiting.set(len(event["waiting_ids"]) + num_pending)
        self.kv_usage.set(1.0 - event["num_free_blocks"] / num_blocks if num_blocks else 0.0)
        self.preemptions.inc(len(event["preempted_ids"]) + len(event["swapped_out_ids"]))
        for rid, info in event["requests"].items():
            if info.get("finish_step") is None:
                self._prompt_len[rid] = info["prompt_len"]
        for rid, n in event["scheduled"].items():
            if rid in self._held or rid not in self._prompt_len:
                continue
            prompt_len = self._prompt_len.pop(rid)  # first admission
            computed_before = event["num_tokens"].get(rid, n) - n
            self.prefix_queries.inc(prompt_len)
            self.prefix_hits.inc(max(0, computed_before))
        self._held = set(event["block_tables"])
        for rid in event["finished_ids"]:
            self._prompt_len.pop(rid, None)

    def on_idle(self, num_free_blocks: int, num_blocks: int) -> None:
        """The engine holds no request (after aborts no step reports it)."""
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(1.0 - num_free_blocks / num_blocks if num_blocks else 0.0)
        self._held = set()

    def on_first_token(self, seconds: float, prompt_len: int, num_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_len)
        self.generation_tokens.inc(num_tokens)

    def on_next_token(self, seconds: float, num_tokens: int) -> None:
        self.itl.observe(seconds)
        self.generation_tokens.inc(num_tokens)

    def on_request_finished(self, out, seconds: float) -> None:
        reasons = {c.finish_reason for c in out.outputs}
        reason = "length" if reasons == {"length"} else sorted(reasons)[0] if reasons else "stop"
        self._success.labels(*self._values, reason).inc()
        self.e2e.observe(seconds)

    def on_request_aborted(self, rid: str) -> None:
        self._success.labels(*self._values, "abort").inc()

    def on_engine_error(self) -> None:
        self.errors.inc()

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
