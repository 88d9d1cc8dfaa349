"""benchmarks/qwen3_next_decode.py's state figures on a tiny Qwen3-Next (the fixtures of
tests/model_engine/test_qwen3_next_parity.py)."""

from tests.engine_support import build_llm
from tests.model_engine.test_qwen3_next_parity import COMMON, VARIANTS, qwen3_next_dirs  # noqa: F401


def fake_engines(monkeypatch, setting):
    """Engines that record `setting()` when built and at each decode: (kind, setting,
    max_len or batch) in the first list returned; the benchmark's emitted lines in the
    second."""
    from benchmarks import deepseek_v4_decode as v4

    seen, lines = [], []

    class Engine:
        def shutdown(self):
            pass

    def build_engine(path, max_len, batches, context, memory):
        seen.append(("build", setting(), max_len))
        return Engine()

    def atom_decode(llm, batch, context, steps, vocab):
        seen.append(("decode", setting(), batch))
        return dict(case="decode", batch=batch, ms_per_step=1.0 + batch)

    monkeypatch.setattr(v4, "build_engine", build_engine)
    monkeypatch.setattr(v4, "atom_decode", atom_decode)
    monkeypatch.setattr(v4, "with_read_limit", lambda record, *_: record)
    monkeypatch.setattr(v4, "emit", lines.append)
    monkeypatch.setattr(v4.torch.cuda, "empty_cache", lambda: None)
    return seen, lines


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


def test_moe_gemv_ab_builds_one_engine_per_path(monkeypatch):
    """`--moe-gemv on off auto` (both benchmarks): each engine is built, and its steps run,
    with its path forced in moe.DECODE_GEMV_OVERRIDE; the override is reset after."""
    import argparse
    from types import SimpleNamespace

    from atom.kernels import moe
    from benchmarks import deepseek_v4_decode as v4

    parser = argparse.ArgumentParser()
    v4.add_switch_options(parser)
    args = parser.parse_args(["--moe-gemv", "on", "off", "auto"])
    args.context, args.steps, args.gpu_memory_utilization = 64, 2, 0.5
    args.shape, args.stream_read = {}, None
    seen, lines = fake_engines(monkeypatch, lambda: moe.DECODE_GEMV_OVERRIDE)
    v4.decode_by_switch("path", args, [1, 4], 100, 999, state_read=SimpleNamespace())
    assert seen == [
        (step, override, value)
        for override in (True, False, None)
        for step, value in (("build", 999), ("decode", 1), ("decode", 4))
    ]
    assert [line["moe_gemv"] for line in lines[:-1]] == ["on", "on", "off", "off", "auto", "auto"]
    assert lines[-1]["case"] == "moe_gemv_summary"
    assert moe.DECODE_GEMV_OVERRIDE is None


def test_shared_pair_ab_builds_one_engine_per_value(monkeypatch):
    """`--shared-pair off on`: each engine is built, and its steps run, with moe.SHARED_PAIR
    as asked; the default (on) is restored after."""
    import argparse

    from atom.kernels import moe
    from benchmarks import deepseek_v4_decode as v4

    parser = argparse.ArgumentParser()
    v4.add_switch_options(parser)
    args = parser.parse_args(["--shared-pair", "off", "on"])
    args.context, args.steps, args.gpu_memory_utilization = 64, 2, 0.5
    args.shape, args.stream_read = {}, None
    seen, lines = fake_engines(monkeypatch, lambda: moe.SHARED_PAIR)
    v4.decode_by_switch("path", args, [1], 100, 999)
    assert seen == [("build", False, 999), ("decode", False, 1), ("build", True, 999),
                    ("decode", True, 1)]  # fmt: skip
    assert [line["shared_pair"] for line in lines[:-1]] == ["off", "on"]
    assert lines[-1]["case"] == "shared_pair_summary"
    assert moe.SHARED_PAIR is True


def test_attn_split_cap_ab_builds_one_engine_per_cap(monkeypatch):
    """`--attn-split-cap 128 32`: each engine is built, and its steps run, under its cap in
    decode_attention.MAX_SPLITS; the module default is restored after."""
    from atom.kernels import decode_attention
    from benchmarks import qwen3_next_decode as q3n

    default = decode_attention.MAX_SPLITS
    args = q3n.argparse.Namespace(attn_split_cap=[128, 32], context=64, steps=2)
    args.gpu_memory_utilization, args.shape, args.stream_read = 0.5, {}, None
    seen, lines = fake_engines(monkeypatch, lambda: decode_attention.MAX_SPLITS)
    q3n.decode_by_split_cap("path", args, [1], 100, 999)
    assert seen == [("build", 128, 999), ("decode", 128, 1), ("build", 32, 999), ("decode", 32, 1)]
    assert [line["attn_split_cap"] for line in lines[:-1]] == [128, 32]
    assert lines[-1]["case"] == "attn_split_cap_summary"
    assert decode_attention.MAX_SPLITS == default


def test_pdl_chain_ab_builds_one_engine_per_value(monkeypatch):
    """`--pdl-chain off on`: each engine built and stepped with pdl.CHAIN as asked, the
    default restored after."""
    import argparse

    from atom.kernels import pdl
    from benchmarks import deepseek_v4_decode as v4

    parser = argparse.ArgumentParser()
    v4.add_switch_options(parser)
    args = parser.parse_args(["--pdl-chain", "off", "on"])
    args.context, args.steps, args.gpu_memory_utilization = 64, 2, 0.5
    args.shape, args.stream_read = {}, None
    assert v4.any_switch(args)
    seen, lines = fake_engines(monkeypatch, lambda: pdl.CHAIN)
    v4.decode_by_switch("path", args, [1], 100, 999)
    assert [s[1] for s in seen] == [False, False, True, True]
    assert [line["pdl_chain"] for line in lines[:-1]] == ["off", "on"]
    assert pdl.CHAIN is True
