"""The error every checkpoint reader raises (its own module: loader.py and gguf_loader.py
both raise it, and loader.py dispatches to gguf_loader), and the shape check they share."""


class ModelLoadError(ValueError):
    """A checkpoint cannot be opened; the message names the file and what is wrong with it."""


def check_shape(tensor, expected, name: str) -> None:
    """Refuse a checkpoint tensor whose shape is not ``expected``, naming it and both shapes."""
    if tuple(tensor.shape) != tuple(expected):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(expected)}"
        )
