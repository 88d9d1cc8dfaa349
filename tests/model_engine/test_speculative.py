"""Speculative decoding on tiny random models: greedy outputs equal plain decoding token for
token (n-gram and draft-model proposers; mixed, chunked, preempted, packed batches; stops
inside an accepted run), KV rollback returns every block. Blocks are checked after each test."""

import numpy as np
import pytest
import torch
import transformers

from atom.config import Config
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.sequence import Sequence
from atom.model_engine.speculative.proposers import NgramProposer
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
LEN = dict(max_model_len=128)
# Random prompts, one that repeats itself (n-gram matches) and one that leaves no room
# to draft (max_tokens 1 and 2: speculating and plain rows share the verify steps).
PROMPTS = random_prompts(21, [20, 33, 5]) + [[5, 6, 7, 8] * 6]


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def expected(target):
    plain = build_llm(target, **LEN)
    outputs = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    short = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2)]
    shorts = plain.generate(PROMPTS[:2], short, use_tqdm=False)
    return [o.token_ids for o in outputs], [o.token_ids for o in shorts]


def self_draft(target, **kwargs):
    return build_llm(target, speculative_method="draft", speculative_model=target, **LEN, **kwargs)


def generate(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_self_draft_accepts_everything_and_matches(target, expected):
    llm = self_draft(target)
    assert generate(llm) == expected[0]
    assert generate(llm, PROMPTS[1:2]) == expected[0][1:2]  # served from the prefix cache
    assert llm.engine.block_manager.prefix_hit_blocks > 0
    stats = llm.engine.speculator.stats
    assert stats.proposed_tokens > 0 and stats.acceptance_rate == 1.0
    # every position accepted as often as it was proposed: drafts of 4 except near the end
    assert stats.accepted_per_position[0] == stats.num_drafts
    # 20 tokens per request, up to 5 per step: far fewer steps than tokens
    assert llm.engine.stats.steps < 2 * 20


def test_draft_steps_run_back_to_back_and_stay_on_the_device(target, expected):
    """Per verify step the draft launches its catch-up and d - 1 decodes without reading a
    token (each feeds the next on the device, and the verify step takes the drafts from
    there); after a step that kept every draft the catch-up computes 2 tokens (a CUDA-graph
    size on GPU). A batch whose sequences draft different numbers reads them once."""
    llm = self_draft(target)
    proposer = llm.engine.speculator.proposer
    events = []
    launch, propose = proposer.runner.launch, proposer.propose

    def spy_launch(batch):
        handle = launch(batch)
        result = handle.result
        handle.result = lambda: events.append("wait") or result()
        events.append("launch")
        return handle

    proposer.runner.launch = spy_launch
    prompt = PROMPTS[1]
    assert generate(llm, [prompt]) == expected[0][1:2]
    stats = llm.engine.speculator.stats
    assert "wait" not in events and proposer.host_syncs == 0
    # one draft launch per draft token (batch 1), every draft kept
    assert proposer.draft_forwards == len(events) == stats.proposed_tokens
    assert stats.accepted_tokens == stats.proposed_tokens
    # the first catch-up: the prompt and the prefill's token; then 2 per step
    assert proposer.catch_up_tokens == len(prompt) + 1 + 2 * (stats.num_drafts - 1)

    # sequences near their max_tokens draft fewer: the drafts come to the host, one wait
    events.clear()

    def spy(name, method):
        return lambda seqs, counts: events.append(name) or method(seqs, counts)

    proposer.propose = spy("host", propose)
    proposer.propose_on_device = spy("device", proposer.propose_on_device)
    shorts = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 3)]
    assert generate(llm, PROMPTS[:2], shorts) == [expected[0][0], expected[0][1][:3]]
    cycles = " ".join(events).replace("host", "|host").replace("device", "|device")
    cycles = [c.split() for c in cycles.split("|")[1:]]
    assert {c[0] for c in cycles} == {"host", "device"}  # both kinds of steps ran
    assert proposer.host_syncs == sum(c[0] == "host" for c in cycles)
    for kind, *cycle in cycles:  # launch ... launch, then the reads (host steps only)
        launches = cycle.count("launch")
        assert cycle[:launches] == ["launch"] * launches and "launch" not in cycle[launches:]
        assert ("wait" in cycle) == (kind == "host")


