"""GET /metrics: engine counters in Prometheus' text exposition format (version 0.0.4).

Values are read without a lock while the engine thread runs: each is a single Python
int or float, so a scrape sees every number whole, though not all from the same step.
"""

from __future__ import annotations

from atom.entrypoints.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(engine: AsyncEngine, model_name: str) -> str:
    llm = engine.engine
    stats = llm.stats
    scheduler = llm.scheduler
    h2d_copies, h2d_bytes = engine.h2d_totals()
    label = f'model_name="{_escape(model_name)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{{{label}{labels}}} {value}")

    def one(name: str, kind: str, help: str, value) -> None:
        metric(name, kind, help, [("", value)])

    one("atom_requests_total", "counter", "Requests admitted by the engine.", stats.requests)
    metric(
        "atom_requests_finished_total",
        "counter",
        "Requests finished, by finish reason (abort: the client went away).",
        [(f',finish_reason="{r}"', engine.finished_requests[r]) for r in FINISH_REASONS],
    )
    one(
        "atom_prompt_tokens_total",
        "counter",
        "Prompt tokens computed (prefill).",
        stats.prompt_tokens,
    )
    one("atom_generation_tokens_total", "counter", "Tokens generated.", stats.generated_tokens)
    one("atom_requests_running", "gauge", "Requests in the running batch.", len(scheduler.running))
    one(
        "atom_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled.",
        len(scheduler.waiting),
    )
    one(
        "atom_kv_cache_usage_ratio",
        "gauge",
        "Fraction of KV-cache blocks in use (0 to 1).",
        f"{llm.block_manager.usage:.6f}",
    )
    one("atom_kv_cache_blocks", "gauge", "KV-cache blocks in all.", llm.block_manager.num_blocks)
    metric(
        "atom_step_seconds",
        "summary",
        "Wall time of engine steps that ran a batch.",
        [],
    )
    lines.append(f"atom_step_seconds_sum{{{label}}} {engine.step_seconds:.6f}")
    lines.append(f"atom_step_seconds_count{{{label}}} {engine.steps}")
    one(
        "atom_last_step_seconds",
        "gauge",
        "Wall time of the latest step.",
        f"{engine.last_step_seconds:.6f}",
    )
    one(
        "atom_h2d_copies_total",
        "counter",
        "Host-to-device copies of step metadata (0 on CPU: host and device share memory).",
        h2d_copies,
    )
    one("atom_h2d_bytes_total", "counter", "Bytes of step metadata sent host-to-device.", h2d_bytes)
    one(
        "atom_h2d_copies_last_step",
        "gauge",
        "Host-to-device copies of the latest step.",
        engine.last_step_h2d_copies,
    )
    one(
        "atom_h2d_bytes_last_step",
        "gauge",
        "Host-to-device bytes of the latest step.",
        engine.last_step_h2d_bytes,
    )
    speculator = getattr(llm, "speculator", None)
    if speculator is not None:  # speculative decoding (atom/model_engine/speculative)
        spec = speculator.stats
        one(
            "atom_spec_decode_num_drafts_total",
            "counter",
            "Sequence-steps that verified speculative drafts.",
            spec.num_drafts,
        )
        one(
            "atom_spec_decode_num_draft_tokens_total",
            "counter",
            "Draft tokens proposed and verified.",
            spec.proposed_tokens,
        )
        one(
            "atom_spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens accepted by the target.",
            spec.accepted_tokens,
        )
        metric(
            "atom_spec_decode_num_accepted_tokens_per_pos_total",
            "counter",
            "Accepted draft tokens by position in the draft (0 = the first draft).",
            [(f',position="{i}"', n) for i, n in enumerate(spec.accepted_per_position)],
        )
    replicas = getattr(llm, "replicas", None)  # data parallelism (DataParallelEngine)
    if replicas is not None:
        _replica_metrics(metric, replicas)
    return "\n".join(lines) + "\n"


def _replica_metrics(metric, replicas) -> None:
    """The counters of each data-parallel replica, labelled replica="<index>"."""

    def each(name: str, kind: str, help: str, value_of) -> None:
        samples = [(f',replica="{i}"', value_of(e)) for i, e in enumerate(replicas)]
        metric(name, kind, help, samples)

    each(
        "atom_replica_requests_total",
        "counter",
        "Requests routed to each data-parallel replica.",
        lambda e: e.stats.requests,
    )
    each(
        "atom_replica_generation_tokens_total",
        "counter",
        "Tokens generated by each data-parallel replica.",
        lambda e: e.stats.generated_tokens,
    )
    each(
        "atom_replica_requests_running",
        "gauge",
        "Requests in each replica's running batch.",
        lambda e: len(e.scheduler.running),
    )
    each(
        "atom_replica_requests_waiting",
        "gauge",
        "Requests waiting on each replica.",
        lambda e: len(e.scheduler.waiting),
    )
    each(
        "atom_replica_kv_cache_usage_ratio",
        "gauge",
        "Fraction of each replica's KV-cache blocks in use (0 to 1).",
        lambda e: f"{e.block_manager.usage:.6f}",
    )
