"""DeepSeek-V4.1 in bf16 on CUDA against fp32 on the CPU, per prefill-attention variant.

    python -m benchmarks.deepseek_v41_bf16                     # both reference checkpoints
    python -m benchmarks.deepseek_v41_bf16 --models tiny-full --variants dense triton32

The measure of `tests/model_engine/test_deepseek_v41_parity.py::
test_bf16_cuda_greedy_close_to_fp32` (greedy agreement: the fraction of generated positions
where bf16 chose fp32's best token; worst regret: (best fp32 logit - fp32 logit of the
chosen token) / max|fp32 logit|, teacher-forced on bf16's own tokens) beside a continuous
one: the teacher-forced logit error on the golden sequences (prompt + upstream fp32 greedy
continuation), mean |bf16 - fp32| / max|fp32 logit| per position (its mean and max) and the
positions whose argmax differs. The fp32 logits come from atom on the CPU, which the parity
tests hold to the golden tokens and logits.

Variants (the prefill's attention; decode is the same in all):
- ``dense``: `atom.attention.v4.PREFILL_ATTENTION = "torch"` (torch selection and dense masks);
- ``reference``: the sparse path's ids, attended by `v4_prefill_attention_reference`;
- ``tritonN``: the sparse path's ids, attended by the Triton kernel with N keys a tile.

The variants compute the same function and differ only in the order of fp32 sums and where
bf16 rounds, so their spread is the noise of the greedy measure (top-k choices and V4.1's
fake quantisation turn rounding noise into discrete flips). Each variant runs on a new
engine (nothing prefix-cached under another variant; ``--graphs``: decode graphs, as the
test's ``graphs`` case). One JSON line per (model,
variant). ``--device cpu --dtype float32`` runs the plumbing on the CPU (the CPU test).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from collections.abc import Callable

import torch

REFERENCE = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "reference", "deepseek_v41"
)
VARIANTS = ("dense", "reference", "triton16", "triton32", "triton64")


def golden(name: str) -> dict:
    with open(os.path.join(REFERENCE, name, "golden.json")) as file:
        return json.load(file)


def build(name: str, **kwargs):
    from atom import LLM

    kwargs.setdefault("num_kvcache_blocks", 64)
    kwargs.setdefault("max_model_len", 128)
    kwargs.setdefault("kv_cache_memory_bytes", 64 << 20)
    return LLM(os.path.join(REFERENCE, name), skip_tokenizer_init=True, **kwargs)


def greedy(llm, prompts, n: int) -> list[list[int]]:
    from atom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def sequence_logits(llm, sequences) -> list[torch.Tensor]:
    """Logits ``[len(seq) - 1, vocab]`` of each sequence's prefill (row i chooses token
    i + 1), on the engine's device and dtype, as fp32 on the CPU."""
    from atom.sampling_params import SamplingParams

    model = llm.engine.model_runner.model
    captured, compute = [], model.compute_logits
    model.compute_logits = lambda hidden: captured.append(compute(hidden)) or captured[-1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = []
    try:
        for sequence in sequences:
            captured.clear()
            llm.generate([sequence], params, use_tqdm=False)
            # the prompt's rows, then the sampled row: nothing else ran the LM head
            shapes = [tuple(c.shape[:1]) for c in captured]
            if shapes != [(len(sequence) - 1,), (1,)]:
                raise RuntimeError(f"LM head calls {shapes} for a {len(sequence)}-token prompt")
            out.append(captured[0].float().cpu().clone())  # no alias of an engine buffer
    finally:
        del model.compute_logits  # the class's method again
    return out


def agreement_and_regret(reference, prompts, outputs) -> tuple[float, float]:
    """The parity test's measure: `reference` (fp32 CPU engine) teacher-forced on each prompt
    + bf16's tokens."""
    sequences = [p + o for p, o in zip(prompts, outputs, strict=True)]
    regrets = []
    logits = sequence_logits(reference, sequences)
    for prompt, generated, rows in zip(prompts, outputs, logits, strict=True):
        rows = rows[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
        chosen = rows.gather(1, torch.tensor(generated)[:, None])[:, 0]
        regrets.append((rows.max(dim=-1).values - chosen) / rows.abs().max(dim=-1).values)
    regrets = torch.cat(regrets)
    return float((regrets == 0).float().mean()), float(regrets.max())


def logit_error(got, expected, prompts) -> dict:
    """Teacher-forced error over the continuation positions (the logits choosing each golden
    token): mean and max of mean|got - expected| / max|expected|, argmax flips."""
    errors, flips, positions = [], 0, 0
    for prompt, a, b in zip(prompts, got, expected, strict=True):
        a, b = a[len(prompt) - 1 :], b[len(prompt) - 1 :]  # rows: positions 0 .. len - 2
        errors.append((a - b).abs().mean(dim=-1) / b.abs().max(dim=-1).values)
        flips += int((a.argmax(-1) != b.argmax(-1)).sum())
        positions += a.shape[0]
    error = torch.cat(errors)
    return dict(tf_mean_err=round(float(error.mean()), 5), tf_max_err=round(float(error.max()), 5),
                tf_argmax_flips=flips, positions=positions)  # fmt: skip


def use_variant(variant: str) -> Callable[[], None]:
    """Switch the prefill attention to `variant`; returns the undo."""
    import atom.attention.v4 as v4
    import atom.attention.v41 as v41
    from atom.kernels.v4_prefill_attention import (
        v4_prefill_attention,
        v4_prefill_attention_reference,
    )

    if variant not in VARIANTS:
        raise ValueError(f"--variants: unknown {variant!r} (one of {', '.join(VARIANTS)})")
    saved = v4.PREFILL_ATTENTION, v41.v4_prefill_attention
    if variant == "dense":
        v4.PREFILL_ATTENTION = "torch"
    elif variant == "reference":
        v41.v4_prefill_attention = v4_prefill_attention_reference
    else:
        block_n = int(variant.removeprefix("triton"))
        v41.v4_prefill_attention = lambda *args: v4_prefill_attention(*args, block_n=block_n)

    def undo():
        v4.PREFILL_ATTENTION, v41.v4_prefill_attention = saved

    return undo


def run(models, variants, device: str, dtype: str, tokens: int, prompts: int | None = None,
        graphs: bool = False):  # fmt: skip
    rows = []
    for name in models:
        data = golden(name)
        chosen = data["prompts"][:prompts]
        prompt_ids = [p["prompt_ids"] for p in chosen]
        sequences = [p["prompt_ids"] + p["greedy_continuation"][:tokens] for p in chosen]
        reference = build(name)
        expected = sequence_logits(reference, sequences)
        for variant in variants:
            undo, llm = use_variant(variant), None
            try:
                # a new engine a variant: no prefix cached under another variant's attention
                llm = build(name, device=device, dtype=dtype, enforce_eager=not graphs,
                            cuda_graph_batch_sizes=[1, 2, 4])  # fmt: skip
                outputs = greedy(llm, prompt_ids, tokens)
                agreement, regret = agreement_and_regret(reference, prompt_ids, outputs)
                row = dict(bench="deepseek_v41_bf16", model=name, variant=variant, device=device,
                           dtype=dtype, graphs=graphs, greedy_agreement=round(agreement, 4),
                           worst_regret=round(regret, 4),
                           **logit_error(sequence_logits(llm, sequences), expected, prompt_ids))  # fmt: skip
            finally:
                undo()
                if llm is not None:
                    llm.shutdown()
                del llm  # its KV cache freed before the next engine sizes its own
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-minimal", "tiny-full"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens a prompt")
    parser.add_argument("--prompts", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--graphs", action="store_true", help="decode under CUDA graphs")
    args = parser.parse_args(argv)
    run(args.models, args.variants, args.device, args.dtype, args.tokens, args.prompts,
        args.graphs)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
