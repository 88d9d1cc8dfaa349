"""Qwen3-Next (gdn backend) against HF transformers on tiny random models, CPU fp32.

Exact greedy tokens equal HF's `generate` for 32 tokens with prompts shorter and longer
than the conv window and the delta rule's chunk (64), for two configs (different
linear/full patterns, head counts, conv kernels, dense and MoE MLPs); the same tokens under
chunked prefill (chunk boundaries inside a conv window), preemption, a batch of 8 mixed
lengths (direct and packed publication) and two micro-batches. The parameters HF
initialises to constants (norm weights, dt_bias, the router) are randomised so that their
use is checked. Every test leaves every KV block and state slot free
(tests/engine_support.py).
"""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3NextForCausalLM"):
    pytest.skip("transformers without Qwen3-Next", allow_module_level=True)

from atom.attention.gdn import GDNBackend  # noqa: E402
from atom.sampling_params import SamplingParams  # noqa: E402
from tests.engine_support import build_llm, hf_greedy_no_eos, vocab_prompts  # noqa: E402

VOCAB = 320
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
)
LIN, FULL = "linear_attention", "full_attention"
VARIANTS = {
    # GDN, GDN, full; 2 k heads / 4 v heads; conv 4; MoE every layer
    "a": dict(
        num_hidden_layers=3,
        layer_types=[LIN, LIN, FULL],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    ),
    # full first, then GDN, GDN, full; 1 k head / 1 v head; conv 3; dense MLP on layer 1; a
    # shared expert as wide as the routed ones (at decode on the CUDA path: one more pair of
    # their GEMVs; "a"'s wider one runs apart)
    "b": dict(
        shared_expert_intermediate_size=16,
        num_hidden_layers=4,
        layer_types=[FULL, LIN, LIN, FULL],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=3,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    # no GDN layer at all (full, full): no state slots, the MHA backend
    "c": dict(
        num_hidden_layers=2,
        layer_types=[FULL, FULL],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
    ),
}


def _make(kind: str, root) -> str:
    torch.manual_seed(5)
    config = transformers.Qwen3NextConfig(**dict(COMMON, **VARIANTS[kind]))
    model = transformers.Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "gate.weight")):
                param.normal_(0.0, 0.3)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.0)
    path = root / kind
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops: one intra-op thread (on a loaded 2-core host, two spinning threads made
    these tests ~80x slower); restored after the module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def qwen3_next_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    return {kind: _make(kind, root) for kind in VARIANTS}


def _prompts(seed, lengths):
    return vocab_prompts(seed, lengths, VOCAB)


PROMPTS = _prompts(0, [1, 5, 40, 70])
MIXED = _prompts(1, [1, 2, 3, 8, 15, 17, 33, 66])


def _hf(path, prompts=PROMPTS):
    return hf_greedy_no_eos(path, prompts, GREEDY.max_tokens)


def _tokens(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["a", "b"])
def test_greedy_matches_hf(qwen3_next_dirs, kind):
    llm = build_llm(qwen3_next_dirs[kind], num_kvcache_blocks=64, max_model_len=256)
    assert all(isinstance(slot.backend, GDNBackend) for slot in llm.engine.model_runner.slots)
    assert _tokens(llm) == _hf(qwen3_next_dirs[kind])


@pytest.mark.parametrize("kind", ["a", "b"])
def test_cuda_path_under_the_interpreter_matches_hf(qwen3_next_dirs, kind, monkeypatch):
    """The CUDA path's fused launches (softmax routing, MoE with the gated shared expert,
    the GDN split and gated norm, the in-place partial rotary, SwiGLU) under Triton's
    interpreter on the CPU: fp32 greedy tokens equal HF's. One prompt, 8 tokens: each
    interpreted step is slow (the GPU parity tests run the same kernels on every prompt)."""
    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
    prompts, params = PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = build_llm(qwen3_next_dirs[kind], num_kvcache_blocks=64, max_model_len=256)
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == hf_greedy_no_eos(qwen3_next_dirs[kind], prompts, params.max_tokens)


