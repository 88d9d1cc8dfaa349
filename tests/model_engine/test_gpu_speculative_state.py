"""Speculative decoding on families with per-sequence state, on CUDA (issue 28, item 1):
fp32 with CUDA graphs on (decode graphs; Qwen3-Next's verify and recompute steps replay
multi-token graphs, V4's and V4.1's run eagerly) and asynchronous scheduling (the CUDA
default). Greedy tokens equal HF's (V4, Qwen3-Next) or the golden continuations of the
upstream V4.1 reference; the counters show that drafts were rejected and states restored.
The CPU variants, and the helpers used here: test_speculative_state.py."""

import pytest

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, hf_greedy_no_eos
from tests.model_engine.test_speculative_state import (  # noqa: F401 (fixture)
    MAX_TOKENS,
    PROMPTS,
    REFERENCE,
    SPEC,
    OneWrongDraft,
    _assert_rolled_back,
    _golden,
    _tokens,
    model_dirs,
)

pytestmark = pytest.mark.gpu


def _cuda(path, **kwargs):
    options = dict(
        device="cuda", dtype="float32", num_kvcache_blocks=64, max_num_seqs=4,
        max_model_len=256, cuda_graph_batch_sizes=[1, 2, 4],
    )  # fmt: skip
    return build_llm(path, **{**options, **kwargs})


@pytest.mark.parametrize("kind", ["v4_swa", "v4_all", "qwen3_next"])
@pytest.mark.parametrize("h2d_backend", ["direct", "packed"])
def test_ngram_and_draft_match_hf_with_graphs(model_dirs, kind, h2d_backend):  # noqa: F811
    path = model_dirs[kind]
    want = hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    ngram = _cuda(path, h2d_backend=h2d_backend, **SPEC)
    draft = _cuda(
        path, h2d_backend=h2d_backend, speculative_method="draft",
        speculative_model=model_dirs["draft320"],
    )  # fmt: skip
    for llm in (ngram, draft):
        assert _tokens(llm) == want
        _assert_rolled_back(llm)
        runner = llm.engine.model_runner
        assert runner.graphs is not None
        if kind == "qwen3_next":  # verify and recompute steps replay multi-token graphs
            assert sum(g.replays for g in runner.verify_graphs) > 0
        else:  # V4's multi-token steps read the host: no such graphs
            assert runner.verify_graphs is None


def test_qwen3_next_every_number_of_kept_drafts_with_graphs(model_dirs):  # noqa: F811
    path = model_dirs["qwen3_next"]
    reference = hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    llm = _cuda(path, **SPEC)
    proposer = OneWrongDraft(PROMPTS, reference, 4)
    llm.engine.speculator.proposer = proposer
    assert _tokens(llm) == reference
    assert {a for d, a in proposer.kept if d == 4} == {0, 1, 2, 3, 4}
    runner = llm.engine.model_runner
    # verify steps of 5 rows and recompute steps of 2-5 rows: graphs, padded to 4 rows of 5
    assert sum(g.replays for g in runner.verify_graphs) > runner.eager_forwards


@pytest.mark.parametrize("name", ["tiny-minimal", "tiny-full"])
def test_v41_matches_golden_on_cuda(model_dirs, name):  # noqa: F811
    """fp32 CUDA, n-gram proposer: the golden continuations (tiny-full: or, where its
    fake quantisation makes fp32 CUDA differ from the reference, the tokens without
    speculation on CUDA)."""
    if not (REFERENCE / name / "golden.json").is_file():
        pytest.skip(f"no DeepSeek-V4.1 reference data at {REFERENCE}")
    prompts, golden = _golden(name)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(skip_tokenizer_init=True, max_model_len=128)
    llm = _cuda(str(REFERENCE / name), **kwargs, **SPEC)
    tokens = _tokens(llm, prompts + PROMPTS[2:], params)
    plain = _tokens(_cuda(str(REFERENCE / name), **kwargs), prompts + PROMPTS[2:], params)
    assert tokens == plain
    if name == "tiny-minimal":
        assert tokens[: len(golden)] == golden
    _assert_rolled_back(llm)
