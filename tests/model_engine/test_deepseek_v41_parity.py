"""DeepSeek-V4.1 (v41 backend) against the upstream reference's golden outputs, CPU fp32.

The golden files (../shared/reference/deepseek_v41/, README there) hold what the upstream
HF `deepseek_v41` implementation produced on two tiny random checkpoints: 24 greedy tokens
for four prompts (1, 7, 33, 70 tokens: shorter and longer than the window and every
compress group), the last prompt logits and, for tiny-full, every position's engram hash ids.

- tiny-minimal (no fake quantisation takes effect, no engram): exact tokens batched and one
  at a time, last prompt logits within 1e-4; the same tokens under chunked prefill,
  preemption, packed publication and two micro-batches.
- tiny-full (FP8/FP4 fake quantisation, two-level top-k, engram): exact tokens, except a
  mismatch whose deciding position comes at or after a position the golden file lists as
  rounding-fragile (`EXCUSED` records which were needed: none in this run); the hash ids
  the engine computed (chunked prefill and decode, history from the sequence's state) equal
  the recorded ones at every position.
- the CUDA path's decode under the interpreter (`ATOM_INTERPRET_CUDA_PATH=1`, V4's decode
  kernels): both models' golden tokens for two prompts decoding together.
- bf16: on CPU the engine runs (a pooled fp32 latent meets bf16 indexer weights) with the
  last prompt logits within the measured gap; `gpu`: bf16 on CUDA (Triton fake quantisation,
  engram hashing and lookup, indexer scores, two-level top-k, decode attention; eager and
  graphs) against fp32 on the same tokens; fp32 on CUDA gives the golden tokens.
Every test leaves every KV block and state slot free (tests/engine_support.py).
"""

import json
from pathlib import Path

import pytest
import torch

from atom.attention.v41 import V41Backend
from atom.forward_context import AttentionMetadata, forward_context
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm

# Tiny ops, one torch thread, engines too (tests/engine_support.py, one_cpu_thread).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

REFERENCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepseek_v41"
if not (REFERENCE / "tiny-minimal" / "golden.json").is_file():
    pytest.skip(f"no DeepSeek-V4.1 reference data at {REFERENCE}", allow_module_level=True)

# Positions excused in tiny-full (prompt index -> fragile position that explained a
# mismatch). Empty: atom matched every token of this run exactly.
EXCUSED: dict[int, int] = {}


def _golden(name):
    return json.loads((REFERENCE / name / "golden.json").read_text())


MINIMAL, FULL = _golden("tiny-minimal"), _golden("tiny-full")
PROMPTS = [p["prompt_ids"] for p in MINIMAL["prompts"]]
assert PROMPTS == [p["prompt_ids"] for p in FULL["prompts"]]


def _params(n=24):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _llm(name, **kwargs):
    kwargs.setdefault("num_kvcache_blocks", 64)
    kwargs.setdefault("max_model_len", 128)
    return build_llm(str(REFERENCE / name), skip_tokenizer_init=True, **kwargs)


def _tokens(llm, prompts=PROMPTS, n=24):
    return [o.token_ids for o in llm.generate(prompts, _params(n), use_tqdm=False)]


def _expected(golden, n=24):
    return [p["greedy_continuation"][:n] for p in golden["prompts"]]


def test_minimal_batched_and_one_at_a_time_with_logits():
    llm = _llm("tiny-minimal")
    assert all(isinstance(s.backend, V41Backend) for s in llm.engine.model_runner.slots)
    assert _tokens(llm) == _expected(MINIMAL)
    model = llm.engine.model_runner.model
    logits = []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    for prompt, golden in zip(PROMPTS, MINIMAL["prompts"], strict=True):
        logits.clear()
        assert _tokens(llm, [prompt], 12) == [golden["greedy_continuation"][:12]]
        expected = torch.tensor(golden["prompt_last_logits"])
        torch.testing.assert_close(logits[0][0], expected, atol=1e-4, rtol=0)