def test_no_linear_attention_layer_matches_hf(qwen3_next_dirs):
    """Only full-attention layers (it used to crash on the state slot of a sequence that
    holds none): HF's tokens, whole and in chunks of 7 with preemptions."""
    path = qwen3_next_dirs["c"]
    expected = _hf(path)
    llm = build_llm(path, num_kvcache_blocks=64, max_model_len=256)
    assert llm.engine.block_manager.state_slots is None
    assert _tokens(llm) == expected
    llm = build_llm(path, max_num_batched_tokens=7, max_num_seqs=4, num_kvcache_blocks=9,
                    max_model_len=144)  # fmt: skip
    assert _tokens(llm) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    # no state: prefix caching stays on and a repeated prompt reuses its blocks
    llm = build_llm(path, num_kvcache_blocks=64, max_model_len=256, enable_prefix_caching=True)
    assert _tokens(llm) == expected and _tokens(llm) == expected
    assert llm.engine.block_manager.prefix_hit_blocks > 0


def test_no_full_attention_layer_is_refused(tmp_path):
    """Only GDN layers: refused at load, naming layer_types (it crashed sizing the cache)."""
    from atom.models.loader import ModelLoadError

    kwargs = dict(COMMON, **VARIANTS["a"])
    kwargs.update(num_hidden_layers=2, layer_types=[LIN, LIN])
    transformers.Qwen3NextConfig(**kwargs).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="layer_types .* no full_attention layer"):
        build_llm(str(tmp_path), load_format="dummy", num_kvcache_blocks=8)


def test_chunked_prefill_and_preemption(qwen3_next_dirs):
    path = qwen3_next_dirs["a"]
    expected = _hf(path)
    # chunks of 7 tokens: boundaries fall inside the 4-wide conv window and the 64 chunk
    llm = build_llm(path, max_num_batched_tokens=7, max_num_seqs=4, num_kvcache_blocks=64)
    assert _tokens(llm) == expected
    # 4 sequences of up to 102 tokens do not fit 9 blocks of 16 together
    llm = build_llm(path, num_kvcache_blocks=9, max_num_seqs=4, max_model_len=144)
    assert _tokens(llm) == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("h2d_backend", ["direct", "packed"])
def test_batch_of_eight_mixed_lengths(qwen3_next_dirs, h2d_backend):
    path = qwen3_next_dirs["b"]
    llm = build_llm(path, num_kvcache_blocks=64, max_num_batched_tokens=48, h2d_backend=h2d_backend)
    assert _tokens(llm, MIXED) == _hf(path, MIXED)


def test_two_micro_batches(qwen3_next_dirs):
    path = qwen3_next_dirs["b"]
    llm = build_llm(path, num_kvcache_blocks=64, num_micro_batches=2, max_num_batched_tokens=24)
    assert len(llm.engine.model_runner.slots) == 2
    assert _tokens(llm) == _hf(path)


def test_prefix_caching_is_off_with_one_log_line(qwen3_next_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="atom.model_engine.llm_engine"):
        llm = build_llm(qwen3_next_dirs["a"], num_kvcache_blocks=16, enable_prefix_caching=True)
    lines = [r.message for r in caplog.records if "prefix caching is off" in r.message]
    assert len(lines) == 1 and "qwen3_next" in lines[0]
    assert not llm.engine.block_manager.enable_prefix_caching


