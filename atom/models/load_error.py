"""The error every checkpoint reader raises (its own module: loader.py and gguf_loader.py
both raise it, and loader.py dispatches to gguf_loader)."""


class ModelLoadError(ValueError):
    """A checkpoint cannot be opened; the message names the file and what is wrong with it."""
