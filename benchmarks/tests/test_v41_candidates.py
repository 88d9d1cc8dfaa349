"""The kernels that lost to their torch references, beside the benchmarks as candidates
(benchmarks/candidates/): DeepSeek-V4.1's Triton two-level top-k and Engram lookup against
the references the engine runs (moved from tests/kernels/test_v41_kernels.py and
test_recompile_guard.py, and tests/model_engine/test_topk_ties.py's engine check)."""

import pytest
import torch

import atom.attention.v41
from atom.kernels.v41_engram import engram_reference
from atom.kernels.v41_topk import candidate_blocks_reference, two_level_topk_reference
from benchmarks.candidates import v41_engram_lookup, v41_topk
from benchmarks.candidates.v41_engram_lookup import engram
from benchmarks.candidates.v41_topk import candidate_blocks, two_level_topk
from tests.engine_support import build_llm, vocab_prompts
from tests.kernels.recompile_guard import SWEEP, assert_one_variant, kernel_arguments
from tests.kernels.test_v41_kernels import DEVICE, _engram_case, _scores_with_ties
from tests.model_engine.test_topk_ties import _tokens, v41_ties_dir  # noqa: F401 (a fixture)

pytest.importorskip("triton")
BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "rows,width,topk,block_size,topk_blocks",
    [(1, 1, 4, 4, 3), (4, 37, 6, 4, 3), (3, 130, 200, 8, 40), (2, 1500, 64, 16, 7)],
)
def test_two_level_topk_kernels_match_references(rows, width, topk, block_size, topk_blocks):
    """Same candidate blocks and the same entry ids in the same order (ties: lower index;
    -1 pads where fewer entries are visible than k; candidates restrict the second level)."""
    scores, num_visible, visible = _scores_with_ties(rows, width, width)
    expected_blocks = candidate_blocks_reference(scores, num_visible, topk_blocks, block_size)
    blocks = candidate_blocks(scores, num_visible, topk_blocks, block_size)
    assert torch.equal(blocks, expected_blocks)
    for candidates in (None, expected_blocks):
        expected = two_level_topk_reference(scores, visible, topk, candidates)
        got = two_level_topk(scores, visible, topk, candidates)
        assert torch.equal(got, expected), (got, expected)


def test_candidate_blocks_break_block_ties_by_the_lower_block():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5]])  # blocks of 3
    keep = candidate_blocks_reference(scores, torch.tensor([7]), 2, 3)
    assert torch.equal(
        candidate_blocks(scores.to(DEVICE), torch.tensor([7]).to(DEVICE), 2, 3).cpu(), keep
    )


def test_two_level_topk_ties_do_not_depend_on_width_or_batch():
    """Row 0 of a tie-heavy batch, alone and padded to a wider row (invisible entries, as a
    larger max_model_len gives the decode rows): the same blocks and the same ids, Triton
    and references alike, each the lower index among equal scores."""
    scores, num_visible, visible = _scores_with_ties(4, 37, 11)
    wide = torch.nn.functional.pad(scores, (0, 91), value=float("-inf"))
    wide_visible = torch.nn.functional.pad(visible, (0, 91), value=False)
    for blocks_of, topk_of in ((candidate_blocks, two_level_topk),
                               (candidate_blocks_reference, two_level_topk_reference)):  # fmt: skip
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


@pytest.mark.gpu
def test_two_level_topk_long_rows_on_gpu():
    """A 64K-entry row and a decode batch of 64 on the H200: still exact."""
    for rows, width, topk in [(1, 65536, 512), (64, 4097, 128)]:
        scores, num_visible, visible = _scores_with_ties(rows, width, rows)
        blocks = candidate_blocks_reference(scores, num_visible, 64, 64)
        assert torch.equal(candidate_blocks(scores, num_visible, 64, 64), blocks)
        expected = two_level_topk_reference(scores, visible, topk, blocks)
        assert torch.equal(two_level_topk(scores, visible, topk, blocks), expected)


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_engram_lookup_kernel_matches_reference(tokens):
    args = _engram_case(tokens, torch.float32, hc=4 if tokens == 37 else 2, dim=40)
    expected = engram_reference(*args, 1e-20)
    torch.testing.assert_close(engram(*args, 1e-20), expected, rtol=1e-5, atol=1e-5)


