"""Greedy parity with HF transformers on tiny random Llama / Qwen2 / Llama-3 (rope scaling)."""

import pytest

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
def test_greedy_matches_hf(tiny_model_dirs, kind):
    prompts = random_prompts(0, [1, 7, 33, 70])
    expected = hf_greedy(tiny_model_dirs[kind], prompts, GREEDY.max_tokens)
    llm = build_llm(tiny_model_dirs[kind])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
