"""Random weights in a model's real shapes: `load_format="dummy"` (benchmarks, tests)."""

from __future__ import annotations

import torch

from atom.models.load_error import ModelLoadError

DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def random_init(model: torch.nn.Module) -> None:
    """Random weights in the real shapes (`load_format="dummy"`, for benchmarks)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, param in model.named_parameters():
        if param.dtype not in DENSE_DTYPES:  # a quantized layer (fp8, packed int4, scales)
            raise ModelLoadError(
                f"load_format='dummy' draws dense weights only; {name} is {param.dtype} "
                "(a quantization_config in config.json): load a checkpoint instead"
            )
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=generator)
        elif name.endswith("bias"):
            param.zero_()
        else:  # norm weights
            param.fill_(1.0)
