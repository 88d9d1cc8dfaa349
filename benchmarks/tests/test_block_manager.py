"""benchmarks/block_manager.py's measurement of the block manager's set-up, at the
block count of a tiny model on a large GPU."""


def test_a_cache_of_32_7m_blocks_sets_up_at_once_in_under_16_bytes_a_block():
    """A tiny model on the H200 at 0.9 memory utilisation gets ~32.7M blocks: set-up must
    not build per-block objects (it took 35-40 s and several GB with one object each)."""
    from benchmarks.block_manager import H200_TINY_MODEL_BLOCKS, measure_construction

    record = measure_construction(H200_TINY_MODEL_BLOCKS)
    assert record["seconds"] < 0.5, record
    assert record["traced_bytes_per_block"] < 16, record
    assert record["resident_bytes_per_block"] < 1, record  # nothing touched up front
    assert record["churn_blocks"] == 256 * 128  # and it hands out and takes back blocks
