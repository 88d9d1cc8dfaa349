"""Sampling options on CUDA (run by the lead on the H200; skipped without a GPU).

The batched processors give the CPU result on the GPU; with CUDA graphs and asynchronous
scheduling (placeholders filled on the device) penalties give the synchronous tokens, and
logprobs match HF's log-softmax of the same fp32 checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from atom.model_engine.sampling.logits_processors import LogitsInputs, apply_logits_processors
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams
from tests.engine_support import TINY, build_llm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    torch.manual_seed(7)
    config = transformers.LlamaConfig(**TINY, vocab_size=512, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("small_gpu") / "llama"
    model.save_pretrained(path)
    return str(path), model


def test_processors_on_cuda_equal_cpu():
    generator = torch.Generator().manual_seed(0)
    vocab = 1000
    seqs = []
    for row in range(32):
        prompt = torch.randint(0, vocab, (20,), generator=generator).tolist()
        seq = Sequence(
            prompt,
            SamplingParams(
                max_tokens=64,
                presence_penalty=0.5 * (row % 3),
                frequency_penalty=0.2,
                repetition_penalty=1.0 + 0.1 * (row % 4),
                logit_bias={row: 3.0, 999: -5.0},
                min_tokens=5 if row % 5 == 0 else 0,
                stop_token_ids=[7],
            ),
        )
        seq.sampling_params.all_stop_token_ids = [2, 7]
        seq.token_ids += torch.randint(0, vocab, (row % 9,), generator=generator).tolist()
        seqs.append(seq)
    logits = torch.randn(32, vocab, generator=generator) * 3
    cpu = apply_logits_processors(logits.clone(), LogitsInputs.build(seqs, None, vocab, torch.device("cpu")))  # fmt: skip
    device = torch.device("cuda")
    gpu = apply_logits_processors(logits.cuda(), LogitsInputs.build(seqs, None, vocab, device))
    torch.testing.assert_close(gpu.cpu(), cpu)


def test_async_graphs_penalties_and_logprobs(small_model):
    path, model = small_model
    prompts = [[5, 6, 7], [8, 9, 10, 11], list(range(30, 60))]
    params = SamplingParams(
        temperature=0, max_tokens=16, presence_penalty=1.5, frequency_penalty=1.0,
        ignore_eos=True, logprobs=3,
    )  # fmt: skip
    results = []
    for async_scheduling in (False, True):
        # A fixed cache, as the other GPU engine tests: sized from free memory, the second
        # engine would see the first one's cache (still alive in `_ENGINES`) as used.
        llm = build_llm(
            path, device="cuda", dtype="float32", max_model_len=256,
            async_scheduling=async_scheduling, num_kvcache_blocks=64,
        )  # fmt: skip
        results.append(llm.generate(prompts, params, use_tqdm=False))
    assert [o.token_ids for o in results[0]] == [o.token_ids for o in results[1]]
    # Raw logprobs (before the penalties) equal HF's log-softmax of the same tokens.
    for prompt, out in zip(prompts, results[1], strict=True):
        full = prompt + out.token_ids
        with torch.no_grad():
            reference = model(torch.tensor([full])).logits[0].log_softmax(-1)
        for i, entry in enumerate(out.logprobs):
            position = len(prompt) + i
            assert abs(entry.logprob - reference[position - 1, full[position]].item()) < 1e-3


def test_kernels_in_the_engine_equal_the_cpu_references(small_model):
    """Penalties, logit_bias, min_tokens and logprobs through the Triton kernels (CUDA
    graphs, asynchronous scheduling, chunked prefill, preemption) give the CPU engine's
    tokens (torch references) and its logprobs."""
    path, _ = small_model
    prompts = [list(range(20 + 5 * i, 40 + 5 * i)) for i in range(6)]
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=0.8,
        frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={7: 2.0, 300: -1.0},
        min_tokens=4, stop_token_ids=[11], logprobs=5,
    )  # fmt: skip
    results = {}
    for device in ("cpu", "cuda"):
        llm = build_llm(
            path, device=device, dtype="float32", max_model_len=64, num_kvcache_blocks=7,
            max_num_seqs=4, max_num_batched_tokens=32,
        )  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        results[device] = outputs
    for cpu, gpu in zip(results["cpu"], results["cuda"], strict=True):
        assert gpu.token_ids == cpu.token_ids
        for a, b in zip(cpu.logprobs, gpu.logprobs, strict=True):
            assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-3
