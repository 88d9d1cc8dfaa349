"""Speculative decoding at batch 1: output tok/s against plain decoding, one run.

    python -m benchmarks.speculative            # H200: Llama-3.2-1B shape, random bf16

Weights: random in the real shapes, except that the embeddings are scaled up and the LM
head's rows are a permutation of the embedding rows (untied: the same bytes per step as
the tied checkpoint), so that token x predicts perm(x) with a logit margin of hundreds:
the greedy continuation no longer flips between GEMM shapes (a 1-row decode against a
k + 1-row verify), and acceptance measures the proposer, not bf16 rounding of near-ties.

Cases (one random prompt, greedy, ignore_eos, the same prompt for every case):
- plain: no speculation (asynchronous scheduling, decode CUDA graphs: the default);
- plain_sync: no speculation, synchronous scheduling (what verify steps run with);
- self_draft: the model as its own draft, k drafts a step; every draft is accepted, but
  each draft token costs one forward of the full model (so at most ~1x plain);
- small_draft: a draft of the target's shape with `--draft-layers` layers (2) and the same
  embeddings and LM head (so it predicts the same tokens): what a user with a small draft
  gets;
- ngram_random: the n-gram proposer on random text (it finds little or nothing to propose);
- oracle: a proposer that replays the plain run's output (free, always right): the verify
  mechanics alone, one verify forward per k + 1 tokens (the upper bound of any proposer).
Each case prints one JSON line (with host waits, kernel and graph launches per step on
CUDA); the summary line has the ratios against `plain` beside each acceptance rate.
`--tiny` runs a tiny Llama shape (CPU smoke test of the script).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

from benchmarks.harness import emit
from benchmarks.offline_throughput import LLAMA_32_1B, random_prompts
from tests.support.speculative_model import TINY, set_margin_weights


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


def _runners(engine) -> list:
    runners = [engine.model_runner]
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    if getattr(proposer, "runner", None) is not None:
        runners.append(proposer.runner)
    return runners


def _launch_counts(llm, prompt, args) -> dict:
    """Per engine step of one short generation, from torch.profiler (CUDA only): kernel
    launches outside graphs, graph launches, host waits on the device."""
    from torch.profiler import ProfilerActivity, profile

    from atom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=min(64, args.output_len), ignore_eos=True)
    engine = llm.engine
    steps = engine.stats.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
    steps = max(1, engine.stats.steps - steps)
    counts = {"kernels": 0, "graphs": 0, "syncs": 0, "sync_ms": 0.0}
    for event in prof.key_averages():
        name = event.key
        if name in (
            "cudaLaunchKernel",
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cudaLaunchKernelExC",
        ):
            counts["kernels"] += event.count
        elif name == "cudaGraphLaunch":
            counts["graphs"] += event.count
        elif name.endswith("Synchronize") and name.startswith("cuda"):
            # calls (the producer guard's included, which mostly find the copy done) and
            # the host time they blocked
            counts["syncs"] += event.count
            counts["sync_ms"] += event.cpu_time_total / 1e3
    return {f"{key}_per_step": round(value / steps, 3) for key, value in counts.items()}


def run_case(name: str, model_dir: str, args, prompt, oracle=None, **engine_kwargs) -> dict:
    from atom.model_engine.llm import LLM
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
        # a fixed cache: the cases' engines stay alive in one process, so sizing each from
        # free memory left the later ones no room
        num_kvcache_blocks=engine_kwargs.pop("num_kvcache_blocks", 256),
        enforce_eager=args.enforce_eager,
        **engine_kwargs,
    )
    engine = llm.engine
    for runner in _runners(engine):  # in place: the captured graphs read the same memory
        set_margin_weights(runner.model)
    if oracle is not None:
        speculator = SpeculativeDecoder(ReplayProposer(oracle), args.k, engine.max_model_len)
        engine.speculator, engine.scheduler.lookahead = speculator, speculator.lookahead
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warmup = random_prompts(1, args.input_len, engine.hf_config.vocab_size, seed=7)
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), False)
    runners = _runners(engine)
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    best, out = None, None
    for _ in range(args.repeats):
        if args.device == "cuda":
            torch.cuda.synchronize()
        before = _counters(engine, runners, proposer)
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        counters = {k: v - before[k] for k, v in _counters(engine, runners, proposer).items()}
        if best is None or seconds < best[0]:
            best = (seconds, counters)
    seconds, counters = best
    steps = counters.pop("steps")
    proposed, accepted = counters.pop("proposed"), counters.pop("accepted")
    cycles = counters.pop("verify_steps")
    record = dict(
        case=name,
        output_tok_s=round(len(out.token_ids) / seconds, 1),
        ms_per_step=round(seconds / steps * 1e3, 3),
        steps=steps,
        output_len=len(out.token_ids),
    )
    record["target_eager_forwards_per_step"] = round(
        counters.pop("target_eager_forwards") / steps, 2
    )
    if engine.speculator is not None:
        record.update(
            acceptance_rate=round(accepted / proposed, 4) if proposed else 0.0,
            proposed=proposed,
            accepted=accepted,
            verify_steps=cycles,
        )
        # per verify step (a propose + verify cycle at batch 1)
        record.update(
            {f"{k}_per_verify": round(v / max(1, cycles), 2) for k, v in counters.items()}
        )
    if args.device == "cuda" and not args.no_profile:
        try:
            record.update(_launch_counts(llm, prompt, args))
        except Exception as error:  # the profiler is an extra: keep the timings
            record["profile_error"] = repr(error)[:200]
    record["token_ids"] = out.token_ids
    del llm, engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return record


def _counters(engine, runners, proposer) -> dict:
    """Cumulative engine steps, forwards outside CUDA graphs (target, draft) and the
    draft proposer's launches and host waits."""
    counters = dict(steps=engine.stats.steps, target_eager_forwards=runners[0].eager_forwards)
    stats = engine.speculator.stats if engine.speculator is not None else None
    counters.update(
        proposed=stats.proposed_tokens if stats else 0,
        accepted=stats.accepted_tokens if stats else 0,
        verify_steps=stats.num_drafts if stats else 0,
    )
    if len(runners) > 1:
        counters.update(
            draft_eager_forwards=runners[1].eager_forwards,
            draft_launches=proposer.draft_forwards,
            draft_host_syncs=proposer.host_syncs,
        )
    return counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (best)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (smoke test)")
    parser.add_argument("--draft-layers", type=int, default=2, help="small_draft's layers")
    parser.add_argument("--no-profile", action="store_true", help="skip the launch counts")
    parser.add_argument(
        "--cases", default="plain,plain_sync,self_draft,small_draft,ngram_random,oracle"
    )
    args = parser.parse_args(argv)
    args.device = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        print("this benchmark needs a CUDA device (or --tiny on CPU)", file=sys.stderr)
        return 2
    import transformers

    shape = dict(TINY if args.tiny else LLAMA_32_1B, tie_word_embeddings=False)
    config = transformers.LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    small = dict(shape, num_hidden_layers=args.draft_layers)
    draft = transformers.LlamaConfig(**small, architectures=["LlamaForCausalLM"])
    prompt = random_prompts(1, args.input_len, config.vocab_size, seed=1)[0]
    cases = args.cases.split(",")
    spec = dict(num_speculative_tokens=args.k)
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        draft_dir = os.path.join(model_dir, "draft")
        draft.save_pretrained(draft_dir)
        for name in cases:
            kwargs = {}
            if name == "plain_sync":
                kwargs = dict(async_scheduling=False)
            elif name == "self_draft":
                kwargs = dict(speculative_method="draft", speculative_model=model_dir, **spec)
            elif name == "small_draft":
                kwargs = dict(speculative_method="draft", speculative_model=draft_dir, **spec)
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
        summary = {}
        for name, r in results.items():
            if name == "plain":
                continue
            summary[f"{name}_vs_plain"] = round(r["output_tok_s"] / base, 3)
            if "acceptance_rate" in r:
                summary[f"{name}_acceptance"] = r["acceptance_rate"]
        emit(dict(case="summary", **summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
