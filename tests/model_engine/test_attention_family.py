"""Each model's AttentionFamily (atom/attention/family.py) against the layouts it replaced.

The expected figures are the formulas of the code before the family (model_engine/kv_cache.py,
attention/v4.py's v4_block_bytes / v4_state_bytes / allocate_v4_cache, state_slots.py's
state_specs allocator), written out by hand for tiny layers: block bytes, state bytes and
the shapes the one state allocator lays out must not move.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom.attention.backend import MHABackend, MLABackend
from atom.attention.family import AttentionFamily, MLAFamily, kv_cache_torch_dtype
from atom.attention.gdn import GatedDeltaNetState, GDNBackend, GDNFamily
from atom.attention.mha import MHAAttention
from atom.attention.mla import MLAAttention
from atom.attention.v4 import V4Attention, V4Backend, V4Family
from atom.attention.v41 import V41Attention, V41Backend, V41Family
from atom.model_engine import state_slots
from atom.models.deepseek_v2 import DeepseekV2ForCausalLM
from atom.models.deepseek_v4 import DeepseekV4ForCausalLM
from atom.models.deepseek_v41 import DeepseekV41ForCausalLM
from atom.models.llama import LlamaForCausalLM
from atom.models.qwen3_next import Qwen3NextForCausalLM
from tests.support.deepseek_v41_shapes import v41_shape

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BLOCK = 16
SLOTS = 3  # state slots (+ 1 scratch row each tensor)


def _mha_model():
    layers = [MHAAttention(4, 2, 16, 0.25) for _ in range(3)]
    return SimpleNamespace(attention_layers=layers)


def _mla_model():
    layers = [MLAAttention(4, 24, 8, 8, 8, 0.25) for _ in range(2)]  # latent 24 + 8
    return SimpleNamespace(attention_layers=layers)


CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def _v4_model(hca_ratio: int = 16):
    config = SimpleNamespace(
        num_attention_heads=4, head_dim=32, sliding_window=8,
        compress_rates={CSA: 4, HCA: hca_ratio}, index_head_dim=16, index_topk=3,
    )  # fmt: skip
    rope = (torch.zeros(64, 4), torch.zeros(64, 4))
    layers = [V4Attention(config, kind, rope, 64) for kind in (SWA, CSA, HCA)]
    return SimpleNamespace(attention_layers=layers)


def _v41_model():
    config = v41_shape(sources=[2, 11], engram=True)
    config.compress_ratios = [0, 0] + [2] * 9 + [1] * 3  # 14 layers, sources 2 (r 2), 11 (r 1)
    layers = [V41Attention(config, i, 64, 3 if i == 0 else 0) for i in range(14)]
    return SimpleNamespace(attention_layers=layers)


def _gdn_model():
    full = [MHAAttention(4, 2, 16, 0.25)]
    gdn = [GatedDeltaNetState(2, 4, 8, 16, 4) for _ in range(2)]  # conv_dim 2*16 + 64 = 96
    return SimpleNamespace(attention_layers=full, state_layers=gdn)


def test_mha_block_bytes_as_before():
    family, model = AttentionFamily(), _mha_model()
    # 2 (K, V) x kv heads x head_dim x itemsize, per layer and token
    assert family.kv_block_bytes(model, BLOCK, BF16) == 3 * 2 * 2 * 16 * 2 * BLOCK
    # fp8: one byte per element plus a float32 scale per token and kv head
    assert family.kv_block_bytes(model, BLOCK, FP8) == 3 * 2 * 2 * (16 + 4) * BLOCK
    assert not family.has_state and family.num_state_slots(8) == 0
    assert family.state_contract(model, BF16) == []


def test_mha_cache_views_as_before():
    family, model = AttentionFamily(), _mha_model()
    cache = family.allocate_kv_cache(model, 5, BLOCK, FP8, "cpu")
    assert cache.data.shape == (2, 3, 5, BLOCK, 2, 16) and cache.data.dtype == FP8
    assert cache.scales.shape == (2, 3, 5, BLOCK, 2)
    for index, layer in enumerate(model.attention_layers):
        assert layer.k_cache.data_ptr() == cache.data[0, index].data_ptr()
        assert layer.v_scale.data_ptr() == cache.scales[1, index].data_ptr()


def test_mla_block_bytes_and_fp8_refusal_as_before():
    family, model = MLAFamily(), _mla_model()
    assert family.kv_block_bytes(model, BLOCK, BF16) == 2 * 32 * 2 * BLOCK
    cache = family.allocate_kv_cache(model, 5, BLOCK, BF16, "cpu")
    assert cache.data.shape == (2, 5, BLOCK, 32) and cache.scales is None
    assert model.attention_layers[1].latent_cache.shape == (5, BLOCK, 32)
    with pytest.raises(ValueError, match="not supported for MLA"):
        family.kv_block_bytes(model, BLOCK, FP8)


def _old_v4_state_bytes_per_slot(itemsize: int) -> int:
    """attention/v4.py's v4_state_bytes before the family, by hand for _v4_model()."""
    ring = 8 * 32  # window x head_dim, every layer
    csa = 2 * (2 * 4) * (2 * 32) + 2 * (2 * 4) * (2 * 16)  # kv + gate, index kv + gate
    hca = 2 * 16 * 32  # kv + gate rows of ratio 16, width head_dim
    return (3 * ring + csa + hca) * itemsize