def test_benchmark_margin_weights_make_a_small_draft_exact(tmp_path):
    """benchmarks/speculative.py's weights: token x predicts perm(x) (the greedy
    output follows the permutation), so a 1-layer draft with the same tables proposes
    what the target decodes: every draft accepted."""
    from tests.support.speculative_model import TINY, set_margin_weights

    shape = dict(TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    transformers.LlamaConfig(**shape).save_pretrained(tmp_path / "target")
    transformers.LlamaConfig(**dict(shape, num_hidden_layers=1)).save_pretrained(tmp_path / "d")
    llm = build_llm(
        str(tmp_path / "target"), load_format="dummy", speculative_method="draft",
        speculative_model=str(tmp_path / "d"), **LEN,
    )  # fmt: skip
    perm = set_margin_weights(llm.engine.model_runner.model)
    assert torch.equal(set_margin_weights(llm.engine.speculator.proposer.runner.model), perm)
    prompt = [t % TINY["vocab_size"] for t in random_prompts(3, [12])[0]]
    tokens = generate(llm, [prompt])[0]
    chain = [prompt[-1]] + tokens
    assert tokens == [int(perm[t]) for t in chain[:-1]]
    assert llm.engine.speculator.stats.acceptance_rate == 1.0


def test_different_draft_has_low_acceptance_and_matches(target, tiny_model_dirs, expected):
    llm = build_llm(
        target, speculative_method="draft", speculative_model=tiny_model_dirs["qwen2"], **LEN
    )
    assert generate(llm) == expected[0]
    stats = llm.engine.speculator.stats
    assert stats.proposed_tokens > 20 and stats.acceptance_rate < 0.3


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_mixed_speculating_and_plain_rows(target, expected, method):
    kwargs = dict(ngram_min=1) if method == "ngram" else dict(speculative_model=target)
    llm = build_llm(target, speculative_method=method, **LEN, **kwargs)
    mixed = []
    launch = llm.engine.model_runner.launch

    def spy(batch):
        if batch.draft_token_ids is not None:
            mixed.append(sum(1 for d in batch.draft_token_ids if not d))
        return launch(batch)

    llm.engine.model_runner.launch = spy
    shorts = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2)]
    outputs = generate(llm, PROMPTS + PROMPTS[:2], [GREEDY] * len(PROMPTS) + shorts)
    assert outputs == expected[0] + expected[1]
    if method == "draft":  # (a random tiny model rarely repeats itself: few n-gram hits)
        assert any(mixed)  # some verify step also computed rows without drafts


@pytest.mark.parametrize("h2d_backend", ["direct", "packed"])
def test_chunked_prefill_and_small_budget(target, expected, h2d_backend):
    # 8 tokens per step: prompts are chunked and drafts cut to what the budget leaves
    llm = self_draft(target, max_num_batched_tokens=8, max_num_seqs=3, h2d_backend=h2d_backend)
    assert generate(llm) == expected[0]
    assert llm.engine.speculator.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_under_tight_memory(target, method):
    prompts = random_prompts(22, [40, 44, 38, 30])
    plain = build_llm(target, enable_prefix_caching=False, **LEN)
    want = generate(plain, prompts)
    kwargs = dict(ngram_min=1) if method == "ngram" else dict(speculative_model=target)
    # 9 blocks of 16: the four requests cannot all grow (drafts reserve blocks too)
    tight = build_llm(
        target,
        speculative_method=method,
        num_kvcache_blocks=9,
        enable_prefix_caching=False,
        **LEN,
        **kwargs,
    )
    assert generate(tight, prompts) == want
    assert tight.engine.scheduler.num_preemptions > 0
    if method == "draft":  # the draft's KV state restarts with each re-admission
        assert tight.engine.speculator.stats.acceptance_rate == 1.0


def test_stop_token_eos_and_max_tokens_inside_an_accepted_run(target, expected):
    llm = self_draft(target)
    reference = expected[0][0]
    stop = reference[6]  # the 7th token: inside the second run of 5 (4 drafts + 1)
    cut = reference[: reference.index(stop) + 1]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert out.token_ids == cut and out.finish_reason == "stop"
    llm.engine.scheduler.eos_token_ids = {stop}  # the same token as the model's EOS
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20), False)[0]
    assert out.token_ids == cut and out.finish_reason == "stop"
    llm.engine.scheduler.eos_token_ids = set()
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=7), False)[0]
    assert out.token_ids == reference[:7] and out.finish_reason == "length"


