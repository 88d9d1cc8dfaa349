"""Quantized checkpoints packed by hand (an implementation independent of atom's readers),
loaded by atom and compared with HF transformers running the dequantized weights (CPU fp32).

Each format quantizes the same tiny random Llama (and DeepSeek-V2/V3 for block FP8): the
test computes the quantized values, packs them the way the format stores them, writes the
quantized directory and a plain one of the dequantized weights (q - z) * s. atom reads the
quantized one: its greedy tokens equal HF's on the plain one and its prefill logits are
within 1e-4 of the logit scale (both compute x @ W^T with the same fp32 weights; what is
left is summation order). Bad input is refused at load, naming the tensor or config key.
"""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from atom.forward_context import AttentionMetadata, forward_context
from atom.models.loader import ModelLoadError, open_model
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, hf_greedy_no_eos, vocab_prompts

VOCAB = 320
FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = vocab_prompts(3, [5, 17, 30], VOCAB)
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- an independent packer for every format ------------------------------------------------
def fp8_quantize(w, granularity, block=(128, 128)):
    """(fp8 values, scale tensor as the checkpoint stores it, dequantized float32)."""
    rows, cols = w.shape
    if granularity == "tensor":
        scale = w.abs().max().reshape(1) / 448
        full = scale.expand(rows, cols)
    elif granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        full = scale.expand(rows, cols)
    else:
        bn, bk = block
        scale = torch.empty(-(-rows // bn), -(-cols // bk))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
        full = scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    q = (w / full).to(FP8)
    return q, scale, q.float() * full


def int4_quantize(w, group, symmetric, zero_min=0):
    """(unsigned values [N, K] in [0, 16), scale [N, G], zero [N, G], dequantized)."""
    rows, cols = w.shape
    group = group or cols
    g = w.reshape(rows, cols // group, group)
    if symmetric:
        scale = g.abs().amax(dim=-1) / 7
        zero = torch.full_like(scale, 8)
    else:
        low, high = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
        scale = (high - low) / 15
        zero = torch.round(-low / scale).clamp(zero_min, 15)
    scale = scale.to(torch.float16).float()  # the stored dtype of GPTQ / AWQ scales
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    dequant = ((q - zero[..., None]) * scale[..., None]).reshape(rows, cols)
    return q.reshape(rows, cols).to(torch.int64), scale, zero.to(torch.int64), dequant


def pack_words(values, order=range(8)):
    """int64 [R, C] in [0, 16) -> int32 [R, C/8]; nibble i of word w holds column
    8w + order[i]."""
    v = values.numpy().astype(np.uint64).reshape(values.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], dtype=np.uint64)
    for i, column in enumerate(order):
        words |= v[:, :, column] << np.uint64(4 * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_linear(name, w, fmt):
    """Checkpoint tensors of the HF linear `name` (without .weight) and its dequantized W."""
    kind, _, option = fmt.partition(":")
    if kind == "ct_fp8":
        q, scale, deq = fp8_quantize(w, option)
        return {f"{name}.weight": q, f"{name}.weight_scale": scale}, deq
    if kind == "deepseek_fp8":
        q, scale, deq = fp8_quantize(w, "block", _block(option))
        return {f"{name}.weight": q, f"{name}.weight_scale_inv": scale}, deq
    group = None if option.endswith("channel") else 128
    symmetric = kind == "ct_int4" and option.startswith("sym")
    # GPTQ's v1 format stores zero - 1 in four bits: a zero point of 0 does not exist there
    q, scale, zero, deq = int4_quantize(w, group, symmetric, zero_min=int(kind == "gptq"))
    if kind == "ct_int4":
        tensors = {
            f"{name}.weight_packed": pack_words(q),
            f"{name}.weight_scale": scale,
            f"{name}.weight_shape": torch.tensor(list(w.shape)),
        }
        if not symmetric:  # zero points packed along the outputs
            tensors[f"{name}.weight_zero_point"] = pack_words(zero.t()).t().contiguous()
        return tensors, deq
    if kind == "gptq":
        return {
            f"{name}.qweight": pack_words(q).t().contiguous(),  # along the inputs: [K/8, N]
            f"{name}.qzeros": pack_words(zero.t() - 1),  # v1 format: zero - 1
            f"{name}.scales": scale.t().contiguous().half(),
            f"{name}.g_idx": torch.arange(w.shape[1], dtype=torch.int32) // (group or w.shape[1]),
        }, deq
    assert kind == "awq"
    return {
        f"{name}.qweight": pack_words(q.t().contiguous(), AWQ_ORDER),
        f"{name}.qzeros": pack_words(zero.t().contiguous(), AWQ_ORDER),
        f"{name}.scales": scale.t().contiguous().half(),
    }, deq


def _block(option):
    rows, cols = option.split("x")
    return int(rows), int(cols)


CONFIGS = {
    "ct_fp8": lambda option: {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": option,
                    "block_structure": [128, 128] if option == "block" else None,
                },
            }
        },
    },
    "ct_int4": lambda option: {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": option.startswith("sym"),
                    "dynamic": False,
                    "strategy": "channel" if option.endswith("channel") else "group",
                    "group_size": None if option.endswith("channel") else 128,
                },
            }
        },
    },
    "gptq": lambda option: {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": -1 if option == "channel" else 128,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
    },
    "awq": lambda option: {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
    },
    "deepseek_fp8": lambda option: {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(_block(option)),
    },
}
LLAMA_FORMATS = [
    "ct_fp8:tensor",
    "ct_fp8:channel",
    "ct_fp8:block",
    "ct_int4:sym_group",
    "ct_int4:asym_group",
    "ct_int4:sym_channel",
    "gptq:group",
    "gptq:channel",
    "awq:group",
    "deepseek_fp8:96x128",  # blocks that straddle the fused q | k | v and gate | up parts
]


