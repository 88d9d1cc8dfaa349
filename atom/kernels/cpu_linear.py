"""Linear layers on CPU with weights packed once for oneDNN (`Config.cpu_linear="packed"`).

`F.linear` on CPU hands the row-major weight to MKL on every call; at 2..64 rows (decode
batches, short prefills) its GEMM reaches a third of what oneDNN's GEMM reaches on a
weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
then `torch.ops.mkldnn._linear_pointwise`, the pair inductor's CPU backend freezes linear
layers into). benchmarks/cpu_linear.py measures it: F.linear against oneDNN- and
MKL-packed weights at 1, 16 and 64 rows on SmolLM2's and a 1B model's shapes
(docs/benchmarks.md, CPU section). MKL's packed GEMM (`torch.ops.mkl._mkl_linear`) is not
used: at 2+ rows it computes what F.linear computes, at the same speed.

The choice per call, by rows:
- 2 rows or more: the packed weight (2-3x faster at 16 and 64 rows on every measured
  shape, 1 thread);
- 1 row: the packed weight for weights of `ONE_ROW_PACKED_MIN_BYTES` or more (1.3-2.2x:
  SmolLM2's gate_up and LM head, every 1B projection), F.linear below it: MKL's GEMV on a
  weight that stays in cache is ~10 us cheaper than oneDNN's call, which loses 19-35% on
  SmolLM2's 1.3-3.5 MB qkv, o and down projections.

oneDNN sums in another order than MKL (max abs difference under 1e-5 on unit-scale inputs);
the CPU greedy parity tests against HF pass with it. Packing covers fp32 only: bf16 would
need AVX512-BF16 or AMX to be fast, and is left to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Below this many weight bytes a 1-row product keeps F.linear (benchmarks/cpu_linear.py:
# oneDNN loses at 1 row on 1.3-3.5 MB weights, wins from ~7 MB on).
ONE_ROW_PACKED_MIN_BYTES = 4 << 20


def can_pack(weight: torch.Tensor) -> bool:
    """A 2-D fp32 CPU weight, with oneDNN in this torch build."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


def packed_for_one_row(weight: torch.Tensor) -> bool:
    """Whether a 1-row product on this weight takes the packed form (else F.linear)."""
    return weight.numel() * weight.element_size() >= ONE_ROW_PACKED_MIN_BYTES


class PackedLinearWeight:
    """A [out, in] weight reordered once into oneDNN's layout, beside the dense one (which
    stays: a tied LM head's is the embedding table, and small 1-row products use it;
    the packed copy costs as much memory again).

    `__call__(x, bias)` is `F.linear(x, dense, bias)` up to summation order; x is [..., in]
    fp32 on CPU, the result [..., out].
    """

    def __init__(self, dense: torch.Tensor):
        if not can_pack(dense):
            raise ValueError(
                f"only 2-D fp32 CPU weights are packed, got {tuple(dense.shape)} "
                f"{dense.dtype} on {dense.device}; set cpu_linear='dense' (ATOM_CPU_LINEAR=dense)"
            )
        # detach() shares the parameter's storage and version counter: an in-place write
        # to the weight (a test setting weights after the engine started) bumps the
        # version, and the next product packs it again. A write through `.data` is not seen.
        self.dense = dense.detach()
        self.version = self.dense._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.dense)
        self.out_features, self.in_features = dense.shape
        self.one_row_packed = packed_for_one_row(dense)

    def uses_packed(self, rows: int) -> bool:
        return rows != 1 or self.one_row_packed

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        if (rows == 1 and not self.one_row_packed) or x.dtype != torch.float32:
            return F.linear(x, self.dense, bias)
        if self.dense._version != self.version:
            self.version = self.dense._version
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.dense)
        flat = x.reshape(rows, self.in_features)
        if bias is not None and bias.requires_grad:
            bias = bias.detach()  # the oneDNN op has no autograd; an engine never trains
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)
