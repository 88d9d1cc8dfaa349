"""DeepSeek-V4.1 edge cases against the upstream semantics (issue 28): a SwiGLU limit of 0
clamps nothing (routed and shared experts alike).

Tiny-full's weights (../shared/reference/deepseek_v41/, README there) under an edited
config.json; the module skips without that data.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm

REFERENCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepseek_v41"
if not (REFERENCE / "tiny-full" / "golden.json").is_file():
    pytest.skip(f"no DeepSeek-V4.1 reference data at {REFERENCE}", allow_module_level=True)

PROMPTS = [p["prompt_ids"] for p in json.loads((REFERENCE / "tiny-full" / "golden.json").read_text())["prompts"]]  # fmt: skip


def edited_checkpoint(directory: Path, name: str = "tiny-full", **changes) -> Path:
    """`name`'s files linked into `directory`, with config.json's keys replaced."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in (REFERENCE / name).iterdir():
        if file.name != "config.json":
            os.symlink(file, directory / file.name)
    config = json.loads((REFERENCE / name / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _run(path, prompts, n=6):
    """(tokens per prompt, last prompt logits per prompt, shared expert outputs)."""
    llm = build_llm(str(path), skip_tokenizer_init=True, num_kvcache_blocks=64, max_model_len=128)
    model = llm.engine.model_runner.model
    logits, shared = [], []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    for layer in model.model.layers:
        layer.ffn.shared_experts.register_forward_hook(lambda m, i, out: shared.append(out))
    tokens, last = [], []
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for prompt in prompts:
        logits.clear()
        tokens.append(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        last.append(logits[0][0])
    return tokens, last, shared


def test_swiglu_limit_zero_clamps_no_expert(tmp_path):
    """Upstream clamps `if swiglu_limit > 0`, for routed and shared experts: at 0 the model
    is the same weights with the clamp removed (here: a limit no activation reaches)."""
    prompts = [PROMPTS[3], PROMPTS[2][:20]]  # 70 and 20 tokens
    zero = _run(edited_checkpoint(tmp_path / "zero", swiglu_limit=0.0), prompts)
    unclamped = _run(edited_checkpoint(tmp_path / "huge", swiglu_limit=1e30), prompts)
    assert zero[0] == unclamped[0]
    for a, b in zip(zero[1], unclamped[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert all(out.abs().max() > 0 for out in zero[2])


def test_bf16_rounds_where_the_reference_rounds():
    """tiny-full in bf16 (CPU): the norms compute ``weight * normed.to(bf16)`` with the
    weight in bf16 (the pooled compressor latent is cast to bf16 before its norm), and the
    mHC expand runs in fp32 and is cast once."""
    import atom.models.deepseek_v41 as v41

    llm = build_llm(str(REFERENCE / "tiny-full"), skip_tokenizer_init=True, dtype="bfloat16",
                    num_kvcache_blocks=64, max_model_len=128)  # fmt: skip
    model = llm.engine.model_runner.model.model
    layer = model.layers[1]
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(64, 64, generator=generator)).bfloat16()
    norm = layer.attn_norm
    assert norm.weight.dtype == torch.bfloat16
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
    assert torch.equal(norm(x), norm.weight * normed.bfloat16())
    fp32_weight = (norm.weight.float() * normed).bfloat16()  # V4's order: differs somewhere
    assert not torch.equal(norm(x), fp32_weight)

    streams = (3 * torch.randn(64, 4, 64, generator=generator)).bfloat16()
    out = (3 * torch.randn(64, 64, generator=generator)).bfloat16()
    post, comb = torch.rand(64, 4, generator=generator), torch.rand(64, 4, 4, generator=generator)
    expected = post[..., None] * out.float()[:, None] + comb.transpose(-1, -2) @ streams.float()
    assert torch.equal(v41.expand(out, streams, post, comb), expected.bfloat16())

    seen = []
    compressor_norm = layer.attn.compressor.norm  # layer 1: ratio 2, pooled in fp32
    compressor_norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([PROMPTS[2]], params, use_tqdm=False)
    assert seen and set(seen) == {torch.bfloat16}
