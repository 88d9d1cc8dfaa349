"""GDN kernels (causal conv1d update / prefill, gated delta rule recurrent / varlen prefill):
the torch references against HF transformers' Qwen3-Next functions (independent), and the
Triton kernels against the references (CPU: TRITON_INTERPRET=1, fp32; H200: bf16 inputs,
the bound measured and documented in docs/benchmarks.md).

Lengths: 1, non-multiples of the chunk size (64), several chunks; sequences continue from a
state (chunked prefill) or start fresh on a dirty slot; padded rows (slot -1) touch only the
scratch row.
"""

import pytest
import torch

from atom.kernels.gdn_chunk import chunk_bounds, chunked_gated_delta_rule
from atom.kernels.gdn_conv import (
    causal_conv1d_prefill,
    causal_conv1d_prefill_reference,
    causal_conv1d_update,
    causal_conv1d_update_reference,
)
from atom.kernels.gdn_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_reference,
)

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _conv_case(lengths, channels, width, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(total, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen) * 0.5
    state = torch.randn(len(lengths) + 2, width - 1, channels, generator=gen)  # +scratch
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    slots = torch.tensor([len(lengths) - i for i in range(len(lengths))], dtype=torch.int32)
    fresh = torch.tensor([i % 2 for i in range(len(lengths))], dtype=torch.int32)
    to = dict(device=device)
    return (
        x.to(device, dtype), state.to(device, dtype), weight.to(device, dtype),
        cu.to(**to), slots.to(**to), fresh.to(**to),
    )  # fmt: skip


def _rule_case(lengths, hk, hv, dk, dv, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, hk, dk, generator=gen)
    k = torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g = -torch.rand(total, hv, generator=gen) * 0.5
    beta = torch.rand(total, hv, generator=gen)
    state = torch.randn(len(lengths) + 2, hv, dk, dv, generator=gen) * 0.3
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    slots = torch.tensor([len(lengths) - i for i in range(len(lengths))], dtype=torch.int32)
    fresh = torch.tensor([(i + 1) % 2 for i in range(len(lengths))], dtype=torch.int32)
    inputs = [t.to(device, dtype) for t in (q, k, v)]
    rest = [t.to(device) for t in (g, beta, state, cu, slots, fresh)]
    return (*inputs, *rest)


# -- the references against HF's functions (one sequence at a time) ----------------------


def test_conv_references_match_hf():
    lengths, channels, width = [1, 5, 9], 12, 4
    x, state, weight, cu, slots, fresh = _conv_case(lengths, channels, width, 0)
    fresh[:] = 1
    ours_state = state.clone()
    out = causal_conv1d_prefill_reference(x, ours_state, weight, cu, slots, fresh)
    for b in range(len(lengths)):
        seq = x[cu[b] : cu[b + 1]].t()[None]
        expected = hf.causal_conv1d_fn(seq, weight, None, activation="silu")[0].t()
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], expected, rtol=1e-6, atol=1e-6)
        # then one decode token against HF's update on its conv state
        hf_state = torch.nn.functional.pad(seq, (width - 1, 0))[..., -(width - 1) :].clone()
        token = torch.randn(1, channels)
        expected = hf.causal_conv1d_update(token[..., None], hf_state, weight, None, "silu")
        row = slots[b : b + 1]
        got = causal_conv1d_update_reference(token, ours_state, weight, row, fresh[b : b + 1] * 0)
        torch.testing.assert_close(got, expected[..., 0], rtol=1e-6, atol=1e-6)


def test_delta_rule_references_match_hf():
    lengths, hk, hv, dk, dv = [1, 63, 130], 2, 4, 8, 16
    q, k, v, g, beta, state, cu, slots, fresh = _rule_case(lengths, hk, hv, dk, dv, 1)
    ours = state.clone()
    out = chunk_gated_delta_rule_reference(q, k, v, g, beta, ours, cu, slots, fresh)
    for b in range(len(lengths)):
        a, e = cu[b], cu[b + 1]
        initial = None if fresh[b] else state[slots[b]][None]
        expected, final = hf.torch_chunk_gated_delta_rule(
            q[None, a:e], k[None, a:e], v[None, a:e], g[None, a:e], beta[None, a:e],
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[a:e], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[slots[b]], final[0], rtol=1e-5, atol=1e-5)
    # one decode token on every row against HF's recurrent form from the states just written
    rows, zero = slots.clone(), torch.zeros_like(fresh)
    before = ours.clone()
    q1, k1, v1, g1, b1 = q[:3], k[:3], v[:3], g[:3], beta[:3]
    got = recurrent_gated_delta_rule_reference(q1, k1, v1, g1, b1, ours, rows, zero)
    for b in range(3):
        one = slice(b, b + 1)
        expected, final = hf.torch_recurrent_gated_delta_rule(
            q1[None, one], k1[None, one], v1[None, one], g1[None, one], b1[None, one],
            initial_state=before[rows[b]][None], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(got[b], expected[0, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours[rows[b]], final[0], rtol=1e-6, atol=1e-6)


# -- the Triton kernels against the references (interpreter on CPU) ----------------------


@pytest.mark.parametrize("width, channels", [(4, 40), (3, 16)])
def test_conv_kernels_match_reference(width, channels):
    lengths = [1, 2, 7, 0, 130, 20]  # 130 (continuing): three 64-token chunks
    x, state, weight, cu, slots, fresh = _conv_case(lengths, channels, width, width)
    ref_state, got_state = state.clone(), state.clone()
    expected = causal_conv1d_prefill_reference(x, ref_state, weight, cu, slots, fresh)
    got = causal_conv1d_prefill(x, got_state, weight, cu, slots, fresh)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, ref_state, rtol=0, atol=0)
    # decode rows, one of them padding (slot -1: only the scratch row changes)
    tokens = x[:4]
    rows = torch.tensor([1, 3, -1, 4], dtype=torch.int32)
    flags = torch.tensor([0, 1, 0, 0], dtype=torch.int32)
    expected = causal_conv1d_update_reference(tokens, ref_state, weight, rows, flags)
    got = causal_conv1d_update(tokens, got_state, weight, rows, flags)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, ref_state, rtol=0, atol=0)


