"""Greedy outputs are bit-identical between direct and packed publication."""

import pytest

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_direct_and_packed_give_identical_tokens(tiny_model_dirs, device):
    prompts = random_prompts(3, [1, 5, 17, 40, 63, 2])
    sampled = SamplingParams(
        temperature=0.9, top_p=0.8, top_k=40, max_tokens=12, seed=5, ignore_eos=True
    )
    params = [GREEDY] * 5 + [sampled]
    results = {}
    for backend in ("direct", "packed"):
        # a small token budget forces chunked prefill and mixed prefill/decode steps;
        # on CUDA, decode batches of 6, 5, ... replay graphs captured at 8 and 4 (padded)
        llm = build_llm(
            tiny_model_dirs["llama"],
            device=device,
            h2d_backend=backend,
            max_num_batched_tokens=24,
            max_num_seqs=8,
            num_kvcache_blocks=256,
            cuda_graph_batch_sizes=[1, 4, 8],
        )
        results[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.engine.model_runner
        publisher = runner.slots[0].publisher
        assert publisher.backend == backend
        if backend == "packed":
            assert publisher.kernels > 0
        if device == "cuda":
            assert runner.graphs[0].padded_replays > 0
    assert results["direct"] == results["packed"]


def test_sampling_options_identical_between_direct_and_packed(tiny_model_dirs):
    """Penalties, logit_bias, min_tokens and logprobs staged through either publisher:
    the same tokens and log-probabilities."""
    prompts = random_prompts(4, [3, 20, 9])
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=0.7,
        frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={7: 1.0}, min_tokens=3,
        logprobs=3,
    )  # fmt: skip
    results = {}
    for backend in ("direct", "packed"):
        llm = build_llm(
            tiny_model_dirs["llama"], h2d_backend=backend, max_num_batched_tokens=16,
            num_kvcache_blocks=64,
        )  # fmt: skip
        outputs = llm.generate(prompts, [params, GREEDY, params], use_tqdm=False)
        results[backend] = [
            (o.token_ids, [(e.token_id, e.rank, e.top) for e in o.logprobs or []]) for o in outputs
        ]
    assert results["direct"] == results["packed"]
