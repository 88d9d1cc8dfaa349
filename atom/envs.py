"""Environment variables atom reads, in one place, validated at start-up."""

from __future__ import annotations

import os

H2D_BACKENDS = ("direct", "packed")


def h2d_backend() -> str:
    """`ATOM_H2D_BACKEND`: how a runner slot publishes step metadata (default direct)."""
    value = os.environ.get("ATOM_H2D_BACKEND", "direct").strip().lower() or "direct"
    if value not in H2D_BACKENDS:
        raise ValueError(
            f"ATOM_H2D_BACKEND={value!r} is not a known backend; valid values: {', '.join(H2D_BACKENDS)}"
        )
    return value


def h2d_checked() -> bool:
    """`ATOM_H2D_CHECKED=1`: full per-buffer publication checks (tests and debugging)."""
    return os.environ.get("ATOM_H2D_CHECKED", "0") not in ("0", "", "false", "False")


def torch_profiler_dir() -> str | None:
    """`ATOM_TORCH_PROFILER_DIR`: where `LLM.start_profile`/`--profile` write traces."""
    return os.environ.get("ATOM_TORCH_PROFILER_DIR") or None


def api_key() -> str | None:
    """`ATOM_API_KEY`: the server's API key when --api-key is not given (none: open)."""
    return os.environ.get("ATOM_API_KEY") or None


def grammar_cache_bytes() -> int:
    """`ATOM_GRAMMAR_CACHE_MB`: the compiled-grammar cache's bound (default 512 MiB, as
    vLLM's; least recently used grammars are evicted past it)."""
    value = os.environ.get("ATOM_GRAMMAR_CACHE_MB", "512").strip() or "512"
    try:
        megabytes = float(value)
    except ValueError:
        raise ValueError(f"ATOM_GRAMMAR_CACHE_MB={value!r} is not a number of MiB") from None
    if megabytes <= 0:
        raise ValueError(f"ATOM_GRAMMAR_CACHE_MB={value!r} must be positive")
    return int(megabytes * (1 << 20))


def logprob_candidates() -> str:
    """`ATOM_LOGPROB_CANDIDATES`: how logprob candidates are found on the device (default
    select; atom/kernels/sampling.py reads it once, at import)."""
    return os.environ.get("ATOM_LOGPROB_CANDIDATES", "select")


def gdn_chunked_min_tokens() -> int:
    """`ATOM_GDN_CHUNKED_MIN_TOKENS`: the longest new run from which a GDN prefill takes the
    chunked kernels (default 8192; a huge value: never; atom/kernels/gdn_chunk.py reads it
    once, at import)."""
    return int(os.environ.get("ATOM_GDN_CHUNKED_MIN_TOKENS", "8192"))


def cpu_threads() -> int | None:
    """`ATOM_CPU_THREADS`, else `OMP_NUM_THREADS`: the torch thread count of a CPU engine
    (unset: atom/model_engine/cpu_threads.py picks the cores free at start)."""
    name = "ATOM_CPU_THREADS" if os.environ.get("ATOM_CPU_THREADS") else "OMP_NUM_THREADS"
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        threads = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a thread count") from None
    return max(1, threads)