def test_delta_rule_kernels_match_reference():
    lengths, hk, hv, dk, dv = [1, 0, 5, 33], 1, 2, 12, 40  # dims not powers of two
    q, k, v, g, beta, state, cu, slots, fresh = _rule_case(lengths, hk, hv, dk, dv, 2)
    ref_state, got_state = state.clone(), state.clone()
    expected = chunk_gated_delta_rule_reference(q, k, v, g, beta, ref_state, cu, slots, fresh)
    got = chunk_gated_delta_rule(q, k, v, g, beta, got_state, cu, slots, fresh)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state, ref_state, rtol=1e-4, atol=1e-4)
    rows = torch.tensor([4, -1, 2], dtype=torch.int32)
    flags = torch.tensor([0, 0, 1], dtype=torch.int32)
    args = (q[:3], k[:3], v[:3], g[:3], beta[:3])
    expected = recurrent_gated_delta_rule_reference(*args, ref_state, rows, flags)
    got = recurrent_gated_delta_rule(*args, got_state, rows, flags)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, ref_state, rtol=1e-4, atol=1e-4)


def _recurrent_walk(q, k, v, g, beta, state, cu, slots, fresh):
    """The varlen prefill token by token on the recurrent reference (independent of the
    chunked form): state updated in place, out fp32."""
    out = torch.zeros(v.shape)
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            one = slice(t, t + 1)
            flag = fresh[b : b + 1] * int(t == cu[b])
            out[one] = recurrent_gated_delta_rule_reference(
                q[one], k[one], v[one], g[one], beta[one], state, slots[b : b + 1], flag
            ).float()
    return out


# lengths 1, 63, 64, 65, a multiple of 64, an empty row and a long one (5 chunks); head
# dims not powers of two, two value heads per k head, two Dv blocks (block_v 16)
CHUNKED_LENGTHS = [1, 63, 0, 64, 65, 128, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_kernel_matches_references(dtype):
    """Several sequences in one varlen batch, fresh and continuing (random start states on
    shuffled slots): the chunked kernels against the chunked reference and the recurrent
    one (bf16: on the same bf16-rounded inputs, computed in fp32)."""
    q, k, v, g, beta, state, cu, slots, fresh = _rule_case(CHUNKED_LENGTHS, 1, 2, 12, 24, 5)
    rounded = [x.to(dtype).float() for x in (q, k, v)]
    ref_state, walk_state, got_state = state.clone(), state.clone(), state.clone()
    expected = chunk_gated_delta_rule_reference(*rounded, g, beta, ref_state, cu, slots, fresh)
    walked = _recurrent_walk(*rounded, g, beta, walk_state, cu, slots, fresh)
    args = [x.to(dtype) for x in (q, k, v)]
    got = chunked_gated_delta_rule(*args, g, beta, got_state, cu, slots, fresh, block_v=16)
    assert got.dtype == dtype
    out_tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), expected, rtol=out_tol, atol=out_tol)
    torch.testing.assert_close(got.float(), walked, rtol=out_tol, atol=out_tol)
    torch.testing.assert_close(got_state, ref_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, walk_state, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[slots[torch.tensor(CHUNKED_LENGTHS) > 0].long()] = False
    assert torch.equal(got_state[untouched], state[untouched])  # the empty row, the scratch


def test_chunked_kernel_continues_across_calls():
    """Chunked prefill: one sequence's 230 tokens in two steps (a boundary at token 100,
    inside a chunk, so the second step's chunks start elsewhere) equal one step."""
    q, k, v, g, beta, state, cu, slots, fresh = _rule_case([230], 2, 2, 16, 16, 6)
    whole_state, split_state = state.clone(), state.clone()
    bounds = chunk_bounds(cu, 230)  # as the GDN backend hands it over, once a step
    whole = chunked_gated_delta_rule(q, k, v, g, beta, whole_state, cu, slots, fresh, bounds)
    parts = []
    for a, e, flag in ((0, 100, fresh), (100, 230, torch.zeros_like(fresh))):
        bounds = torch.tensor([0, e - a], dtype=torch.int32)
        parts.append(
            chunked_gated_delta_rule(
                q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], split_state, bounds, slots, flag
            )
        )
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_state, whole_state, rtol=1e-5, atol=1e-5)


