"""Linear layers on CPU with weights packed once for oneDNN (`Config.cpu_linear="packed"`).

`F.linear` on CPU hands the row-major weight to MKL on every call; at 2..64 rows (decode
batches, short prefills) its GEMM reaches a third of what oneDNN's GEMM reaches on a
weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
then `torch.ops.mkldnn._linear_pointwise`, the pair inductor's CPU backend freezes linear
layers into). benchmarks/cpu_linear.py measures it: F.linear against oneDNN- and
MKL-packed weights at 1, 16 and 64 rows on SmolLM2's and a 1B model's shapes
(docs/benchmarks.md, CPU section). MKL's packed GEMM (`torch.ops.mkl._mkl_linear`) is not
used: at 2+ rows it computes what F.linear computes, at the same speed.

The form per call, by rows:
- 2 rows or more: the packed weight (2-3x faster at 16 and 64 rows on every measured
  shape, 1 thread);
- 1 row (batch-1 decode) on a weight with more outputs than inputs (qkv, gate_up, the LM
  head): the weight transposed once to [in, out] (`transposed`), then
  `torch.mm(x, transposed)`. A decode step reads every weight once from memory, and MKL's
  product on the [in, out] layout streams a wide weight faster than F.linear's dot per
  output row or oneDNN's 1-row product: `benchmarks.cpu_linear --cold` (each form on
  enough copies of a weight that they come from memory) measures 1.38-1.43x / 1.70-1.83x
  / 1.73-1.95x over F.linear on SmolLM2's qkv / gate_up / LM head at 1 thread (two runs),
  1.60x / 1.60x / 1.55x at 2 (docs/benchmarks.md, CPU section);
- 1 row on a square or tall weight (o, down): F.linear (the transposed form measured
  0.94-0.97x on o and 0.61-0.73x on down).

Memory: the packed copy costs as much as the dense weight, the transposed one as much as
a wide weight; the dense weight stays (a tied LM head's is the embedding table, and the
1-row product on a tall weight uses it). `ATOM_CPU_LINEAR=dense` keeps no copy.

oneDNN sums in another order than MKL (max abs difference under 1e-5 on unit-scale inputs);
the CPU greedy parity tests against HF pass with it. Packing covers fp32 only: bf16 would
need AVX512-BF16 or AMX to be fast, and is left to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_pack(weight: torch.Tensor) -> bool:
    """A 2-D fp32 CPU weight, with oneDNN in this torch build."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


class PackedLinearWeight:
    """A [out, in] weight reordered once into oneDNN's layout for products of 2+ rows, and
    transposed once to [in, out] for 1-row products, beside the dense one (which stays: a
    tied LM head's is the embedding table).

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
        self._lay_out()
        self.out_features, self.in_features = dense.shape

    def _lay_out(self) -> None:
        out_features, in_features = self.dense.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.dense)
        self.transposed = None  # [in, out], for 1 row on a wide weight
        if out_features > in_features:
            self.transposed = self.dense.t().contiguous()

    def uses_packed(self, rows: int) -> bool:
        """Whether a product of `rows` rows takes the packed weight (else, at 1 row, the
        transposed weight when the weight is wide, F.linear when not)."""
        return rows != 1

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.linear(x, self.dense, bias)
        if self.dense._version != self.version:
            self.version = self.dense._version
            self._lay_out()
        if bias is not None and bias.requires_grad:
            bias = bias.detach()  # neither op below has autograd here; an engine never trains
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.shape[0] == 1:
            if self.transposed is None:
                return F.linear(x, self.dense, bias)
            if bias is None:
                out = torch.mm(flat, self.transposed)
            else:
                out = torch.addmm(bias, flat, self.transposed)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
