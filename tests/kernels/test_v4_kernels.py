"""DeepSeek-V4 Triton kernels against their torch references (CPU interpreter; `gpu`
variants on CUDA): window write and the one-pass decode attention (window + selected
compressed entries + sink), lengths 1, non-multiples of every window and long contexts,
with padded rows (state slot -1, context length 0)."""

import pytest
import torch

from atom.kernels.v4_attention import (
    v4_decode_attention,
    v4_decode_attention_reference,
    write_window,
    write_window_reference,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,rows", [(4, 1), (5, 3), (128, 7)])
def test_write_window_matches_reference(device, window, rows):
    torch.manual_seed(window)
    ring = torch.randn(4, window, 32, device=device)
    expected = ring.clone()
    kv = torch.randn(rows, 32, device=device)
    slots = torch.tensor(([0, -1, 2] * rows)[:rows], device=device, dtype=torch.int32)
    positions = torch.randint(0, 5000, (rows,), device=device)
    write_window_reference(expected, kv, slots, positions)
    write_window(ring, kv, slots, positions)
    torch.testing.assert_close(ring, expected, rtol=0, atol=0)


def _case(device, dtype, window, positions, ratio, num_ids, heads=4, dim=32, block_size=16):
    torch.manual_seed(window + ratio + num_ids)
    rows = len(positions)
    positions = torch.tensor(positions, device=device)
    context_lens = (positions + 1).to(torch.int32)
    context_lens[-1] = 0  # a padded row
    slots = torch.arange(rows, device=device, dtype=torch.int32)
    slots[-1] = -1
    width = -(-(int(positions.max()) + 1) // block_size) + 1
    num_blocks = rows * width + 1
    tables = torch.randperm(num_blocks - 1, device=device)[: rows * width].view(rows, width)
    ring = torch.randn(rows + 1, window, dim, device=device, dtype=dtype)
    pool = torch.randn(num_blocks + 1, max(1, block_size // ratio), dim, device=device, dtype=dtype)
    visible = ((positions + 1) // ratio)[:, None]
    ids = torch.randint(0, 10**6, (rows, num_ids), device=device) % visible.clamp(min=1)
    ids = torch.where((visible > 0) & (torch.rand(rows, num_ids, device=device) < 0.8), ids, -1)
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    sinks = torch.randn(heads, device=device)
    return (
        q,
        ring,
        slots,
        positions,
        context_lens,
        pool,
        ids,
        tables.int(),
        ratio,
        block_size,
        sinks,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "window,positions,ratio,num_ids",
    [
        (4, [0, 9], 4, 1),
        (5, [3, 17, 40], 4, 3),
        (8, [100, 1000, 5], 128, 9),
        (16, [4095, 2], 4, 40),
    ],
)
@pytest.mark.parametrize("with_entries", [True, False])
def test_decode_attention_matches_reference(
    device, window, positions, ratio, num_ids, with_entries
):
    args = list(_case(device, torch.float32, window, positions, ratio, num_ids))
    if not with_entries:
        args[5] = args[6] = None
    expected = v4_decode_attention_reference(*args, scale=32**-0.5)
    got = v4_decode_attention(*args, scale=32**-0.5)
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4)
    assert got[-1].abs().max() == 0  # the padded row attends to nothing


@pytest.mark.gpu
def test_decode_attention_bf16_matches_reference():
    args = _case("cuda", torch.bfloat16, 128, [8191, 300, 64, 7], 4, 512, heads=64, dim=512)
    expected = v4_decode_attention_reference(*args, scale=512**-0.5)
    got = v4_decode_attention(*args, scale=512**-0.5)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
