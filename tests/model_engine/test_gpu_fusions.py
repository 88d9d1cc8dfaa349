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
        ("fp8", Fusions.only("rope_kv_write", "decode_merge", "greedy_argmax")),
        ("fp8", Fusions.only("decode_short")),  # batch <= 4 graphs; 8 keeps the plain decode
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
