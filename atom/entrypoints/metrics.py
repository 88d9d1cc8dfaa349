"""GET /metrics through prometheus_client (text exposition format 0.0.4).

Two sources, one registry per server:
- `EngineCollector` reads the engine's cumulative counters and gauges at scrape time
  (requests, tokens, running / waiting, KV-cache usage, step time, host-to-device copies,
  prefix-cache queries and hits). They are single Python ints or floats written by the
  engine thread, so a scrape sees every number whole, though not all from one step.
- `RequestMetrics` holds per-request histograms, observed on the event loop as outputs
  arrive: time to first token, inter-token latency, end-to-end latency, queue time, and
  prompt / generation tokens per request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class EngineCollector:
    """The engine's counters as metric families, read at each scrape."""

    def __init__(self, engine, model_name: str):
        self.engine = engine  # AsyncEngine
        self.model_name = model_name

    def collect(self):
        engine, name = self.engine, self.model_name
        llm = engine.engine
        stats, scheduler, bm = llm.stats, llm.scheduler, llm.block_manager
        h2d_copies, h2d_bytes = engine.h2d_totals()

        def one(family, kind, help, value):
            metric = kind(family, help, labels=["model_name"])
            metric.add_metric([name], value)
            return metric

        yield one("atom_requests", CounterMetricFamily, "Requests admitted by the engine.", stats.requests)  # fmt: skip
        finished = CounterMetricFamily(
            "atom_requests_finished",
            "Requests finished, by finish reason (abort: the client went away).",
            labels=["model_name", "finish_reason"],
        )
        for reason in FINISH_REASONS:
            finished.add_metric([name, reason], engine.finished_requests[reason])
        yield finished
        yield one("atom_prompt_tokens", CounterMetricFamily, "Prompt tokens computed (prefill).", stats.prompt_tokens)  # fmt: skip
        yield one("atom_generation_tokens", CounterMetricFamily, "Tokens generated.", stats.generated_tokens)  # fmt: skip
        yield one("atom_requests_running", GaugeMetricFamily, "Requests in the running batch.", len(scheduler.running))  # fmt: skip
        yield one("atom_requests_waiting", GaugeMetricFamily, "Requests waiting to be scheduled.", len(scheduler.waiting))  # fmt: skip
        yield one("atom_kv_cache_usage_ratio", GaugeMetricFamily, "Fraction of KV-cache blocks in use (0 to 1).", bm.usage)  # fmt: skip
        yield one("atom_kv_cache_blocks", GaugeMetricFamily, "KV-cache blocks in all.", bm.num_blocks)  # fmt: skip
        yield one(
            "atom_prefix_cache_queries",
            CounterMetricFamily,
            "Prompt tokens looked up in the prefix cache (full blocks).",
            bm.prefix_queried_blocks * bm.block_size,
        )
        yield one(
            "atom_prefix_cache_hits",
            CounterMetricFamily,
            "Prompt tokens served from the prefix cache.",
            bm.prefix_hit_blocks * bm.block_size,
        )
        steps = SummaryMetricFamily(
            "atom_step_seconds",
            "Wall time of engine steps that ran a batch.",
            labels=["model_name"],
        )
        steps.add_metric([name], count_value=engine.steps, sum_value=engine.step_seconds)
        yield steps
        yield one("atom_last_step_seconds", GaugeMetricFamily, "Wall time of the latest step.", engine.last_step_seconds)  # fmt: skip
        yield one(
            "atom_h2d_copies",
            CounterMetricFamily,
            "Host-to-device copies of step metadata (0 on CPU: host and device share memory).",
            h2d_copies,
        )
        yield one("atom_h2d_bytes", CounterMetricFamily, "Bytes of step metadata sent host-to-device.", h2d_bytes)  # fmt: skip
        yield one("atom_h2d_copies_last_step", GaugeMetricFamily, "Host-to-device copies of the latest step.", engine.last_step_h2d_copies)  # fmt: skip
        yield one("atom_h2d_bytes_last_step", GaugeMetricFamily, "Host-to-device bytes of the latest step.", engine.last_step_h2d_bytes)  # fmt: skip
        speculator = getattr(llm, "speculator", None)
        if speculator is not None:  # speculative decoding (atom/model_engine/speculative)
            yield from _spec_decode_metrics(name, speculator.stats)
        replicas = getattr(llm, "replicas", None)  # data parallelism (DataParallelEngine)
        if replicas is not None:
            yield from _replica_metrics(name, replicas)


def _spec_decode_metrics(name: str, spec):
    """Speculative-decoding counters (prometheus_client appends `_total`)."""

    def one(family, help, value):
        metric = CounterMetricFamily(family, help, labels=["model_name"])
        metric.add_metric([name], value)
        return metric

    yield one("atom_spec_decode_num_drafts", "Sequence-steps that verified speculative drafts.", spec.num_drafts)  # fmt: skip
    yield one("atom_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.proposed_tokens)  # fmt: skip
    yield one("atom_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", spec.accepted_tokens)  # fmt: skip
    per_position = CounterMetricFamily(
        "atom_spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens by position in the draft (0 = the first draft).",
        labels=["model_name", "position"],
    )
    for i, n in enumerate(spec.accepted_per_position):
        per_position.add_metric([name, str(i)], n)
    yield per_position


def _replica_metrics(name: str, replicas):
    """The counters of each data-parallel replica, labelled replica="<index>"."""

    def each(family, kind, help, value_of):
        metric = kind(family, help, labels=["model_name", "replica"])
        for i, engine in enumerate(replicas):
            metric.add_metric([name, str(i)], value_of(engine))
        return metric

    yield each("atom_replica_requests", CounterMetricFamily, "Requests routed to each data-parallel replica.", lambda e: e.stats.requests)  # fmt: skip
    yield each("atom_replica_generation_tokens", CounterMetricFamily, "Tokens generated by each data-parallel replica.", lambda e: e.stats.generated_tokens)  # fmt: skip
    yield each("atom_replica_requests_running", GaugeMetricFamily, "Requests in each replica's running batch.", lambda e: len(e.scheduler.running))  # fmt: skip
    yield each("atom_replica_requests_waiting", GaugeMetricFamily, "Requests waiting on each replica.", lambda e: len(e.scheduler.waiting))  # fmt: skip
    yield each("atom_replica_kv_cache_usage_ratio", GaugeMetricFamily, "Fraction of each replica's KV-cache blocks in use (0 to 1).", lambda e: e.block_manager.usage)  # fmt: skip


class RequestMetrics:
    """Per-request histograms; `RequestTimer` observes one request into them."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        def histogram(name, help, buckets):
            return Histogram(name, help, ["model_name"], registry=registry, buckets=buckets).labels(model_name)  # fmt: skip

        self.time_to_first_token = histogram(
            "atom_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            _LATENCY_BUCKETS,  # fmt: skip
        )
        self.inter_token_latency = histogram(
            "atom_inter_token_latency_seconds",
            "Time between a request's successive outputs.",
            _LATENCY_BUCKETS,  # fmt: skip
        )
        self.e2e_latency = histogram(
            "atom_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            _LATENCY_BUCKETS,  # fmt: skip
        )
        self.queue_time = histogram(
            "atom_request_queue_time_seconds",
            "Time a request waited before its first step.",
            _LATENCY_BUCKETS,  # fmt: skip
        )
        self.prompt_tokens = histogram(
            "atom_request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "atom_request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )


class MetricsRegistry:
    """The server's registry: engine collector plus request histograms."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(engine, model_name))
        self.requests = RequestMetrics(self.registry, model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
