"""The engine on CUDA with the fused kernels of issue 17 (atom/fusions.py) switched on:
greedy tokens within bf16 tolerance of HF, and the same tokens as with every fusion off in
fp32 (CUDA graphs on, contexts long enough for several decode splits)."""

import pytest

from atom.fusions import Fusions, names
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts
from tests.model_engine.test_gpu_engine import _assert_near_hf_greedy

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ALL = Fusions.only(*names())


@pytest.mark.parametrize("kind", ["llama", "llama3"])
def test_all_fusions_bf16_greedy_within_tolerance_of_hf(tiny_model_dirs, kind):
    llm = build_llm(
        tiny_model_dirs[kind], device="cuda", num_kvcache_blocks=4096, max_num_seqs=8, fusions=ALL
    )
    assert llm.engine.model_runner.graphs is not None
    prompts = random_prompts(1, [1, 9, 40, 300])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        _assert_near_hf_greedy(tiny_model_dirs[kind], prompt, out.token_ids, tolerance=0.02)


@pytest.mark.parametrize(
    "kv_cache_dtype, fusions",
    [
        ("auto", ALL),
        ("auto", Fusions()),  # the defaults (PDL on since the fourth pass)
        ("fp8", Fusions.only("rope_kv_write", "greedy_argmax")),
    ],
)
def test_fusions_give_the_tokens_of_the_unfused_engine(tiny_model_dirs, kv_cache_dtype, fusions):
    common = dict(
        device="cuda",
        dtype="float32",
        num_kvcache_blocks=4096,
        max_num_seqs=8,
        kv_cache_dtype=kv_cache_dtype,
    )
    fused = build_llm(tiny_model_dirs["llama"], fusions=fusions, **common)
    plain = build_llm(tiny_model_dirs["llama"], fusions=Fusions.none(), **common)
    prompts = random_prompts(3, [1, 17, 130, 300, 5])  # batch 5: a padded graph of 8
    a = fused.generate(prompts, GREEDY, use_tqdm=False)
    b = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # and one sequence at a time (batch-1 graphs)
    for prompt in prompts[:2]:
        a = fused.generate([prompt], GREEDY, use_tqdm=False)[0]
        b = plain.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert a.token_ids == b.token_ids


@pytest.mark.parametrize("mode", ["measure", "fused", "unfused"])
def test_every_gemv_policy_choice_keeps_the_unfused_tokens(tmp_path, mode):
    """A Llama shape outside the benchmark matrix (hidden 1024, MLP 2816, 4 layers, vocab
    32000; fp32, random weights): the defaults give the greedy tokens of the engine with
    every fusion off, whatever the GEMV policy chose (measured, every site Triton, none),
    at batch 1 (the GEMV's graphs). Measured choices are cached: a second start reads them
    all from the file and times nothing."""
    import transformers

    from atom.kernels import gemv_policy
    from tests.engine_support import vocab_prompts

    model_dir = tmp_path / "model"
    transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024,
        tie_word_embeddings=False,
    ).save_pretrained(model_dir)  # fmt: skip
    cache = str(tmp_path / "gemv_policy.json")
    common = dict(device="cuda", dtype="float32", load_format="dummy", num_kvcache_blocks=512,
                  max_num_seqs=4, skip_tokenizer_init=True)  # fmt: skip
    previous = gemv_policy.set_policy(gemv_policy.GemvPolicy(mode, cache))
    try:
        fused = build_llm(str(model_dir), fusions=Fusions(), **common)
        report = gemv_policy.current_policy().report()
        plain = build_llm(str(model_dir), fusions=Fusions.none(), **common)
        for prompt in vocab_prompts(5, [1, 17, 130], 32000):
            a = fused.generate([prompt], GREEDY, use_tqdm=False)[0]
            b = plain.generate([prompt], GREEDY, use_tqdm=False)[0]
            assert a.token_ids == b.token_ids
        if mode == "measure":
            assert len(report) >= 5 and all(row["source"] == "measured" for row in report)
            gemv_policy.set_policy(gemv_policy.GemvPolicy(mode, cache))  # the next start
            again = build_llm(str(model_dir), fusions=Fusions(), **common)
            assert again.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == a.token_ids
            policy = gemv_policy.current_policy()
            assert [row["source"] for row in policy.report()] == ["cached"] * len(report)
            assert policy.spent_s == 0.0
            assert [r["choice"] for r in policy.report()] == [r["choice"] for r in report]
    finally:
        gemv_policy.set_policy(previous)


def test_a_qkv_bias_in_the_gemv_keeps_the_unfused_tokens(tmp_path):
    """Qwen2's qkv bias is added in the batch-1 GEMV's epilogue (with the norm prologue
    and the RoPE + KV-write epilogue): with every site on the Triton GEMV (policy
    ``fused``), a Qwen2 shape (fp32, random weights and biases) gives the greedy tokens of
    the engine with every fusion off."""
    import transformers

    from atom.kernels import gemv_policy
    from tests.engine_support import vocab_prompts

    model_dir = tmp_path / "model"
    config = transformers.Qwen2Config(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=8000, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    import torch

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF starts the biases at zero
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(model_dir)
    common = dict(device="cuda", dtype="float32", num_kvcache_blocks=512, max_num_seqs=4,
                  skip_tokenizer_init=True)  # fmt: skip
    previous = gemv_policy.set_policy(gemv_policy.GemvPolicy("fused"))
    try:
        fused = build_llm(str(model_dir), fusions=Fusions(), **common)
        plain = build_llm(str(model_dir), fusions=Fusions.none(), **common)
        qkv = fused.engine.model_runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.bias is not None and qkv.bias.abs().sum() > 0
        for prompt in vocab_prompts(5, [1, 17, 130], 8000):
            a = fused.generate([prompt], GREEDY, use_tqdm=False)[0]
            b = plain.generate([prompt], GREEDY, use_tqdm=False)[0]
            assert a.token_ids == b.token_ids
    finally:
        gemv_policy.set_policy(previous)