# -- on the H200: bf16 inputs, a Qwen3-Next layer's geometry -------------------------------

# Measured bound (max abs error of bf16 kernel outputs vs the fp32 reference on the same
# bf16-rounded inputs, outputs of unit scale): see docs/benchmarks.md ("GDN kernels").
BF16_BOUND = 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[1], [1, 63, 65, 200], [4097]])
def test_kernels_bf16_on_gpu(lengths):
    hk, hv, dk, dv, width = 16, 32, 128, 128, 4
    channels = 2 * hk * dk + hv * dv
    x, cstate, weight, cu, slots, fresh = _conv_case(lengths, channels, width, 3, "cuda")
    xb, cb, wb = x.bfloat16(), cstate.bfloat16(), weight.bfloat16()
    ref_state = cb.float()
    expected = causal_conv1d_prefill_reference(xb.float(), ref_state, wb.float(), cu, slots, fresh)
    got = causal_conv1d_prefill(xb, cb, wb, cu, slots, fresh)
    conv_error = (got.float() - expected).abs().max().item()
    q, k, v, g, beta, state, cu, slots, fresh = _rule_case(lengths, hk, hv, dk, dv, 4, "cuda")
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref_state, got_state = state.clone(), state.clone()
    expected = chunk_gated_delta_rule_reference(
        qb.float(), kb.float(), vb.float(), g, beta, ref_state, cu, slots, fresh
    )
    got = chunk_gated_delta_rule(qb, kb, vb, g, beta, got_state, cu, slots, fresh)
    rule_error = (got.float() - expected).abs().max().item()
    state_error = (got_state - ref_state).abs().max().item()
    print(
        f"GDN bf16 {lengths}: conv {conv_error:.2e} rule {rule_error:.2e} state {state_error:.2e}"
    )
    assert conv_error < BF16_BOUND and rule_error < BF16_BOUND and state_error < 1e-3
    # decode: one token per sequence from the states just written
    rows = slots[: len(lengths)]
    zero = torch.zeros_like(rows)
    args = (qb[: len(lengths)], kb[: len(lengths)], vb[: len(lengths)])
    expected = recurrent_gated_delta_rule_reference(
        *(a.float() for a in args), g[: len(lengths)], beta[: len(lengths)], ref_state, rows, zero
    )
    got = recurrent_gated_delta_rule(
        *args, g[: len(lengths)], beta[: len(lengths)], got_state, rows, zero
    )
    assert (got.float() - expected).abs().max().item() < BF16_BOUND


# Measured bound of the chunked kernels in bf16 (max abs error of outputs vs the fp32
# reference on the same bf16-rounded inputs; the state is fp32 throughout): see
# docs/benchmarks.md ("GDN kernels"). The fp32 path uses ieee dots: tight on a GPU too.
CHUNKED_BF16_BOUND = 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[1], [1, 63, 64, 65, 200], [4097], [8192, 3000, 1]])
def test_chunked_kernel_on_gpu(lengths):
    """A Qwen3-Next layer's geometry (16 k heads, 32 v heads of 128): bf16 and fp32 inputs
    against the reference, and the sequential kernel beside it."""
    hk, hv, dk, dv = 16, 32, 128, 128
    q, k, v, g, beta, state, cu, slots, fresh = _rule_case(lengths, hk, hv, dk, dv, 7, "cuda")
    ref_state, got_state, seq_state = state.clone(), state.clone(), state.clone()
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    rounded = [x.float() for x in (qb, kb, vb)]
    expected = chunk_gated_delta_rule_reference(*rounded, g, beta, ref_state, cu, slots, fresh)
    got = chunked_gated_delta_rule(qb, kb, vb, g, beta, got_state, cu, slots, fresh)
    sequential = chunk_gated_delta_rule(qb, kb, vb, g, beta, seq_state, cu, slots, fresh)
    rule_error = (got.float() - expected).abs().max().item()
    state_error = (got_state - ref_state).abs().max().item()
    seq_error = (sequential.float() - expected).abs().max().item()
    fp32_state = state.clone()
    fp32 = chunked_gated_delta_rule(*rounded, g, beta, fp32_state, cu, slots, fresh)
    fp32_error = (fp32 - expected).abs().max().item()
    fp32_state_error = (fp32_state - ref_state).abs().max().item()
    print(
        f"GDN chunked {lengths}: bf16 out {rule_error:.2e} state {state_error:.2e} "
        f"(sequential kernel {seq_error:.2e}); fp32 out {fp32_error:.2e} "
        f"state {fp32_state_error:.2e}"
    )
    assert rule_error < CHUNKED_BF16_BOUND and state_error < 1e-3
    assert fp32_error < 1e-4 and fp32_state_error < 1e-4
