"""benchmarks/deepseek_v4_prefill.py on CPU: its arguments, the A/B switch it sets and
restores, the engine's length and the summary's ratios."""

import pytest

import atom.attention.v4 as v4
from benchmarks import deepseek_v4_prefill as bench


def test_defaults_time_8k_and_64k_with_both_prefills():
    args = bench.parse_args([])
    assert args.prompts == [8192, 65536] and args.chunk == 8192
    assert args.prefill_attention == ["triton", "torch"] and not args.skip_hf
    assert bench.max_model_len(args.prompts) >= 65536 + 1  # the prompt and its first token


def test_switch_values_and_their_order_are_kept():
    args = bench.parse_args(["--prefill-attention", "torch", "triton", "--skip-hf",
                             "--prompts", "100", "3000", "--chunk", "512"])  # fmt: skip
    assert args.prefill_attention == ["torch", "triton"] and args.skip_hf
    assert args.prompts == [100, 3000] and args.chunk == 512


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill-attention", "flash"],
        ["--prefill-attention", "triton", "triton"],
        ["--prompts", "0"],
        ["--chunk", "0"],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_the_switch_sets_the_backend_and_restores_it():
    assert v4.PREFILL_ATTENTION == "triton"
    with bench.prefill_attention("torch"):
        assert v4.PREFILL_ATTENTION == "torch"
    assert v4.PREFILL_ATTENTION == "triton"
    with pytest.raises(RuntimeError), bench.prefill_attention("torch"):
        raise RuntimeError("an engine failed")
    assert v4.PREFILL_ATTENTION == "triton"
    with pytest.raises(ValueError, match="one of"), bench.prefill_attention("dense"):
        pass


def test_torch_choice_turns_the_sparse_path_off(monkeypatch):
    """`sparse_prefill` follows the switch on the CUDA path (here: the interpreter's)."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
    q = torch.zeros(1)
    assert v4.sparse_prefill(q)
    with bench.prefill_attention("torch"):
        assert not v4.sparse_prefill(q)


def test_ratios_over_the_first_setting():
    times = {("triton", 8): 2.0, ("torch", 8): 6.0, ("triton", 64): 10.0, ("torch", 64): 55.0}
    ratios = bench.ratios_over_first(times, ["triton", "torch"], [8, 64])
    assert ratios == {"8": {"triton": 1.0, "torch": 3.0}, "64": {"triton": 1.0, "torch": 5.5}}


def test_timing_loop_on_a_tiny_cpu_engine(tmp_path, capsys):
    """`time_prompts` on a tiny random V4 (CPU, torch path): a `ttft` line per prompt."""
    import json

    import torch

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers without DeepSeek-V4")
    from tests.engine_support import build_llm

    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(
        vocab_size=320, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
        partial_rotary_factor=0.25, hc_sinkhorn_iters=3, o_groups=2, o_lora_rank=8,
        index_n_heads=16, index_head_dim=16, max_position_embeddings=512, num_hidden_layers=2,
        layer_types=[csa, hca], mlp_layer_types=["hash_moe", "moe"],
        compress_rates={csa: 4, hca: 8}, sliding_window=5, hc_mult=2, index_topk=4,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(tmp_path)
    args = bench.parse_args(["--prompts", "9", "30", "--chunk", "16", "--repeats", "2"])
    llm = build_llm(str(tmp_path), num_kvcache_blocks=16, max_model_len=64,
                    max_num_batched_tokens=args.chunk)  # fmt: skip
    times = bench.time_prompts(llm, "torch", args, 320)
    assert set(times) == {("torch", 9), ("torch", 30)} and min(times.values()) > 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["case"], r["prompt_len"], r["chunk"]) for r in lines] == [
        ("ttft", 9, 16),
        ("ttft", 30, 16),
    ]


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_sweep_inputs_run_through_the_kernel_and_reference(kind):
    """--sweep-kernel's inputs (a small shape, CPU, fp32, the interpreter): the kernel and
    the chunked reference it is timed against agree; CSA's ids are picks, -1 after."""
    import torch

    from atom.kernels.v4_prefill_attention import (
        v4_prefill_attention,
        v4_prefill_attention_reference,
    )

    csa, hca = bench.CSA, bench.HCA
    shape = dict(num_attention_heads=4, head_dim=32, sliding_window=8, index_topk=5,
                 compress_rates={csa: 4, hca: 16})  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    inputs = bench.kernel_inputs(70, 24, kind, shape, generator, "cpu", torch.float32)
    q, keys, key_first, start, entries, ids, ratio = inputs[:7]
    assert (q.shape[0], start, key_first, keys.shape[0]) == (24, 46, 39, 31)
    if kind == "csa":
        visible = (torch.arange(46, 70) + 1) // ratio
        picks = (ids >= 0).sum(dim=1)
        assert torch.equal(picks, visible.clamp(max=5)) and bool((ids < visible[:, None]).all())
    else:
        assert ids is None and entries.shape[0] == 70 // 16
    got = v4_prefill_attention(*inputs, block_h=16, block_n=16)
    torch.testing.assert_close(got, v4_prefill_attention_reference(*inputs), rtol=2e-5, atol=2e-5)
    bench.reference_in_chunks(*inputs)  # the timed reference runs on these inputs


def test_sweep_geometries_are_distinct_powers_of_two():
    assert len(set(bench.GEOMETRIES)) == len(bench.GEOMETRIES)
    for block_h, block_n, warps, stages in bench.GEOMETRIES:
        assert all(v & (v - 1) == 0 for v in (block_h, block_n, warps)) and stages >= 1