def test_v4_block_and_state_bytes_as_before():
    family, model = V4Family(), _v4_model()
    # per block: CSA 16 // 4 = 4 rows of head_dim + index_head_dim; HCA 1 row of head_dim
    assert family.kv_block_bytes(model, BLOCK, BF16) == (4 * (32 + 16) + 1 * 32) * 2
    contract = family.state_contract(model, BF16)
    expected = _old_v4_state_bytes_per_slot(2) * (SLOTS + 1)
    assert state_slots.state_bytes(contract, SLOTS) == expected
    with pytest.raises(ValueError, match="fp8.*not supported for DeepSeek-V4"):
        family.kv_block_bytes(model, BLOCK, FP8)


def test_v4_hca_pool_sized_to_the_compress_ratio():
    """An HCA entry longer than a block (ratio 64 at block 16: one entry per 4 blocks) is
    spread over its 4 blocks, 32 / 4 = 8 channels in each: no block row left empty. Before,
    every block held a whole 32-wide row of which 3 in 4 stayed empty: (4 * (32 + 16) +
    1 * 32) * 2 = 448 bytes a block; now (4 * (32 + 16) + 1 * 8) * 2 = 400 (the HCA part
    4x smaller, bytes per token 32 * 2 / 64 = 1, the ratio's own)."""
    family, model = V4Family(), _v4_model(hca_ratio=64)
    assert family.kv_block_bytes(model, BLOCK, BF16) == (4 * (32 + 16) + 1 * 8) * 2
    cache = family.allocate_kv_cache(model, 5, BLOCK, BF16, "cpu")
    assert [p.shape for p in cache.data] == [(6, 4, 32), (6, 4, 16), (6, 1, 8)]
    hca = model.attention_layers[2]
    assert hca.block_bytes(BLOCK, 2) == 32 * 2 * BLOCK // 64  # 1 byte a token
    with pytest.raises(ValueError, match="must divide into compress ratio 4096 / block_size 16"):
        family.kv_block_bytes(_v4_model(hca_ratio=64 * 64), BLOCK, BF16)


def test_v4_pool_bytes_per_sequence_at_the_real_ratios():
    """DeepSeek-V4's own ratios at block 16 (issue 32, item 5): HCA 128 (8 blocks an entry),
    CSA 4, head_dim 512, index_head_dim 128. The blocks of an 8,192-token sequence (512)
    hold exactly its entries' bytes, by hand: HCA 8192 / 128 = 64 entries x 512 x 2 bytes
    (a whole 512-wide row a block would be 8x that), CSA 2048 x 512 x 2, its indexer keys
    2048 x 128 x 2. The benchmark's `kv_bytes` reads the same `pool_shapes`."""
    config = SimpleNamespace(
        num_attention_heads=4, head_dim=512, sliding_window=8,
        compress_rates={CSA: 4, HCA: 128}, index_head_dim=128, index_topk=3,
    )  # fmt: skip
    rope = (torch.zeros(64, 4), torch.zeros(64, 4))
    csa, hca = (V4Attention(config, kind, rope, 8192) for kind in (CSA, HCA))
    blocks = 8192 // BLOCK
    assert hca.pool_shapes(BLOCK) == {"pool": (1, 64)}
    assert hca.block_bytes(BLOCK, 2) * blocks == 64 * 512 * 2
    assert csa.pool_shapes(BLOCK) == {"pool": (4, 512), "index_pool": (4, 128)}
    assert csa.block_bytes(BLOCK, 2) * blocks == 2048 * (512 + 128) * 2
    model = SimpleNamespace(attention_layers=[csa, hca])
    per_block = V4Family().kv_block_bytes(model, BLOCK, BF16)
    assert per_block * blocks == (2048 * (512 + 128) + 64 * 512) * 2


