"""KV bytes per token of the V4.1 shape (docs/architecture.md), from the v41 layout,
against the hand count: memory per token counts KV sources, not compressed layers."""

from tests.support.deepseek_v41_shapes import RATIOS, bytes_per_token, v41_shape


def test_v41_shape_bytes_per_token():
    shared = bytes_per_token(v41_shape(), block_size=16, context=65536)
    # two ratio-2 sources: (512 + 128) x 2 bytes / 2; two ratio-1 sources: (512 + 128) x 2
    assert shared["paged"] == 2 * 640 + 2 * 1280 == 3840
    # window rings 40 x 128 x 512 x 2, ratio-2 partial groups 2 x 2 x 2 x 512 x 4 (fp32),
    # engram history 3 x 8
    assert shared["state_per_sequence"] == 40 * 128 * 512 * 2 + 2 * 2 * 2 * 512 * 4 + 3 * 8
    compressed = [i for i, r in enumerate(RATIOS) if r]
    unshared = bytes_per_token(v41_shape(compressed), block_size=16, context=65536)
    assert unshared["paged"] == 18 * 640 + 20 * 1280
