"""DeepSeek-V4 mHC kernels (atom/kernels/v4_mhc.py) against their torch references, and the
references against the model's own modules (HyperConnection + FP32RMSNorm, expand,
HyperHead + the final norm; DeepSeek-V4.1's variants: the collapse by the carried pre with
its RMSNorm, the expand rounded once, the final collapse): CPU interpreter, `gpu` variants
on CUDA."""

import types

import pytest
import torch

from atom.kernels.v4_mhc import (
    hc_collapse,
    hc_collapse_reference,
    hc_head,
    hc_head_reference,
    hc_post,
    hc_post_reference,
    hc_pre,
    hc_pre_carried,
    hc_pre_carried_reference,
    hc_pre_reference,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EPS, HC_EPS = 1e-6, 1e-6


def _block(n, d, device, head=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = n if head else (2 + n) * n
    fn = (torch.randn(m, n * d, generator=g) * 0.05).to(device)
    base = (torch.randn(m, generator=g) * 0.5).to(device)
    scale = (torch.rand(1 if head else 3, generator=g) + 0.5).to(device)
    weight = (torch.rand(d, generator=g) + 0.5).to(device)
    return fn, base, scale, weight


def _streams(tokens, n, d, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, n, d, generator=g) * 2).to(device=device, dtype=dtype)


def _tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 64), (3, 2, 48), (2, 3, 200)])
def test_hc_pre_matches_reference(device, dtype, tokens, n, d):
    fn, base, scale, weight = _block(n, d, device)
    streams = _streams(tokens, n, d, dtype, device)
    post, comb, x = hc_pre(streams, fn, base, scale, weight, 5, EPS, HC_EPS, EPS)
    ref_post, ref_comb, ref_x = hc_pre_reference(
        streams, fn, base, scale, weight, 5, EPS, HC_EPS, EPS
    )
    torch.testing.assert_close(post, ref_post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, ref_x, **_tolerance(dtype))
    # Sinkhorn: columns then rows sum to ~1
    torch.testing.assert_close(comb.sum(-2), torch.ones_like(comb.sum(-2)), rtol=0, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 64), (3, 3, 200)])
@pytest.mark.parametrize(
    "round_once, bf16_tolerance",
    [
        # V4: a few ulps of values up to ~8 (the CPU bf16 matmul rounds its own way)
        (False, dict(rtol=2e-2, atol=0.1)),
        # V4.1's expand: fp32 sums in another order; bf16: the interpreter truncates where
        # torch rounds (1 ulp of values up to ~8)
        (True, dict(rtol=1e-2, atol=0.07)),
    ],
)
def test_hc_post_matches_reference(device, dtype, tokens, n, d, round_once, bf16_tolerance):
    fn, base, scale, weight = _block(n, d, device)
    streams = _streams(tokens, n, d, dtype, device)
    post, comb, _ = hc_pre_reference(streams, fn, base, scale, weight, 3, EPS, HC_EPS, EPS)
    out = _streams(tokens, 1, d, dtype, device, seed=2)[:, 0]
    got = hc_post(out, streams, post, comb, round_once=round_once)
    expected = hc_post_reference(out, streams, post, comb, round_once=round_once)
    tolerance = _tolerance(dtype) if dtype == torch.float32 else bf16_tolerance
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 64), (5, 2, 48)])
def test_hc_head_matches_reference(device, dtype, tokens, n, d):
    fn, base, scale, weight = _block(n, d, device, head=True)
    streams = _streams(tokens, n, d, dtype, device)
    got = hc_head(streams, fn, base, scale, weight, EPS, HC_EPS, EPS)
    expected = hc_head_reference(streams, fn, base, scale, weight, EPS, HC_EPS, EPS)
    torch.testing.assert_close(got, expected, **_tolerance(dtype))


def test_references_are_the_models_math():
    """The references equal the model's modules bit for bit (fp32)."""
    from atom.models.deepseek_v4 import FP32RMSNorm, HyperConnection, HyperHead, expand

    n, d, iters = 4, 32, 7
    config = types.SimpleNamespace(hc_mult=n, hidden_size=d, hc_sinkhorn_iters=iters,
                                   hc_eps=HC_EPS, rms_norm_eps=EPS)  # fmt: skip
    hc, head, norm = HyperConnection(config), HyperHead(config), FP32RMSNorm(d, EPS)
    fn, base, scale, weight = _block(n, d, "cpu")
    hfn, hbase, hscale, _ = _block(n, d, "cpu", head=True, seed=3)
    with torch.no_grad():
        hc.fn.copy_(fn), hc.base.copy_(base), hc.scale.copy_(scale), norm.weight.copy_(weight)
        head.hc_fn.copy_(hfn), head.hc_base.copy_(hbase), head.hc_scale.copy_(hscale)
    streams = _streams(3, n, d, torch.float32, "cpu")
    out = _streams(3, 1, d, torch.float32, "cpu", seed=4)[:, 0]
    post, comb, x = hc(streams, norm)
    ref_post, ref_comb, ref_x = hc_pre_reference(
        streams, fn, base, scale, weight, iters, EPS, HC_EPS, EPS
    )
    assert torch.equal(post, ref_post) and torch.equal(comb, ref_comb)
    assert torch.equal(x, ref_x)
    assert torch.equal(
        expand(out, streams, post, comb), hc_post_reference(out, streams, post, comb)
    )
    expected = hc_head_reference(streams, hfn, hbase, hscale, weight, EPS, HC_EPS, EPS)
    assert torch.equal(head(streams, norm), expected)