def write_pair(
    model, root, fmt, quantized_names, expert_parts=("gate_proj", "up_proj", "down_proj")
):
    """Save `model` twice: quantized in format `fmt`, and dequantized as a plain checkpoint.
    `expert_parts`: the names of one routed expert's gate, up and down linears (DeepSeek-V4's
    checkpoints: w1, w3, w2). Returns (quantized dir, plain dir)."""
    kind, _, option = fmt.partition(":")
    plain_dir, quant_dir = root / "plain", root / "quantized"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors = {}
    gate_name, up_name, down_name = expert_parts
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # HF stacks the routed experts; DeepSeek's checkpoints store each expert's linears
        stacked, prefix = state[name], name.rsplit(".", 1)[0]
        for e in range(stacked.shape[0]):
            if name.endswith("gate_up_proj"):
                gate, up = stacked[e].chunk(2)
                parts = {gate_name: gate, up_name: up}
            else:
                parts = {down_name: stacked[e]}
            for part, rows in parts.items():  # views: the dequantized values go back in
                stored, dequantized = quantize_linear(f"{prefix}.{e}.{part}", rows.float(), fmt)
                tensors.update(stored)
                rows.copy_(dequantized)
    for name in list(state):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        module = name[: -len(".weight")]
        if name.endswith(".weight") and quantized_names(name):
            stored, dequantized = quantize_linear(module, state[name].float(), fmt)
            tensors.update(stored)
            state[name] = dequantized
        else:
            tensors[name] = state[name].contiguous()
    model.load_state_dict(state)
    model.save_pretrained(plain_dir)
    quant_dir.mkdir()
    save_file(tensors, quant_dir / "model.safetensors")
    config = json.loads((plain_dir / "config.json").read_text())
    config["quantization_config"] = CONFIGS[kind](option)
    (quant_dir / "config.json").write_text(json.dumps(config))
    return str(quant_dir), str(plain_dir)


