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


def flag(name: str, default: bool) -> bool:
    """A 0/1 knob (``ATOM_QUANT_KERNELS``, ``ATOM_QUANT_GEMV_TUNE``): unset the default,
    ``0``/``false``/``off`` off, anything else on."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "off")


def interpret_cuda_path() -> bool:
    """`ATOM_INTERPRET_CUDA_PATH=1` (with TRITON_INTERPRET=1): a CPU model takes its CUDA
    path's fused Triton kernels, interpreted (tests, benchmarks/deepseek_v4_kernel_map.py)."""
    return os.environ.get("ATOM_INTERPRET_CUDA_PATH") == "1"


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


def gdn_chunked_min_tokens() -> int:
    """`ATOM_GDN_CHUNKED_MIN_TOKENS`: the longest new run from which a GDN prefill takes the
    chunked kernels (default 8192; a huge value: never): `Fusions.gdn_chunked_min_tokens`."""
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


CPU_LINEAR_MODES = ("packed", "dense")
CPU_MALLOC_MODES = ("heap", "system")


def cpu_malloc() -> str:
    """`ATOM_CPU_MALLOC`: where a CPU engine's freed activations go
    (atom/model_engine/cpu_heap.py): heap (the default: glibc keeps them for the next step)
    | system (glibc's default: large blocks go back to the kernel)."""
    return _choice("ATOM_CPU_MALLOC", CPU_MALLOC_MODES)


def cpu_linear() -> str:
    """`ATOM_CPU_LINEAR`: how a CPU engine's fp32 linear layers multiply
    (atom/kernels/cpu_linear.py): packed (the default: weights packed once for oneDNN) |
    dense (F.linear on the checkpoint's layout)."""
    return _choice("ATOM_CPU_LINEAR", CPU_LINEAR_MODES)


def fusion_settings(variables: list[str]) -> dict[str, str]:
    """The `ATOM_FUSE_*` switches that are set, lower-cased ({variable: value}; atom/fusions.py
    parses them: 1 on, 0 off, unset or `default` the default)."""
    values = {name: os.environ.get(name, "").strip().lower() for name in variables}
    return {name: value for name, value in values.items() if value not in ("", "default")}


PDL_KERNELS = ("latency", "small", "all")
PDL_RELEASES = ("start", "end")


def pdl_kernels() -> str:
    """`ATOM_PDL_KERNELS`: which GEMVs join a PDL chain (measurement, atom/kernels/pdl.py):
    latency (the default: those under its latency bound) | small (none) | all."""
    return _choice("ATOM_PDL_KERNELS", PDL_KERNELS)


def pdl_release() -> str:
    """`ATOM_PDL_RELEASE`: when a GEMV under PDL lets the next kernel launch (measurement):
    start (the default) | end (after its K loop)."""
    return _choice("ATOM_PDL_RELEASE", PDL_RELEASES)


GEMV_POLICY_MODES = ("measure", "fused", "unfused")


def gemv_policy() -> str:
    """`ATOM_GEMV_POLICY`: how batch-1 linear layers pick the Triton GEMV
    (atom/kernels/gemv_policy.py): measure (the default) | fused | unfused."""
    return _choice("ATOM_GEMV_POLICY", GEMV_POLICY_MODES)


def gemv_trial_budget_s() -> float:
    """`ATOM_GEMV_TRIAL_BUDGET_S`: seconds of timed GEMV trials per process (default 1)."""
    raw = os.environ.get("ATOM_GEMV_TRIAL_BUDGET_S", "").strip()
    try:
        return float(raw) if raw else 1.0
    except ValueError:
        raise ValueError(
            f"ATOM_GEMV_TRIAL_BUDGET_S={raw!r}: seconds of timed trials, e.g. 1.0"
        ) from None


def cache_dir() -> str:
    """`ATOM_CACHE_DIR`: where measured choices are kept across starts (the GEMV policy's
    gemv_policy.json; default ~/.cache/atom)."""
    return os.environ.get("ATOM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "atom"
    )


def _choice(name: str, valid: tuple[str, ...]) -> str:
    """One of ``valid`` (the first when unset or empty), lower-cased."""
    value = os.environ.get(name, "").strip().lower() or valid[0]
    if value not in valid:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(valid)}")
    return value
