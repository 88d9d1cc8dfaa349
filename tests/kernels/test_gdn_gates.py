"""The GDN layer's elementwise launches (atom/kernels/gdn_gates.py: `gdn_split`,
`gated_rms_norm`) against their torch references, and the references against the model's
ops: CPU interpreter, `gpu` variants on CUDA."""

import pytest
import torch

from atom.kernels.gdn_gates import (
    gated_rms_norm,
    gated_rms_norm_reference,
    gdn_split,
    gdn_split_reference,
)
from atom.models.qwen3_next import GatedRMSNorm

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (Hk, R, Dk, Dv): Qwen3-Next's ratio 2, a ratio 1, head dims not powers of two
GEOMETRIES = [(2, 2, 16, 8), (3, 1, 8, 12), (1, 4, 24, 16)]


def _projections(tokens, hk, ratio, dk, dv, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = hk * (2 * dk + 2 * ratio * dv)
    qkvz = torch.randn(tokens, width + 3, generator=g)[:, :width]  # strided rows
    ba = torch.randn(tokens, 2 * hk * ratio, generator=g) * 4
    ba[0, 0], ba[-1, -1] = 30.0, -30.0  # softplus past its threshold, beta saturating
    a_log = torch.randn(hk * ratio, generator=g)
    dt_bias = torch.randn(hk * ratio, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (qkvz, ba, a_log, dt_bias)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,ratio,dk,dv", GEOMETRIES)
def test_split_matches_reference(device, dtype, hk, ratio, dk, dv):
    qkvz, ba, a_log, dt_bias = _projections(3, hk, ratio, dk, dv, dtype, device)
    mixed, g, beta = gdn_split(qkvz, ba, a_log, dt_bias, hk, dk, dv)
    ref_mixed, ref_g, ref_beta = gdn_split_reference(qkvz, ba, a_log, dt_bias, hk, dk, dv)
    assert g.dtype == beta.dtype == torch.float32 and mixed.dtype == dtype
    assert torch.equal(mixed, ref_mixed)
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6)
    half = dict(rtol=8e-3, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, ref_beta, **half)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,ratio,dk,dv", GEOMETRIES)
def test_gated_norm_matches_model_norm(device, dtype, hk, ratio, dk, dv):
    """Against `GatedRMSNorm` (HF's Qwen3NextRMSNormGated) on z read in place from qkvz."""
    qkvz, _, _, _ = _projections(3, hk, ratio, dk, dv, dtype, device, seed=1)
    x = torch.randn(3, hk * ratio, dv, generator=torch.Generator().manual_seed(2))
    x = x.to(device=device, dtype=dtype)
    z = qkvz.view(3, hk, -1)[..., 2 * dk + ratio * dv :].unflatten(-1, (ratio, dv))
    norm = GatedRMSNorm(dv, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dv, generator=torch.Generator().manual_seed(3)) + 0.5)
    norm = norm.to(device=device, dtype=dtype)
    with torch.no_grad():
        expected = norm(x.reshape(-1, dv), z.reshape(-1, dv)).reshape(3, -1)
        out = gated_rms_norm(x, z, norm.weight, norm.eps)
        assert torch.equal(gated_rms_norm_reference(x, z, norm.weight, norm.eps), expected)
    assert out.dtype == dtype and out.shape == (3, hk * ratio * dv)
    tolerance = (
        dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    )
    torch.testing.assert_close(out, expected, **tolerance)


def test_no_tokens():
    qkvz, ba, a_log, dt_bias = _projections(1, 2, 2, 16, 8, torch.float32, "cpu")
    mixed, g, beta = gdn_split(qkvz[:0], ba[:0], a_log, dt_bias, 2, 16, 8)
    assert mixed.shape == (0, 2 * 2 * 16 + 4 * 8) and g.shape == beta.shape == (0, 4)
