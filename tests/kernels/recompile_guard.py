"""The recompile guard: how many variants Triton compiled for a kernel over a length sweep.

Triton compiles a new variant of a kernel for every new value of a ``tl.constexpr`` and, for
a plain integer argument not listed in ``do_not_specialize``, for every class of its value
(1, a multiple of 16, anything else). Runtime lengths must therefore never be constexpr and
must be listed in ``do_not_specialize`` (docs/architecture.md, "Kernels"). The guard runs a
kernel through its public wrapper over ``SWEEP`` and asserts that one variant served every
length.

Counting works on a fresh copy of the kernel (same Python function, same flags, empty
caches) swapped in for the module's kernel while the sweep runs, so variants compiled by
earlier tests do not hide new ones; Triton's on-disk cache keeps the copies cheap. The
helpers live in atom/kernels/jit_variants.py (the kernel benchmark uses them too).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import torch

from atom.kernels.jit_variants import (  # noqa: F401 (re-exported for the tests)
    compiled_variants,
    fresh_copy,
    kernel_arguments,
    swapped_kernels,
)

# The lengths every kernel is run with: value 1, multiples of 16 and odd values around them.
SWEEP = [1, 16, 257, 4096, 4097, 65536, *random.Random(5).sample(range(2, 70000), 3)]


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
