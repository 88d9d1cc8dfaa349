"""`python -m benchmarks.sampler --breakdown`: where the SamplingPlan's device time goes.

On the inputs of the `sampler` case (the same plan, logits and SamplingState), one JSON line
per measurement (CUDA events on a GPU, wall time on CPU; milliseconds per call):

- `case: breakdown`, `piece`: each part of `SamplingPlan.sample` alone - `options_greedy`
  (the sampling pass with the options and the argmax: an all-greedy step without
  logprobs), `options_greedy_stats` (the same pass also leaving the raw logits' statistics:
  the plan's pass when logprobs are on), `options_write` (the pass writing the processed
  logits: steps that sample), `stats_only` (the statistics alone), `select` (the top-k
  selection from the statistics: atom/kernels/logprob_topk.py), `rounds_kernel` /
  `rounds_merge` (the k-rounds candidate, benchmarks/candidates/logprob_rounds.py),
  `count_greater`, `chosen_gather`,
  `state_update` (`count_sampled`).
- `case: candidates`, `method`: the top-k alternatives side by side, each checked against a
  stable descending sort of the fp32 rows: `values_equal`, `ids_exact` (ties to the lower
  index), `ids_valid` (each id's logit is its value, ids distinct per row), `lse_max_diff`.
  Methods: `select` (statistics pass + selection: the engine's), `rounds` (the candidate),
  `torch` (logsumexp + topk of the fp32 rows), `torch_topk_only`.
- `case: plan_sample`, `method` select: all of `plan.sample` (the engine's method):
  `ms` (events around back-to-back calls), `host_enqueue_ms` (the host's time per call,
  not waiting for the device), and on CUDA from torch.profiler `kernels_per_call`,
  `device_us_per_call` and the `top_kernels` [name, per call, us per call].
- `case: breakdown_summary`: the fastest exact / valid method, plan.sample's figures.
- last, on CUDA: `case: plan_sample_graph` / `candidates_graph` / `breakdown_graph`:
  `graph_ms`, plan.sample, each top-k method and each piece replayed from a CUDA graph
  (device time without the host's launches), then `case: graph_summary` with all of them.
  If `ms` is well above `graph_ms` / `device_us_per_call`, the host's launches dominate.
"""

from __future__ import annotations

import time

import torch

from atom.kernels import logprob_topk, sampling, use_triton
from benchmarks.candidates import logprob_rounds


def _check(got, want, logits, rows) -> dict:
    lse, values, ids = got
    want_lse, want_values, want_ids = want
    raw = logits[rows.long()].float()
    valid = torch.equal(raw.gather(1, ids), values) and all(
        len(set(r)) == len(r) for r in ids.tolist()
    )
    return dict(
        values_equal=torch.equal(values, want_values),
        ids_exact=torch.equal(ids, want_ids),
        ids_valid=valid,
        lse_max_diff=float((lse - want_lse).abs().max()) if len(lse) else 0.0,
    )


def graph_ms(fn, timed, device, iters: int):
    """Milliseconds per replay of a CUDA graph of one call of `fn`: its device time without
    the host's launches (a string saying why when it cannot be captured; None on CPU)."""
    if device.type != "cuda":
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return round(timed(graph.replay, device, iters), 4)
    except Exception as error:  # noqa: BLE001 - reported, the run goes on
        torch.cuda.synchronize()
        return f"not capturable: {type(error).__name__}: {str(error)[:160]}"


