"""DeepSeek-V4 decode at a fixed context does not depend on `max_model_len` (issue 32).

The decode chain of a CSA layer (indexer scores, top-k select, attention over the chosen
entries) and of an HCA layer (attention over every visible entry) runs at the same context
with the page-table rows and the scores row sized for a max_model_len of 8K and of 64K: the
torch references and the Triton kernels (CPU interpreter; `gpu` variants on CUDA) each give
bit-identical results at both, and the kernels match the references. The kernels read only
each row's own entries, so nothing past them (garbage here) can matter."""

import pytest
import torch

from atom.kernels.v4_attention import v4_decode_attention, v4_decode_attention_reference
from atom.kernels.v4_compressor import pool_layout
from atom.kernels.v4_indexer import indexer_topk_decode, indexer_topk_decode_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HEADS, DIM, INDEX_HEADS, INDEX_DIM, WINDOW, BLOCK, TOPK = 4, 32, 4, 16, 8, 16, 8
CSA_RATIO, HCA_RATIO = 4, 128


def _state(device):
    """Two sequences at positions 1299 and 520, and a padded row; pools of 300 blocks."""
    generator = torch.Generator().manual_seed(32)
    positions = torch.tensor([1299, 520, 0])
    context_lens = torch.tensor([1300, 521, 0], dtype=torch.int32)
    slots = torch.tensor([0, 1, -1], dtype=torch.int32)
    num_blocks = 300
    used = -(-1300 // BLOCK)
    blocks = torch.randperm(num_blocks, generator=generator)[: 2 * used].view(2, used)

    def pool(ratio, dim):
        return torch.randn(num_blocks + 1, *pool_layout(BLOCK, ratio, dim), generator=generator)

    state = dict(
        positions=positions, context_lens=context_lens, slots=slots, blocks=blocks,
        ring=torch.randn(3, WINDOW, DIM, generator=generator),
        csa_pool=pool(CSA_RATIO, DIM), hca_pool=pool(HCA_RATIO, DIM),
        index_pool=pool(CSA_RATIO, INDEX_DIM),
        q=torch.randn(3, HEADS, DIM, generator=generator),
        index_q=torch.randn(3, INDEX_HEADS, INDEX_DIM, generator=generator),
        index_weights=torch.randn(3, INDEX_HEADS, generator=generator),
        sinks=torch.randn(HEADS, generator=generator),
    )  # fmt: skip
    return {k: v.to(device) for k, v in state.items()}


def _decode(s, max_model_len: int, kernels: bool):
    """(top-k ids, CSA output, HCA output) with tables and scores sized for max_model_len."""
    device = s["q"].device
    # the engine's rows: max_model_len / block_size columns, unused ones padded (garbage)
    tables = torch.full((3, max_model_len // BLOCK), 7, dtype=torch.int32, device=device)
    tables[:2, : s["blocks"].shape[1]] = s["blocks"].int()
    topk = indexer_topk_decode if kernels else indexer_topk_decode_reference
    attend = v4_decode_attention if kernels else v4_decode_attention_reference
    common = (s["positions"], s["context_lens"])
    ids = topk(
        s["index_q"], s["index_weights"], s["index_pool"], tables, *common, CSA_RATIO, BLOCK,
        TOPK, -(-max_model_len // CSA_RATIO),
    )  # fmt: skip
    args = (s["q"], s["ring"], s["slots"], *common)
    scale = DIM**-0.5
    csa = attend(*args, s["csa_pool"], ids, tables, CSA_RATIO, BLOCK, s["sinks"], scale)
    hca = attend(*args, s["hca_pool"], None, tables, HCA_RATIO, BLOCK, s["sinks"], scale)
    return ids, csa, hca


@pytest.mark.parametrize("device", DEVICES)
def test_decode_identical_at_8k_and_64k_max_model_len(device):
    state = _state(device)
    results = {}
    for kernels in (False, True):
        short, long = (_decode(state, n, kernels) for n in (8192, 65536))
        for a, b in zip(short, long, strict=True):
            assert torch.equal(a, b)  # bit for bit
        results[kernels] = short
    (ref_ids, ref_csa, ref_hca), (ids, csa, hca) = results[False], results[True]
    assert torch.equal(ids, ref_ids)
    assert (ids[0] >= 0).all() and (ids[2] == -1).all()
    torch.testing.assert_close(csa, ref_csa, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(hca, ref_hca, rtol=2e-4, atol=2e-4)
    assert hca[2].abs().max() == 0 and csa[2].abs().max() == 0  # the padded row
