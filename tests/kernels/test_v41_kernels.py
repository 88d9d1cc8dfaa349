"""DeepSeek-V4.1 kernels against their torch references (and the references against
hand-computed values): fake quantisation (FP8 e4m3 / FP4 e2m1, ue8m0 and e4m3 scales),
Engram hashing, the two-level top-k's references (candidate blocks, then entries), the
indexer scores over a shared source's keys, the decode pooling on V4's compressor kernel
and the one-launch store of entries and keys (the Triton top-k and Engram lookup, candidates
that lost, are tested in benchmarks/tests/test_v41_candidates.py). Kernels run under TRITON_INTERPRET=1 on CPU
(conftest) and on CUDA when there is one; bf16 inputs only on CUDA (the interpreter rounds
float -> bf16 toward zero). Lengths 1, non-multiples of every tile and long rows.

Bounds (docs/benchmarks.md, "DeepSeek-V4.1 kernels"): fake quantisation, hashing and the
top-k are exact (same bits, same ids in the same order); the bf16 Engram lookup is within
`ENGRAM_BF16_BOUND` of the fp32 reference on the same bf16 inputs (max |error| / max
|reference|; the test prints the measured figure)."""

import pytest
import torch

from atom.kernels.v4_indexer import index_scores_decode, index_scores_decode_reference
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


def _scores_with_ties(rows, width, seed):
    """Index scores with exact ties (zeros, -0.0, repeated integers) and causal masks:
    each row sees its first ``num_visible`` entries (0 and all of them included)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, generator=generator)
    scores = torch.where(torch.rand(rows, width, generator=generator) < 0.3, scores.round(), scores)
    scores[:, ::5] = 0.0
    scores[:, 1::7] = -0.0
    num_visible = torch.randint(0, width + 1, (rows,), generator=generator)
    num_visible[0] = width
    if rows > 2:
        num_visible[1] = 0
    visible = torch.arange(width)[None, :] < num_visible[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    return masked.to(DEVICE), num_visible.to(DEVICE), visible.to(DEVICE)


def test_candidate_reference_breaks_block_ties_by_the_lower_block():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5]])  # blocks of 3
    keep = candidate_blocks_reference(scores, torch.tensor([7]), 2, 3)
    assert keep[0].tolist() == [True] * 3 + [False] * 3 + [True] * 3  # block 0 + newest 2


def test_two_level_topk_ties_do_not_depend_on_width_or_batch():
    """Row 0 of a tie-heavy batch, alone and padded to a wider row (invisible entries, as a
    larger max_model_len gives the decode rows): the same blocks and the same ids, each the
    lower index among equal scores (the Triton candidate: benchmarks/tests)."""
    scores, num_visible, visible = _scores_with_ties(4, 37, 11)
    wide = torch.nn.functional.pad(scores, (0, 91), value=float("-inf"))
    wide_visible = torch.nn.functional.pad(visible, (0, 91), value=False)
    for blocks_of, topk_of in ((candidate_blocks_reference, two_level_topk_reference),):
        picks = []
        for s, v, n in ((scores, visible, num_visible), (scores[:1], visible[:1], num_visible[:1]),
                        (wide[:1], wide_visible[:1], num_visible[:1])):  # fmt: skip
            blocks = blocks_of(s, n, 3, 4)
            picks.append((blocks[0, :37].tolist(), topk_of(s, v, 6, blocks)[0].tolist()))
        assert picks[0] == picks[1] == picks[2]
    row = scores[0].tolist()  # the rule by hand inside the candidate blocks
    inside = [i for i, keep in enumerate(picks[0][0]) if keep]
    ranked = sorted((-row[i], i) for i in inside)
    assert picks[0][1] == [i for _, i in ranked[:6]]


def _engram_case(tokens, dtype, hc=2, dim=64, cols=6, head_dim=16, rows=300, seed=0):
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, head_dim, generator=generator)
    wkv = torch.randn((hc + 1) * dim, cols * head_dim, generator=generator) * cols**-0.5 / 4
    q_weight, k_weight = torch.randn(2, hc, dim, generator=generator)
    streams = torch.randn(tokens, hc, dim, generator=generator)
    hash_ids = torch.randint(0, rows, (tokens, 2, cols), generator=generator)[:, 1]  # a view
    args = [streams, hash_ids, table, wkv, q_weight, k_weight]
    return [a.to(DEVICE, dtype) if a.is_floating_point() else a.to(DEVICE) for a in args]


@pytest.mark.parametrize("positions", [[0, 1], [2, 40, 63, 5]])
def test_index_scores_over_a_shared_source_match_reference(positions):
    """The scores a later index layer reads from its KV source's keys (ratio 1, block 16):
    -inf where the row may not see an entry (a padded row sees none)."""
    torch.manual_seed(len(positions))
    heads, dim, ratio, block_size, max_entries = 16, 32, 1, 16, 64
    rows = len(positions)
    positions = torch.tensor(positions, device=DEVICE)
    context_lens = (positions + 1).int()
    context_lens[-1] = 0
    width = max_entries // block_size
    tables = torch.randperm(rows * width, device=DEVICE)[: rows * width].view(rows, width).int()
    pool = torch.randn(rows * width + 1, block_size, dim, device=DEVICE)
    q = torch.randn(rows, heads, dim, device=DEVICE)
    weights = torch.randn(rows, heads, device=DEVICE)
    args = (q, weights, pool, tables, positions, context_lens, ratio, block_size, max_entries)
    expected = index_scores_decode_reference(*args)
    torch.testing.assert_close(index_scores_decode(*args), expected, rtol=1e-5, atol=1e-5)
    assert torch.isinf(expected[-1]).all()


@pytest.mark.parametrize("ties", [False, True])
def test_decode_selects_match_the_two_level_references(ties):
    """Decode on CUDA chooses with V4's select over each row's own entries: the candidate
    blocks and the top-k inside them are the references' sets (ids ascending, -1 after)."""
    from atom.kernels.v4_indexer import ascending_ids
    from atom.kernels.v41_topk import candidate_blocks_decode, two_level_topk_decode

    generator = torch.Generator().manual_seed(41)
    rows, width, block_size, topk_blocks, topk = 4, 700, 16, 5, 24
    if ties:  # ReLU zeros and repeated values: ties at both levels
        scores = torch.randint(0, 3, (rows, width), generator=generator).float()
    else:
        scores = torch.randn(rows, width, generator=generator)
    num_visible = torch.tensor([700, 333, 17, 0])
    visible = torch.arange(width)[None, :] < num_visible[:, None]
    scores = scores.masked_fill(~visible, float("-inf")).to(DEVICE)
    visible, num_visible = visible.to(DEVICE), num_visible.to(DEVICE)
    expected_blocks = candidate_blocks_reference(scores, num_visible, topk_blocks, block_size)
    got_blocks = candidate_blocks_decode(scores, num_visible, topk_blocks, block_size)
    assert torch.equal(got_blocks, expected_blocks)
    for candidates in (None, got_blocks):
        expected = two_level_topk_reference(scores, visible, topk, candidates)
        got = two_level_topk_decode(scores, num_visible, topk, candidates)
        assert torch.equal(got, ascending_ids(expected)), (got, expected)


