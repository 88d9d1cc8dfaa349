"""Failure containment in the engine (issue 29, item 1): a fault traced to one request
fails that request alone (finish reason "error", its blocks freed) and every other
request in flight finishes with the tokens it has without the fault.

Faults are injected in each step component: the sampler and the model forward (batch-wide:
the engine isolates the culprit by retrying halves), the grammar matcher and the
sampling-state setup (per-request guards). The reference is the same engine's greedy run
of the other prompts without the fault. The block-leak check of tests/engine_support.py
runs after each test (every KV block free).
"""

from __future__ import annotations

import pytest

from atom.model_engine.failures import is_device_fault
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

BATCH_STAGE = "the step (model forward or sampler)"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MARK = 45_000  # in the culprit's prompt only (random_prompts draws ids in [100, 40000))
OTHERS = random_prompts(29, [13, 40, 7, 22, 31])
CULPRIT = random_prompts(30, [9])[0] + [MARK] + random_prompts(31, [5])[0]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_model_dirs, request):
    return build_llm(tiny_model_dirs["llama"], async_scheduling=request.param)


@pytest.fixture(scope="module")
def expected(llm):
    """The other prompts' greedy tokens, without any fault."""
    return [o.token_ids for o in llm.generate(OTHERS, GREEDY, use_tqdm=False)]


def _is_culprit(seq) -> bool:
    return MARK in seq.token_ids[: seq.num_prompt_tokens]


def _run(engine, culprit_params=GREEDY, setup=None):
    """Add the culprit among the others (in one step), step to the end; returns
    ({seq_id: (tokens, finish_reason, error)}, culprit id, other ids)."""
    ids = [engine.add_request(p, GREEDY) for p in OTHERS[:2]]
    culprit = engine.add_request(CULPRIT, culprit_params)
    ids += [engine.add_request(p, GREEDY) for p in OTHERS[2:]]
    if setup is not None:
        setup(engine.requests[culprit])
    results = {i: ([], None, None) for i in [culprit, *ids]}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens, _, _ = results[out.seq_id]
            results[out.seq_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)
    assert not engine.has_unfinished()
    return results, culprit, ids


def _check(llm, expected, results, culprit, ids, needle: str):
    tokens, reason, error = results[culprit]
    assert reason == "error" and needle in error, (reason, error)
    assert [results[i][0] for i in ids] == expected
    assert all(results[i][1] == "length" for i in ids)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.requests
    # The engine goes on: the culprit's prompt without the fault is served again.
    again = llm.generate([OTHERS[0]], GREEDY, use_tqdm=False)[0]
    assert again.token_ids == expected[0]


class _Batches:
    """Records the sequences of the step being launched (for batch-wide faults)."""

    def __init__(self, monkeypatch, runner):
        self.seqs = []
        self.fired = 0
        launch = runner.launch

        def recording(batch):
            self.seqs = batch.seqs
            return launch(batch)

        monkeypatch.setattr(runner, "launch", recording)

    def culprit_in_step(self) -> bool:
        return any(_is_culprit(s) for s in self.seqs)


def test_sampler_fault_fails_only_its_request(llm, expected, monkeypatch):
    runner = llm.engine.model_runner
    batches = _Batches(monkeypatch, runner)
    sampler = runner.sampler

    class FaultySampler:
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, params):
            if batches.culprit_in_step():
                batches.fired += 1
                raise IndexError("injected sampler fault")
            return sampler(logits, params)

    monkeypatch.setattr(runner, "sampler", FaultySampler())
    results, culprit, ids = _run(llm.engine)
    assert batches.fired >= 2  # the whole batch, then the halves holding the culprit
    _check(llm, expected, results, culprit, ids, f"{BATCH_STAGE} failed (IndexError)")


def test_model_forward_fault_fails_only_its_request(llm, expected, monkeypatch):
    model = llm.engine.model_runner.model
    forward = model.forward
    fired = []

    def faulty_forward(input_ids, positions, *rest):
        if (input_ids == MARK).any():
            fired.append(input_ids.numel())
            raise RuntimeError("injected forward fault")
        return forward(input_ids, positions, *rest)

    monkeypatch.setattr(model, "forward", faulty_forward)
    results, culprit, ids = _run(llm.engine)
    assert len(fired) >= 2
    _check(llm, expected, results, culprit, ids, f"{BATCH_STAGE} failed (RuntimeError)")


