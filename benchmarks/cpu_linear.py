"""CPU linear layers: F.linear against packed weights, on real model shapes.

    python -m benchmarks.cpu_linear                        # SmolLM2 + Llama-3.2-1B, 1 and 2 threads
    python -m benchmarks.cpu_linear --models smollm2 --threads 1 --rows 1 16
    python -m benchmarks.cpu_linear --engine               # the engine, dense vs packed

For each weight shape of the models' layers (qkv, o, gate_up, down, LM head) and each row
count, five forms of y = x @ W^T in fp32:
- dense: F.linear on the checkpoint's [out, in] weight (MKL);
- onednn: the weight reordered once for oneDNN (`mkldnn._reorder_linear_weight`), then
  `mkldnn._linear_pointwise`;
- mkl: the weight packed once for MKL at this row count (`mkl._mkl_reorder_linear_weight`),
  then `mkl._mkl_linear`;
- transposed: the weight transposed once to [in, out], then `torch.mm(x, W^T)`;
- atom: what `Config.cpu_linear="packed"` does (atom/kernels/cpu_linear.py: onednn at 2+
  rows; at 1 row transposed on a wide weight, dense on a square or tall one).

`--cold`: each form runs on enough copies of the weight (>= 256 MB in all, taken in turn)
that its weight comes from memory, as in a decode step, which reads each layer's weights
once; without it the one weight stays in the caches after the first call.

The forms alternate within each round (the machine may be shared: a round's forms see the
same load) and the best round counts. Printed: microseconds per product, each form's speed
against dense (dense time / form time: above 1 is faster), the largest |difference| from
dense, and LOSS where the form atom chose (onednn, transposed or dense) is more than 5%
slower than the best other one in the same rounds.

`--engine`: one CPU engine on the embedded SmolLM2 (fp32), the same random 128-token
prompts at each batch size (prefix caching off: each run prefills them), 64 greedy tokens
with ignore_eos; each round runs the batch with the weights' packed forms taken away
(dense: what `ATOM_CPU_LINEAR=dense` runs) and with them (packed), so both see the same
load. Prints output tok/s (generated tokens /
wall time of the `generate` call, prefill included), packed / dense per round, and whether
the tokens are the same.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from atom.kernels.cpu_linear import PackedLinearWeight
from benchmarks.model_shapes import LLAMA_32_1B

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)
MODELS = {"smollm2": SMOLLM2_135M, "llama-1b": LLAMA_32_1B}


def layer_shapes(config: dict, lm_head: bool) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one decoder layer's linears (+ the LM head)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    shapes = [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o", hidden, heads * head_dim),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
    ]
    if lm_head:
        shapes.append(("lm_head", config["vocab_size"], hidden))
    return shapes


def time_forms(forms: dict, rounds: int, inner: int) -> dict[str, float]:
    """Best seconds per call of each form, the forms alternating within each round."""
    for form in forms.values():
        form()
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(rounds):
        for name, form in forms.items():
            start = time.perf_counter()
            for _ in range(inner):
                form()
            best[name] = min(best[name], (time.perf_counter() - start) / inner)
    return best


COLD_BYTES = 256 << 20


def measure(out_features: int, in_features: int, rows: int, rounds: int, cold: bool) -> dict:
    weight = torch.randn(out_features, in_features) * in_features**-0.5
    copies = -(-COLD_BYTES // (weight.numel() * 4)) if cold else 1
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    x = torch.randn(rows, in_features)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    transposed = [w.t().contiguous() for w in weights]
    atom = [PackedLinearWeight(w) for w in weights]
    turn = dict.fromkeys(["dense", "onednn", "mkl", "transposed", "atom"], 0)

    def next_copy(form: str) -> int:  # the copies in turn, one counter per form
        turn[form] = (turn[form] + 1) % copies
        return turn[form]

    def mkl_form():
        i = next_copy("mkl")
        return torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, rows)

    forms = {
        "dense": lambda: F.linear(x, weights[next_copy("dense")]),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(
            x, onednn[next_copy("onednn")], None, "none", [], ""
        ),
        "mkl": mkl_form,
        "transposed": lambda: torch.mm(x, transposed[next_copy("transposed")]),
        "atom": lambda: atom[next_copy("atom")](x),
    }
    reference = F.linear(x, weight)
    diffs = {name: (form() - reference).abs().max().item() for name, form in forms.items()}
    flops = 2 * rows * out_features * in_features
    inner = max(1, min(50, int(5e7 / flops)))
    seconds = time_forms(forms, rounds, inner)
    chosen = "onednn" if atom[0].uses_packed(rows) else "dense"
    if chosen == "dense" and atom[0].transposed is not None:
        chosen = "transposed"
    return dict(seconds=seconds, diffs=diffs, chosen=chosen)


def engine_ab(batches: list[int], input_len: int, output_len: int, rounds: int) -> None:
    from atom import LLM, SamplingParams
    from benchmarks.offline_throughput import random_prompts

    # no prefix caching: every run prefills its prompts (the same prompts run 2 x rounds times)
    llm = LLM(
        device="cpu", max_num_seqs=max(batches), max_model_len=1024, enable_prefix_caching=False
    )
    model = llm.engine.model_runner.model
    packed = [(p, p.cpu_packed) for p in model.parameters() if hasattr(p, "cpu_packed")]
    if not packed:
        raise SystemExit("no packed weight: is ATOM_CPU_LINEAR=dense set?")
    vocab = model.lm_head.vocab_size
    prompts = random_prompts(max(batches) + 2, input_len, vocab, seed=0)

    def generate(batch, form, max_tokens=output_len):
        for parameter, packing in packed:
            if form == "packed":
                parameter.cpu_packed = packing
            elif hasattr(parameter, "cpu_packed"):
                del parameter.cpu_packed
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(o.token_ids) for o in outputs) / seconds, [o.token_ids for o in outputs]

    for form in ("dense", "packed"):
        generate(prompts[-2:], form, 4)  # warm-up
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print("| batch | round | dense tok/s | packed tok/s | packed / dense | same tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in batches:
        for round_ in range(rounds):
            dense, dense_tokens = generate(prompts[:batch], "dense")
            fast, packed_tokens = generate(prompts[:batch], "packed")
            same = "yes" if dense_tokens == packed_tokens else "NO"
            print(
                f"| {batch} | {round_} | {dense:.1f} | {fast:.1f} | {fast / dense:.2f} | {same} |",
                flush=True,
            )
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--big-lm-head", action="store_true", help="also Llama-1B's 1 GB LM head (slow)"
    )
    parser.add_argument("--cold", action="store_true", help="weights from memory (copies in turn)")
    parser.add_argument("--engine", action="store_true", help="the engine, dense vs packed")
    parser.add_argument("--engine-rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    if args.engine:
        engine_ab(args.batches, args.input_len, args.output_len, args.engine_rounds)
        return
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}", flush=True)
    header = ("threads model    layer    shape          rows   dense us  onednn     mkl  transp"
              "    atom  |diff| onednn  atom")  # fmt: skip
    print(header)
    losses = 0
    for threads in args.threads:
        torch.set_num_threads(threads)
        for model in args.models:
            lm_head = model == "smollm2" or args.big_lm_head
            for layer, out_features, in_features in layer_shapes(MODELS[model], lm_head):
                for rows in args.rows:
                    result = measure(out_features, in_features, rows, args.rounds, args.cold)
                    seconds, diffs = result["seconds"], result["diffs"]
                    dense = seconds["dense"]
                    ratio = {name: dense / s for name, s in seconds.items()}
                    # the choice loses where its form (onednn or transposed) is >5% slower
                    # than the best other form (all timed in the same rounds; `atom` adds
                    # the wrapper)
                    chosen = result["chosen"]
                    others = [n for n in ("dense", "onednn", "transposed") if n != chosen]
                    loss = seconds[chosen] > 1.05 * min(seconds[n] for n in others)
                    losses += loss
                    print(
                        f"{threads:>7} {model:<8} {layer:<8} {out_features:>6}x{in_features:<6}"
                        f" {rows:>5} {dense * 1e6:>10.0f} {ratio['onednn']:>6.2f}x"
                        f" {ratio['mkl']:>6.2f}x {ratio['transposed']:>6.2f}x {ratio['atom']:>6.2f}x"
                        f" {diffs['onednn']:>12.1e} {diffs['atom']:.1e}"
                        f"  ({chosen})"
                        f"{'  LOSS' if loss else ''}",
                        flush=True,
                    )
    print(f"load average {os.getloadavg()[0]:.2f}; atom's choice lost on {losses} shape(s)")


if __name__ == "__main__":
    main()
