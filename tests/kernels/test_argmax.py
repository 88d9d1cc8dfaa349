"""greedy_argmax (two-stage Triton argmax) against torch.argmax."""

import pytest
import torch

from atom.kernels.argmax import (
    argmax_config,
    chunked_argmax_cpu,
    greedy_argmax,
    greedy_argmax_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "rows, vocab, dtype",
    [
        (1, 49152, torch.float32),  # SmolLM2's vocabulary
        (3, 1000, torch.float16),  # one chunk, not a power of 2
        (2, 40000, torch.float32),  # a partial last chunk
        pytest.param(1, 128256, torch.bfloat16, marks=pytest.mark.gpu),  # Llama 3
        pytest.param(257, 128256, torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
def test_greedy_argmax_matches_torch(rows, vocab, dtype):
    generator = torch.Generator().manual_seed(rows + vocab)
    device = "cuda" if dtype == torch.bfloat16 else DEVICE
    logits = torch.randn(rows, vocab, generator=generator).to(device, dtype)
    # the maximum in the last chunk of row 0, in the first position of the last row
    logits[0, -1] = 100.0
    logits[-1, 0] = 101.0
    tokens = greedy_argmax(logits)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert torch.equal(tokens, greedy_argmax_reference(logits))
    # a strided view (rows of a wider buffer) gives the same tokens
    wide = torch.zeros(rows, vocab + 64, device=device, dtype=dtype)
    wide[:, :vocab] = logits
    assert torch.equal(greedy_argmax(wide[:, :vocab]), tokens)


def test_ties_go_to_the_lowest_index_across_chunks():
    vocab = 40000
    block_v, num_chunks = argmax_config(vocab, on_gpu=DEVICE == "cuda")
    assert num_chunks > 1
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, [block_v + 5, 7, vocab - 1]] = 3.0  # equal maxima in three chunks
    logits[1] = -1.0  # every logit ties
    assert greedy_argmax(logits).tolist() == [7, 0]


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (2, 49152), (64, 49152), (5, 3000), (3, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_argmax_cpu_equals_torch(rows, vocab, dtype):
    """Random rows, ties inside and across chunks, a maximum in the short last chunk, NaN
    and all -inf rows: the indices of torch.argmax."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype)
    assert torch.equal(chunked_argmax_cpu(logits), logits.argmax(-1))
    special = logits.clone()
    special[0, [5, 1030, vocab - 1]] = 100.0  # ties: the first
    special[-1, vocab - 1] = 100.0  # the maximum in the last (short) chunk
    if rows > 2:
        special[1, [2000 % vocab, 7]] = float("nan")
        special[2] = float("-inf")
    assert torch.equal(chunked_argmax_cpu(special), special.argmax(-1))
    strided = torch.randn(rows, vocab + 7).to(dtype)[:, :vocab]  # rows of the padded buffer
    assert torch.equal(chunked_argmax_cpu(strided), strided.argmax(-1))
