"""Engine behaviour on a tiny random Llama: batching, chunked prefill, preemption,
prefix caching, sampling options, aborts and bad input. Blocks are checked after each test."""

import pytest

from atom.model_engine.llm_engine import LLMEngine
from atom.models.loader import ModelLoadError
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return build_llm(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def reference(llm):
    """The probe prompt's greedy tokens when it runs alone."""
    probe = random_prompts(7, [45])[0]
    return probe, llm.generate([probe], GREEDY, use_tqdm=False)[0].token_ids


def test_same_tokens_inside_a_mixed_batch(llm, reference):
    probe, alone = reference
    others = random_prompts(8, [1, 3, 17, 16, 32, 90, 5, 64, 2, 48, 31, 15, 100, 9, 77])
    batch = others[:8] + [probe] + others[8:]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert len(batch) == 16
    assert outputs[8].token_ids == alone


def test_same_tokens_with_forced_chunked_prefill(tiny_model_dirs, reference):
    probe, alone = reference
    chunked = build_llm(tiny_model_dirs["llama"], max_num_batched_tokens=8, max_num_seqs=4)
    prompts = [probe] + random_prompts(9, [30, 12, 50])
    outputs = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert outputs[0].token_ids == alone
    assert chunked.engine.stats.steps > sum(len(p) for p in prompts) // 8  # really chunked


def test_same_tokens_under_preemption(tiny_model_dirs, reference):
    probe, alone = reference
    # 7 blocks of 16 tokens: two ~45-token prompts fit (3 blocks each) but cannot both grow to 4.
    tight = build_llm(tiny_model_dirs["llama"], num_kvcache_blocks=7, enable_prefix_caching=False)
    prompts = [probe] + random_prompts(10, [40, 44, 38])
    outputs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert outputs[0].token_ids == alone
    free = build_llm(tiny_model_dirs["llama"], enable_prefix_caching=False)
    assert [o.token_ids for o in outputs] == [
        o.token_ids for o in free.generate(prompts, GREEDY, use_tqdm=False)
    ]


def test_prefix_cache_hits_and_unchanged_output(llm, tiny_model_dirs):
    shared = random_prompts(11, [100])[0]
    first, second = shared + [101, 102, 103], shared + [201, 202]
    engine = llm.engine
    expected = build_llm(tiny_model_dirs["llama"], enable_prefix_caching=False).generate(
        [second], GREEDY, use_tqdm=False
    )[0]
    llm.generate([first], GREEDY, use_tqdm=False)
    hits_before = engine.block_manager.prefix_hit_blocks
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert engine.block_manager.prefix_hit_blocks - hits_before == 100 // 16
    assert out.num_cached_tokens == (100 // 16) * 16
    assert out.token_ids == expected.token_ids


def test_whole_prompt_cached_still_computes_last_token(llm):
    prompt = random_prompts(12, [64])[0]  # exactly 4 blocks
    a = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    b = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 48  # the last block is recomputed for its logits
    assert a.token_ids == b.token_ids


def test_max_tokens_stop_tokens_and_eos(llm):
    prompt = random_prompts(13, [20])[0]
    free_run = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    stop = free_run[5]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == free_run[: free_run.index(stop) + 1]
    assert out.finish_reason == "stop"
    # Without ignore_eos: the first 3 tokens, cut after an end-of-sequence token if any.
    eos = llm.engine.scheduler.eos_token_ids
    ends = [i + 1 for i, t in enumerate(free_run[:3]) if t in eos]
    expected = free_run[: ends[0]] if ends else free_run[:3]
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert short.token_ids == expected
    assert short.finish_reason == ("stop" if ends else "length")


def test_end_of_sequence_stops_unless_ignored(llm, monkeypatch):
    """A token the model treats as end-of-sequence ends the output (kept in it, finish
    reason stop); ignore_eos generates past it."""
    prompt = random_prompts(13, [20])[0]
    free_run = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    eos = free_run[2]
    monkeypatch.setattr(llm.engine.scheduler, "eos_token_ids", {eos})
    params = SamplingParams(temperature=0.0, max_tokens=16)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == free_run[: free_run.index(eos) + 1]
    assert out.finish_reason == "stop"
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == free_run


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompt = random_prompts(14, [12])[0]
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True
    )
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].token_ids
    others = random_prompts(15, [5, 30, 9])
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(others + [prompt], [noisy] * 3 + [seeded], use_tqdm=False)
    assert outputs[-1].token_ids == alone
    other_seed = llm.generate(
        [prompt],
        SamplingParams(
            temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=99, ignore_eos=True
        ),
        use_tqdm=False,
    )[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm):
    prompt = random_prompts(16, [10])[0]
    greedy = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], top1, use_tqdm=False)[0].token_ids == greedy


