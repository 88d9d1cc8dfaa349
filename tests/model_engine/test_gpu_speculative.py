"""Speculative decoding on CUDA: verify steps replayed from CUDA graphs (padded batch
sizes) give the tokens of eager verify steps and of plain decoding; direct and packed; the
draft's catch-up steps replay graphs too; the benchmark's margin weights make bf16 greedy
decoding agree between decode and verify shapes."""

import pytest

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts(31, [20, 33, 5])  # 3 sequences: verify graphs replay at 4 (padded)


def _llm(model, **kwargs):
    return build_llm(
        model, device="cuda", dtype="float32", num_kvcache_blocks=512, max_num_seqs=8,
        max_model_len=256, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("h2d_backend", ["direct", "packed"])
def test_self_draft_verify_graphs_match_eager_and_plain(tiny_model_dirs, h2d_backend):
    model = tiny_model_dirs["llama"]
    plain = [o.token_ids for o in _llm(model).generate(PROMPTS, GREEDY, use_tqdm=False)]
    spec = dict(speculative_method="draft", speculative_model=model, h2d_backend=h2d_backend)
    graphs = _llm(model, **spec)
    eager = _llm(model, enforce_eager=True, **spec)
    for llm in (graphs, eager):
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == plain
        assert llm.engine.speculator.stats.acceptance_rate == 1.0
    verify = graphs.engine.model_runner.verify_graphs[0]
    assert verify.replays > 0 and verify.padded_replays > 0
    assert eager.engine.model_runner.verify_graphs is None
    # outside graphs: the target's prefill step and the draft's catch-up on the prompts;
    # every later draft step is a decode or a 2-token catch-up, replayed
    draft = graphs.engine.speculator.proposer.runner
    assert graphs.engine.model_runner.eager_forwards == 1
    assert draft.eager_forwards == 1 and len(draft.slots) == 2  # launches alternate slots
    assert sum(g.replays for g in draft.verify_graphs) > 0
    assert all(g.rows_per_seq == 2 for g in draft.verify_graphs)
    # drafts stayed on the device: the host never waited for the draft's tokens
    assert graphs.engine.speculator.proposer.host_syncs == 0


def test_ngram_and_a_different_draft_match_plain_on_cuda(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    prompts = PROMPTS + [[5, 6, 7, 8] * 6]
    plain = [o.token_ids for o in _llm(model).generate(prompts, GREEDY, use_tqdm=False)]
    ngram = _llm(model, speculative_method="ngram", ngram_min=1)
    assert [o.token_ids for o in ngram.generate(prompts, GREEDY, use_tqdm=False)] == plain
    other = _llm(model, speculative_method="draft", speculative_model=tiny_model_dirs["qwen2"])
    assert [o.token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)] == plain
    assert other.engine.speculator.stats.acceptance_rate < 0.3


def test_bf16_self_draft_runs_and_mostly_accepts(tiny_model_dirs):
    """bf16: the verify (varlen) and draft (decode) kernels round differently, so a near-tie
    may flip a draft; the output must still be what the target's own verify rows chose."""
    model = tiny_model_dirs["llama"]
    llm = build_llm(
        model, device="cuda", num_kvcache_blocks=512, max_num_seqs=8, max_model_len=256,
        speculative_method="draft", speculative_model=model,
    )  # fmt: skip
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in outputs)
    assert llm.engine.speculator.stats.acceptance_rate > 0.9


def test_bf16_margin_weights_accept_every_draft(tmp_path):
    """The benchmark's weights (benchmarks/speculative.py): with large logit margins a
    bf16 self-draft, a 1-layer draft and the plain run give the same tokens, every draft
    accepted."""
    import transformers

    from tests.support.speculative_model import TINY, set_margin_weights

    shape = dict(TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    transformers.LlamaConfig(**shape).save_pretrained(tmp_path / "target")
    transformers.LlamaConfig(**dict(shape, num_hidden_layers=1)).save_pretrained(tmp_path / "d")
    kwargs = dict(
        device="cuda", load_format="dummy", num_kvcache_blocks=512, max_num_seqs=8,
        max_model_len=256,
    )  # fmt: skip
    prompts = [[t % TINY["vocab_size"] for t in p] for p in PROMPTS]
    outputs, rates = [], []
    for draft in (None, tmp_path / "target", tmp_path / "d"):
        spec = (
            {} if draft is None else dict(speculative_method="draft", speculative_model=str(draft))
        )
        llm = build_llm(str(tmp_path / "target"), **kwargs, **spec)
        runners = [llm.engine.model_runner]
        if draft is not None:
            runners.append(llm.engine.speculator.proposer.runner)
        for runner in runners:
            set_margin_weights(runner.model)
        outputs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        if draft is not None:
            rates.append(llm.engine.speculator.stats.acceptance_rate)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert rates == [1.0, 1.0]
