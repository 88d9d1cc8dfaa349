"""DeepSeek-V4.1 kernels on the GPU: the Triton two-level top-k and Engram lookup (candidates
that lost, benchmarks/candidates/) against their torch references, which the engine runs
(device time, CUDA graphs), and whether they agree.

    python -m benchmarks.deepseek_v41_kernels

One JSON line per case, on stdout: ``topk`` (candidate blocks, then entries inside them,
for B query rows over N entries; a row per decode sequence) and ``engram`` (T tokens,
hc streams of the hidden size). Each line has the Triton and the reference device
microseconds per call (median of 15 replays of a CUDA graph of 20 calls: the capture also
checks that the kernels are graph-capturable) and ``equal`` / ``gap`` against the reference
(the top-k must be exact; the Engram gap is max |error| / max |reference| in bf16).
"""

from __future__ import annotations

import argparse

import torch

from atom.kernels import v41_engram, v41_topk
from benchmarks.candidates import v41_engram_lookup
from benchmarks.candidates import v41_topk as v41_topk_triton
from benchmarks.harness import device_us, emit

DEVICE = "cuda"


def bench_topk(rows: int, entries: int, topk: int, block_size: int, topk_blocks: int) -> None:
    generator = torch.Generator(DEVICE).manual_seed(rows + entries)
    scores = torch.randn(rows, entries, device=DEVICE, generator=generator)
    num_visible = torch.randint(1, entries + 1, (rows,), device=DEVICE, generator=generator)
    visible = torch.arange(entries, device=DEVICE)[None] < num_visible[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))

    def triton_path():
        blocks = v41_topk_triton.candidate_blocks(scores, num_visible, topk_blocks, block_size)
        return blocks, v41_topk_triton.two_level_topk(scores, visible, topk, blocks)

    def reference_path():
        blocks = v41_topk.candidate_blocks_reference(scores, num_visible, topk_blocks, block_size)
        return blocks, v41_topk.two_level_topk_reference(scores, visible, topk, blocks)

    got, expected = triton_path(), reference_path()
    equal = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    emit(
        case="topk", rows=rows, entries=entries, topk=topk, block_size=block_size,
        topk_blocks=topk_blocks, triton_us=round(device_us(triton_path), 2),
        reference_us=round(device_us(reference_path), 2), equal=equal,
    )  # fmt: skip


def bench_decode_select(rows: int, entries: int, topk: int, block_size: int, topk_blocks: int):
    """The engine's decode choice on CUDA (attention/v41.py ``_choose_decode``: the
    Triton select over each row's own entries) against the references it replaced
    (``_choose``: a sort over the whole max_model_len row), candidate blocks then entries
    inside them, as a candidate-source layer runs them."""
    generator = torch.Generator(DEVICE).manual_seed(rows * 7 + entries)
    scores = torch.randn(rows, entries, device=DEVICE, generator=generator)
    # a decode row at a fixed context inside a wider max_model_len row
    counts = torch.full((rows,), entries // 8, device=DEVICE, dtype=torch.int32)
    visible = torch.arange(entries, device=DEVICE)[None] < counts[:, None].long()
    scores = scores.masked_fill(~visible, float("-inf"))

    def select_path():
        blocks = v41_topk.candidate_blocks_decode(scores, counts, topk_blocks, block_size)
        return blocks, v41_topk.two_level_topk_decode(scores, counts, topk, blocks)

    def reference_path():
        blocks = v41_topk.candidate_blocks_reference(scores, counts.long(), topk_blocks, block_size)
        return blocks, v41_topk.two_level_topk_reference(scores, visible, topk, blocks)

    (got_blocks, got), (want_blocks, want) = select_path(), reference_path()
    same = torch.equal(got_blocks, want_blocks) and all(
        set(a[a >= 0].tolist()) == set(b[b >= 0].tolist()) for a, b in zip(got, want, strict=True)
    )
    emit(
        case="decode_select", rows=rows, entries=entries, visible=entries // 8, topk=topk,
        select_us=round(device_us(select_path), 2),
        reference_us=round(device_us(reference_path), 2), same_sets=same,
    )  # fmt: skip


def bench_engram(tokens: int, hc: int, hidden: int, cols: int, head_dim: int, rows: int):
    generator = torch.Generator(DEVICE).manual_seed(tokens)

    def randn(*shape, scale=1.0):
        x = torch.randn(*shape, device=DEVICE, generator=generator) * scale
        return x.to(torch.bfloat16)

    streams = randn(tokens, hc, hidden)
    hash_ids = torch.randint(0, rows, (tokens, cols), device=DEVICE, generator=generator)
    table = randn(rows, head_dim)
    wkv = randn((hc + 1) * hidden, cols * head_dim, scale=(cols * head_dim) ** -0.5)
    q_weight, k_weight = randn(hc, hidden), randn(hc, hidden)
    args = (streams, hash_ids, table, wkv, q_weight, k_weight, 1e-6)
    fp32 = [a.float() if a.is_floating_point() else a for a in args[:-1]]
    expected = v41_engram.engram_reference(*fp32, 1e-6)
    got = v41_engram_lookup.engram(*args).float()
    gap = ((got - expected).abs().max() / expected.abs().max()).item()
    emit(
        case="engram", tokens=tokens, hc=hc, hidden=hidden, cols=cols, head_dim=head_dim,
        triton_us=round(device_us(lambda: v41_engram_lookup.engram(*args)), 2),
        reference_us=round(device_us(lambda: v41_engram.engram_reference(*args)), 2),
        gap=gap,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    for rows, entries in [(1, 4096), (64, 4096), (1, 65536), (16, 65536)]:
        bench_topk(rows, entries, topk=512, block_size=64, topk_blocks=16)
    for rows, entries in [(1, 8192), (64, 8192), (1, 65536), (64, 65536)]:
        bench_decode_select(rows, entries, topk=512, block_size=64, topk_blocks=16)
    for tokens in [1, 64, 4096]:
        bench_engram(tokens, hc=4, hidden=4096, cols=16, head_dim=64, rows=100_000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