def test_a_request_longer_than_the_kv_cache_ends_instead_of_hanging(llm, tiny_model_dirs):
    """2 blocks of 16 tokens and max_tokens=100: the request used to preempt itself
    forever. An explicit max_model_len that does not fit is refused at start (naming both
    sizes and the flag); the model's default is lowered to what the cache holds."""
    with pytest.raises(ValueError) as refused:
        LLMEngine(
            model=tiny_model_dirs["llama"], device="cpu", num_kvcache_blocks=2, max_model_len=1024
        )
    message = str(refused.value)
    assert "max_model_len 1024" in message and "2 blocks of 16 tokens (32 tokens)" in message
    assert "--max-model-len" in message
    engine = build_llm(tiny_model_dirs["llama"], num_kvcache_blocks=2).engine
    assert engine.max_model_len == 32
    prompt = random_prompts(19, [5])[0]
    seq = engine.requests[
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    ]
    try:
        for _ in range(100):  # bounded: a hang fails the test instead of the suite
            if not engine.has_unfinished():
                break
            engine.step()
        out = engine.output_of(seq)
        assert out.finish_reason == "length" and len(out.token_ids) == 32 - 5
    finally:
        engine.abort(seq.seq_id)
    roomy = SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True)
    assert out.token_ids == llm.generate([prompt], roomy, use_tqdm=False)[0].token_ids


def test_abort_frees_blocks(llm):
    engine = llm.engine
    seq_id = engine.add_request(random_prompts(17, [40])[0], GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort(seq_id)
    assert not engine.abort(seq_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", GREEDY, "prompt is empty"),
        ([], GREEDY, "prompt is empty"),
        ([1] * 1024, GREEDY, "max_model_len"),
        ([10**9], GREEDY, "token ids"),
    ],
)
def test_bad_requests_are_refused_and_others_finish(llm, prompt, params, message):
    engine = llm.engine
    good = engine.add_request(random_prompts(18, [9])[0], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    finished = []
    while engine.has_unfinished():
        finished += [o.seq_id for o in engine.step() if o.finished]
    assert finished == [good]


def test_generate_refuses_a_bad_prompt_without_queuing_others(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine prompt", ""], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2**70), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(model=str(tmp_path / "nope"), device="cpu")


def test_truncated_gguf_is_a_clear_error(tmp_path):
    from atom.models.default_model import default_model_path

    truncated = tmp_path / "model.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(100_000))
    with pytest.raises(ModelLoadError, match="model.gguf"):
        LLMEngine(model=str(truncated), device="cpu")


def test_max_model_len_larger_than_the_model_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(model=tiny_model_dirs["llama"], device="cpu", max_model_len=4096)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(max_num_batched_tokens=8, max_num_seqs=4),
        dict(num_kvcache_blocks=7, enable_prefix_caching=False),
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_async_scheduling_gives_the_same_tokens(tiny_model_dirs, options):
    """Scheduling step N+1 before step N's tokens are read changes nothing, including
    stop tokens found while the next step is already in flight."""
    prompts = [random_prompts(7, [45])[0]] + random_prompts(10, [40, 44, 38, 3])
    sync = build_llm(tiny_model_dirs["llama"], async_scheduling=False, **options)
    stop = sync.generate(prompts[:1], GREEDY, use_tqdm=False)[0].token_ids[4]
    params = [SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop])]
    params += [GREEDY] * 3 + [SamplingParams(temperature=0.0, max_tokens=1)]
    expected = [o.token_ids for o in sync.generate(prompts, params, use_tqdm=False)]
    assert expected[0][-1] == stop and len(expected[0]) < 16
    overlapped = build_llm(tiny_model_dirs["llama"], async_scheduling=True, **options)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == expected
    assert all(-1 not in o.token_ids for o in got)
    if "num_kvcache_blocks" in options:
        assert overlapped.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_step_whose_results_fail_finishes_its_requests_without_placeholders(
    tiny_model_dirs, monkeypatch, async_scheduling
):
    """If reading a step's tokens raises (e.g. a dead tensor-parallel rank), the step is
    not left in flight, its request (and, asynchronously, the next step's, launched on
    its tokens) ends with finish reason "error", no placeholder token (-1), blocks freed;
    a request that was waiting then runs as if nothing happened."""
    from atom.model_engine import model_runner

    llm = build_llm(tiny_model_dirs["llama"], async_scheduling=async_scheduling, max_num_seqs=1)
    engine = llm.engine
    victim_prompt, bystander_prompt = random_prompts(3, [5, 9])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected, victim_alone = [
        o.token_ids for o in llm.generate([bystander_prompt, victim_prompt], params, use_tqdm=False)
    ]
    victim = engine.requests[engine.add_request(victim_prompt, params)]
    bystander = engine.requests[engine.add_request(bystander_prompt, params)]
    engine.step()  # step 1: the victim's prefill (read at once unless asynchronous)
    assert (engine._in_flight is not None) == async_scheduling

    def broken(self):  # a device fault: raised after failing the requests (issue 29)
        raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr(model_runner.StepHandle, "result", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()  # async: launches step 2 on step 1's tokens, reading step 1 fails
    assert engine._in_flight is None
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
    failed = engine.output_of(victim)
    received = [] if async_scheduling else victim_alone[:1]  # tokens read before the failure
    assert failed.finish_reason == "error" and failed.token_ids == received
    assert victim.token_ids == victim_prompt + received
    done = engine.output_of(bystander)
    assert done.finish_reason == "length" and done.token_ids == expected