def prefill_logits(llm, ids):
    """The engine's model on one prompt, no KV cache (a dense prefill): [T, vocab]."""
    model = llm.engine.model_runner.model
    dense = AttentionMetadata(None, None, None, None, len(ids), False)
    with torch.no_grad(), forward_context(dense):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        return model.compute_logits(hidden)


def check_parity(quant_dir, plain_dir):
    llm = build_llm(quant_dir, num_kvcache_blocks=64)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == hf_greedy_no_eos(plain_dir, PROMPTS, GREEDY.max_tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32)
    ids = PROMPTS[2]
    with torch.no_grad():
        expected = hf.eval()(torch.tensor([ids])).logits[0]
    logits = prefill_logits(llm, ids)
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    return llm


def _is_llama_linear(name):
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in LINEAR


@pytest.fixture(scope="module")
def llama_model():
    torch.manual_seed(11)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


@pytest.mark.parametrize("fmt", LLAMA_FORMATS)
def test_llama_quantized_checkpoint_matches_dequantized_hf(llama_model, tmp_path, fmt):
    quant_dir, plain_dir = write_pair(llama_model, tmp_path, fmt, _is_llama_linear)
    llm = check_parity(quant_dir, plain_dir)
    layer = llm.engine.model_runner.model.model.layers[0]
    expected = torch.float8_e4m3fn if "fp8" in fmt else torch.int32  # int4: words [K/8, N]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert linear.weight.dtype == expected  # held quantized, not dequantized at load
    assert llm.engine.model_runner.model.lm_head.weight.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt",
    ["ct_fp8:channel", "ct_fp8:tensor", "deepseek_fp8:96x128", "gptq:group", "ct_int4:asym_group"],
)
def test_llama_quantized_on_cuda_runs_the_kernels_and_generates_the_dequantized_tokens(
    llama_model, tmp_path, fmt
):
    """On CUDA (fp32, CUDA graphs) the quantized layers run the kernels of
    atom/kernels/fp8_linear.py and int4_linear.py: greedy tokens equal those of the
    dequantized plain checkpoint on CUDA, and the weights stay quantized."""
    quant_dir, plain_dir = write_pair(llama_model, tmp_path, fmt, _is_llama_linear)
    options = dict(device="cuda", dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    quantized = build_llm(quant_dir, **options)
    got = [o.token_ids for o in quantized.generate(PROMPTS, GREEDY, use_tqdm=False)]
    layer = quantized.engine.model_runner.model.model.layers[0]
    assert layer.mlp.down_proj.weight.is_cuda
    assert layer.mlp.down_proj.weight.dtype in (torch.float8_e4m3fn, torch.int32)
    quantized.engine.shutdown()
    plain = build_llm(plain_dir, **options)
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == expected


# -- DeepSeek-V2 / V3 with DeepSeek's block FP8 --------------------------------------------
DEEPSEEK = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.mark.parametrize(
    "version, fmt",
    [("v2", "deepseek_fp8:24x32"), ("v3", "deepseek_fp8:32x32"), ("v3", "gptq:channel")],
)
def test_deepseek_quantized_checkpoint_matches_dequantized_hf(tmp_path, version, fmt):
    """Every projection, shared and routed expert quantized. Block FP8 (`weight_scale_inv`)
    with small blocks, so that these tiny matrices hold several blocks and ragged edges (real
    V3 checkpoints use 128 x 128, the same code; 24 rows: the up rows of the fused experts
    start inside a block); GPTQ: the routed experts are dequantized at load."""
    torch.manual_seed(5)
    if version == "v3":
        config = transformers.DeepseekV3Config(
            **DEEPSEEK, n_group=2, topk_group=1, norm_topk_prob=True
        )
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**DEEPSEEK))

    def quantized(name):
        return name.startswith("model.layers.") and name.endswith(("proj.weight", "_mqa.weight"))

    quant_dir, plain_dir = write_pair(model, tmp_path, fmt, quantized)
    llm = check_parity(quant_dir, plain_dir)
    layer = llm.engine.model_runner.model.model.layers[1]
    stored = torch.float8_e4m3fn if "fp8" in fmt else torch.int32
    assert layer.self_attn.q_b_proj.weight.dtype == stored
    assert layer.self_attn.o_proj.weight.dtype == stored
    assert layer.mlp.shared_experts.down_proj.weight.dtype == stored
    experts = torch.float8_e4m3fn if "fp8" in fmt else torch.float32
    assert layer.mlp.experts.gate_up_proj.dtype == experts
    assert layer.mlp.experts.down_proj.dtype == experts


