"""Sampling options beyond temperature / top-k / top-p (issue 16), checked against references.

Penalties and logit_bias against a torch transcription of vLLM's definitions; logprobs
(sampled and prompt) against HF transformers' log-softmax of the same checkpoint (CPU,
fp32, 1e-4); n samples share the prompt's KV blocks and follow their own seed streams.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from atom.model_engine.sampling.logits_processors import LogitsInputs, apply_logits_processors
from atom.model_engine.sequence import PLACEHOLDER_TOKEN, Sequence
from atom.sampling_params import SamplingParams
from tests.engine_support import TINY, build_llm

VOCAB = 512


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A tiny random Llama with a 512-token vocabulary (fast LM head, exact references)."""
    torch.manual_seed(7)
    config = transformers.LlamaConfig(**TINY, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("small") / "llama"
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def llm(small_model):
    return build_llm(small_model[0], max_model_len=256)


def vllm_apply_penalties(logits, prompt_tokens, output_tokens, presence, frequency, repetition):
    """vLLM's `apply_penalties` (model_executor/layers/utils.py), transcribed literally."""
    num_seqs, vocab_size = logits.shape

    def bin_counts_and_mask(tokens):
        counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.long)
        counts.scatter_add_(1, tokens, torch.ones_like(tokens))
        counts = counts[:, :vocab_size]
        return counts, counts > 0

    _, prompt_mask = bin_counts_and_mask(prompt_tokens)
    output_bin_counts, output_mask = bin_counts_and_mask(output_tokens)
    repetition = repetition.unsqueeze(dim=1).repeat(1, vocab_size)
    penalties = torch.where(prompt_mask | output_mask, repetition, 1.0)
    logits[logits > 0] /= penalties[logits > 0]
    logits[logits <= 0] *= penalties[logits <= 0]
    logits -= frequency.unsqueeze(dim=1) * output_bin_counts
    logits -= presence.unsqueeze(dim=1) * output_mask
    return logits


def _seq(prompt, output, **params) -> Sequence:
    seq = Sequence(prompt, SamplingParams(max_tokens=50, **params))
    seq.token_ids += output
    return seq


def test_penalties_bias_and_min_tokens_match_vllm_definitions():
    torch.manual_seed(0)
    vocab = 64
    seqs = [
        _seq(
            [1, 2, 3, 3],
            [5, 5, 6],
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.7,
        ),  # fmt: skip
        _seq([7, 8], [9], logit_bias={4: 3.0, 9: -2.5}),
        _seq([10], [11, 12, 11, 11], repetition_penalty=0.6, frequency_penalty=-1.0),
        _seq([13, 14], [], min_tokens=3, stop_token_ids=[20, 21]),
        _seq([15], [16, 17, 18]),  # plain row in the same batch
    ]
    logits = torch.randn(len(seqs), vocab) * 3
    inputs = LogitsInputs.build(seqs, None, vocab, torch.device("cpu"))
    ours = apply_logits_processors(logits.clone(), inputs)

    expected = logits.clone()
    expected[1, 4] += 3.0
    expected[1, 9] += -2.5
    expected[3, [20, 21]] = float("-inf")

    def padded(lists):
        width = max(len(x) for x in lists)
        return torch.tensor([x + [vocab] * (width - len(x)) for x in lists])

    params = [s.sampling_params for s in seqs]
    expected = vllm_apply_penalties(
        expected,
        padded([s.token_ids[: s.num_prompt_tokens] for s in seqs]),
        padded([s.output_token_ids for s in seqs]),
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.repetition_penalty for p in params]),
    )
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_penalty_batches_match_vllm(seed):
    generator = torch.Generator().manual_seed(seed)
    vocab, rows = 50, 12

    def ints(n):
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def choice(values):
        return values[int(torch.randint(0, len(values), (1,), generator=generator))]

    seqs = []
    for _ in range(rows):
        prompt = ints(int(torch.randint(1, 8, (1,), generator=generator)))
        output = ints(int(torch.randint(0, 10, (1,), generator=generator)))
        seqs.append(
            _seq(
                prompt,
                output,
                presence_penalty=choice([0.0, 0.4, -1.0]),
                frequency_penalty=choice([0.0, 0.25, 1.5]),
                repetition_penalty=choice([1.0, 1.0, 0.7, 2.0]),
            )
        )
    logits = torch.randn(rows, vocab, generator=generator) * 4
    inputs = LogitsInputs.build(seqs, None, vocab, torch.device("cpu"))
    ours = logits.clone() if inputs is None else apply_logits_processors(logits.clone(), inputs)

    def padded(lists):
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [vocab] * (width - len(x)) for x in lists])

    params = [s.sampling_params for s in seqs]
    expected = vllm_apply_penalties(
        logits.clone(),
        padded([s.token_ids[: s.num_prompt_tokens] for s in seqs]),
        padded([s.output_token_ids for s in seqs]),
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.repetition_penalty for p in params]),
    )
    torch.testing.assert_close(ours, expected)