def device_profile(fn, calls: int = 10, top: int = 8) -> dict:
    """Kernels per call, their device microseconds per call (torch.profiler), the top ones."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [
        (event.name, 1, event.time_range.elapsed_us())
        for event in prof.events()
        if event.device_type == DeviceType.CUDA
    ]
    if not events:  # a profiler that lists device activity only in its averages
        events = [
            (entry.key, entry.count, entry.self_device_time_total)
            for entry in prof.key_averages()
            if entry.device_type == DeviceType.CUDA or entry.self_device_time_total > 0
        ]
    by_name: dict[str, list[float]] = {}
    for name, count, us in events:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += count
        entry[1] += us
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return dict(
        kernels_per_call=round(sum(c for c, _ in by_name.values()) / calls, 1),
        device_us_per_call=round(sum(us for _, us in by_name.values()) / calls, 1),
        top_kernels=[[n[:80], round(c / calls, 1), round(us / calls, 1)] for n, (c, us) in ranked],
    )


def run_breakdown(plan, sampler, logits, params, timed, emit, device, iters: int) -> dict:
    """The JSON lines above for `plan` (a reused decode plan, rows already built)."""

    def ms(fn) -> float:
        return round(timed(fn, device, iters), 4)

    state = plan.state
    tables = state.tables()
    rows = plan.logprob_index
    if rows is None:
        rows = torch.arange(plan.num_rows, device=logits.device)
    k = max(plan.logprob_k)
    tokens, _ = plan.sample(sampler, logits, params)
    kernels = use_triton(logits)  # the Triton pieces (CUDA, or TRITON_INTERPRET=1)
    pieces, piece_fns = {}, {}

    def piece(name, fn):
        pieces[name], piece_fns[name] = ms(fn), fn
        emit(dict(case="breakdown", piece=name, ms=pieces[name]))

    tables = (plan.state_rows, *tables)
    piece("options_greedy", lambda: sampling.greedy_with_sampling_options(logits, *tables))
    piece("options_greedy_stats", lambda: sampling.greedy_with_sampling_options(logits, *tables, stats=True))  # fmt: skip
    piece("options_write", lambda: sampling.apply_sampling_options(logits, *tables))
    if kernels:
        piece("stats_only", lambda: sampling.logit_stats(logits, rows))
        stats = sampling.greedy_with_sampling_options(logits, *tables, stats=True)[1]
        piece("select", lambda: logprob_topk.select_topk(logits, rows, stats, rows, k))
        blocks = logprob_rounds.block_candidates(logits, rows, k)
        piece("rounds_kernel", lambda: logprob_rounds.block_candidates(logits, rows, k))
        piece("rounds_merge", lambda: logprob_rounds.merge_block_candidates(*blocks, k))
    chosen = logits[rows, tokens].float()
    piece("count_greater", lambda: sampling.count_greater(logits, rows, chosen))
    piece("chosen_gather", lambda: logits[rows, tokens].float())
    piece("state_update", lambda: state.count_sampled(plan.state_rows, tokens))

    want = logprob_topk.topk_lower_index_reference(logits, rows, k)
    methods = {"torch": lambda: sampling.logprob_candidates_reference(logits, rows, k)}
    methods["torch_topk_only"] = lambda: logits[rows].float().topk(k, dim=1)
    if kernels:
        methods["select"] = lambda: sampling.logprob_candidates(logits, rows, k)
        methods["rounds"] = lambda: logprob_rounds.rounds_candidates(logits, rows, k)
    results = {}
    for name, fn in methods.items():
        record = dict(case="candidates", method=name, k=k, ms=ms(fn))
        got = fn()
        if name == "torch_topk_only":
            got = (want[0], got.values, got.indices)
        record.update(_check(got, want, logits, rows))
        results[name] = record
        emit(record)

    def sample():
        return plan.sample(sampler, logits, params)

    def host_enqueue_ms() -> float:  # the host's time per call, not waiting for the device
        calls = min(iters, 10)  # ~30 launches a call: stay below the launch queue's depth
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            sample()
        elapsed = time.perf_counter() - begin
        if device.type == "cuda":
            torch.cuda.synchronize()
        return round(elapsed * 1e3 / calls, 4)

    plan_ms, plan_records = {}, {}
    method = "select"  # the engine's (sampling.logprob_candidates)
    record = dict(case="plan_sample", method=method, ms=ms(sample))
    record["host_enqueue_ms"] = host_enqueue_ms()
    if device.type == "cuda":
        record.update(device_profile(sample))
    plan_ms[method], plan_records[method] = record["ms"], record
    emit(record)

    def fastest(flag):
        ok = [r for r in results.values() if r[flag] and r["method"] != "torch_topk_only"]
        return min(ok, key=lambda r: r["ms"])["method"] if ok else None

    summary = dict(
        case="breakdown_summary",
        pieces_sum_ms=round(sum(v for n, v in pieces.items() if n not in _NOT_IN_PLAN), 4),
        plan_sample_ms=plan_ms,
        plan_sample_device_us={m: r.get("device_us_per_call") for m, r in plan_records.items()},
        plan_sample_host_enqueue_ms={m: r["host_enqueue_ms"] for m, r in plan_records.items()},
        fastest_exact_method=fastest("ids_exact"),
        fastest_valid_method=fastest("ids_valid"),
    )
    emit(summary)
    if device.type == "cuda":  # last: a failed capture is the riskiest step
        summary["graph"] = graph_section(plan, sample, piece_fns, methods, timed, emit, device, iters)  # fmt: skip
    return summary


def graph_section(plan, sample, piece_fns, methods, timed, emit, device, iters) -> dict:
    """Device time without the host's launches: plan.sample, each top-k method and each
    piece replayed from a CUDA graph; then `case: graph_summary`."""
    figures: dict[str, dict] = {"plan_sample": {}, "candidates": {}, "pieces": {}}
    try:
        figures["plan_sample"]["select"] = graph_ms(sample, timed, device, iters)
        emit(dict(case="plan_sample_graph", method="select", graph_ms=figures["plan_sample"]["select"]))  # fmt: skip
        for name, fn in methods.items():
            figures["candidates"][name] = graph_ms(fn, timed, device, iters)
            emit(dict(case="candidates_graph", method=name, graph_ms=figures["candidates"][name]))  # fmt: skip
        for name, fn in piece_fns.items():
            figures["pieces"][name] = graph_ms(fn, timed, device, iters)
            emit(dict(case="breakdown_graph", piece=name, graph_ms=figures["pieces"][name]))
    except Exception as error:  # noqa: BLE001 - a broken capture: the figures so far stand
        emit(dict(case="graph_error", error=f"{type(error).__name__}: {str(error)[:200]}"))
    emit(dict(case="graph_summary", **figures))
    return figures


# Pieces measured beside, not part of, the greedy plan.sample with logprobs.
_NOT_IN_PLAN = {"options_greedy", "options_write", "stats_only", "rounds_kernel", "rounds_merge"}