def test_v4_allocation_shapes_as_before():
    family, model = V4Family(), _v4_model()
    cache = family.allocate_kv_cache(model, 5, BLOCK, BF16, "cpu")
    swa, csa, hca = model.attention_layers
    assert [p.shape for p in cache.data] == [(6, 4, 32), (6, 4, 16), (6, 1, 32)]
    assert csa.pool.shape == (6, 4, 32) and csa.index_pool.shape == (6, 4, 16)
    assert swa.block_size == csa.block_size == BLOCK
    tensors = state_slots.allocate_state(family.state_contract(model, BF16), SLOTS, "cpu")
    assert swa.ring.shape == (SLOTS + 1, 8, 32) and swa.ring.dtype == BF16
    assert csa.state_kv.shape == csa.state_gate.shape == (SLOTS + 1, 8, 64)
    assert csa.index_state_kv.shape == (SLOTS + 1, 8, 32)
    assert hca.state_gate.shape == (SLOTS + 1, 16, 32)
    assert len(tensors) == 3 + 4 + 2 and all(not t.any() for t in tensors)
    assert tensors[0] is swa.ring


def test_v41_block_and_state_bytes_as_before():
    family, model = V41Family(), _v41_model()
    layers = model.attention_layers
    # pools: source 2 (ratio 2: 8 rows a block), source 11 (ratio 1: 16 rows), both with keys
    assert family.kv_block_bytes(model, BLOCK, BF16) == (8 + 16) * (512 + 128) * 2
    # before: ring (window, head_dim) in the cache dtype on every layer; the ratio-2 source's
    # partial group (ratio, head_dim) fp32 kv + gate; the Engram history (3, 1) int64
    per_slot = 14 * 128 * 512 * 2 + 2 * 2 * 512 * 4 + 3 * 8
    contract = family.state_contract(model, BF16)
    assert state_slots.state_bytes(contract, SLOTS) == per_slot * (SLOTS + 1)
    state_slots.allocate_state(contract, SLOTS, "cpu")
    assert layers[0].engram_tokens.shape == (SLOTS + 1, 3, 1)
    assert layers[0].engram_tokens.dtype == torch.int64
    assert layers[2].state_kv.shape == (SLOTS + 1, 2, 512) and layers[2].state_kv.dtype == (
        torch.float32
    )
    assert layers[5].ring.shape == (SLOTS + 1, 128, 512)


def test_gdn_block_and_state_bytes_as_before():
    family, model = GDNFamily(), _gdn_model()
    dtype = torch.get_default_dtype()  # the conv state's: the model dtype at construction
    assert family.kv_block_bytes(model, BLOCK, BF16) == 2 * 2 * 16 * 2 * BLOCK  # MHA layers
    conv = (4 - 1) * 96 * dtype.itemsize
    delta = 4 * 8 * 16 * 4
    contract = family.state_contract(model, BF16)
    assert state_slots.state_bytes(contract, SLOTS) == 2 * (conv + delta) * (SLOTS + 1)
    state_slots.allocate_state(contract, SLOTS, "cpu")
    layer = model.state_layers[1]
    assert layer.conv_state.shape == (SLOTS + 1, 3, 96) and layer.conv_state.dtype == dtype
    assert layer.recurrent_state.shape == (SLOTS + 1, 4, 8, 16)
    assert layer.recurrent_state.dtype == torch.float32


def _qwen3_next(layer_types):
    return SimpleNamespace(layer_types=layer_types, num_hidden_layers=len(layer_types))


