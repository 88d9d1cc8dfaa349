"""The recompile guard: how many variants Triton compiled for a kernel over a length sweep.

Triton compiles a new variant of a kernel for every new value of a ``tl.constexpr`` and, for
a plain integer argument not listed in ``do_not_specialize``, for every class of its value
(1, a multiple of 16, anything else). Runtime lengths must therefore never be constexpr and
must be listed in ``do_not_specialize`` (docs/architecture.md, "Kernels"). The guard runs a kernel through its
public wrapper over ``SWEEP`` and asserts that one variant served every length.

Counting works on a fresh copy of the kernel (same Python function, same flags, empty
caches) swapped in for the module's kernel while the sweep runs, so variants compiled by
earlier tests do not hide new ones; Triton's on-disk cache keeps the copies cheap.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

# The lengths every kernel is run with: value 1, multiples of 16 and odd values around them.
SWEEP = [1, 16, 257, 4096, 4097, 65536, *random.Random(5).sample(range(2, 70000), 3)]


def kernel_arguments(kernel) -> tuple[list[str], set[str], set[str]]:
    """(argument names, names in do_not_specialize, constexpr names) of a Triton kernel.

    Works for a ``JITFunction`` (GPU) and for the interpreter's ``InterpretedFunction``
    (``TRITON_INTERPRET=1``), which keeps its decorator arguments in ``kwargs``.
    """
    parameters = inspect.signature(kernel.fn).parameters
    names = list(parameters)
    do_not_specialize = getattr(kernel, "do_not_specialize", None)
    if do_not_specialize is None:
        do_not_specialize = getattr(kernel, "kwargs", {}).get("do_not_specialize") or []
    dns = {names[i] if isinstance(i, int) else i for i in do_not_specialize}
    params = getattr(kernel, "params", None)
    if params is not None:
        constexpr = {p.name for p in params if p.is_constexpr}
    else:
        constexpr = {n for n, p in parameters.items() if "constexpr" in str(p.annotation)}
    return names, dns, constexpr


def compiled_variants(kernel) -> int:
    """How many compiled variants a ``JITFunction`` holds, over all devices.

    Triton 3.x (3.6 and 3.9 alike): ``device_caches[device]`` is a tuple whose first item
    is the dict of compiled kernels (followed by the key cache in recent releases, then
    target, backend and binder). Triton 2.x kept ``cache[device]`` dicts.
    """
    device_caches = getattr(kernel, "device_caches", None)
    if device_caches is not None:
        return sum(len(entry[0]) for entry in device_caches.values())
    cache = getattr(kernel, "cache", None)
    if isinstance(cache, dict):
        return sum(len(per_device) for per_device in cache.values())
    raise TypeError(f"cannot find the compiled-kernel cache of {kernel!r}")


def fresh_copy(kernel, *, dynamic: bool = True):
    """A new JITFunction over ``kernel``'s Python function, with empty caches.

    ``dynamic=False`` drops ``do_not_specialize`` (Triton's default behaviour), for
    comparisons.
    """
    import triton

    options = {}
    if dynamic:
        options["do_not_specialize"] = list(getattr(kernel, "do_not_specialize", []) or [])
        alignment = getattr(kernel, "do_not_specialize_on_alignment", None)
        if alignment:
            options["do_not_specialize_on_alignment"] = list(alignment)
    return triton.jit(kernel.fn, **options)


@contextmanager
def swapped_kernels(module, names: Iterable[str], *, dynamic: bool = True):
    """Replace ``module.<name>`` by fresh copies while the block runs; yields {name: copy}."""
    originals = {name: getattr(module, name) for name in names}
    copies = {name: fresh_copy(kernel, dynamic=dynamic) for name, kernel in originals.items()}
    for name, copy in copies.items():
        setattr(module, name, copy)
    try:
        yield copies
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


def variants_over_sweep(
    module, names: Iterable[str], run: Callable[[int], None], lengths=SWEEP, *, dynamic=True
) -> dict[str, list[int]]:
    """Run ``run(n)`` for each length with fresh copies of the kernels; returns, per kernel,
    its number of compiled variants after each length."""
    names = list(names)
    history: dict[str, list[int]] = {name: [] for name in names}
    with swapped_kernels(module, names, dynamic=dynamic) as copies:
        for n in lengths:
            run(n)
            for name, copy in copies.items():
                history[name].append(compiled_variants(copy))
        torch.cuda.synchronize()
    return history


def assert_one_variant(
    module, names: Iterable[str], run: Callable[[int], None], lengths=SWEEP
) -> None:
    """Every kernel in ``names`` compiled exactly one variant across ``lengths``."""
    lengths = list(lengths)
    history = variants_over_sweep(module, names, run, lengths)
    for name, counts in history.items():
        if counts[-1] != 1:
            steps = zip(lengths, [0, *counts[:-1]], counts, strict=True)
            grew = [n for n, before, after in steps if after > before]
            raise AssertionError(
                f"{module.__name__}.{name}: {counts[-1]} compiled variants over lengths "
                f"{lengths}; new variants at {grew}. A runtime length is constexpr or "
                "missing from do_not_specialize."
            )