def test_minimal_chunked_prefill_and_preemption():
    """Chunks of 7 tokens; the 1-, 7- and 33-token prompts grow to 8 blocks of 16
    together, so 7 blocks force preemptions (recompute from position 0)."""
    llm = _llm(
        "tiny-minimal",
        max_num_batched_tokens=7,
        max_num_seqs=4,
        num_kvcache_blocks=7,
        max_model_len=112,
    )
    assert _tokens(llm) == _expected(MINIMAL)
    assert llm.engine.scheduler.num_preemptions > 0


def test_minimal_packed_publication_and_two_micro_batches():
    llm = _llm("tiny-minimal", h2d_backend="packed", max_num_batched_tokens=40)
    assert _tokens(llm, n=8) == _expected(MINIMAL, 8)
    llm = _llm("tiny-minimal", num_micro_batches=2, max_num_batched_tokens=24)
    assert len(llm.engine.model_runner.slots) == 2
    assert _tokens(llm, n=8) == _expected(MINIMAL, 8)


@pytest.mark.parametrize("name", ["tiny-minimal", "tiny-full"])
def test_sparse_prefill_under_the_interpreter_matches_golden(name, monkeypatch):
    """The CUDA path's prefill (V4's Triton sparse attention, the indexer's scorer and the
    two-level select over the query tokens, tiny-full's candidate blocks published per
    launch) under the interpreter, a 33-token prompt in chunks of 7: the golden tokens,
    and every prefill chunk of every layer went through the sparse kernel."""
    import atom.attention.v41

    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
    real, chunks = atom.attention.v41.v4_prefill_attention, []

    def counted(q, *args, **kwargs):
        chunks.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(atom.attention.v41, "v4_prefill_attention", counted)
    llm = _llm(name, max_num_batched_tokens=7)
    golden = MINIMAL if name == "tiny-minimal" else FULL
    assert _tokens(llm, PROMPTS[2:3], 4) == [_expected(golden, 4)[2]]
    layers = len(llm.engine.model_runner.model.attention_layers)
    assert sum(chunks) == layers * len(PROMPTS[2]) and max(chunks) == 7


def _fragile_positions(prompt_golden) -> list[int]:
    return sorted(
        {w["position"] for kind in prompt_golden["quant_fragility"].values() for w in kind["where"]}
    )


def test_full_greedy_with_quantisation_and_engram_hash_ids():
    llm = _llm("tiny-full", max_num_batched_tokens=20)
    hashes = llm.engine.model_runner.model.model.hashes
    seen: list[dict[int, list]] = []  # per prompt: position -> (token, hash ids) computed
    forward = hashes.forward

    def record(input_ids, positions, history):
        ids = forward(input_ids, positions, history)
        for token, position, row in zip(
            input_ids.tolist(), positions.tolist(), ids.tolist(), strict=True
        ):
            seen[-1].setdefault(position, []).append((token, row))
        return ids

    hashes.forward = record
    outputs = []
    for prompt in PROMPTS:  # one at a time: positions name the rows
        seen.append({})
        outputs.append(llm.generate([prompt], _params(), use_tqdm=False)[0].token_ids)
    excused = {}
    for index, (tokens, golden) in enumerate(zip(outputs, FULL["prompts"], strict=True)):
        expected = golden["greedy_continuation"]
        if tokens == expected:
            continue
        first = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        deciding = len(golden["prompt_ids"]) + first - 1
        earlier = [p for p in _fragile_positions(golden) if p <= deciding]
        assert earlier, f"prompt {index}: token {first} differs with no fragile position before"
        excused[index] = max(earlier)
    assert excused == EXCUSED
    # hash ids at every prompt position equal the recorded ones; at every position of the
    # sequence (decode steps: history from the state slot) they equal those of one
    # stateless pass over the whole sequence
    for tokens, golden, computed_at in zip(outputs, FULL["prompts"], seen, strict=True):
        sequence = golden["prompt_ids"] + tokens[:-1]
        with forward_context(AttentionMetadata(None, None, None, None, len(sequence), False)):
            whole = forward(torch.tensor(sequence), torch.arange(len(sequence)), None)
        for position, token in enumerate(sequence):
            computed = [ids for t, ids in computed_at[position] if t == token]
            assert computed and all(c == whole[position].tolist() for c in computed), position
            if position < len(golden["prompt_ids"]):
                assert computed[0] == golden["engram_hash_ids"][position], position


