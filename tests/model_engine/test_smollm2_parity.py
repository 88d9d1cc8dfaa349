"""Greedy parity with HF transformers on the real SmolLM2-135M-Instruct GGUF weights (CPU fp32)."""

import os

import torch
import transformers

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, hf_generate

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain gravity to a five year old.",
    "Give me three tips for learning Python.",
    "What is 12 times 7?",
]


def test_first_32_greedy_tokens_match_hf(smollm2_llm):
    path = smollm2_llm.engine.model_path
    prompts = [smollm2_llm.chat_prompt([{"role": "user", "content": c}]) for c in CHATS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    )
    expected = hf_generate(hf, prompts, 32, stop_at_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outputs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for chat, got, want in zip(CHATS, outputs, expected, strict=True):
        assert got.token_ids == want, chat
    assert sum(len(w) for w in expected) >= 4 * 16  # the comparison covered real text
    assert any("Paris" in o.text for o in outputs)


COPY_TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, "
    "and of having nothing to do."
)
COPY_CHATS = [
    f"Repeat the following text word for word.\n\n{COPY_TEXT}",
    "def add(a, b):\n    return a + b\n\nRewrite this Python function exactly as it is.",
]


def test_ngram_speculation_is_exact_and_accepts_on_copying_prompts(smollm2_llm):
    """Greedy SmolLM2 with the n-gram proposer equals plain decoding on prompts that make it
    copy text, and accepts most of what it proposes there. The engine of the parity test is
    reused (loading the GGUF again would cost a minute): the proposer is attached to it."""
    from atom.model_engine.speculative.decoder import SpeculativeDecoder
    from atom.model_engine.speculative.proposers import NgramProposer

    prompts = [smollm2_llm.chat_prompt([{"role": "user", "content": c}]) for c in COPY_CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = [o.token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    engine = smollm2_llm.engine
    speculator = SpeculativeDecoder(NgramProposer(2, 4), 4, engine.max_model_len)
    engine.speculator, engine.scheduler.lookahead = speculator, speculator.lookahead
    try:
        outputs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.speculator = engine.scheduler.lookahead = None
    assert [o.token_ids for o in outputs] == plain
    assert "Alice was" in outputs[0].text
    stats = speculator.stats
    assert stats.proposed_tokens >= 16 and stats.acceptance_rate > 0.3, vars(stats)


def test_pipeline_parallel_pp2_equals_pp1(smollm2_llm):
    """Two stages of 15 layers on spawned ranks (each reads only its stage's tensors)
    generate the single-process engine's tokens; the tied LM head is on stage 1."""
    prompts = [smollm2_llm.chat_prompt([{"role": "user", "content": c}]) for c in CHATS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [o.token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    llm = build_llm(smollm2_llm.engine.model_path, pipeline_parallel_size=2, max_model_len=256)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected
    finally:
        llm.shutdown()
