"""The engine's logprobs on CUDA (the top k selected from the sampling pass's statistics,
atom/kernels/sampling.py) equal the CPU engine's (torch references). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import transformers

from atom.sampling_params import SamplingParams
from tests.engine_support import TINY, build_llm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(7)
    # 5000 entries: two blocks of the candidates kernels, the second one partial
    config = transformers.LlamaConfig(**TINY, vocab_size=5000, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("logprob_candidates") / "llama"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def _generate(path, device):
    prompts = [list(range(20 + 5 * i, 40 + 5 * i)) for i in range(4)]
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=0.8,
        repetition_penalty=1.3, logit_bias={7: 2.0}, logprobs=20,
    )  # fmt: skip
    llm = build_llm(
        path, device=device, dtype="float32", max_model_len=64, num_kvcache_blocks=16,
        max_num_seqs=4,
    )  # fmt: skip
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def cpu_outputs(model_dir):
    return _generate(model_dir, "cpu")


def test_engine_logprobs_on_cuda_equal_the_cpu_engine(model_dir, cpu_outputs):
    cpu = cpu_outputs
    gpu = _generate(model_dir, "cuda")
    for a, b in zip(cpu, gpu, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.rank == y.rank and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert abs(x.logprob - y.logprob) < 1e-3
