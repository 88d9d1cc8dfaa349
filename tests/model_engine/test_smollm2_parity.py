"""Greedy parity with HF transformers on the real SmolLM2-135M-Instruct GGUF weights (CPU fp32)."""

import os

import torch
import transformers

from atom.sampling_params import SamplingParams
from tests.engine_support import hf_generate

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
