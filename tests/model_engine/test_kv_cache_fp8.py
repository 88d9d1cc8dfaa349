"""fp8 KV cache (``kv_cache_dtype="fp8"``) on the tiny parity models.

Each prompt is generated greedily by an engine with the model-dtype cache and by one with
the fp8 cache; every step's logits are recorded (eager, one prompt at a time) and compared
while the two token streams agree. The error is relative to the step's largest logit
magnitude. Measured (docs/architecture.md, "fp8 KV cache"): CPU fp32 at most 1.0%
(llama 0.97%, qwen2 0.88%, llama3 0.74%); the H200 figures are in the same place.
"""

import pytest
import torch

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# max |logit_fp8 - logit| / max |logit| over every compared step
LOGIT_TOLERANCE = 0.03
KINDS = ["llama", "qwen2", "llama3"]


def _record_logits(llm) -> list[torch.Tensor]:
    """Every logits row the engine computes from now on, as fp32 on the host."""
    model = llm.engine.model_runner.model
    compute_logits = model.compute_logits
    recorded: list[torch.Tensor] = []

    def recording(hidden):
        logits = compute_logits(hidden)
        recorded.append(logits.float().cpu())
        return logits

    model.compute_logits = recording
    return recorded


def measure_fp8_logit_error(model_dir: str, device: str, dtype: str) -> tuple[float, int, int]:
    """(max relative logit error, compared steps, steps where the greedy tokens differ).

    Where the tokens first differ, the fp8 engine's token must be a near-tie under the
    unquantized logits (within the same tolerance); later steps are not compared, their
    contexts differ.
    """
    common = dict(device=device, dtype=dtype, enforce_eager=True, async_scheduling=False)
    reference = build_llm(model_dir, kv_cache_dtype="auto", **common)
    quantized = build_llm(model_dir, kv_cache_dtype="fp8", **common)
    assert quantized.engine.model_runner.kv_cache.data.dtype == torch.float8_e4m3fn
    reference_logits, quantized_logits = _record_logits(reference), _record_logits(quantized)
    worst, compared, diverged = 0.0, 0, 0
    for prompt in random_prompts(0, [1, 7, 33, 70]):
        reference_logits.clear()
        quantized_logits.clear()
        expected = reference.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
        got = quantized.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
        assert len(reference_logits) == len(quantized_logits) == len(expected)
        for step, (ref, fp8) in enumerate(zip(reference_logits, quantized_logits, strict=True)):
            magnitude = ref.abs().max().item()
            worst = max(worst, (fp8 - ref).abs().max().item() / magnitude)
            compared += 1
            if got[step] != expected[step]:
                gap = (ref[0, expected[step]] - ref[0, got[step]]).item() / magnitude
                assert gap <= LOGIT_TOLERANCE, f"step {step}: fp8 chose a token {gap:.2%} worse"
                diverged += 1
                break
    return worst, compared, diverged


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_kv_cache_logits_close_to_fp32_on_cpu(tiny_model_dirs, kind):
    error, compared, _ = measure_fp8_logit_error(tiny_model_dirs[kind], "cpu", "float32")
    print(f"{kind} cpu fp32: max relative logit error of the fp8 KV cache {error:.4%}")
    assert compared >= 4 * 2 and 0 < error <= LOGIT_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_kv_cache_logits_close_to_bf16_on_gpu(tiny_model_dirs, kind):
    error, compared, _ = measure_fp8_logit_error(tiny_model_dirs[kind], "cuda", "bfloat16")
    print(f"{kind} cuda bf16: max relative logit error of the fp8 KV cache {error:.4%}")
    assert compared >= 4 * 2 and 0 < error <= LOGIT_TOLERANCE


@pytest.mark.gpu
def test_fp8_kv_cache_cuda_graphs_match_eager(tiny_model_dirs):
    """Decode CUDA graphs over the fp8 cache (scales bound at capture) replay exactly."""
    common = dict(device="cuda", kv_cache_dtype="fp8", num_kvcache_blocks=2048, max_num_seqs=16)
    graphs = build_llm(tiny_model_dirs["llama"], **common)
    eager = build_llm(tiny_model_dirs["llama"], enforce_eager=True, **common)
    assert graphs.engine.model_runner.graphs is not None
    prompts = random_prompts(4, [3, 17, 33, 5, 64])
    a = graphs.generate(prompts, GREEDY, use_tqdm=False)
    b = eager.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_fp8_kv_cache_holds_about_twice_the_blocks(tiny_model_dirs):
    auto = build_llm(tiny_model_dirs["llama"], kv_cache_memory_bytes=16 << 20)
    fp8 = build_llm(tiny_model_dirs["llama"], kv_cache_memory_bytes=16 << 20, kv_cache_dtype="fp8")
    # fp32 model, head_dim 16: 4 bytes per element against 1 byte + a 4-byte scale per row
    head_dim = 64 // 4
    ratio = fp8.engine.block_manager.num_blocks / auto.engine.block_manager.num_blocks
    assert ratio == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)


def test_kv_cache_dtype_is_validated():
    from atom.config import Config

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Config(device="cpu", kv_cache_dtype="int4")
