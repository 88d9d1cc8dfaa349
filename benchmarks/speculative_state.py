"""The cost of exact speculative rollback on models with per-sequence state, batch 1.

    python -m benchmarks.speculative_state [--gdn-layers 36] [--v4-layers 60]
        [--layers 8] [--v4-engine-layers 0] [--tokens 128] [--skip-engine]

Families whose state rows are written in place (DeepSeek-V4 / V4.1, Qwen3-Next) roll
rejected drafts back by state snapshot (atom/model_engine/speculative/state_rollback.py):
per verify step a copy of the drafting sequence's state rows, another copy back when it
rejected a draft, and the next step recomputes the kept tokens and the bonus token instead
of verifying new drafts. One JSON line each:
- `copy`: save + restore of one sequence's rows (and of 8) with `StateSnapshots` over
  state tensors of full-depth shapes: Qwen3-Next-80B-A3B (`--gdn-layers` GDN layers: conv
  [3, 8192] bf16, delta rule [32, 128, 128] fp32) and the V4 benchmark shape
  (benchmarks/deepseek_v4_decode.py, `--v4-layers` layers alternating CSA / HCA:
  window ring [128, 512], compressor and indexer rows, bf16); CUDA events, median;
- `engine`: output tok/s at batch 1 on a Qwen3-Next-80B shape with `--layers` layers
  (and the V4 benchmark shape with `--v4-engine-layers`; random bf16 weights with the
  margin tables of benchmarks/speculative.py, so that greedy decoding follows a
  fixed permutation whatever the rounding; CUDA graphs), plain decoding beside
  speculation with k = 4 and a proposer that replays the plain run's tokens with one
  wrong draft whose position cycles 0..4 (kept drafts 0, 1, 2, 3, 4 in turn: rejections
  in 4 of 5 verify steps) or with every draft right; `exact` is the state-snapshot rollback, `positions` the old rollback
  by `num_computed_tokens` alone (wrong tokens on this family; the same work otherwise
  minus the copies and the recompute steps): their gap is the cost of exactness.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from atom.model_engine.speculative.state_rollback import StateSnapshots
from benchmarks.harness import emit


def gdn_state(layers: int, slots: int) -> list[torch.Tensor]:
    tensors = []
    for _ in range(layers):
        tensors.append(torch.zeros(slots + 1, 3, 8192, dtype=torch.bfloat16, device="cuda"))
        tensors.append(torch.zeros(slots + 1, 32, 128, 128, dtype=torch.float32, device="cuda"))
    return tensors


def v4_state(layers: int, slots: int) -> list[torch.Tensor]:
    """The V4 benchmark shape's state_shapes: CSA (ratio 4, overlap) and HCA (ratio 128)."""
    tensors = []
    for index in range(layers):
        shapes = [(128, 512)]  # window ring
        if index % 2 == 0:  # CSA: compressor and indexer rows (2 * ratio, 2 * width)
            shapes += [(8, 1024)] * 2 + [(8, 256)] * 2
        else:  # HCA: compressor rows (ratio, width)
            shapes += [(128, 512)] * 2
        for shape in shapes:
            tensors.append(torch.zeros(slots + 1, *shape, dtype=torch.bfloat16, device="cuda"))
    return tensors


def time_copies(name: str, tensors, slots: int, repeats: int = 200) -> dict:
    snapshots = StateSnapshots(tensors, slots)
    record = dict(case="copy", shape=name, tensors=len(tensors))
    record["state_bytes_per_sequence"] = snapshots.nbytes // slots
    for count in (1, min(8, slots)):
        rows = list(range(count))
        times = {"save": [], "restore": []}
        for _ in range(repeats):
            for kind in times:
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                getattr(snapshots, kind)(rows)
                end.record()
                end.synchronize()
                times[kind].append(start.elapsed_time(end) * 1000)
        for kind, values in times.items():
            record[f"{kind}_us_{count}_seq"] = round(statistics.median(values), 1)
    return record


