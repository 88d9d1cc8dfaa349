"""benchmarks/qwen3_next_decode.py's state figures on a tiny Qwen3-Next (the fixtures of
tests/model_engine/test_qwen3_next_parity.py)."""

from tests.engine_support import build_llm
from tests.model_engine.test_qwen3_next_parity import COMMON, VARIANTS, qwen3_next_dirs  # noqa: F401


def test_state_bytes_of_the_benchmark(qwen3_next_dirs):  # noqa: F811 (the fixture)
    """The benchmark's state figure: conv + delta-rule rows of every GDN layer (hand count)."""
    from benchmarks.qwen3_next_decode import state_bytes

    llm = build_llm(qwen3_next_dirs["a"], num_kvcache_blocks=16)
    shape = dict(VARIANTS["a"], **COMMON)
    record = state_bytes(llm, 1000, shape)
    conv = (4 - 1) * (2 * 2 * 8 + 4 * 16) * 4  # (K - 1) x conv_dim, fp32 model
    delta = 4 * 8 * 16 * 4  # Hv x Dk x Dv, fp32
    assert record["gdn_state_per_sequence_bytes"] == 2 * (conv + delta)
    assert record["all_attention_kv_per_sequence_bytes"] == 3 * 2 * 2 * 16 * 4 * 1000
