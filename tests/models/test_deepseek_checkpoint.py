"""load_checkpoint (atom/models/deepseek_v4_checkpoint.py), the V4 / V4.1 weight loader: per-expert
checkpoint tensors stacked into the fused expert weights, and the errors a bad checkpoint
gets (no place, wrong shape, anything left unset)."""

import re
from types import SimpleNamespace

import pytest
import torch

from atom.models.deepseek_v4_checkpoint import load_checkpoint

EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
CONFIG = SimpleNamespace(moe_intermediate_size=3, tie_word_embeddings=False)


def targets():
    return {
        "norm.weight": torch.zeros(4),
        "mlp.experts.gate_up_proj": torch.zeros(2, 6, 4),  # 2 experts, [w1 | w3] rows
        "mlp.experts.down_proj": torch.zeros(2, 4, 3),
    }


def checkpoint():
    weights = [("norm.weight", torch.arange(4.0))]
    for e in range(2):
        weights += [
            (f"mlp.experts.{e}.w1.weight", torch.full((3, 4), 10.0 * e + 1)),
            (f"mlp.experts.{e}.w3.weight", torch.full((3, 4), 10.0 * e + 3)),
            (f"mlp.experts.{e}.w2.weight", torch.full((4, 3), 10.0 * e + 2)),
        ]
    return weights


def test_experts_are_stacked_and_skipped_tensors_ignored():
    t = targets()
    weights = [*checkpoint(), ("mtp.0.anything", torch.zeros(1))]
    load_checkpoint(CONFIG, t, weights, lambda s: None if s.startswith("mtp.") else s, EXPERT)
    assert torch.equal(t["norm.weight"], torch.arange(4.0))
    gate_up, down = t["mlp.experts.gate_up_proj"], t["mlp.experts.down_proj"]
    for e in range(2):
        assert torch.all(gate_up[e, :3] == 10 * e + 1) and torch.all(gate_up[e, 3:] == 10 * e + 3)
        assert torch.all(down[e] == 10 * e + 2)


def test_bad_checkpoints_are_refused_by_name():
    with pytest.raises(ValueError, match="'stray.weight' has no place"):
        load_checkpoint(CONFIG, targets(), [("stray.weight", torch.zeros(1))], str, EXPERT)
    with pytest.raises(ValueError, match="'mlp.experts.2.w1.weight' has no place"):
        weights = [*checkpoint(), ("mlp.experts.2.w1.weight", torch.zeros(3, 4))]
        load_checkpoint(CONFIG, targets(), weights, str, EXPERT)
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(5,\)"):
        load_checkpoint(CONFIG, targets(), [("norm.weight", torch.zeros(5))], str, EXPERT)
    missing = [w for w in checkpoint() if w[0] != "mlp.experts.1.w3.weight"]
    with pytest.raises(ValueError, match=r"missing weights: mlp.experts.gate_up_proj#1.w3"):
        load_checkpoint(CONFIG, targets(), missing, str, EXPERT)


def test_tensor_parallelism_is_refused_with_the_model_name():
    from atom.distributed.tensor_parallel import ShardingError
    from atom.models.deepseek_v4 import DeepseekV4ForCausalLM
    from atom.models.deepseek_v41 import DeepseekV41ForCausalLM

    for cls, name in [
        (DeepseekV4ForCausalLM, "deepseek_v4"),
        (DeepseekV41ForCausalLM, "deepseek_v41"),
    ]:
        cls.validate_tensor_parallel(CONFIG, 1)  # one process: fine
        with pytest.raises(ShardingError, match=f"^{name}: tensor parallelism is not supported"):
            cls.validate_tensor_parallel(CONFIG, 2)


def test_v4_input_projections_load_into_their_rows_of_the_stacked_weight():
    """HF keeps V4's projections of a layer's input apart (q_a, kv, the compressor's and the
    indexer's kv / gate / scorer; q_b and the indexer's q_b); atom stacks them (one GEMV at
    batch 1): each checkpoint tensor must land in its own rows, and one left out is named."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("needs transformers with DeepSeek-V4")
    from atom.models.deepseek_v4 import DeepseekV4ForCausalLM

    csa = "compressed_sparse_attention"
    config = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
        partial_rotary_factor=0.25, o_groups=2, o_lora_rank=8, index_n_heads=16,
        index_head_dim=16, num_hidden_layers=1, layer_types=[csa], mlp_layer_types=["moe"],
        compress_rates={csa: 4}, sliding_window=8, hc_mult=2, index_topk=3,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_weights = transformers.DeepseekV4ForCausalLM(config).state_dict()
    model = DeepseekV4ForCausalLM(config, 64)
    model.load_weights(list(hf_weights.items()))
    attn = model.model.layers[0].self_attn
    prefix = "model.layers.0.self_attn."
    for layer, names in [
        (attn.input_proj, ["q_a_proj", "kv_proj", "compressor.kv_proj", "compressor.gate_proj",
                           "compressor.indexer.kv_proj", "compressor.indexer.gate_proj",
                           "compressor.indexer.scorer.weights_proj"]),
        (attn.query_proj, ["q_b_proj", "compressor.indexer.q_b_proj"]),
    ]:  # fmt: skip
        assert layer.part_names == names
        rows = layer.weight.split(layer.local_sizes)
        for name, part in zip(names, rows, strict=True):
            assert torch.equal(part, hf_weights[f"{prefix}{name}.weight"]), name
    left_out = [(k, v) for k, v in hf_weights.items() if not k.endswith("indexer.kv_proj.weight")]
    with pytest.raises(ValueError, match=r"missing weights: .*compressor\.indexer\.kv_proj"):
        DeepseekV4ForCausalLM(config, 64).load_weights(left_out)
