"""`hidden_act` (issue 28): every family runs SiLU only (its MLPs, the fused MoE kernel,
Qwen3-Next's GDN conv), as HF does with `ACT2FN["silu"]`; any other activation is refused
at load with an error naming the key and its value, instead of SiLU's tokens where HF
would run the other activation."""

import json
from pathlib import Path

import pytest

from atom.models.loader import ModelLoadError
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
MLA = dict(SMALL, num_key_value_heads=4, moe_intermediate_size=16, first_k_dense_replace=1,
           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
           q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
V4 = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
          head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
          partial_rotary_factor=0.25, hc_sinkhorn_iters=3, o_groups=2, o_lora_rank=8,
          index_n_heads=4, index_head_dim=16, max_position_embeddings=128, num_hidden_layers=2,
          layer_types=["sliding_attention", "compressed_sparse_attention"],
          mlp_layer_types=["moe", "moe"], sliding_window=8, hc_mult=2, index_topk=2)  # fmt: skip
QWEN3_NEXT = dict(SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  num_experts=4, num_experts_per_tok=2, head_dim=8,
                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", SMALL),
    "qwen2": ("Qwen2Config", SMALL),
    "deepseek_v2": ("DeepseekV2Config", MLA),
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, n_group=2, topk_group=1)),
    "deepseek_v4": ("DeepseekV4Config", V4),
    "qwen3_next": ("Qwen3NextConfig", QWEN3_NEXT),
}
V41 = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepseek_v41"


def _config_dir(tmp_path, family: str, act: str) -> str:
    name, kwargs = FAMILIES[family]
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers without {name}")
    config_class(**kwargs, hidden_act=act).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_other_activations_are_refused_naming_hidden_act(tmp_path, family, act):
    path = _config_dir(tmp_path, family, act)
    with pytest.raises(ModelLoadError, match=f"hidden_act '{act}' is not supported"):
        build_llm(path, load_format="dummy", num_kvcache_blocks=8)


def test_deepseek_v41_gelu_is_refused(tmp_path):
    if not (V41 / "tiny-minimal" / "config.json").is_file():
        pytest.skip(f"no DeepSeek-V4.1 reference data at {V41}")
    config = json.loads((V41 / "tiny-minimal" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_act="gelu")))
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        build_llm(str(tmp_path), load_format="dummy", num_kvcache_blocks=8)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_silu_spelled_swish_loads(tmp_path, family):
    """HF's ACT2FN maps "swish" to SiLU too."""
    llm = build_llm(_config_dir(tmp_path, family, "swish"), load_format="dummy",
                    num_kvcache_blocks=8)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids) == 3