# -- DeepSeek-V4.1: the carried pre, the norm rounded before its weight, the expand rounded once


def _carried_pre(tokens, n, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(tokens, n, generator=g) + 0.2).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 64), (3, 2, 48), (2, 3, 200)])
def test_hc_pre_carried_matches_reference(device, dtype, tokens, n, d):
    fn, base, scale, weight = _block(n, d, device)
    weight = weight.to(dtype)  # V4.1 holds the norm weight in the model's dtype
    streams = _streams(tokens, n, d, dtype, device)
    carried = _carried_pre(tokens, n, device)
    args = (streams, carried, fn, base, scale, weight, 5, EPS, HC_EPS, EPS)
    pre, post, comb, x = hc_pre_carried(*args)
    ref_pre, ref_post, ref_comb, ref_x = hc_pre_carried_reference(*args)
    for got, expected in ((pre, ref_pre), (post, ref_post), (comb, ref_comb)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert x.dtype == dtype
    torch.testing.assert_close(x, ref_x, **_tolerance(dtype))
    # the carried pre collapses, not this site's: V4's kernel on the same streams differs
    _, _, v4_x = hc_pre(streams, fn, base, scale, weight.float(), 5, EPS, HC_EPS, EPS)
    assert not torch.allclose(x.float(), v4_x.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 64), (5, 2, 48), (2, 3, 200)])
def test_hc_collapse_matches_reference(device, dtype, tokens, n, d):
    _, _, _, weight = _block(n, d, device)
    streams = _streams(tokens, n, d, dtype, device)
    pre = _carried_pre(tokens, n, device)
    got = hc_collapse(streams, pre, weight.to(dtype), EPS)
    expected = hc_collapse_reference(streams, pre, weight.to(dtype), EPS)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **_tolerance(dtype))


def test_v41_references_are_the_models_math(monkeypatch):
    """The V4.1 references equal V4.1's modules bit for bit: `site_input`'s and
    `site_output`'s CPU path (HyperConnection.mixes, collapse, RMSNorm, expand) and the final
    norm, in fp32 and bf16 (the rounding points differ from V4's in bf16)."""
    from atom.models.deepseek_v4 import HyperConnection, collapse
    from atom.models.deepseek_v41 import RMSNorm, expand, site_input, site_output

    monkeypatch.delenv("ATOM_INTERPRET_CUDA_PATH", raising=False)  # the torch path

    n, d, iters = 4, 32, 7
    config = types.SimpleNamespace(hc_mult=n, hidden_size=d, hc_sinkhorn_iters=iters,
                                   hc_eps=HC_EPS, rms_norm_eps=EPS)  # fmt: skip
    fn, base, scale, weight = _block(n, d, "cpu")
    for dtype in (torch.float32, torch.bfloat16):
        hc, norm = HyperConnection(config), RMSNorm(d, EPS).to(dtype)
        with torch.no_grad():
            hc.fn.copy_(fn), hc.base.copy_(base), hc.scale.copy_(scale)
            norm.weight.copy_(weight)
        streams = _streams(3, n, d, dtype, "cpu")
        carried = _carried_pre(3, n, "cpu")
        got = site_input(hc, streams, carried, norm)
        expected = hc_pre_carried_reference(
            streams, carried, fn, base, scale, norm.weight, iters, EPS, HC_EPS, EPS
        )
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        out = _streams(3, 1, d, dtype, "cpu", seed=4)[:, 0]
        _, post, comb, _ = expected
        assert torch.equal(
            site_output(out, streams, post, comb),
            hc_post_reference(out, streams, post, comb, round_once=True),
        )
        assert torch.equal(expand(out, streams, post, comb), site_output(out, streams, post, comb))
        assert torch.equal(
            norm(collapse(streams, carried)),
            hc_collapse_reference(streams, carried, norm.weight, EPS),
        )