# -- DeepSeek-V4 with DeepSeek's block FP8, 128 x 128 as V4 ships ---------------------------
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# 128 x 128 blocks over dims of 128 (whole blocks) and 64 / 96 (partial blocks, the scale grid
# rounded up as DeepSeek's format does). q_lora_rank 96: kv's rows start inside q_a's block
# in the stacked q_a | kv, which then keeps a scale per row; q_b | indexer q_b (256 + 128
# rows) keep 128-row blocks.
DEEPSEEK_V4 = dict(
    vocab_size=VOCAB, hidden_size=128, moe_intermediate_size=64, num_attention_heads=4,
    head_dim=64, q_lora_rank=96, num_experts_per_tok=2, n_routed_experts=4,
    partial_rotary_factor=0.25, hc_sinkhorn_iters=3, o_groups=2, o_lora_rank=64,
    index_n_heads=4, index_head_dim=32, max_position_embeddings=512, initializer_range=0.2,
    num_hidden_layers=3, layer_types=[SWA, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8}, sliding_window=8, hc_mult=2, index_topk=3,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
V4_PROMPTS = vocab_prompts(4, [5, 17, 40], VOCAB)  # shorter and longer than window and ratios


def _v4_quantized(name):
    """The linears transformers' FP8 quantizer converts in V4 (every nn.Linear of the layers,
    the routed experts are quantized by write_pair), and also the compressor's kv / gate,
    which V4-Flash ships in bf16 and atom holds dense: an FP8 one is dequantized at load. The
    indexer's kv / gate and scorer stay plain, as V4-Flash ships them; the router, norms, mHC,
    sinks, position biases, embedding and LM head too."""
    plain = (".indexer.kv_proj.", ".indexer.gate_proj.", ".weights_proj.")
    return (
        name.startswith("model.layers.")
        and name.endswith("proj.weight")
        and not any(part in name for part in plain)
    )


@pytest.fixture(scope="module")
def v4_fp8_dirs(tmp_path_factory):
    """(quantized dir, plain dir of the dequantized weights) of a tiny random V4."""
    torch.manual_seed(7)
    config = transformers.DeepseekV4Config(**DEEPSEEK_V4)
    model = transformers.DeepseekV4ForCausalLM(config)
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    with torch.no_grad():  # what HF initialises to zero, randomised so that its use is checked
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.stack([torch.randperm(experts)[:top_k] for _ in buffer]))
            elif name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    root = tmp_path_factory.mktemp("v4_fp8")
    return write_pair(model, root, "deepseek_fp8:128x128", _v4_quantized, ("w1", "w3", "w2"))


