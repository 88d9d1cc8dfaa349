"""The attention backends by the name a model declares (`attention_backend`, default mha).

The one table of names: it imports every backend, and no backend imports it, so there is
no import circle (backend.py holds the shared base class the backends build on).
"""

from __future__ import annotations

from atom.attention.backend import MHABackend, MLABackend, PagedAttentionBackend
from atom.attention.gdn import GDNBackend
from atom.attention.v4 import V4Backend
from atom.attention.v41 import V41Backend

BACKENDS: dict[str, type[PagedAttentionBackend]] = {
    "mha": MHABackend,
    "mla": MLABackend,
    "v4": V4Backend,
    "v41": V41Backend,
    "gdn": GDNBackend,
}


def backend_for(model) -> PagedAttentionBackend:
    """A fresh backend of the family the model declares (`attention_backend`, default mha)."""
    name = getattr(model, "attention_backend", "mha")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[name]()
