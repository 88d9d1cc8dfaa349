"""The engine on CUDA (bf16): Triton kernels, decode CUDA graphs at padded batch sizes,
KV cache sized from free memory. Parity with HF transformers within a logits tolerance."""

import pytest
import torch
import transformers

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _assert_near_hf_greedy(model_dir, prompt, tokens, tolerance):
    """Each generated token's HF logit is within `tolerance` x |best logit| of HF's best.

    bf16 keeps 8 significant bits: one unit in the last place is 2^-7 of the magnitude
    (0.125 at a logit of 16-32), so near-ties may flip; 2% is 2-5 such units (a qwen2 near-tie
    measured 2 units, 1.26%, on the H200).
    """
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.bfloat16
    ).cuda()
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.inference_mode():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    best = logits.max(dim=1).values
    gap = (best - chosen) / best.abs().clamp(min=1.0)
    assert gap.max().item() <= tolerance, gap.tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
def test_bf16_greedy_within_tolerance_of_hf(tiny_model_dirs, kind):
    llm = build_llm(tiny_model_dirs[kind], device="cuda", num_kvcache_blocks=4096, max_num_seqs=8)
    assert llm.engine.model_runner.graphs is not None
    prompts = random_prompts(1, [1, 9, 40, 129])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        _assert_near_hf_greedy(tiny_model_dirs[kind], prompt, out.token_ids, tolerance=0.02)


def test_cuda_graph_padded_batches_match_eager(tiny_model_dirs):
    graphs = build_llm(
        tiny_model_dirs["llama"],
        device="cuda",
        dtype="float32",
        num_kvcache_blocks=4096,
        max_num_seqs=16,
    )
    eager = build_llm(
        tiny_model_dirs["llama"],
        device="cuda",
        dtype="float32",
        num_kvcache_blocks=4096,
        max_num_seqs=16,
        enforce_eager=True,
    )
    prompts = random_prompts(2, [3, 17, 33, 5, 64])  # 5 sequences: replayed at padded size 8
    assert graphs.engine.model_runner.graphs[0].padded_size(5) == 8
    a = graphs.generate(prompts, GREEDY, use_tqdm=False)
    b = eager.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_kv_cache_sized_from_free_memory(tiny_model_dirs):
    small = build_llm(
        tiny_model_dirs["llama"], device="cuda", gpu_memory_utilization=0.2, max_num_seqs=4
    )
    free, total = torch.cuda.mem_get_info()
    blocks = small.engine.block_manager.num_blocks
    block_bytes = small.engine.model_runner.kv_block_bytes()
    assert blocks * block_bytes <= 0.2 * total
    assert blocks > 1000


def test_tiny_model_at_default_memory_utilisation_starts_in_under_10_s(tiny_model_dirs):
    """At 0.9 GPU memory utilisation the tiny model gets tens of millions of KV blocks
    (~32.7M on an H200): their bookkeeping must not be per-block objects (35-40 s and
    several GB of host memory before). A small warm-up engine (4 MB of KV) pays the CUDA
    context and Triton compilations first."""
    import time

    build_llm(tiny_model_dirs["llama"], device="cuda", num_kvcache_blocks=1024)
    start = time.perf_counter()
    llm = build_llm(tiny_model_dirs["llama"], device="cuda")
    seconds = time.perf_counter() - start
    manager = llm.engine.block_manager
    assert manager.num_blocks > 1_000_000, manager.num_blocks
    assert seconds < 10, seconds
    assert manager.bookkeeping_bytes / manager.num_blocks < 16
    out = llm.generate([random_prompts(5, [9])[0]], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