def test_deepseek_v4_block_fp8_matches_dequantized_hf(v4_fp8_dirs):
    """atom's fp32 greedy tokens on the block-FP8 V4 checkpoint equal HF's DeepseekV4 on the
    dequantized weights (the test's own quantizer; HF's model is the independent reference),
    and the quantized linears stay FP8 in memory."""
    quant_dir, plain_dir = v4_fp8_dirs
    llm = build_llm(quant_dir, num_kvcache_blocks=64, max_model_len=256)
    got = [o.token_ids for o in llm.generate(V4_PROMPTS, GREEDY, use_tqdm=False)]
    assert got == hf_greedy_no_eos(plain_dir, V4_PROMPTS, GREEDY.max_tokens)
    model = llm.engine.model_runner.model
    csa = model.model.layers[1]
    attn, mlp = csa.self_attn, csa.mlp
    assert attn.input_proj.part_names == ["q_a_proj", "kv_proj"]
    for layer in (attn.input_proj, attn.query_proj, attn.o_a_proj, attn.o_b_proj,
                  mlp.shared_experts.gate_proj, mlp.shared_experts.down_proj):  # fmt: skip
        assert layer.weight.dtype == FP8, layer
    assert attn.input_proj.weight_block == (1, 128)  # kv starts at row 96, inside a block
    assert attn.query_proj.weight_block == (128, 128)  # the indexer's q_b starts at row 256
    assert mlp.experts.gate_up_proj.dtype == mlp.experts.down_proj.dtype == FP8
    # dense: the compressor's and indexer's projections, router, norms, mHC, embedding, head
    assert attn.compressor_proj.part_names == [
        "compressor.kv_proj", "compressor.gate_proj", "compressor.indexer.kv_proj",
        "compressor.indexer.gate_proj", "compressor.indexer.scorer.weights_proj",
    ]  # fmt: skip
    assert attn.compressor_proj.weight.dtype == torch.float32
    assert mlp.gate.weight.dtype == model.lm_head.weight.dtype == torch.float32
    assert csa.attn_hc.fn.dtype == attn.sinks.dtype == torch.float32


def test_deepseek_v4_block_fp8_under_deepseek_names_matches_hf(v4_fp8_dirs, tmp_path):
    """The names DeepSeek's V4 checkpoints use (what HF's `save_pretrained` writes:
    `attn.wq_a`, `ffn.experts.N.w1`, `ffn.shared_experts.w2`, ...), each linear beside its
    `weight_scale_inv`: the plain directory's tensors quantized again (the same blocks give
    the same fp8 values and scales; the indexer's kv / gate and scorer stay plain, as in
    the first checkpoint), HF's greedy tokens."""
    quant_dir, plain_dir = v4_fp8_dirs
    tensors = load_file(f"{plain_dir}/model.safetensors")
    assert "model.layers.1.attn.wq_a.weight" in tensors  # DeepSeek names
    for name in [n for n in tensors if n.startswith("model.layers.")]:
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        plain = ".indexer.compressor." in name or module == "weights_proj"
        if name.endswith(".weight") and module.startswith("w") and not plain:
            q, scale, _ = fp8_quantize(tensors.pop(name), "block")
            tensors.update({name: q, f"{name}_scale_inv": scale})
    target = tmp_path / "deepseek_names"
    target.mkdir()
    save_file(tensors, target / "model.safetensors")
    shutil.copy(f"{quant_dir}/config.json", target / "config.json")
    llm = build_llm(str(target), num_kvcache_blocks=64, max_model_len=256)
    got = [o.token_ids for o in llm.generate(V4_PROMPTS, GREEDY, use_tqdm=False)]
    assert got == hf_greedy_no_eos(plain_dir, V4_PROMPTS, GREEDY.max_tokens)
    attn = llm.engine.model_runner.model.model.layers[1].self_attn
    assert attn.input_proj.weight.dtype == attn.o_b_proj.weight.dtype == FP8