def test_full_chunked_prefill_and_preemption_batched():
    """Chunks of 7 tokens, and 7 blocks for 4 sequences growing to 14: the engram history
    and the partial groups come from the state slot across chunks, and are rebuilt after
    each preemption (recompute)."""
    llm = _llm(
        "tiny-full",
        max_num_batched_tokens=7,
        max_num_seqs=4,
        num_kvcache_blocks=7,
        max_model_len=112,
    )
    assert _tokens(llm) == _expected(FULL)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", ["tiny-minimal", "tiny-full"])
def test_decode_cuda_path_under_the_interpreter_matches_golden(name, monkeypatch):
    """The CUDA path's decode (V4's window write, decode attention, compressor kernel in its
    V4.1 variant with the one-launch entry store, indexer scores and selects; the shared
    expert as one more pair of the MoE GEMVs; Triton fake quantisation and engram hashing)
    under the interpreter: two prompts decoding together give the golden tokens, and every
    source layer's decode steps stored through the kernel path. Few tokens: each
    interpreted step is slow (the GPU parity tests run every prompt)."""
    import atom.attention.v41

    monkeypatch.setenv("ATOM_INTERPRET_CUDA_PATH", "1")
    real, stores = atom.attention.v41.store_entries_decode, []

    def counted(pool, *args, **kwargs):
        stores.append(pool.shape)
        return real(pool, *args, **kwargs)

    monkeypatch.setattr(atom.attention.v41, "store_entries_decode", counted)
    llm = _llm(name)
    golden = MINIMAL if name == "tiny-minimal" else FULL
    n = 6
    assert _tokens(llm, PROMPTS[1:3], n) == _expected(golden, n)[1:3]
    sources = sum(layer.is_source for layer in llm.engine.model_runner.model.attention_layers)
    assert len(stores) == sources * (n - 1)  # the first token comes from the prefill


# bf16 on CUDA against fp32 on the same tokens. The fp32 logits come from atom on CPU,
# which the tests above hold to the golden tokens and logits (the golden files' top-5 cannot
# serve once a bf16 run leaves the golden sequence). Two figures per run: the agreement (the
# fraction of generated positions where bf16 chose fp32's best token) and the worst regret
# ((best fp32 logit - fp32 logit of the chosen token) / max|fp32 logit| at that position).
# Top-k selections and fake-quant rounding make bf16 flips discrete: most positions agree
# exactly and a few pick a clearly worse token (tiny-full's every fake-quant step is
# active). The bounds are the figures measured on the H200 (docs/benchmarks.md) with margin;
# the test prints them.
# H200 2026-12-01 (eager and graphs alike): tiny-minimal 0.958 / 0.267, tiny-full
# 0.656 / 0.615; bf16 on CPU (torch references) 0.958 / 0.267 and 0.667 / 0.696. With the
# reference's rounding points (issue 28: norm weight after the cast, fp32 mHC expand,
# routing weight before w2, latent cast before its norm), bf16 on CPU: 0.917 / 0.459 and
# 0.688 / 0.367 (teacher-forced mean |logit error| / max|logit| unchanged: 0.021, 0.058).
# H200 2026-12-02 with those rounding points (eager and graphs alike): tiny-minimal
# 0.885 / 0.267, tiny-full 0.667 / 0.362. tiny-full's worst regret fell from 0.615 to 0.362,
# so its bound tightens from 0.80 to 0.42; tiny-minimal keeps its worst regret (0.267, bound
# 0.35 -> 0.30) with one more flipped position (agreement 0.958 -> 0.885, bound 0.90 -> 0.86).
BF16_BOUNDS = {"tiny-minimal": (0.86, 0.30), "tiny-full": (0.64, 0.42)}  # agreement, regret


