"""Speculative decoding at batch 1: output tok/s against plain decoding, one run.

    python -m atom.benchmarks.speculative            # H200: Llama-3.2-1B shape, random bf16

Cases (one random prompt, greedy, ignore_eos, the same prompt for every case):
- plain: no speculation (asynchronous scheduling, decode CUDA graphs: the default);
- plain_sync: no speculation, synchronous scheduling (what verify steps run with);
- self_draft: the model as its own draft (same random weights), k drafts a step; every
  draft is accepted, but each draft token costs one forward of the full model;
- ngram_random: the n-gram proposer on random text (it finds little or nothing to propose);
- oracle: a proposer that replays the plain run's output (free, always right): what the
  verify mechanics give when proposals cost nothing and are all accepted (upper bound).
Each case prints one JSON line; the summary line has the ratios against `plain`.
`--tiny` runs a tiny Llama shape (CPU smoke test of the script).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time

import torch

from atom.benchmarks.offline_throughput import LLAMA_32_1B, random_prompts

TINY = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


class ReplayProposer:
    """Proposes the known continuation of each prompt (benchmark only: the oracle case)."""

    def __init__(self, continuations: dict[tuple, list[int]]):
        self.continuations = continuations
        self._pending: dict[int, list[int]] = {}

    def lookahead(self, seq, limit: int) -> int:
        known = self.continuations.get(tuple(seq.token_ids[: seq.num_prompt_tokens]), [])
        proposal = known[seq.num_output_tokens : seq.num_output_tokens + limit]
        self._pending[seq.seq_id] = proposal
        return len(proposal)

    def may_propose(self, seq) -> bool:
        return True

    def propose(self, seqs, counts):
        return [self._pending.pop(s.seq_id, [])[:c] for s, c in zip(seqs, counts, strict=True)]

    def on_verified(self, seq, position, num_drafts, num_accepted):
        pass


def run_case(name: str, model_dir: str, args, prompt, oracle=None, **engine_kwargs) -> dict:
    from atom.model_engine.llm_engine import LLM
    from atom.model_engine.speculative.decoder import SpeculativeDecoder
    from atom.sampling_params import SamplingParams

    llm = LLM(
        model_dir,
        device=args.device,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=8,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=args.enforce_eager,
        **engine_kwargs,
    )
    engine = llm.engine
    if oracle is not None:
        speculator = SpeculativeDecoder(ReplayProposer(oracle), args.k, engine.max_model_len)
        engine.speculator, engine.scheduler.lookahead = speculator, speculator.lookahead
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warmup = random_prompts(1, args.input_len, engine.hf_config.vocab_size, seed=7)
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), False)
    best, out = None, None
    for _ in range(args.repeats):
        if args.device == "cuda":
            torch.cuda.synchronize()
        steps = engine.stats.steps
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        steps = engine.stats.steps - steps
        if best is None or seconds < best[0]:
            best = (seconds, steps)
    seconds, steps = best
    record = dict(
        case=name,
        output_tok_s=round(len(out.token_ids) / seconds, 1),
        ms_per_step=round(seconds / steps * 1e3, 3),
        steps=steps,
        output_len=len(out.token_ids),
    )
    if engine.speculator is not None:
        stats = engine.speculator.stats
        record.update(
            acceptance_rate=round(stats.acceptance_rate, 4),
            proposed=stats.proposed_tokens,
            accepted=stats.accepted_tokens,
        )
    record["token_ids"] = out.token_ids
    del llm, engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (best)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (smoke test)")
    parser.add_argument("--cases", default="plain,plain_sync,self_draft,ngram_random,oracle")
    args = parser.parse_args(argv)
    args.device = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        print("this benchmark needs a CUDA device (or --tiny on CPU)", file=sys.stderr)
        return 2
    import transformers

    shape = TINY if args.tiny else LLAMA_32_1B
    config = transformers.LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    prompt = random_prompts(1, args.input_len, config.vocab_size, seed=1)[0]
    cases = args.cases.split(",")
    spec = dict(num_speculative_tokens=args.k)
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        for name in cases:
            kwargs = {}
            if name == "plain_sync":
                kwargs = dict(async_scheduling=False)
            elif name == "self_draft":
                kwargs = dict(speculative_method="draft", speculative_model=model_dir, **spec)
            elif name == "ngram_random":
                kwargs = dict(speculative_method="ngram", **spec)
            elif name == "oracle":
                plain = results.get("plain") or run_case("plain", model_dir, args, prompt)
                oracle = {tuple(prompt): plain["token_ids"]}
                # a speculative engine (synchronous, verify-sized buffers) whose proposer
                # is replaced by the replay
                kwargs = dict(speculative_method="ngram", **spec)
                results[name] = run_case(name, model_dir, args, prompt, oracle, **kwargs)
                continue
            results[name] = run_case(name, model_dir, args, prompt, **kwargs)
    reference = results.get("plain", {}).get("token_ids")
    for record in results.values():
        tokens = record.pop("token_ids")
        if reference is not None:
            record["same_tokens_as_plain"] = tokens == reference
        emit(dict(record, model="tiny" if args.tiny else "llama-3.2-1b-shape", k=args.k))
    if "plain" in results:
        base = results["plain"]["output_tok_s"]
        emit(
            dict(
                case="summary",
                **{
                    f"{name}_vs_plain": round(r["output_tok_s"] / base, 3)
                    for name, r in results.items()
                    if name != "plain"
                },
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
