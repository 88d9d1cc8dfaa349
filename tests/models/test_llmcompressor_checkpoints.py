"""SmolLM2-135M quantized by llm-compressor (the real tool), loaded by atom, compared with HF.

llmcompressor 0.14 pins transformers <= 5.17 and atom needs >= 5.24, so the tool lives in a
side directory installed once with `pip install --no-deps --target` (it reuses this venv's
torch, datasets, accelerate, ...; ~10 s, cached under the temp dir by version), and
tests/models/llmcompressor_worker.py runs there as a subprocess: it quantizes the embedded
GGUF converted to an HF directory, saves the compressed checkpoint, HF's logits and greedy
tokens on it (transformers 5.17 + compressed-tensors at run time), and the weights as
compressed-tensors decompresses them (a plain checkpoint). Each scheme is quantized once
and kept on disk (keyed by the tool versions, the worker and the prompts).

Bounds (fp32 CPU):
- int4 (W4A16 GPTQ, W4A16_ASYM): atom runs the very weights compressed-tensors decompresses,
  so greedy tokens equal HF's on both the compressed and the decompressed checkpoint, and the
  last-token logits agree to 1e-4 of the logit scale (summation order only).
- FP8_DYNAMIC: activations are rounded to e4m3 per token, in atom as in compressed-tensors:
  one linear on the same input gives HF's output to 1e-6 (bit for bit in practice). Over 30
  layers, 1e-6-sized summation-order differences (atom fuses q | k | v and gate | up) flip
  a few roundings (one e4m3 step is 1/16 relative) and the flips compound: measured, the
  last-token logits drift by 0.06-0.11 of the logit scale. So the whole-model checks are the
  argmax of every prompt's last logits, logits within 0.25 of the scale, HF's greedy path
  fed back to atom (each HF token atom's argmax or a near-tie), atom's own greedy path fed
  back to atom's prefill (each decoded token the prefill's argmax or a near-tie), and atom's
  greedy tokens equal to HF's up to the first step whose top two are a near-tie (a fixed
  token count broke when a fresh quantization put a 0.003-of-scale tie at the third token,
  and a count up to the first teacher-forced flip broke on a three-way tie at the eleventh);
  with the rounding switched off atom equals the decompressed model (greedy
  tokens, logits within 1e-4: the weights are exact).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from atom.models.default_model import default_model_path, save_default_model_as_hf
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm
from tests.models.test_quantized_checkpoints import prefill_logits

LLMCOMPRESSOR = "0.14.0.1"
SIDE_PACKAGES = [
    f"llmcompressor=={LLMCOMPRESSOR}",
    "compressed-tensors==0.19.0",
    "transformers==5.17.0",
    "huggingface-hub>=1.5,<2",
    "auto-round==0.15.1",
    "loguru",
    "nvidia-ml-py",
    "pillow",
]
WORKER = Path(__file__).with_name("llmcompressor_worker.py")
CACHE = Path(tempfile.gettempdir()) / f"atom-llmcompressor-{LLMCOMPRESSOR}"
# "The capital of France is" and a short instruction, as SmolLM2 token ids
PROMPTS = [[504, 3575, 282, 4649, 314], [28, 5248, 7432, 30, 2088, 314, 260, 3575, 282, 4649, 47]]
GREEDY_TOKENS = 16  # as the worker's HF generate
SCHEMES = ("FP8_DYNAMIC", "W4A16", "W4A16_ASYM")


def _side_packages() -> Path:
    site = CACHE / "site-packages"
    if (site / "llmcompressor").is_dir():
        return site
    partial = CACHE / "site-packages.partial"
    shutil.rmtree(partial, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target"]
    result = subprocess.run(
        [*command, str(partial), *SIDE_PACKAGES], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot install llmcompressor (no package index?): {result.stderr[-500:]}")
    partial.rename(site)
    return site


def _smollm2_hf_dir() -> Path:
    """The embedded SmolLM2 GGUF as an fp32 HF directory (made once, cached)."""
    return save_default_model_as_hf(CACHE / "smollm2-hf")


@pytest.fixture(scope="session")
def quantized_smollm2():
    """scheme -> directory with quantized/, dequantized/ and hf_compressed.pt."""
    try:
        default_model_path()
    except Exception as e:
        pytest.skip(str(e))
    CACHE.mkdir(parents=True, exist_ok=True)
    site = _side_packages()
    hf_dir = _smollm2_hf_dir()
    key = hashlib.sha1(WORKER.read_bytes() + json.dumps(PROMPTS).encode()).hexdigest()[:10]
    for stale in CACHE.glob("*-*"):  # results of an older worker or other prompts
        if stale.name.startswith(("FP8_DYNAMIC-", "W4A16", "prompts-")) and key not in stale.name:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    prompts_file = CACHE / f"prompts-{key}.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    env = dict(os.environ, PYTHONPATH=str(site), TOKENIZERS_PARALLELISM="false")
    outputs = {scheme: CACHE / f"{scheme}-{key}" for scheme in SCHEMES}
    missing = [s for s, out in outputs.items() if not (out / "hf_compressed.pt").exists()]
    for scheme in missing:
        shutil.rmtree(outputs[scheme], ignore_errors=True)
        outputs[scheme].mkdir()
    if missing:  # one worker for them all: its imports are paid once
        jobs = [f"{scheme}={outputs[scheme]}" for scheme in missing]
        result = subprocess.run(
            [sys.executable, str(WORKER), str(hf_dir), str(prompts_file), *jobs],
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            for scheme in missing:
                if not (outputs[scheme] / "hf_compressed.pt").exists():
                    shutil.rmtree(outputs[scheme], ignore_errors=True)
            pytest.fail(f"llmcompressor ({', '.join(missing)}) failed:\n{result.stderr[-3000:]}")
    return outputs


def _hf_dense(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as the worker: atom runs with ignore_eos
    logits, tokens = [], []
    with torch.no_grad():
        for ids in PROMPTS:
            input_ids = torch.tensor([ids])
            logits.append(model(input_ids).logits[0, -1])
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
            )
            tokens.append(out[0, len(ids) :].tolist())
    return torch.stack(logits), tokens


def _atom(path: Path):
    llm = build_llm(str(path), max_model_len=256, num_kvcache_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    logits = torch.stack([prefill_logits(llm, ids)[-1] for ids in PROMPTS])
    return llm, logits, tokens


def _close(got, expected, bound):
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= bound * scale, (got - expected).abs().max() / scale


def _near_ties(llm, ids, path):
    """atom's prefill logits with `path` fed after `ids` (teacher forcing): at every step,
    how far `path`'s token is below the argmax and how far the runner-up is below the
    argmax, both in units of the logit scale."""
    forced = prefill_logits(llm, ids + path)[len(ids) - 1 : len(ids) - 1 + len(path)]
    scale = forced.abs().max()
    top = forced.topk(2, dim=-1).values
    picked = forced.gather(1, torch.tensor(path)[:, None])[:, 0]
    return (top[:, 0] - picked) / scale, (top[:, 0] - top[:, 1]) / scale


def _greedy_within_near_ties(llm, ids, got, expected, tie=0.02):
    """At every step of HF's greedy path fed to atom (teacher forcing), HF's token is atom's
    argmax or a near-tie (within `tie` of the logit scale; measured up to 0.005); at every
    step of atom's own greedy path (paged decode, 16 tokens) fed back to atom's prefill, the
    decoded token is likewise the prefill's argmax or a near-tie (decode and prefill sum in
    different orders, so a rounding may flip: measured up to ~0.015). atom's greedy tokens
    equal HF's up to the first step whose top two are within `tie` (there either may win:
    a 0.008-of-scale three-way tie at the eleventh token of a fresh quantization parted the
    texts while no teacher-forced argmax differed)."""
    hf_gap, margin = _near_ties(llm, ids, expected)
    assert hf_gap.max() <= tie, hf_gap
    decode_gap, _ = _near_ties(llm, ids, got)
    assert decode_gap.max() <= tie, decode_gap
    ties = (margin < tie).nonzero()
    agree = int(ties[0]) if len(ties) else len(expected)
    assert got[:agree] == expected[:agree]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_int4_checkpoint_matches_hf_and_the_decompressed_model(quantized_smollm2, scheme):
    out = quantized_smollm2[scheme]
    config = json.loads((out / "quantized" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    llm, logits, tokens = _atom(out / "quantized")
    assert llm.engine.model_runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.int32
    compressed = torch.load(out / "hf_compressed.pt")
    dense_logits, dense_tokens = _hf_dense(out / "dequantized")
    assert tokens == compressed["tokens"] == dense_tokens
    _close(logits, compressed["logits"], 1e-4)
    _close(logits, dense_logits, 1e-4)


@pytest.mark.slow
def test_fp8_dynamic_checkpoint_matches_hf(quantized_smollm2, monkeypatch):
    out = quantized_smollm2["FP8_DYNAMIC"]
    config = json.loads((out / "quantized" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized"
    llm, logits, tokens = _atom(out / "quantized")
    layer = llm.engine.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    compressed = torch.load(out / "hf_compressed.pt")
    # one linear on the same input: compressed-tensors' activation rounding, bit for bit
    x, y = compressed["linears"]["self_attn.q_proj"]
    with torch.no_grad():
        _close(layer.self_attn.qkv_proj(x)[:, : y.shape[-1]], y, 1e-6)
        x, y = compressed["linears"]["mlp.down_proj"]
        _close(layer.mlp.down_proj(x), y, 1e-6)
    # the whole model: rounding flips make the logits drift (module docstring)
    _close(logits, compressed["logits"], 0.25)
    assert torch.equal(logits.argmax(-1), compressed["logits"].argmax(-1))
    for ids, got, expected in zip(PROMPTS, tokens, compressed["tokens"], strict=True):
        _greedy_within_near_ties(llm, ids, got, expected)
    # weight-only (activations left unrounded): the decompressed model's fp32 weights exactly
    monkeypatch.setattr("atom.models.quantization.fp8.fp8_round_per_token", lambda x: x)
    _, logits, tokens = _atom(out / "quantized")
    dense_logits, dense_tokens = _hf_dense(out / "dequantized")
    assert tokens == dense_tokens
    _close(logits, dense_logits, 1e-4)
