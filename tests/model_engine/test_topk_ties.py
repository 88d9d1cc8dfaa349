"""The indexer top-k tie rule (docs/architecture.md "Top-k ties"): among equal scores the
lower entry index wins, in every path (prefill and decode, CPU references and Triton), so
a sequence's tokens do not depend on the batch around it, on chunking or on max_model_len.

Tie-prone configs (few indexer heads, a small top-k: exact ReLU zeros at the cut are
common), CPU fp32:
- DeepSeek-V4 against HF transformers' module math with the same rule applied to its
  scores (HF's `topk` leaves the order of equal scores to the implementation: its own
  one-shot and chunked runs can disagree);
- DeepSeek-V4.1 (tiny-minimal's weights with 2 of its 16 indexer heads; no reference
  implementation here): the same tokens alone, batched, chunked and at another
  max_model_len.
Each test also checks that exact ties at the cut did occur.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import atom.attention.v4
import atom.attention.v41
import atom.kernels.v4_indexer
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, vocab_prompts

transformers = pytest.importorskip("transformers")

VOCAB = 320
CSA, SWA = "compressed_sparse_attention", "sliding_attention"
V4_TIES = dict(
    vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
    head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
    partial_rotary_factor=0.25, hc_sinkhorn_iters=3, o_groups=2, o_lora_rank=8,
    index_n_heads=4, index_head_dim=16, index_topk=2, max_position_embeddings=512,
    initializer_range=0.3, bos_token_id=1, eos_token_id=2, num_hidden_layers=3,
    layer_types=[SWA, CSA, CSA], mlp_layer_types=["moe", "moe", "moe"],
    compress_rates={CSA: 4, "heavily_compressed_attention": 16}, sliding_window=8, hc_mult=2,
)  # fmt: skip
N = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
PROMPTS = vocab_prompts(3, [100, 37, 61, 9], VOCAB)


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """Tensor.topk with the documented rule: among equal values the lower index first."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextmanager
def counting_ties(monkeypatch, module, name):
    """Wrap `module.name`, a top-k choice `(scores [T, N], visible [T, N], k[, candidates])`:
    counts the rows whose k-th best visible score equals the next one (a tie at the cut)."""
    original, ties = getattr(module, name), []

    def wrapped(scores, visible, k, candidates=None):
        if candidates is not None:
            visible = visible & candidates
        masked = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True)
        values = masked.values
        if values.shape[-1] > k:
            cut = (values[:, k - 1] == values[:, k]) & (values[:, k] > float("-inf"))
            ties.append(int(cut.sum()))
        return original(scores, visible, k, *(() if candidates is None else (candidates,)))

    monkeypatch.setattr(module, name, wrapped)
    yield ties


@pytest.fixture(scope="module")
def v4_ties_dir(tmp_path_factory):
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers without DeepSeek-V4")
    torch.manual_seed(11)
    config = transformers.DeepseekV4Config(**V4_TIES)
    model = transformers.DeepseekV4ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("v4_ties") / "model"
    model.save_pretrained(path)
    return str(path)


