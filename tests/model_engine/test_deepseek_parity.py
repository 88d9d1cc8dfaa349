"""DeepSeek-V2 / V3 (MLA backend) against HF transformers on tiny random models.

Greedy tokens equal HF's generate in fp32; first-step logits close to HF's forward; the
same tokens under chunked prefill, preemption, prefix caching, packed publication and two
micro-batches (the shared page table through the MLA backend). A bf16 variant on CUDA.
"""

import pytest
import torch
import transformers

from atom.attention.backend import MLABackend
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, hf_greedy_no_eos, vocab_prompts

# Tiny ops, atom and HF alike: one torch thread (tests/engine_support.py, one_cpu_thread).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB = 320
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
COMMON = dict(
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
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
VARIANTS = {
    "v2": dict(),
    "v2_q_lora_yarn": dict(q_lora_rank=24, rope_parameters=YARN),
    "v2_group_limited": dict(topk_method="group_limited_greedy", n_group=2, topk_group=1),
    "v3": dict(n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def _make(kind: str, root) -> str:
    torch.manual_seed(7)
    kwargs = dict(COMMON, **VARIANTS[kind])
    if kind == "v3":
        config = transformers.DeepseekV3Config(**kwargs)
        model = transformers.DeepseekV3ForCausalLM(config)
        with torch.no_grad():  # a non-trivial correction bias, so its use is checked
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    else:
        config = transformers.DeepseekV2Config(**kwargs)
        model = transformers.DeepseekV2ForCausalLM(config)
    path = root / kind
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {kind: _make(kind, root) for kind in VARIANTS}


def _prompts(seed, lengths):
    return vocab_prompts(seed, lengths, VOCAB)


PROMPTS = _prompts(0, [1, 9, 40, 21])


def _hf(path, prompts=PROMPTS, max_new_tokens=GREEDY.max_tokens):
    return hf_greedy_no_eos(path, prompts, max_new_tokens)


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_greedy_matches_hf(deepseek_dirs, kind):
    llm = build_llm(deepseek_dirs[kind], num_kvcache_blocks=64)
    runner = llm.engine.model_runner
    assert all(isinstance(slot.backend, MLABackend) for slot in runner.slots)
    assert _tokens(llm) == _hf(deepseek_dirs[kind])


@pytest.mark.parametrize("kind", ["v2", "v2_q_lora_yarn", "v3"])
def test_first_step_logits_match_hf(deepseek_dirs, kind):
    """The engine's model (cache + MLA prefill, then absorbed decode) vs HF's forward."""
    from atom.forward_context import AttentionMetadata, forward_context

    path = deepseek_dirs[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = build_llm(path, num_kvcache_blocks=16)
    model = llm.engine.model_runner.model
    ids = PROMPTS[2]
    n = len(ids)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        # prefill of all but the last token, then one decode step, on a 3-block page table
        block_size = llm.engine.model_runner.block_size
        table = torch.tensor([[2, 0, 5]], dtype=torch.int32)
        positions = torch.arange(n)
        slots = table[0, positions // block_size].long() * block_size + positions % block_size
        prefill = AttentionMetadata(
            slot_mapping=slots[:-1],
            context_lens=torch.tensor([n - 1], dtype=torch.int32),
            block_tables=table,
            cu_seqlens_q=torch.tensor([0, n - 1], dtype=torch.int32),
            max_seqlen_q=n - 1,
            is_decode=False,
        )
        with forward_context(prefill):
            hidden = model(torch.tensor(ids[:-1]), positions[:-1])
        logits = model.compute_logits(hidden)
        decode = AttentionMetadata(
            slot_mapping=slots[-1:],
            context_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=table,
            cu_seqlens_q=None,
            max_seqlen_q=1,
            is_decode=True,
        )
        with forward_context(decode):
            hidden = model(torch.tensor(ids[-1:]), positions[-1:])
        logits = torch.cat([logits, model.compute_logits(hidden)])
    scale = expected.abs().max()
    assert (logits - expected).abs().max() <= 1e-4 * scale


def test_chunked_prefill_preemption_prefix_cache(deepseek_dirs):
    """Small token budget (chunked prefill, mixed steps) and a tiny cache (preemption)."""
    path = deepseek_dirs["v2_q_lora_yarn"]
    expected = _hf(path)
    llm = build_llm(path, max_num_batched_tokens=16, max_num_seqs=4, num_kvcache_blocks=64)
    assert _tokens(llm) == expected
    # preemption: 4 sequences of up to 72 tokens do not fit 10 blocks of 16 together
    llm = build_llm(path, num_kvcache_blocks=10, max_num_seqs=4, enable_prefix_caching=False)
    assert _tokens(llm) == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits(deepseek_dirs):
    path = deepseek_dirs["v2"]
    prompt = _prompts(3, [50])[0]
    expected = _hf(path, [prompt])
    llm = build_llm(path, num_kvcache_blocks=64, enable_prefix_caching=True)
    assert _tokens(llm, [prompt]) == expected
    bm = llm.engine.block_manager
    hits_before = bm.prefix_hit_blocks
    assert _tokens(llm, [prompt]) == expected  # second time: served from the latent cache
    assert bm.prefix_hit_blocks > hits_before


@pytest.mark.parametrize(
    "options",
    [dict(h2d_backend="packed"), dict(num_micro_batches=2), dict(h2d_backend="direct")],
    ids=["packed", "two_micro_batches", "direct"],
)
def test_publication_and_micro_batches(deepseek_dirs, options):
    path = deepseek_dirs["v3"]
    llm = build_llm(path, num_kvcache_blocks=64, max_num_batched_tokens=24, **options)
    assert _tokens(llm) == _hf(path)
    runner = llm.engine.model_runner
    assert all(isinstance(slot.backend, MLABackend) for slot in runner.slots)
    if options.get("num_micro_batches") == 2:
        assert len(runner.slots) == 2


def test_fp8_kv_cache_is_refused(deepseek_dirs):
    with pytest.raises(ValueError, match="not supported for MLA"):
        build_llm(deepseek_dirs["v2"], num_kvcache_blocks=8, kv_cache_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v2_q_lora_yarn", "v3"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_bf16_cuda_logits_close_to_hf(deepseek_dirs, kind, enforce_eager):
    """bf16 on CUDA (Triton latent write + decode, CUDA graphs for decode): the greedy
    continuation's logits stay close to HF fp32's on the same tokens."""
    path = deepseek_dirs[kind]
    llm = build_llm(
        path,
        device="cuda",
        dtype="bfloat16",
        num_kvcache_blocks=64,
        enforce_eager=enforce_eager,
        cuda_graph_batch_sizes=[1, 2, 4],
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = _tokens(llm, PROMPTS, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, generated in zip(PROMPTS, outputs, strict=True):
            full = torch.tensor([prompt + generated])
            logits = hf(full).logits[0, len(prompt) - 1 : -1]
            # each generated token is (near) HF's top choice at its position; bf16 through
            # the CPU references measured up to 2.3% of the largest logit (a near-tie)
            chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
            gap = logits.max(dim=-1).values - chosen
            assert gap.max() <= 0.08 * logits.abs().max(), (gap, logits.abs().max())


def test_tensor_parallel_is_refused_clearly_for_deepseek(deepseek_dirs):
    from atom.distributed.tensor_parallel import ShardingError
    from atom.models.deepseek_v2 import DeepseekV2ForCausalLM
    from atom.models.loader import read_config

    config = read_config(next(iter(deepseek_dirs.values())))
    with pytest.raises(ShardingError, match="tensor parallelism is not supported"):
        DeepseekV2ForCausalLM.validate_tensor_parallel(config, 2)
