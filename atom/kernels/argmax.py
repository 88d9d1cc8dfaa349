"""Greedy sampling: argmax over the vocabulary in two short kernels.

Shapes and dtypes:
    logits   [rows, vocab], fp32/bf16/fp16; rows may be strided, vocab must be unit-stride.
    tokens   [rows] int64: the index of each row's largest logit; on ties the lowest
             index (as torch.argmax on CPU and CUDA). NaN logits are not supported (torch
             would return a NaN's index).

Why two stages: one program per row (what a plain row reduction does at batch 1) reads all
128K logits of Llama-3's vocabulary alone, tens of microseconds. Stage 1 splits each row into
chunks of BLOCK_V logits over many programs (their maxima and indices to a small fp32/int32
scratch), stage 2 reduces each row's chunk results; both are a few microseconds.

Runtime lengths: rows (the grid only, no argument). Geometry (constexpr): vocab, chunk
size, chunk count. Offsets are int64 (rows x vocab passes 2^31 at 16K rows of 128K).
"""

import torch

from atom.kernels.platform import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): keep the module importable for the reference
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,
    chunk_max_ptr,  # [rows, NUM_CHUNKS] fp32
    chunk_index_ptr,  # [rows, NUM_CHUNKS] int32
    stride_logits_row,
    VOCAB: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    # Program (row, chunk): the largest of logits[row, chunk * BLOCK_V : + BLOCK_V].
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < VOCAB
    values = tl.load(
        logits_ptr + row * stride_logits_row + offs, mask=mask, other=float("-inf")
    ).to(tl.float32)
    best = tl.max(values, axis=0)
    # lowest index holding the maximum (ties go left, as torch.argmax)
    index = tl.min(tl.where(values == best, offs, VOCAB), axis=0)
    tl.store(chunk_max_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(chunk_index_ptr + row * NUM_CHUNKS + chunk, index)


@triton.jit
def _rows_argmax_kernel(
    chunk_max_ptr,
    chunk_index_ptr,
    tokens_ptr,  # [rows] int64
    VOCAB: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    BLOCK_C: tl.constexpr,  # next_power_of_2(NUM_CHUNKS)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < NUM_CHUNKS
    best = tl.load(chunk_max_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    index = tl.load(chunk_index_ptr + row * NUM_CHUNKS + offs, mask=mask, other=VOCAB)
    top = tl.max(best, axis=0)
    # chunks are in index order: the lowest index among the chunks holding the maximum
    token = tl.min(tl.where(best == top, index, VOCAB), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))


def argmax_config(vocab: int, on_gpu: bool) -> tuple[int, int]:
    """(BLOCK_V, number of chunks) for a vocabulary: geometry only."""
    # 2K logits per program on a GPU (63 programs per row at 128K); the interpreter pays
    # per program, so it takes big chunks.
    block_v = 2048 if on_gpu else 16384
    block_v = min(block_v, triton.next_power_of_2(vocab))
    return block_v, triton.cdiv(vocab, block_v)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit: [rows, vocab] -> [rows] int64 (ties: lowest).

    Runs the Triton kernels on CUDA (or under TRITON_INTERPRET=1), the torch reference
    otherwise.
    """
    if not use_triton(logits):
        return greedy_argmax_reference(logits)
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits [rows, vocab], vocab unit-stride"
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    block_v, num_chunks = argmax_config(vocab, logits.is_cuda)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits,
        chunk_max,
        chunk_index,
        logits.stride(0),
        VOCAB=vocab,
        BLOCK_V=block_v,
        NUM_CHUNKS=num_chunks,
        num_warps=4,
    )
    _rows_argmax_kernel[(rows,)](
        chunk_max,
        chunk_index,
        tokens,
        VOCAB=vocab,
        NUM_CHUNKS=num_chunks,
        BLOCK_C=triton.next_power_of_2(num_chunks),
        num_warps=1,
    )
    return tokens


def greedy_argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``greedy_argmax``."""
    return logits.argmax(dim=-1)


# Logits per chunk of `chunked_argmax_cpu`
CPU_ARGMAX_CHUNK = 1024


def chunked_argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [rows, vocab] CPU logits, the same indices (ties and
    NaN included: the first), faster from 2 rows: on CPU torch's argmax of several rows
    does not vectorize (3.9 ms at 64 x 49152 fp32, 1 thread, against 0.07 ms for one row),
    its amax does. Each row's chunk maxima (amax over [rows, chunks, CPU_ARGMAX_CHUNK]),
    the first chunk holding the row's maximum, then the argmax inside that chunk only."""
    rows, vocab = logits.shape
    chunk = CPU_ARGMAX_CHUNK
    num_chunks = vocab // chunk
    if rows < 2 or num_chunks < 2 or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    maxima = logits[:, : num_chunks * chunk].view(rows, num_chunks, chunk).amax(-1)
    if num_chunks * chunk < vocab:  # the short last chunk
        tail = logits[:, num_chunks * chunk :].amax(-1, keepdim=True)
        maxima = torch.cat((maxima, tail), dim=1)
    starts = maxima.argmax(dim=-1) * chunk
    # the short last chunk repeats its last logit past the vocabulary: never a first maximum
    index = (starts[:, None] + torch.arange(chunk)).clamp_(max=vocab - 1)
    return starts + logits.gather(1, index).argmax(dim=-1)