def hf_stable_greedy(path, prompts, n, chunk=None):
    """HF fp32 greedy with the tie rule on its indexer's `topk`; with `chunk`, the prompt is
    prefilled in pieces of `chunk` tokens through the cache first."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    original = torch.Tensor.topk
    torch.Tensor.topk = stable_topk
    try:
        with torch.no_grad():
            for ids in prompts:
                cache = transformers.DynamicCache(config=model.config)
                tokens, logits = list(ids), None
                step = chunk or len(ids)
                for start in range(0, len(ids), step):
                    piece = torch.tensor([ids[start : start + step]])
                    positions = torch.arange(start, start + piece.shape[1])[None]
                    out = model(piece, cache=cache, position_ids=positions, use_cache=True)
                    logits = out.logits[0, -1]
                for _ in range(n):
                    token = int(logits.argmax())
                    tokens.append(token)
                    position = torch.tensor([[len(tokens) - 1]])
                    out = model(torch.tensor([[token]]), cache=cache,
                                position_ids=position, use_cache=True)  # fmt: skip
                    logits = out.logits[0, -1]
                outputs.append(tokens[len(ids) :])
    finally:
        torch.Tensor.topk = original
    return outputs


def _tokens(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_v4_ties_follow_the_rule_in_every_batch_shape(v4_ties_dir, monkeypatch):
    expected = hf_stable_greedy(v4_ties_dir, PROMPTS, N)
    assert hf_stable_greedy(v4_ties_dir, PROMPTS[:1], N, chunk=7) == expected[:1]
    with counting_ties(monkeypatch, atom.kernels.v4_indexer, "select_topk") as decode, \
            counting_ties(monkeypatch, atom.attention.v4, "select_topk") as prefill:  # fmt: skip
        llm = build_llm(v4_ties_dir, num_kvcache_blocks=64, max_model_len=256)
        alone = [_tokens(llm, [p])[0] for p in PROMPTS]
        batched = _tokens(build_llm(v4_ties_dir, num_kvcache_blocks=64, max_model_len=512), PROMPTS)
        chunked = _tokens(build_llm(v4_ties_dir, num_kvcache_blocks=64, max_model_len=160,
                                    max_num_batched_tokens=7, max_num_seqs=4), PROMPTS)  # fmt: skip
    assert sum(prefill) > 0 and sum(decode) > 0, (prefill, decode)
    assert alone == expected
    assert batched == expected
    assert chunked == expected


V41 = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepseek_v41"


@pytest.fixture(scope="module")
def v41_ties_dir(tmp_path_factory):
    """tiny-full (two-level top-k, every fake-quant step, engram) with its first 2 indexer
    heads of 16 and a top-2."""
    source = V41 / "tiny-full"
    if not (source / "model.safetensors").is_file():
        pytest.skip(f"no DeepSeek-V4.1 reference data at {V41}")
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("v41_ties")
    config = json.loads((source / "config.json").read_text())
    heads, dim = 2, config["index_head_dim"]
    tensors = load_file(source / "model.safetensors")
    for name in list(tensors):
        if name.endswith("indexer.wq_b.weight"):
            tensors[name] = tensors[name][: heads * dim].contiguous()
        elif name.endswith("indexer.weights_proj.weight"):
            tensors[name] = tensors[name][:heads].contiguous()
    save_file(tensors, path / "model.safetensors")
    config.update(index_n_heads=heads, index_topk=2)
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        os.symlink(source / name, path / name)
    return str(path)


def test_v41_ties_do_not_depend_on_batch_chunking_or_max_model_len(v41_ties_dir, monkeypatch):
    prompts = vocab_prompts(5, [70, 33, 90, 7], 256)
    with counting_ties(monkeypatch, atom.attention.v41, "two_level_topk_reference") as ties:
        llm = build_llm(v41_ties_dir, skip_tokenizer_init=True, num_kvcache_blocks=64,
                        max_model_len=128)  # fmt: skip
        alone = [_tokens(llm, [p])[0] for p in prompts]
    assert sum(ties) > 0, ties
    batched = _tokens(build_llm(v41_ties_dir, skip_tokenizer_init=True, num_kvcache_blocks=64,
                                max_model_len=512), prompts)  # fmt: skip
    chunked = _tokens(build_llm(v41_ties_dir, skip_tokenizer_init=True, num_kvcache_blocks=64,
                                max_model_len=160, max_num_batched_tokens=7, max_num_seqs=4),
                      prompts)  # fmt: skip
    assert batched == alone
    assert chunked == alone


@pytest.mark.gpu
def test_v4_ties_on_cuda_follow_the_rule(v4_ties_dir):
    """fp32 on CUDA (Triton indexer scores, the stable sort on the device, decode graphs):
    HF's tokens under the rule, batched and in chunks."""
    expected = hf_stable_greedy(v4_ties_dir, PROMPTS, N)
    cuda = dict(device="cuda", dtype="float32", num_kvcache_blocks=64, cuda_graph_batch_sizes=[1, 2, 4])  # fmt: skip
    assert _tokens(build_llm(v4_ties_dir, max_model_len=256, **cuda), PROMPTS) == expected
    llm = build_llm(v4_ties_dir, max_model_len=512, max_num_batched_tokens=7, **cuda)
    assert _tokens(llm, PROMPTS) == expected
