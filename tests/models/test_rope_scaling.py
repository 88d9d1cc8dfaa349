"""Linear and yarn rope scaling (as llama.cpp writes them into GGUF files) against HF.

Such files used to fail to load: the GGUF loader emitted the scaling, the Llama rotary
embedding refused it.
"""

from __future__ import annotations

import gguf
import pytest
import torch
import transformers

from atom.models.layers import RotaryEmbedding, rope_parameters
from atom.models.loader import ModelLoadError, open_model
from atom.sampling_params import SamplingParams
from tests.engine_support import TINY, build_llm, hf_generate
from tests.models.test_loader import write_gguf

VOCAB = 512  # small: the LM head dominates a tiny model's time
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def _hf_llama(scaling: dict) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        **dict(TINY, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2),
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )
    torch.manual_seed(4)
    return transformers.LlamaForCausalLM(config).eval()


def _scaling_metadata(scaling: dict):
    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        writer.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])

    return add


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_cos_sin_equal_hf(kind):
    model = _hf_llama(SCALINGS[kind])
    theta, scaling = rope_parameters(model.config)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    ours = RotaryEmbedding(head_dim, 1024, theta, scaling, model.config.max_position_embeddings)
    positions = torch.arange(1024)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1024, head_dim), positions)
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_gguf_with_rope_scaling_loads_and_generates_hf_greedy(tmp_path, kind):
    model = _hf_llama(SCALINGS[kind])
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, model, "llama", _scaling_metadata(SCALINGS[kind]))
    generator = torch.Generator().manual_seed(20)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (7, 300)]
    expected = hf_generate(model, prompts, 8)  # the long prompt passes yarn's 256 positions
    llm = build_llm(str(path), skip_tokenizer_init=True, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_unsupported_yarn_key_is_refused_at_load_naming_it(tmp_path):
    model = _hf_llama(SCALINGS["yarn"])
    path = tmp_path / "yarn_log.gguf"

    def metadata(writer: gguf.GGUFWriter) -> None:
        _scaling_metadata(SCALINGS["yarn"])(writer)
        writer.add_rope_scaling_yarn_log_mul(0.1)

    write_gguf(path, model, "llama", metadata)
    with pytest.raises(ModelLoadError, match="yarn_log_multiplier"):
        open_model(path)