# bf16 Engram lookup on CUDA against the fp32 reference of the same bf16 inputs:
# max |error| / max |reference|. The kernel keeps key and value in fp32 and rounds only its
# output, so the gap is bf16 output rounding (at most 2^-8 = 3.9e-3 of an element). CPU
# proxy of the kernel (the fp32 reference, output rounded to bf16), this test's shapes:
# 2.8e-3 / 2.1e-3 / 3.3e-3 at 1 / 37 / 512 tokens; the torch reference run in bf16 itself
# is 2.8e-3 / 3.7e-3 / 7.7e-3 from fp32. The H200 figure is printed by the test.
ENGRAM_BF16_BOUND = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 4097])
def test_engram_lookup_bf16_on_gpu(tokens):
    args = _engram_case(tokens, torch.bfloat16, hc=4, dim=1024, cols=16, head_dim=64, rows=5000)
    expected = engram_reference(*[a.float() if a.is_floating_point() else a for a in args], 1e-6)
    got = engram(*args, 1e-6)
    gap = ((got.float() - expected).abs().max() / expected.abs().max()).item()
    print(f"engram bf16 tokens {tokens}: relative gap {gap:.2e} (bound {ENGRAM_BF16_BOUND})")
    assert gap <= ENGRAM_BF16_BOUND


# -- one compiled variant over the length sweep (tests/kernels/test_recompile_guard.py's rule)

KERNELS = {
    # the Engram lookup: gathered GEMM, then the gate (the hash-id row stride is the number
    # of engram columns of every layer, the streams' row stride hc * hidden: geometry)
    (v41_engram_lookup, "_engram_kv_kernel"): (["num_tokens"], ["stride_hash_row"]),
    (v41_engram_lookup, "_engram_gate_kernel"): (
        ["num_tokens"],
        ["stride_streams_row", "eps", "scale"],
    ),
    # the two-level top-k: row width (entries or blocks), k and the row strides (the width
    # again, for prefill rows of every length) are runtime
    (v41_topk, "_topk_kernel"): (
        [
            "num_items",
            "num_entries",
            "k",
            "stride_scores_row",
            "stride_allowed_row",
            "stride_out_row",
        ],
        [],
    ),
}


@pytest.mark.parametrize("module, name", list(KERNELS), ids=[n for _, n in KERNELS])
def test_runtime_lengths_are_dynamic(module, name):
    runtime, fixed = KERNELS[module, name]
    names, dns, constexpr = kernel_arguments(getattr(module, name))
    assert set(runtime) <= set(names) and set(runtime) == set(dns)
    assert not set(runtime) & set(constexpr)
    assert set(fixed) <= set(names) and not set(fixed) & set(constexpr)


def _generator():
    return torch.Generator("cuda").manual_seed(0)


@pytest.mark.gpu
def test_v41_engram_lookup_one_variant():
    hc, dim, cols, head_dim = 4, 512, 6, 32
    tokens = max(SWEEP)
    streams = torch.randn(tokens, hc, dim, device="cuda", dtype=BF16)
    hash_ids = torch.randint(0, 5000, (tokens, 2, cols), device="cuda")[:, 1]
    table = torch.randn(5000, head_dim, device="cuda", dtype=BF16)
    wkv = torch.randn((hc + 1) * dim, cols * head_dim, device="cuda", dtype=BF16)
    q_weight, k_weight = torch.randn(2, hc, dim, device="cuda", dtype=BF16)

    def run(n):
        v41_engram_lookup.engram(streams[:n], hash_ids[:n], table, wkv, q_weight, k_weight, 1e-6)

    assert_one_variant(v41_engram_lookup, ["_engram_kv_kernel", "_engram_gate_kernel"], run)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["candidate_blocks", "entries"])
def test_v41_two_level_topk_one_variant(level):
    """Row widths (prefill: one row per query over its sequence's entries; decode: the
    static entry count) and row counts swept; one variant per level (MODE constexpr)."""
    scores = torch.randn(64, max(SWEEP), device="cuda")
    generator = _generator()

    def run(n):
        rows = min(n, 64)
        num_visible = torch.randint(0, n + 1, (rows,), device="cuda", generator=generator)
        visible = torch.arange(n, device="cuda")[None] < num_visible[:, None]
        masked = scores[:rows, :n].masked_fill(~visible, float("-inf"))
        if level == "candidate_blocks":
            v41_topk.candidate_blocks(masked, num_visible, 8, 64)
        else:
            v41_topk.two_level_topk(masked, visible, 512, visible)

    assert_one_variant(v41_topk, ["_topk_kernel"], run)


@pytest.mark.gpu
def test_v41_triton_topk_and_references_pick_the_same_on_ties(v41_ties_dir, monkeypatch):  # noqa: F811
    """On CUDA (eager) the two-level top-k's Triton kernels and the torch references choose
    the same entries on the tie-prone config: the same tokens (fp32)."""
    prompts = vocab_prompts(5, [70, 33, 90, 7], 256)
    cuda = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=64,
                max_model_len=128, enforce_eager=True)  # fmt: skip
    references = _tokens(build_llm(v41_ties_dir, **cuda), prompts)
    monkeypatch.setattr(atom.attention.v41, "candidate_blocks_reference", candidate_blocks)
    monkeypatch.setattr(atom.attention.v41, "two_level_topk_reference", two_level_topk)
    assert _tokens(build_llm(v41_ties_dir, **cuda), prompts) == references
