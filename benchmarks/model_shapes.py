"""Real model shapes for the benchmarks (random weights: only the shapes matter).

The matrix of issue 30 (`python -m benchmarks.offline_throughput --shapes`): the five
shapes users run most at batch 1, and two that no kernel choice was tuned on
(Qwen2.5-1.5B, Llama-2-13B). Each entry holds a Hugging Face config's fields; ``MATRIX``
names them with their model type and ``hf_config`` builds the config.
"""

from __future__ import annotations


def _llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


LLAMA_32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_llama3_rope(32.0),
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
)

LLAMA_32_3B = dict(
    LLAMA_32_1B,
    hidden_size=3072,
    num_hidden_layers=28,
    num_attention_heads=24,
    head_dim=128,
)

LLAMA_31_8B = dict(
    LLAMA_32_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    head_dim=128,
    rope_scaling=_llama3_rope(8.0),
    tie_word_embeddings=False,
)

QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)

# two shapes outside the matrix the bars name
QWEN25_15B = dict(
    QWEN25_7B,
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)

LLAMA_2_13B = dict(
    vocab_size=32000,
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=40,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# too big for one H200 in bf16 (~141 GB of weights): FP8 (~70 GB) only, so not in MATRIX
# (whose every shape the bf16 benchmarks run); benchmarks/quantized_decode.py names it
LLAMA_31_70B = dict(
    LLAMA_31_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
)

# name -> (model type, config fields); Qwen2's q/k/v carry a bias
MATRIX = {
    "llama-3.2-1b": ("llama", LLAMA_32_1B),
    "llama-3.2-3b": ("llama", LLAMA_32_3B),
    "llama-3.1-8b": ("llama", LLAMA_31_8B),
    "qwen2.5-7b": ("qwen2", QWEN25_7B),
    "smollm2-135m": ("llama", SMOLLM2_135M),
    "qwen2.5-1.5b": ("qwen2", QWEN25_15B),
    "llama-2-13b": ("llama", LLAMA_2_13B),
}


QUANTIZED_ONLY = {"llama-3.1-70b": ("llama", LLAMA_31_70B)}


def hf_config(name: str):
    """The transformers config of the shape ``name`` (a key of MATRIX or QUANTIZED_ONLY)."""
    import transformers

    model_type, fields = {**MATRIX, **QUANTIZED_ONLY}[name]
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    return transformers.AutoConfig.for_model(model_type, architectures=[architecture], **fields)