class CyclingOracle:
    """Proposes the plain run's continuation; draft `wrong` of each proposal is wrong,
    `wrong` cycling over 0..k (k: none), or never (`always_right`)."""

    def __init__(self, continuations: dict, k: int, vocab: int, always_right: bool):
        self.continuations = continuations
        self.k, self.vocab, self.always_right = k, vocab, always_right
        self.calls = 0
        self._pending: dict[int, list[int]] = {}

    def lookahead(self, seq, limit: int) -> int:
        known = self.continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        proposal = list(known[seq.num_output_tokens : seq.num_output_tokens + limit])
        wrong = self.calls % (self.k + 1)
        self.calls += 1
        if not self.always_right and wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % self.vocab
        self._pending[seq.seq_id] = proposal
        return len(proposal)

    def may_propose(self, seq) -> bool:
        return True

    def propose(self, seqs, counts):
        return [self._pending.pop(s.seq_id, [])[:c] for s, c in zip(seqs, counts, strict=True)]

    def on_verified(self, seq, position, num_drafts, num_accepted):
        pass


def engine_cases(family: str, layers: int, tokens: int) -> None:
    import time

    import transformers

    from atom import LLM, SamplingParams
    from tests.support.speculative_model import set_margin_weights

    if family == "qwen3_next":
        from benchmarks.qwen3_next_decode import qwen3_next_shape

        shape, config_class = qwen3_next_shape(layers, 4096), transformers.Qwen3NextConfig
    else:
        from benchmarks.deepseek_v4_decode import v4_shape

        shape, config_class = v4_shape(layers, 4096), transformers.DeepseekV4Config
    path = tempfile.mkdtemp(prefix="atom_spec_state_")
    config_class(**shape, tie_word_embeddings=False).save_pretrained(path)
    kwargs = dict(
        load_format="dummy", dtype="bfloat16", num_kvcache_blocks=256, max_num_seqs=4,
        max_model_len=1024, cuda_graph_batch_sizes=[1, 2, 4], skip_tokenizer_init=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, shape["vocab_size"], (64,), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def build(**spec):
        llm = LLM(path, **kwargs, **spec)
        set_margin_weights(llm.engine.model_runner.model)  # greedy = a fixed permutation
        return llm

    def timed(llm) -> tuple[list[int], float, int]:
        llm.generate([prompt], params, use_tqdm=False)  # warm-up (kernels, graphs)
        torch.cuda.synchronize()
        steps = llm.engine.stats.steps
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        torch.cuda.synchronize()
        return out, time.perf_counter() - start, llm.engine.stats.steps - steps

    plain = build()
    reference, seconds, steps = timed(plain)
    base = tokens / seconds
    emit(dict(case="engine", family=family, layers=layers, mode="plain", tok_s=round(base, 1),
              steps=steps, ms_per_step=round(1000 * seconds / steps, 3)))  # fmt: skip
    plain.shutdown()
    del plain
    continuations = {tuple(prompt): reference}
    for pattern in ("one_wrong_cycling", "always_right"):
        for rollback in ("exact", "positions"):
            llm = build(speculative_method="ngram", num_speculative_tokens=4)
            speculator = llm.engine.speculator
            speculator.proposer = CyclingOracle(
                continuations, 4, shape["vocab_size"], pattern == "always_right"
            )
            if rollback == "positions":  # the old rollback (inexact here): no copies
                speculator.state_snapshots = None
            out, seconds, steps = timed(llm)
            stats = speculator.stats
            emit(
                dict(
                    case="engine", family=family, layers=layers, mode=f"spec_{rollback}",
                    proposer=pattern, tok_s=round(tokens / seconds, 1),
                    vs_plain=round(tokens / seconds / base, 3), steps=steps,
                    ms_per_step=round(1000 * seconds / steps, 3),
                    acceptance=round(stats.acceptance_rate, 3),
                    restores_both_runs=stats.state_restores,
                    same_tokens_as_plain=out == reference,
                )
            )  # fmt: skip
            llm.shutdown()
            del llm, speculator
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gdn-layers", type=int, default=36)
    parser.add_argument("--v4-layers", type=int, default=60)
    parser.add_argument("--layers", type=int, default=8, help="engine cases, Qwen3-Next")
    parser.add_argument("--v4-engine-layers", type=int, default=0, help="0: no V4 engine case")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    slots = 8
    gdn, v4 = gdn_state(args.gdn_layers, slots), v4_state(args.v4_layers, slots)
    emit(time_copies(f"qwen3_next_80b_{args.gdn_layers}_gdn_layers", gdn, slots))
    emit(time_copies(f"deepseek_v4_bench_{args.v4_layers}_layers", v4, slots))
    del gdn, v4
    torch.cuda.empty_cache()
    if not args.skip_engine:
        engine_cases("qwen3_next", args.layers, args.tokens)
        if args.v4_engine_layers:
            engine_cases("deepseek_v4", args.v4_engine_layers, args.tokens)


if __name__ == "__main__":
    main()
