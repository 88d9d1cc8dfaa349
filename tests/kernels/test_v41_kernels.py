"""DeepSeek-V4.1 kernels against their torch references (and the references against
hand-computed values): fake quantisation (FP8 e4m3 / FP4 e2m1, ue8m0 and e4m3 scales),
Engram hashing, the two-level top-k. Kernels run under TRITON_INTERPRET=1 on CPU
(conftest) and on CUDA when there is one; bf16 inputs only on CUDA (the interpreter rounds
float -> bf16 toward zero)."""

import pytest
import torch

from atom.kernels.v41_engram import (
    engram_hash,
    engram_hash_reference,
    engram_multipliers,
    engram_offsets,
    engram_primes,
)
from atom.kernels.v41_quant import (
    e2m1_round,
    fake_quant_fp4,
    fake_quant_fp4_reference,
    fake_quant_fp8,
    fake_quant_fp8_reference,
)
from atom.kernels.v41_topk import candidate_blocks_reference, two_level_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def _values(rows, width, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator) * 10 ** torch.randint(
        -3, 3, (rows, 1), generator=generator
    )
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # e2m1 ties (scale 1)
    return x.to(DEVICE, dtype)


def test_e2m1_rounds_to_nearest_even():
    q = torch.tensor([0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, -0.75, -6.0])
    expected = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -6.0]
    assert e2m1_round(q).tolist() == expected


def test_fp8_reference_by_hand_and_skips_unblocked_widths():
    x = torch.zeros(1, 32)
    # amax 1344: scale 2^ceil(log2 3) = 4; 1344 / 4 = 336 = 10.5 steps of 32: ties to 320;
    # 1.03125 / 4 = 0.2578 = 8.25 steps of 2^-5: 0.25
    x[0, 0], x[0, 1] = 448.0 * 3, 1.0 + 2**-5
    y = fake_quant_fp8_reference(x)
    assert y[0, 0] == 1280.0 and y[0, 1] == 1.0
    odd = torch.randn(3, 40)
    assert fake_quant_fp8_reference(odd) is odd and fake_quant_fp4_reference(odd, 32) is odd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37])
def test_fake_quant_kernels_match_references(rows, dtype):
    x = _values(rows, 64, dtype)
    torch.testing.assert_close(
        fake_quant_fp8(x, 32), fake_quant_fp8_reference(x, 32), rtol=0, atol=0
    )
    torch.testing.assert_close(
        fake_quant_fp4(x, 32), fake_quant_fp4_reference(x, 32), rtol=0, atol=0
    )
    torch.testing.assert_close(
        fake_quant_fp4(x, 16, True), fake_quant_fp4_reference(x, 16, True), rtol=0, atol=0
    )


def test_engram_hash_kernel_matches_reference_and_hand_value():
    primes = torch.tensor(engram_primes(2, 4, 2, 61))
    offsets = torch.tensor(engram_offsets(primes.tolist()))
    multipliers = engram_multipliers([0, 2], 4, 98)
    tokens = torch.randint(0, 98, (300, 4), generator=torch.Generator().manual_seed(1))
    expected = engram_hash_reference(tokens, multipliers, primes, offsets)
    got = engram_hash(
        tokens.to(DEVICE), multipliers.to(DEVICE), primes.to(DEVICE), offsets.to(DEVICE)
    )
    assert torch.equal(got.cpu(), expected)
    # column (n=3, head 1) of layer 1 by hand
    t, m = tokens[5].tolist(), multipliers[1].tolist()
    h = (t[0] * m[0]) ^ (t[1] * m[1]) ^ (t[2] * m[2])
    assert expected[5, 1, 3] == h % primes[1, 1, 1] + offsets[1, 3]


def test_candidate_blocks_pin_the_newest_block_and_drop_unreachable():
    inf = float("-inf")
    # 10 entries in blocks of 4: query sees 9 (blocks 0, 1 full; block 2 partial)
    scores = torch.tensor([[5.0, 1.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.5, inf]])
    keep = candidate_blocks_reference(scores, torch.tensor([9]), 2, 4)
    assert keep[0].tolist() == [False] * 4 + [True] * 6  # best full block 1 + newest block 2
    keep = candidate_blocks_reference(torch.full((1, 10), inf), torch.tensor([0]), 2, 4)
    assert not keep.any()
    visible = torch.tensor([[True] * 9 + [False]])
    chosen = two_level_topk_reference(scores, visible, 2, keep | True)
    assert sorted(chosen[0].tolist()) == [0, 4]
    chosen = two_level_topk_reference(
        scores, visible, 2, candidate_blocks_reference(scores, torch.tensor([9]), 2, 4)
    )
    assert sorted(chosen[0].tolist()) == [4, 8]