@pytest.mark.parametrize("ratio,dim,length", [(2, 40, 1), (2, 32, 9), (4, 24, 23)])
def test_compressor_latent_decode_matches_reference(ratio, dim, length):
    """V4.1's decode pooling on V4's compressor kernel (no position bias, the latent out):
    token by token over a sequence with a padded row beside it, the same state bit for bit
    and the same latent of every row (a partial group too; ~4e-7 apart on the CPU)."""
    from atom.kernels.v4_compressor import (
        compressor_latent_decode,
        compressor_latent_decode_reference,
    )

    generator = torch.Generator().manual_seed(ratio + length)
    kv = torch.randn(length, 2, dim, generator=generator).to(DEVICE)
    gate = torch.randn(length, 2, dim, generator=generator).to(DEVICE)
    states = [torch.zeros(3, ratio, dim, device=DEVICE) for _ in range(4)]
    slots = torch.tensor([1, -1], device=DEVICE, dtype=torch.int32)
    for t in range(length):
        positions = torch.tensor([t, 0], device=DEVICE)
        expected = compressor_latent_decode_reference(
            *states[:2], kv[t], gate[t], slots, positions, torch.float32
        )
        got = compressor_latent_decode(*states[2:], kv[t], gate[t], slots, positions, torch.float32)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # CUDA: tl.exp approx
    for got, expected in zip(states[2:], states[:2], strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("ratio,with_keys", [(1, True), (2, True), (2, False)])
def test_store_entries_decode_matches_reference(ratio, with_keys):
    """The entries (and keys) of the rows that close a group, in one launch: the same pools
    as the reference outside the scratch block (which the reference writes for the other
    rows); padded rows (state slot -1) and rows mid-group store nothing."""
    from atom.kernels.v4_compressor import (
        pool_layout,
        store_entries_decode,
        store_entries_decode_reference,
    )

    generator = torch.Generator().manual_seed(ratio)
    dim, key_dim, block_size, width = 40, 24, 16, 4
    positions = torch.tensor([0, 1, 17, 33, 63, 5], device=DEVICE)
    slots = torch.tensor([0, 1, 2, 3, -1, 5], device=DEVICE, dtype=torch.int32)
    rows = len(positions)
    tables = torch.randperm(rows * width, generator=generator).view(rows, width).int().to(DEVICE)
    entries = torch.randn(rows, dim, generator=generator).to(DEVICE)
    keys = torch.randn(rows, key_dim, generator=generator).to(DEVICE) if with_keys else None
    num_blocks = rows * width + 1
    pools = [
        torch.zeros(num_blocks, *pool_layout(block_size, ratio, d), device=DEVICE)
        for d in (dim, key_dim) * 2
    ]
    for fn, (pool, index_pool) in (
        (store_entries_decode_reference, pools[:2]),
        (store_entries_decode, pools[2:]),
    ):
        fn(pool, tables, slots, positions, entries, ratio, block_size,
           index_pool if with_keys else None, keys)  # fmt: skip
    assert torch.equal(pools[2][:-1], pools[0][:-1])
    assert torch.equal(pools[3][:-1], pools[1][:-1])
    assert pools[2].count_nonzero() == (5 if ratio == 1 else 4) * dim  # live rows that close