def test_deepseek_v4_block_fp8_cuda_path_under_the_interpreter_matches_hf(v4_fp8_dirs, monkeypatch):
    """The CUDA path on the CPU under Triton's interpreter: the FP8 linears through their
    kernels (atom/kernels/fp8_linear.py: the dot kernel at prefill, the GEMV at decode, on the
    per-row scales of q_a | kv and the 128 x 128 blocks of the others), the routed experts
    through the grouped FP8 MoE GEMMs with V4's clamp, and V4's own kernels: HF's greedy
    tokens. One prompt, 4 tokens (each interpreted step is slow)."""
    import atom.kernels.fp8_linear as fp8_kernels
    import atom.kernels.moe as moe_kernels
    from atom.models.quantization.fp8 import Fp8LinearMethod

    pytest.importorskip("triton")
    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
    launches = []

    def cuda_apply(self, layer, x, bias=None):  # Fp8LinearMethod.apply's CUDA branch
        return fp8_kernels.fp8_linear(x, layer.weight, layer.weight_scale, layer.weight_block, bias)

    def counted(name, real):
        def run(*args, **kwargs):
            launches.append(name)
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(Fp8LinearMethod, "apply", cuda_apply)
    monkeypatch.setattr(fp8_kernels, "fp8_gemv", counted("gemv", fp8_kernels.fp8_gemv))
    monkeypatch.setattr(fp8_kernels, "fp8_dot", counted("dot", fp8_kernels.fp8_dot))
    grouped = counted("moe", moe_kernels._grouped_pairs)
    monkeypatch.setattr(moe_kernels, "_grouped_pairs", grouped)
    quant_dir, plain_dir = v4_fp8_dirs
    prompts, params = (
        V4_PROMPTS[1:2],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    llm = build_llm(quant_dir, num_kvcache_blocks=64, max_model_len=256)
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == hf_greedy_no_eos(plain_dir, prompts, params.max_tokens)
    assert {"gemv", "dot"} <= set(launches) and launches.count("moe") == 3 * 4  # layers x steps


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c.update(expert_dtype="fp4"), "expert_dtype = 'fp4'"),
        (lambda c: c.update(scale_fmt="ue8m0"), "scale_fmt = 'ue8m0'"),
        (lambda c: c.update(fmt="e5m2"), "fmt = 'e5m2'"),
        (lambda c: c.update(modules_to_convert=["embed_tokens"]), "modules_to_convert = "),
        (
            lambda c: (c.clear(), c.update(quant_method="gptq", bits=4, group_size=128)),
            "quant_method fp8",
        ),
    ],
    ids=["fp4_experts", "ue8m0_scales", "e5m2", "fp8_embedding", "gptq"],
)
def test_deepseek_v4_unsupported_fp8_config_is_refused_naming_the_key(
    v4_fp8_dirs, tmp_path, edit, key
):
    path = _variant(v4_fp8_dirs[0], tmp_path, edit_config=edit)
    with pytest.raises(ModelLoadError, match=f"quantization_config.{key}".replace(".", r"\.")):
        open_model(path)


def test_deepseek_v4_scales_of_another_block_size_are_refused_naming_the_tensor(
    v4_fp8_dirs, tmp_path
):
    """A config whose weight_block_size does not match the stored scales (64 x 64 over
    128 x 128 ones) is refused while the weights stream in, naming the scale tensor."""
    path = _variant(
        v4_fp8_dirs[0], tmp_path, edit_config=lambda c: c.update(weight_block_size=[64, 64])
    )
    with pytest.raises(ModelLoadError, match=r"weight_scale_inv has shape .*64x64 block"):
        _load_all(path)


def test_deepseek_v4_stacked_fp8_experts_are_refused(v4_fp8_dirs, tmp_path):
    """HF's stacked expert tensors (`experts.gate_up_proj`, fp8) instead of one tensor per
    expert linear: refused by name, not copied as fp8 values without their scales."""
    prefix = "model.layers.1.mlp.experts"

    def stack(tensors):
        tensors[f"{prefix}.gate_up_proj"] = torch.zeros(4, 128, 128).to(FP8)
        for e in range(4):
            for part in ("w1", "w3"):
                tensors.pop(f"{prefix}.{e}.{part}.weight")
                tensors.pop(f"{prefix}.{e}.{part}.weight_scale_inv")

    path = _variant(v4_fp8_dirs[0], tmp_path, edit_tensors=stack)
    with pytest.raises(ModelLoadError, match="stacked experts in a quantized checkpoint"):
        build_llm(path, num_kvcache_blocks=8)