@pytest.mark.parametrize(
    "cls, config, family_type, backend_type",
    [
        (LlamaForCausalLM, None, AttentionFamily, MHABackend),
        (DeepseekV2ForCausalLM, None, MLAFamily, MLABackend),
        (DeepseekV4ForCausalLM, None, V4Family, V4Backend),
        (DeepseekV41ForCausalLM, None, V41Family, V41Backend),
        (Qwen3NextForCausalLM, ["linear_attention", "full_attention"], GDNFamily, GDNBackend),
        (Qwen3NextForCausalLM, ["full_attention"] * 2, AttentionFamily, MHABackend),
    ],
)
def test_each_model_declares_a_fresh_family(cls, config, family_type, backend_type):
    hf = _qwen3_next(config) if config else SimpleNamespace()
    family = cls.family(hf)
    assert type(family) is family_type and family is not cls.family(hf)
    first, second = family.backend(), family.backend()  # one per runner slot
    assert type(first) is backend_type and first is not second
    assert family.speculation is backend_type.speculation


def test_what_each_family_supports():
    hf = SimpleNamespace()
    llama = LlamaForCausalLM.family(hf).supports
    assert llama.prefix_caching and llama.draft_model and llama.fp8_kv
    assert llama.tensor_parallel and llama.pipeline_parallel
    for cls in (DeepseekV2ForCausalLM, DeepseekV4ForCausalLM, DeepseekV41ForCausalLM):
        supports = cls.family(hf).supports
        assert not (supports.draft_model or supports.fp8_kv or supports.pipeline_parallel)
        assert not supports.tensor_parallel
    gdn = Qwen3NextForCausalLM.family(_qwen3_next(["linear_attention", "full_attention"]))
    plain = Qwen3NextForCausalLM.family(_qwen3_next(["full_attention"]))
    # state not cached with blocks: no prefix caching; the full-attention K/V may be fp8
    assert not gdn.supports.prefix_caching and gdn.supports.fp8_kv and gdn.has_state
    assert plain.supports.prefix_caching and not plain.has_state
    for family in (gdn, plain):  # Qwen3-Next: one process, never a draft
        assert not (family.supports.tensor_parallel or family.supports.pipeline_parallel)
        assert not family.supports.draft_model
    for cls in (DeepseekV4ForCausalLM, DeepseekV41ForCausalLM):
        family = cls.family(hf)
        assert family.has_state and not family.supports.prefix_caching
        assert family.num_state_slots(8) == 8


def test_cache_dtype_names():
    assert kv_cache_torch_dtype("auto", BF16) is BF16
    assert kv_cache_torch_dtype("fp8", BF16) is FP8
    with pytest.raises(ValueError, match="auto or fp8"):
        kv_cache_torch_dtype("int8", BF16)


def _arch(name: str, **fields):
    return SimpleNamespace(architectures=[name], hidden_act="silu", **fields)


def test_pipeline_parallelism_asks_the_family():
    from atom.distributed import PipelineError
    from atom.model_engine.distributed_runner import validate_parallelism

    config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2)
    for name, model_type in [
        ("DeepseekV2ForCausalLM", "deepseek_v2"),
        ("DeepseekV4ForCausalLM", "deepseek_v4"),
        ("DeepseekV41ForCausalLM", "deepseek_v41_text"),
    ]:
        with pytest.raises(PipelineError, match="pipeline parallelism is not supported"):
            validate_parallelism(config, _arch(name, model_type=model_type))
    llama = dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    validate_parallelism(config, _arch("LlamaForCausalLM", num_hidden_layers=4, **llama))
    with pytest.raises(PipelineError):  # the Llama family's own check: a stage per layer
        validate_parallelism(config, _arch("LlamaForCausalLM", num_hidden_layers=1, **llama))


@pytest.mark.parametrize(
    "cls, model_type",
    [
        (DeepseekV2ForCausalLM, "deepseek_v2"),
        (DeepseekV4ForCausalLM, "deepseek_v4"),
        (DeepseekV41ForCausalLM, "deepseek_v41"),
        (Qwen3NextForCausalLM, "qwen3_next"),
    ],
)
def test_a_family_without_tensor_parallelism_is_refused_by_its_model(cls, model_type):
    from atom.distributed.tensor_parallel import ShardingError

    hf = SimpleNamespace(
        model_type=model_type, layer_types=["linear_attention", "full_attention"],
        num_hidden_layers=2,
    )  # fmt: skip
    assert not cls.family(hf).supports.tensor_parallel
    with pytest.raises(ShardingError, match="tensor parallelism is not supported"):
        cls.validate_tensor_parallel(hf, 2)