@pytest.mark.parametrize("method", ["fill_next_token_bitmask", "accept_token"])
def test_grammar_matcher_fault_fails_only_its_request(llm, expected, method):
    if llm.tokenizer is None:
        pytest.skip("structured output needs the SmolLM2 tokenizer")
    fired = []

    class FaultyMatcher:
        """The culprit's real matcher, whose `method` raises from its second call on."""

        def __init__(self, matcher):
            self.matcher = matcher
            self.calls = 0

        def __getattr__(self, name):
            return getattr(self.matcher, name)

        def _faulty(self, *args):
            self.calls += 1
            if self.calls >= 2:
                fired.append(method)
                raise RuntimeError(f"injected {method} fault")
            return getattr(self.matcher, method)(*args)

    def setup(seq):
        seq.grammar = FaultyMatcher(seq.grammar)
        setattr(seq.grammar, method, seq.grammar._faulty)

    params = SamplingParams(temperature=0.0, max_tokens=12, json_object=True)
    results, culprit, ids = _run(llm.engine, params, setup)
    assert fired
    _check(llm, expected, results, culprit, ids, "the grammar matcher failed (RuntimeError)")
    assert llm.engine._num_structured == 0 and llm.engine._num_planned == 0


def test_bad_sampling_state_fails_only_its_request(llm, expected):
    """The crafted request of the issue with the API's checks bypassed: a stop id past the
    vocabulary reaches the sampling-state setup, which refuses that request alone."""

    def setup(seq):
        seq.sampling_params.all_stop_token_ids = [100_000]

    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=1)
    results, culprit, ids = _run(llm.engine, params, setup)
    _check(llm, expected, results, culprit, ids, "sampling-state setup failed (SamplingStateError)")


def test_token_ids_outside_the_vocabulary_are_refused_by_generate(llm):
    vocab = llm.engine.hf_config.vocab_size
    cases = {
        "stop_token_ids": SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[100_000]),
        "logit_bias": SamplingParams(max_tokens=4, logit_bias={vocab: 1.0}),
    }
    in_vocab = rf"token ids must be in the model's vocabulary \[0, {vocab}\); token id"
    for field, params in cases.items():
        with pytest.raises(ValueError, match=f"^{field}: {in_vocab}"):
            llm.generate(["Hello"] if llm.tokenizer else [[5, 6]], params, use_tqdm=False)
    with pytest.raises(ValueError, match=f"^prompt: {in_vocab} {vocab} is not"):
        llm.generate([[5, vocab]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=f"^stop_token_ids: {in_vocab} 1099511627776 is not"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[2**40]), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_failed_read_fails_its_step_and_the_engine_goes_on(llm, expected, monkeypatch):
    """Reading a step's tokens raises (not a device fault): the requests of that step (and,
    asynchronously, of the step launched on its tokens) fail; `step` does not raise, and
    requests added afterwards get their reference tokens."""
    from atom.model_engine import model_runner

    engine = llm.engine
    victims = [engine.add_request(p, GREEDY) for p in OTHERS[:2]]
    engine.step()  # their prefill (in flight when asynchronous)
    real_result = model_runner.StepHandle.result

    def broken(self):
        raise KeyError("lost tokens")

    monkeypatch.setattr(model_runner.StepHandle, "result", broken)
    outputs = engine.step()
    if not outputs:  # synchronous: the prefill was read; this step's read failed
        outputs = engine.step()
    monkeypatch.setattr(model_runner.StepHandle, "result", real_result)
    failed = {o.seq_id: o for o in outputs if o.finish_reason == "error"}
    assert set(failed) == set(victims)
    assert all("reading the step's tokens failed (KeyError)" in o.error for o in failed.values())
    assert not engine.has_unfinished()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    again = llm.generate(OTHERS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == expected


def test_device_faults_are_told_apart():
    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_device_fault(RuntimeError("injected forward fault"))
    assert not is_device_fault(IndexError("index 100000 is out of bounds"))


def test_step_outputs_carry_the_sampled_tokens(llm, expected):
    """Each StepOutput holds the token its step sampled (with asynchronous scheduling the
    next step's placeholder already follows it: it was sent as -1 before)."""
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in OTHERS]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.seq_id] += out.new_token_ids
    assert [tokens[i] for i in ids] == expected


def test_without_isolation_a_batch_fault_fails_the_step(llm, expected, monkeypatch):
    """Where a failed step cannot be retried in parts (ranks, speculation, per-sequence
    state), a batch-wide fault fails every request of that step, and only those."""
    model = llm.engine.model_runner.model
    forward = model.forward

    def faulty_forward(input_ids, positions, *rest):
        if (input_ids == MARK).any():
            raise RuntimeError("injected forward fault")
        return forward(input_ids, positions, *rest)

    monkeypatch.setattr(model, "forward", faulty_forward)
    monkeypatch.setattr(llm.engine, "_can_isolate", lambda: False)
    results, culprit, ids = _run(llm.engine)
    assert {results[i][1] for i in [culprit, *ids]} == {"error"}  # one step held them all
    assert all(f"{BATCH_STAGE} failed (RuntimeError)" in results[i][2] for i in ids)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    again = llm.generate(OTHERS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == expected