def fp32_agreement_and_regret(name, prompts, outputs) -> tuple[float, float]:
    llm = _llm(name)
    model = llm.engine.model_runner.model
    captured = []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: captured.append(compute(hidden)) or captured[-1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    regrets = []
    for prompt, generated in zip(prompts, outputs, strict=True):
        captured.clear()
        llm.generate([prompt + generated], params, use_tqdm=False)
        rows = captured[0][len(prompt) - 1 :]  # the logits that chose each generated token
        assert rows.shape[0] == len(generated), rows.shape
        chosen = rows.gather(1, torch.tensor(generated)[:, None])[:, 0]
        regrets.append((rows.max(dim=-1).values - chosen) / rows.abs().max(dim=-1).values)
    regrets = torch.cat(regrets)
    return float((regrets == 0).float().mean()), float(regrets.max())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-minimal", "tiny-full"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_bf16_cuda_greedy_close_to_fp32(name, enforce_eager):
    """bf16 on CUDA (Triton fake quantisation, engram hashing and lookup, indexer scores
    over the key source's pool, two-level top-k, window write and decode attention over the
    source's pool; CUDA graphs for decode)."""
    llm = _llm(
        name, device="cuda", dtype="bfloat16", enforce_eager=enforce_eager,
        cuda_graph_batch_sizes=[1, 2, 4],
    )  # fmt: skip
    agreement, regret = fp32_agreement_and_regret(name, PROMPTS, _tokens(llm))
    mode = "eager" if enforce_eager else "graphs"
    print(f"{name} bf16 {mode}: agreement {agreement:.3f}, worst regret {regret:.4f}")
    min_agreement, max_regret = BF16_BOUNDS[name]
    assert agreement >= min_agreement and regret <= max_regret, (agreement, regret)


def test_fp32_agreement_of_the_golden_tokens_is_one():
    """The measure itself, on CPU: the golden continuations are fp32 greedy (agreement 1,
    regret 0); a last token changed is one disagreement with a positive regret."""
    outputs = _expected(MINIMAL, 6)
    assert fp32_agreement_and_regret("tiny-minimal", PROMPTS, outputs) == (1.0, 0.0)
    outputs[0][-1] = (outputs[0][-1] + 1) % 256  # the last: no later position sees it
    agreement, regret = fp32_agreement_and_regret("tiny-minimal", PROMPTS, outputs)
    assert agreement == pytest.approx(23 / 24) and regret > 0.0


# bf16 on CPU (torch references), max |logit - golden| / max |golden| at the last prompt
# token over the four prompts: measured 0.288 (tiny-full, 2026-12-01; fake quantisation
# turns bf16 noise into whole FP8/FP4 steps), 0.325 with the reference's rounding points
# (issue 28); bound 0.45.
BF16_CPU_LAST_LOGIT_GAP = 0.45


def test_bf16_cpu_runs_with_last_logits_close():
    llm = _llm("tiny-full", dtype="bfloat16")
    model = llm.engine.model_runner.model
    captured, compute = [], model.compute_logits
    model.compute_logits = lambda hidden: captured.append(compute(hidden)) or captured[-1]
    worst = 0.0
    for record in FULL["prompts"]:
        captured.clear()
        tokens = llm.generate([record["prompt_ids"]], _params(4), use_tqdm=False)[0].token_ids
        assert len(tokens) == 4
        expected = torch.tensor(record["prompt_last_logits"])
        gap = (captured[0][0].float() - expected).abs().max() / expected.abs().max()
        worst = max(worst, gap.item())
    print(f"tiny-full bf16 cpu: last prompt token logit gap {worst:.4f}")
    assert worst <= BF16_CPU_LAST_LOGIT_GAP


@pytest.mark.gpu
def test_cuda_fp32_minimal_greedy_matches_golden():
    """The CUDA paths (Triton kernels, decode graphs) in fp32 give the golden tokens."""
    llm = _llm("tiny-minimal", device="cuda", dtype="float32", cuda_graph_batch_sizes=[1, 2, 4])
    assert _tokens(llm) == _expected(MINIMAL)


def test_memory_profiling_forward_runs_without_a_cache(monkeypatch):
    """The CUDA sizing run (no blocks, no state slots yet) goes through every layer,
    engram included, in query chunks."""
    import atom.attention.v41

    monkeypatch.setattr(atom.attention.v41, "QUERY_CHUNK", 64)
    llm = _llm("tiny-full", num_kvcache_blocks=8)
    model = llm.engine.model_runner.model
    n = 100  # more than one query chunk
    with torch.no_grad(), forward_context(AttentionMetadata(None, None, None, None, n, False)):
        hidden = model(torch.randint(3, 256, (n,)), torch.arange(n))
    assert hidden.shape == (n, 64) and torch.isfinite(hidden).all()
