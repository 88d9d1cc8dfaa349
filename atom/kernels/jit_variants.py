"""Looking at Triton's compiled variants of a kernel (the recompile guard and the benchmark).

Triton compiles a new variant of a kernel for every new value of a ``tl.constexpr`` and, for
a plain integer argument not listed in ``do_not_specialize``, for every class of its value
(1, a multiple of 16, anything else). These helpers read a kernel's declared arguments,
count its compiled variants, and swap a fresh copy (same Python function, empty caches) in
for a module's kernel so that a sweep counts only what it compiles itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from contextlib import contextmanager


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
    is the dict of compiled kernels (then the key cache in recent releases, the target, the
    backend and the binder). Triton 2.x kept ``cache[device]`` dicts.
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

    ``dynamic=False`` drops ``do_not_specialize``: Triton's default behaviour, for
    comparisons.
    """
    import triton

    options = {}
    if dynamic:
        options["do_not_specialize"] = list(getattr(kernel, "do_not_specialize", None) or [])
        alignment = getattr(kernel, "do_not_specialize_on_alignment", None)
        if alignment:
            options["do_not_specialize_on_alignment"] = list(alignment)
    return triton.jit(kernel.fn, **options)


@contextmanager
def swapped_kernels(module, names: Iterable[str], *, dynamic: bool = True):
    """Replace ``module.<name>`` by fresh copies while the block runs; yields {name: copy}.

    The public wrappers look their kernel up in the module at each call, so they launch
    the copies.
    """
    originals = {name: getattr(module, name) for name in names}
    copies = {name: fresh_copy(kernel, dynamic=dynamic) for name, kernel in originals.items()}
    for name, copy in copies.items():
        setattr(module, name, copy)
    try:
        yield copies
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)