def test_drafts_stop_at_max_model_len(target):
    prompt = random_prompts(23, [110])[0]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = build_llm(target, **LEN).generate([prompt], params, use_tqdm=False)[0]
    got = self_draft(target).generate([prompt], params, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 128 - 110
    assert got.finish_reason == want.finish_reason == "length"


def test_streamed_step_outputs_carry_every_accepted_token(target, expected):
    llm = self_draft(target)
    engine = llm.engine
    engine.add_request(PROMPTS[1], GREEDY)
    pieces = []
    while engine.has_unfinished():
        pieces += [o.new_token_ids for o in engine.step()]
    assert sum(pieces, []) == expected[0][1]
    assert max(len(p) for p in pieces) == 5  # 4 accepted drafts + 1
    assert engine.stats.generated_tokens == 20


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_asynchronous_scheduling_overlaps_steps_that_cannot_draft(target, expected, method):
    kwargs = dict(speculative_model=target) if method == "draft" else {}
    llm = build_llm(target, speculative_method=method, async_scheduling=True, **LEN, **kwargs)
    overlapped = []
    step = llm.engine.step

    def spy():
        outputs = step()
        overlapped.append(llm.engine._in_flight is not None)
        return outputs

    llm.engine.step = spy
    prompts = PROMPTS[:3]  # random text: the n-gram proposer can rarely match
    assert generate(llm, prompts) == expected[0][:3]
    if method == "ngram":  # steps whose successor cannot draft stay in flight
        assert any(overlapped)
    else:  # every decode drafts: nothing overlaps after the prefill
        assert llm.engine.speculator.stats.acceptance_rate == 1.0


def test_seeded_random_sampling_runs_and_frees_blocks(target):
    llm = self_draft(target)
    # a low temperature: the greedy drafts are likely under the target, so some are kept
    params = SamplingParams(temperature=0.1, max_tokens=8, seed=3, ignore_eos=True)
    a = generate(llm, PROMPTS[:2], params)
    b = generate(llm, PROMPTS[:2], params)
    assert a == b and all(len(t) == 8 for t in a)
    assert llm.engine.speculator.stats.accepted_tokens > 0


REFUSED_WITH_SPECULATION = [
    dict(logprobs=2),
    dict(prompt_logprobs=1),
    dict(json_object=True),
    dict(presence_penalty=0.5),
    dict(logit_bias={3: 1.0}),
    dict(min_tokens=2),
]


def test_sampling_plan_options_are_refused_with_speculation(target):
    """Verify steps sample without a SamplingPlan: logprobs, grammars and logits processors
    are a clear ValueError (the server's 400), not tokens that ignore them."""
    llm = build_llm(target, speculative_method="ngram", **LEN)
    for options in REFUSED_WITH_SPECULATION:
        params = SamplingParams(temperature=0.0, max_tokens=4, **options)
        with pytest.raises(ValueError, match="speculative decoding"):
            llm.engine.add_request(PROMPTS[0], params)
    assert not llm.engine.has_unfinished()


def test_ngram_proposer_finds_the_latest_longest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert proposer.match(tokens, 3) == [4, 5, 1]  # latest "1 2 3" followed by 4 5 1
    assert proposer.match(np.array([7, 8, 9]), 4) == []
    assert proposer.match(np.array([1, 2, 1]), 4) == [2, 1]  # runs to the context's end


def test_trim_returns_draft_blocks_and_the_page_table_follows():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=8))
    bm.admit(seq, [])
    bm.grow(seq, 6)
    slot = RunnerSlot(0, 2, 16, 8, 4, 100, torch.device("cpu"), h2d_checked=True)
    table = slot.page_table
    seq.num_computed_tokens = 6
    bm.grow(seq, 5)  # a decode with 4 drafts: positions 6..10 -> 3 blocks
    assert len(seq.block_table) == 3
    table.sync([seq], layout=1, grown=[seq], step=1)
    table.publish(1)
    slot.publisher.flush()
    table.on_published()
    assert bm.trim(seq, 1) == 1  # the next step drafts nothing: the third block returns
    assert bm.num_free_blocks == 6
    table.sync([seq], layout=1, grown=[seq], step=2)  # checked: host rows = block table
    assert table.entries[seq.seq_id].length == 2
    bm.grow(seq, 5)  # drafting again: a (different) third block is sent as an append
    table.sync([seq], layout=1, grown=[seq], step=3)
    table.publish(1)
    slot.publisher.flush()
    table.on_published()  # checked: device rows = host rows
    assert table.device_rows[0, :3].tolist() == seq.block_table
    bm.free(seq)
    assert bm.num_free_blocks == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(speculative_method="eagle"), "speculative_method"),
        (dict(speculative_method="draft"), "speculative_model"),
        (dict(speculative_model="x"), "speculative_method"),
        (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(speculative_method="ngram", ngram_min=3, ngram_max=2), "ngram_min"),
        (dict(speculative_method="ngram", num_micro_batches=2), "micro-batches"),
        (dict(speculative_method="ngram", tensor_parallel_size=2), "tensor parallelism"),
    ],
)
def test_bad_speculative_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(device="cpu", **kwargs)


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="same vocabulary"):
        build_llm(target, speculative_method="draft", speculative_model=str(tmp_path), **LEN)
