"""A checkpoint whose model_type transformers lacks (DeepSeek-V4.1, `deepseek_v41_text`)
loads with its own tokenizer (tokenizer.json / tokenizer_config.json, no model config
instantiated), generates from text and is served through the OpenAI server (issue 28).

Expected values come from the reference data (../shared/reference/deepseek_v41/tiny-full,
README there): a text prompt whose words are the ids of a golden prompt must give the
golden continuation (upstream HF greedy), decoded by the `tokenizers` library itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm
from tests.entrypoints.server_support import run_server

REFERENCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepseek_v41"
CHECKPOINT = REFERENCE / "tiny-full"
if not (CHECKPOINT / "tokenizer.json").is_file():
    pytest.skip(f"no DeepSeek-V4.1 reference data at {REFERENCE}", allow_module_level=True)

TEXT = "But v AN , were they to"  # the words of golden prompt 1


@pytest.fixture(scope="module")
def expected():
    golden = json.loads((CHECKPOINT / "golden.json").read_text())["prompts"][1]
    tokenizer = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    assert tokenizer.encode(TEXT).ids == golden["prompt_ids"]
    continuation = golden["greedy_continuation"][:12]
    return golden["prompt_ids"], continuation, tokenizer.decode(continuation)


@pytest.fixture(scope="module")
def llm():
    return build_llm(str(CHECKPOINT), num_kvcache_blocks=64, max_model_len=128)


def test_v41_directory_loads_its_tokenizer_and_generates_from_text(llm, expected):
    prompt_ids, continuation, _ = expected
    assert llm.tokenizer is not None and llm.tokenizer.encode(TEXT) == prompt_ids
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [output] = llm.generate([TEXT], params, use_tqdm=False)
    assert output.token_ids == continuation
    assert output.text == llm.tokenizer.decode(continuation)


def test_v41_directory_is_served_through_the_openai_server(llm, expected):
    prompt_ids, continuation, text = expected
    server, stop = run_server(llm, "tiny-v41")
    try:
        result = server.client().completions.create(
            model="tiny-v41", prompt=TEXT, max_tokens=12, temperature=0
        )
        assert result.usage.prompt_tokens == len(prompt_ids)
        assert result.usage.completion_tokens == len(continuation)
        assert result.choices[0].text == text
        server.wait_idle()
    finally:
        stop()