# bf16 on CUDA against HF fp32 on the same tokens: the agreement (fraction of generated
# positions where bf16 chose HF's best token) and the worst regret ((best logit - logit of
# the chosen token) / max|logit| there). H200, 2026-12-01: 0.781 / 0.424, eager and graphs
# alike. Earlier runs of the same test moved between 0.50 and 0.88 agreement and up to 1.56
# regret, from run to run. That was a race in the conv kernels: they overwrote state rows
# that other warps of the program were still reading. A barrier fixed it, and eager and
# graphs now agree. Most positions agree exactly. A few flip to a clearly worse token,
# because this tiny random MoE (top-2 of 4 experts, init 0.3) reroutes on a bf16 rounding.
# The bounds are the measured figures with margin.
BF16_BOUNDS = (0.70, 0.55)  # (min agreement, max regret)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_bf16_cuda_logits_close_to_hf(qwen3_next_dirs, enforce_eager):
    """bf16 on CUDA (Triton conv + delta-rule kernels, CUDA graphs for decode): each greedy
    token is (near) HF fp32's best choice on the same tokens."""
    path = qwen3_next_dirs["a"]
    llm = build_llm(
        path,
        device="cuda",
        dtype="bfloat16",
        num_kvcache_blocks=64,
        max_model_len=256,
        enforce_eager=enforce_eager,
        cuda_graph_batch_sizes=[1, 2, 4],
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    regrets = []
    with torch.no_grad():
        for prompt, generated in zip(PROMPTS, outputs, strict=True):
            logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
            gap = logits.max(dim=-1).values - chosen
            regrets.append(gap / logits.abs().max(dim=-1).values)
    regrets = torch.cat(regrets)
    agreement, regret = float((regrets == 0).float().mean()), float(regrets.max())
    mode = "eager" if enforce_eager else "graphs"
    print(f"bf16 {mode}: agreement {agreement:.3f}, worst regret {regret:.4f}")
    min_agreement, max_regret = BF16_BOUNDS
    assert agreement >= min_agreement and regret <= max_regret, (agreement, regret)


@pytest.mark.gpu
def test_cuda_fp32_greedy_matches_hf(qwen3_next_dirs):
    """The CUDA paths (Triton kernels, graphs, chunked prefill) in fp32 give HF's tokens."""
    path = qwen3_next_dirs["a"]
    llm = build_llm(path, device="cuda", dtype="float32", num_kvcache_blocks=64, max_model_len=256,
                    max_num_batched_tokens=32, cuda_graph_batch_sizes=[1, 2, 4])  # fmt: skip
    assert _tokens(llm) == _hf(path)


LONG = _prompts(2, [300, 70])


@pytest.mark.gpu
@pytest.mark.parametrize("max_num_batched_tokens", [1024, 260], ids=["whole", "split"])
def test_cuda_fp32_long_prefill_greedy_matches_hf(
    qwen3_next_dirs, max_num_batched_tokens, monkeypatch
):
    """A 300-token prompt reaches the chunked delta-rule kernels (atom/kernels/gdn_chunk.py); split at 260 tokens, the rest continues from the chunked
    kernels' state on the sequential kernel: HF's tokens either way (fp32, CUDA). The
    thresholds are lowered so that this prompt takes the chunked kernels."""
    import dataclasses

    import atom.kernels.gdn_chunk
    from atom.fusions import Fusions

    monkeypatch.setattr(atom.kernels.gdn_chunk, "CHUNKED_MAX_SEQS", 2)
    fusions = dataclasses.replace(Fusions.from_env(), gdn_chunked_min_tokens=256)
    path = qwen3_next_dirs["a"]
    llm = build_llm(path, device="cuda", dtype="float32", num_kvcache_blocks=64, max_model_len=512,
                    max_num_batched_tokens=max_num_batched_tokens,
                    cuda_graph_batch_sizes=[1, 2, 4], fusions=fusions)  # fmt: skip
    assert _tokens(llm, LONG) == _hf(path, LONG)


def test_memory_profiling_forward_runs_without_a_cache(qwen3_next_dirs):
    """The CUDA sizing run (no blocks, no state slots yet) goes through every layer and
    equals a fresh prefill of the same tokens."""
    from atom.forward_context import AttentionMetadata, forward_context

    llm = build_llm(qwen3_next_dirs["b"], num_kvcache_blocks=8)
    model = llm.engine.model_runner.model
    n = 70  # more than one delta-rule chunk
    ids = torch.randint(3, VOCAB, (n,))
    dense = AttentionMetadata(None, None, None, None, n, False)
    with torch.no_grad(), forward_context(dense):
        hidden = model(ids, torch.arange(n))
    assert hidden.shape == (n, 32) and torch.isfinite(hidden).all()
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_next_dirs["b"]).eval()
    with torch.no_grad():
        expected = hf(ids[None], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)


def test_gdn_projections_load_into_their_rows_and_a_missing_one_is_named(qwen3_next_dirs):
    """HF's in_proj_qkvz and in_proj_ba fill their row ranges of the one `in_proj` weight;
    a checkpoint without in_proj_ba is refused naming it."""
    from safetensors.torch import load_file

    from atom.models.qwen3_next import Qwen3NextForCausalLM

    path = qwen3_next_dirs["a"]
    config = transformers.AutoConfig.from_pretrained(path)
    tensors = load_file(f"{path}/model.safetensors")
    model = Qwen3NextForCausalLM(config)
    model.load_weights(tensors.items())
    prefix = next(n for n in tensors if n.endswith("in_proj_qkvz.weight"))[
        : -len("in_proj_qkvz.weight")
    ]
    gdn = model.get_submodule(prefix.rstrip("."))
    qkvz, ba = tensors[f"{prefix}in_proj_qkvz.weight"], tensors[f"{prefix}in_proj_ba.weight"]
    assert torch.equal(gdn.in_proj.data, torch.cat([qkvz, ba]))
    partial = {n: t for n, t in tensors.items() if n != f"{prefix}in_proj_ba.weight"}
    with pytest.raises(ValueError, match="in_proj#in_proj_ba"):
        Qwen3NextForCausalLM(config).load_weights(partial.items())