def test_placeholder_output_token_is_counted_from_the_input_ids():
    """Asynchronous scheduling: the last output token is on the device only."""
    vocab = 32
    seq = _seq([1, 2], [3, PLACEHOLDER_TOKEN], presence_penalty=1.0)
    inputs = LogitsInputs.build([seq], torch.tensor([4]).numpy(), vocab, torch.device("cpu"))
    input_ids = torch.tensor([0, 0, 0, 0, 17])  # row 0's last input token: the placeholder
    logits = apply_logits_processors(torch.zeros(1, vocab), inputs, input_ids)
    assert logits[0, 3] == logits[0, 17] == -1.0
    assert (logits[0].eq(-1.0)).sum() == 2


def test_logit_bias_and_min_tokens_steer_generation(llm):
    prompt = [5, 6, 7, 8]
    [free] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    [forced] = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, logit_bias={123: 100}), use_tqdm=False
    )
    assert forced.token_ids == [123, 123, 123] != free.token_ids
    # A request that would stop at once (its first greedy token is a stop id) runs on.
    first = free.token_ids[0]
    [stopped] = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first]),
        use_tqdm=False,
    )
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    [held] = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first], min_tokens=2),
        use_tqdm=False,
    )
    assert first not in held.token_ids[:2] and len(held.token_ids) >= 2


def test_logprobs_match_hf_log_softmax(small_model, llm):
    path, model = small_model
    prompt = [3, 17, 300, 42, 9, 77, 500, 4, 11, 12, 8, 99, 100, 101, 102, 103, 104, 105, 6]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=3)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    full = prompt + out.token_ids
    with torch.no_grad():
        reference = model(torch.tensor([full])).logits[0].float().log_softmax(-1)

    def check(entry, position):  # entry: the token at `position`, given those before
        row = reference[position - 1]
        assert entry.token_id == full[position]
        assert abs(entry.logprob - row[full[position]].item()) < 1e-4
        assert entry.rank == int((row > row[full[position]]).sum()) + 1
        top = row.topk(len(entry.top))
        assert [t for t, _ in entry.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), top.values, atol=1e-4, rtol=0)  # fmt: skip

    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        assert len(out.prompt_logprobs[position].top) == 3
        check(out.prompt_logprobs[position], position)
    assert len(out.logprobs) == 4
    for i, entry in enumerate(out.logprobs):
        assert entry.rank == 1 and len(entry.top) == 5  # greedy: the top token
        check(entry, len(prompt) + i)


def test_chunked_prompt_logprobs_equal_one_chunk(small_model):
    path, _ = small_model
    prompt = list(range(10, 60))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    chunked = build_llm(path, max_model_len=256, max_num_batched_tokens=16)
    [a] = chunked.generate([prompt], params, use_tqdm=False)
    whole = build_llm(path, max_model_len=256)
    [b] = whole.generate([prompt], params, use_tqdm=False)
    assert [e.token_id for e in a.prompt_logprobs[1:]] == prompt[1:]
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
        assert abs(x.logprob - y.logprob) < 1e-4


def test_n_samples_share_prompt_blocks_and_follow_their_seeds(llm):
    prompt = list(range(20, 70))  # three full blocks of 16
    bm = llm.engine.block_manager
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=11)
    hits = bm.prefix_hit_blocks
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert bm.prefix_hit_blocks - hits >= 2 * 3  # samples 1 and 2 reuse sample 0's blocks
    assert len(out.outputs) == 3 and out.outputs[0] is out
    # Each sample is its own seed stream: sample i equals a single request seeded seed + i.
    singles = llm.generate(
        [prompt] * 3,
        [SamplingParams(temperature=1.0, max_tokens=6, seed=11 + i) for i in range(3)],
        use_tqdm=False,
    )
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in singles]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    [again] = llm.generate([prompt], params, use_tqdm=False)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_penalties_with_asynchronous_scheduling_equal_synchronous(small_model):
    path, _ = small_model
    params = SamplingParams(
        temperature=0, max_tokens=12, presence_penalty=1.5, frequency_penalty=1.0, ignore_eos=True
    )
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    results = []
    for async_scheduling in (False, True):
        engine = build_llm(path, max_model_len=256, async_scheduling=async_scheduling)
        results.append([o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "bad",
    [
        dict(n=0),
        dict(n=2, best_of=3),
        dict(min_tokens=100, max_tokens=10),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(logit_bias={5: 101}),
        dict(logit_bias={-1: 1}),
        dict(logprobs=21),
        dict(prompt_logprobs=-1),
    ],
)
def test_invalid_options_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_repetition_penalty_survives_preemption_and_chunking(small_model):
    """Penalty state kept on the device across steps: chunked prefills, preemption by
    recompute (rows taken back and rebuilt: 3 state rows for 4 requests) and an
    asynchronous run all give HF transformers' greedy tokens with the same penalty."""
    path, model = small_model
    prompts = [list(range(20 + 7 * i, 39 + 7 * i)) for i in range(4)]
    reference = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12, min_new_tokens=12, do_sample=False, repetition_penalty=1.3,
        )  # fmt: skip
        reference.append(out[0, len(ids) :].tolist())
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True)
    for async_scheduling in (False, True):
        llm = build_llm(
            path, max_model_len=64, num_kvcache_blocks=5, max_num_seqs=3,
            max_num_batched_tokens=24, async_scheduling=async_scheduling,
        )  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outputs] == reference