# -- bad input: refused at load, naming the tensor or the key ------------------------------
@pytest.fixture(scope="module")
def fp8_dir(llama_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return write_pair(llama_model, root, "ct_fp8:channel", _is_llama_linear)[0]


def _variant(source, tmp_path, edit_tensors=None, edit_config=None):
    target = tmp_path / "variant"
    shutil.copytree(source, target)
    if edit_tensors is not None:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors")
    if edit_config is not None:
        config = json.loads((target / "config.json").read_text())
        edit_config(config["quantization_config"])
        (target / "config.json").write_text(json.dumps(config))
    return str(target)


def _load_all(path):
    for _ in open_model(path).weights():
        pass


SCALE = "model.layers.1.self_attn.k_proj.weight_scale"


def test_dummy_weights_of_a_quantized_config_are_refused_naming_load_format(fp8_dir):
    """Random weights are drawn dense only: a quantized config with load_format='dummy'
    is refused at load with a message naming the option and the layer, not a torch error."""
    with pytest.raises(ModelLoadError, match="load_format='dummy'.*float8"):
        build_llm(fp8_dir, load_format="dummy", num_kvcache_blocks=8)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop(SCALE), f"{SCALE} is missing"),
        (lambda t: t.__setitem__(SCALE, torch.full_like(t[SCALE], float("nan"))), SCALE),
        (lambda t: t.__setitem__(SCALE, -t[SCALE]), SCALE),
        (lambda t: t.__setitem__(SCALE, t[SCALE][:-1]), SCALE),
        (lambda t: t.__setitem__(SCALE, t[SCALE].to(torch.int32)), SCALE),
        (
            lambda t: t.__setitem__(
                "model.layers.0.mlp.up_proj.weight", t["model.layers.0.mlp.up_proj.weight"].float()
            ),
            "model.layers.0.mlp.up_proj.weight",
        ),
    ],
    ids=["missing", "nan", "negative", "shape", "dtype", "unquantized_weight"],
)
def test_corrupt_or_missing_scale_is_refused_naming_the_tensor(fp8_dir, tmp_path, edit, message):
    path = _variant(fp8_dir, tmp_path, edit_tensors=edit)
    with pytest.raises(ModelLoadError, match=message.replace(".", r"\.")):
        _load_all(path)
        build_llm(path, num_kvcache_blocks=8)


def _group(config):
    return config["config_groups"]["group_0"]


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c.update(quant_method="bitsandbytes"), "quant_method"),
        (lambda c: c.update(format="nvfp4-pack-quantized"), "format"),
        (lambda c: _group(c)["weights"].update(num_bits=4), "config_groups.group_0.weights"),
        (
            lambda c: _group(c)["weights"].update(strategy="group"),
            "config_groups.group_0.weights.strategy",
        ),
        (lambda c: c.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (lambda c: c.update(quantization_status="frozen"), "quantization_status"),
        (
            lambda c: _group(c).update(input_activations={"type": "int", "num_bits": 8}),
            "config_groups.group_0.input_activations",
        ),
    ],
    ids=["method", "format", "bits", "strategy", "kv_cache", "status", "int8_activations"],
)
def test_unsupported_scheme_is_refused_naming_the_key(fp8_dir, tmp_path, edit, key):
    path = _variant(fp8_dir, tmp_path, edit_config=edit)
    with pytest.raises(ModelLoadError, match=f"quantization_config.{key}".replace(".", r"\.")):
        open_model(path)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ],
)
def test_unsupported_gptq_awq_fp8_options_are_refused(fp8_dir, tmp_path, config, key):
    path = _variant(fp8_dir, tmp_path, edit_config=lambda c: (c.clear(), c.update(config)))
    with pytest.raises(ModelLoadError, match=f"quantization_config.{key}"):
        open_model(path)


