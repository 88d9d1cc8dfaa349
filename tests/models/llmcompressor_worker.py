"""Quantize an HF model directory with llm-compressor and record HF's view of the result.

Runs in the pinned side environment tests/models/test_quantized_checkpoints.py builds
(llmcompressor pins a transformers older than atom's), never imported by atom or its tests:

    python tests/models/llmcompressor_worker.py HF_DIR PROMPTS_JSON SCHEME=OUT_DIR...

each SCHEME is "FP8_DYNAMIC" (no data), "W4A16" (GPTQ on a tiny calibration text) or
"W4A16_ASYM" (round-to-nearest with zero points, no data). SmolLM2-135M's 576 hidden
features are not a multiple of the presets' group of 128, so the int4 schemes are the W4A16
presets with groups of 64 (llm-compressor refuses groups that do not divide the inputs).
Each OUT_DIR gets
- quantized/: what `oneshot` + `save_pretrained(save_compressed=True)` writes;
- dequantized/: the same model with compressed-tensors' decompression of every weight,
  saved as a plain fp32 checkpoint (no quantization_config);
- hf_compressed.pt: HF transformers loading quantized/ (compressed-tensors at run time):
  last-token logits and greedy tokens of each prompt, and the input and output of two
  linear layers.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

CALIBRATION = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. Water boils at one hundred degrees Celsius at sea level. Paris is the "
    "capital of France, and Berlin is the capital of Germany. def add(a, b): return a + b. "
    "The mitochondria is the powerhouse of the cell. In 1969 people first walked on the Moon."
)
GREEDY_TOKENS = 16


def int4_groups(symmetric: bool) -> dict:
    """The W4A16 (symmetric) / W4A16_ASYM presets with groups of 64 inputs."""
    weights = dict(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=64)
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def quantize(hf_dir: str, out: Path, scheme: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    if scheme == "FP8_DYNAMIC":
        oneshot(
            model=model,
            recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]),
        )
    elif scheme == "W4A16_ASYM":
        oneshot(
            model=model,
            recipe=QuantizationModifier(config_groups=int4_groups(False), ignore=["lm_head"]),
        )
    elif scheme == "W4A16":
        from datasets import Dataset

        words = CALIBRATION.split()
        texts = [" ".join(words[i:] + words[:i]) for i in range(0, len(words), 7)]
        encoded = [tokenizer(text) for text in texts]
        dataset = Dataset.from_dict(
            {
                "input_ids": [e["input_ids"] for e in encoded],
                "attention_mask": [e["attention_mask"] for e in encoded],
            }
        )
        oneshot(
            model=model,
            dataset=dataset,
            recipe=GPTQModifier(config_groups=int4_groups(True), ignore=["lm_head"]),
            max_seq_length=128,
            num_calibration_samples=len(texts),
        )
    else:
        raise SystemExit(f"unknown scheme {scheme}")
    model.save_pretrained(out / "quantized", save_compressed=True)
    tokenizer.save_pretrained(out / "quantized")


def hf_outputs(model, prompts) -> dict:
    """Last-token logits and greedy tokens; no EOS id, so generate neither stops early nor
    masks EOS (atom runs with ignore_eos)."""
    model.generation_config.eos_token_id = None
    logits, tokens = [], []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            logits.append(model(input_ids).logits[0, -1].float())
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
            )
            tokens.append(out[0, len(ids) :].tolist())
    return {"logits": torch.stack(logits), "tokens": tokens}


def linear_io(model, ids) -> dict:
    """Input and output of layer 0's q_proj and down_proj on `ids`, as compressed-tensors
    runs them (its activation quantization included)."""
    captured = {}
    layer = model.model.layers[0]
    hooks = [
        layer.get_submodule(name).register_forward_hook(
            lambda module, inputs, output, name=name: captured.__setitem__(
                name, (inputs[0][0].clone(), output[0].clone())
            )
        )
        for name in ("self_attn.q_proj", "mlp.down_proj")
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return captured


def record(hf_dir: str, out: Path, scheme: str, prompts) -> None:
    """Quantize with ``scheme`` into ``out`` and record HF's view of the result;
    hf_compressed.pt, written last, marks ``out`` complete."""
    quantize(hf_dir, out, scheme)
    quantized = out / "quantized"
    compressed = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    outputs = hf_outputs(compressed.eval(), prompts)
    outputs["linears"] = linear_io(compressed, prompts[0])
    # compressed-tensors' own decompression of every weight, kept as a plain checkpoint
    config = transformers.CompressedTensorsConfig(dequantize=True)
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, quantization_config=config
    )
    state = {
        name: tensor
        for name, tensor in dense.state_dict().items()
        if not name.rsplit(".", 1)[-1].startswith(("weight_", "input_", "output_"))
    }
    plain = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise SystemExit(f"decompressed state does not fit: {missing} {unexpected}")
    plain.save_pretrained(out / "dequantized")
    shutil.copy(quantized / "tokenizer.json", out / "dequantized" / "tokenizer.json")
    torch.save(outputs, out / "hf_compressed.pt")


def main() -> None:
    """HF_DIR PROMPTS_JSON SCHEME=OUT_DIR...: every scheme in this one process (its
    imports of llm-compressor and transformers are paid once)."""
    hf_dir, prompts_file, *jobs = sys.argv[1:]
    prompts = json.loads(Path(prompts_file).read_text())
    for job in jobs:
        scheme, out = job.split("=", 1)
        record(hf_dir, Path(out), scheme, prompts)


if __name__ == "__main__":
    main()