# -- tensor parallelism: the quantized weights and their scales sharded on 2 spawned ranks ----
@pytest.mark.parametrize("fmt", ["ct_fp8:block", "ct_int4:asym_group"])
def test_tensor_parallel_2_equals_1(llama_model, tmp_path, fmt):
    """Column layers shard the rows of the weight, its scales and zero points; row layers
    the inputs on block / group boundaries (128 of 256 and 512 here)."""
    quant_dir, _ = write_pair(llama_model, tmp_path, fmt, _is_llama_linear)
    expected = [o.token_ids for o in build_llm(quant_dir).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = build_llm(quant_dir, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        llm.shutdown()


def test_a_linear_on_the_ignore_list_stays_dense(llama_model, tmp_path):
    """compressed-tensors `ignore` by module name and by `re:` pattern: those linears are
    stored and held dense, the others quantized."""
    dense = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj")

    def quantized(name):
        return _is_llama_linear(name) and not name.startswith(dense)

    quant_dir, plain_dir = write_pair(llama_model, tmp_path, "ct_fp8:channel", quantized)
    config = json.loads((tmp_path / "quantized" / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", dense[0], "re:.*layers\\.0\\..*o_proj$"]
    (tmp_path / "quantized" / "config.json").write_text(json.dumps(config))
    llm = check_parity(quant_dir, plain_dir)
    layers = llm.engine.model_runner.model.model.layers
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn


def test_llama_fp8_batch1_fusions_give_the_tokens_of_the_unfused_fp8_path(
    llama_model, tmp_path, monkeypatch
):
    """A per-channel FP8 checkpoint decoding one sequence at a time: with the batch-1
    fusions (norm + qkv GEMV + RoPE / KV write, norm + gate_up GEMV + SiLU; the GEMV policy
    'fused') the fused GEMVs read the fp8 weights and their row scales, and the greedy
    tokens equal those of every fusion off (the FP8 linear and the separate kernels). The
    fused paths run under the Triton interpreter here, and the FP8 layers take their CUDA
    path (atom/kernels/fp8_linear.py: weight-only, as the fused GEMVs) on both sides."""
    from atom.fusions import Fusions
    from atom.kernels import gemv as gemv_module
    from atom.kernels import gemv_policy
    from atom.kernels.fp8_linear import fp8_linear
    from atom.models import llama
    from atom.models.quantization.fp8 import Fp8LinearMethod

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(llama, "_fused_kernels_on", lambda x: True)

    def cuda_apply(self, layer, x, bias=None):  # Fp8LinearMethod.apply's CUDA branch
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.weight_block, bias)

    monkeypatch.setattr(Fp8LinearMethod, "apply", cuda_apply)
    fp8_launches = []
    real_launch = gemv_module._launch

    def launch(x, weight, out, silu_mul, *args, **kwargs):
        if weight.dtype == FP8:
            fp8_launches.append("rope" if kwargs.get("rope") is not None else silu_mul)
        return real_launch(x, weight, out, silu_mul, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "_launch", launch)
    quant_dir, _ = write_pair(llama_model, tmp_path, "ct_fp8:channel", _is_llama_linear)
    # One prompt, 5 tokens: the prefill and four batch-1 decode steps through every layer
    # (the interpreter runs each fused GEMV program by program: 50 s for two prompts of 6)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    previous = gemv_policy.set_policy(None)  # the engines' own ('fused'), then set back
    try:
        for name, fusions in (("fused", Fusions()), ("unfused", Fusions.none())):
            llm = build_llm(quant_dir, num_kvcache_blocks=64, max_num_seqs=1, fusions=fusions,
                            gemv_policy="fused")  # fmt: skip
            outputs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
            tokens[name] = [o.token_ids for o in outputs]
            llm.engine.shutdown()
            if name == "fused":
                # per layer and step: qkv with RoPE + KV write, gate_up with SiLU
                assert set(fp8_launches) == {"rope", True}, fp8_launches
                fp8_launches.clear()
    finally:
        gemv_policy.set_policy(previous)
    assert not fp8_launches
    assert tokens["fused"] == tokens["unfused"]
