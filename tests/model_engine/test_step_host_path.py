"""The host side of a step: its log-probability entries (atom/model_engine/sampling/logprobs.py),
the frozen start-up heap of the stepping loops (atom/gc_heap.py), and the profile of a
decode step's host phases (benchmarks/engine_host_profile.py).

A step's Logprob entries keep their alternatives in the step's arrays until `top` is
read; what a reader sees must equal the eager conversion of the same tensors."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from atom.gc_heap import frozen_heap
from atom.model_engine.sampling.logprobs import Logprob, LogprobTensors


def _tensors(rows: int = 6, k: int = 5) -> LogprobTensors:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(rows, k, generator=generator).sort(dim=1, descending=True).values
    return LogprobTensors(
        torch.randn(rows, generator=generator),
        torch.randint(1, 100, (rows,), generator=generator),
        torch.randint(0, 50_000, (rows, k), generator=generator),
        values,
    )


def test_entries_equal_the_eager_conversion():
    t = _tensors()
    tokens, ks = [11, 12, 13, 14, 15, 16], [5, 0, 3, 5, 1, 2]
    entries = t.entries(tokens, ks)
    ids, values = t.top_ids.tolist(), t.top_values.tolist()
    for i, entry in enumerate(entries):
        top = list(zip(ids[i][: ks[i]], values[i][: ks[i]], strict=True))
        expected = Logprob(tokens[i], t.chosen[i].item(), t.ranks[i].item(), top)
        assert entry == expected and repr(entry) == repr(expected)
        assert all(type(a) is int and type(b) is float for a, b in entry.top)
        restored = pickle.loads(pickle.dumps(entry))
        assert restored == expected and restored.top is not entry.top


def test_entries_do_not_read_the_transfer_memory_later():
    """The host tensors (pinned on CUDA) are reused once freed: entries copy them."""
    t = _tensors()
    entries = t.entries([1] * 6, [5] * 6)
    before = t.top_ids[0, :5].tolist()
    t.top_ids.fill_(-1)
    t.top_values.fill_(0.0)
    assert [a for a, _ in entries[0].top] == before


def test_top_can_be_set():
    entry = _tensors().entries([3] * 6, [4] * 6)[2]
    entry.top = [(7, -0.5)]
    assert entry.top == [(7, -0.5)] and entry != Logprob(3, entry.logprob, entry.rank, [])


def test_frozen_heap_skips_old_objects_and_leaves_foreign_freezes():
    if gc.get_freeze_count():  # a server engine thread of the session holds its freeze
        pytest.skip("the heap is frozen by a running engine loop")
    # The permanent generation's count can only fall while frozen (a frozen object that
    # dies leaves it); a second freeze would raise it, an unfreeze would empty it.
    young = []  # objects made after the freeze: a nested freeze would take them in
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        young.extend([object()] for _ in range(1000))
        with frozen_heap():  # nested: already frozen, left as it is
            assert 0 < gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0  # everything collectable again
    gc.freeze()  # someone else's freeze: neither extended nor undone
    try:
        outside = gc.get_freeze_count()
        young.extend([object()] for _ in range(1000))
        with frozen_heap():
            pass
        assert 0 < gc.get_freeze_count() <= outside
    finally:
        gc.unfreeze()


def test_steady_decode_fills_placeholders_in_place(tiny_model_dirs, monkeypatch):
    """Asynchronous scheduling: a decode step whose placeholder k is token k, taking token
    k of the last step, fills them with one prefix copy and uploads no (dst, src) pairs;
    once a finished request shifts the rows the pairs go up again. Tokens equal those of
    synchronous scheduling (no placeholders) either way."""
    from atom.model_engine import runner_slot
    from atom.sampling_params import SamplingParams
    from tests.engine_support import build_llm, random_prompts

    prompts = random_prompts(21, [6, 9, 4])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 9)]
    sync = build_llm(tiny_model_dirs["llama"], async_scheduling=False)
    expected = [o.token_ids for o in sync.generate(prompts, params, use_tqdm=False)]
    steps = []
    prepare = runner_slot.RunnerSlot._prepare

    def recording(self, batch, padded_seqs):
        step = prepare(self, batch, padded_seqs)
        if step.num_placeholders:
            staged = self.buffers.placeholder_dst.staged_step == self.publisher.step
            steps.append((step.num_placeholders, step.placeholders_in_place, staged))
        return step

    monkeypatch.setattr(runner_slot.RunnerSlot, "_prepare", recording)
    overlapped = build_llm(tiny_model_dirs["llama"], async_scheduling=True)
    got = [o.token_ids for o in overlapped.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    in_place = [(n, staged) for n, flag, staged in steps if flag]
    pairs = [(n, staged) for n, flag, staged in steps if not flag]
    # three rows decoding in place, then (request 0 done) two rows shifted by one: pairs
    assert (3, False) in in_place and (2, False) in in_place
    assert pairs and all(staged for _, staged in pairs)
    assert steps.index(next(s for s in steps if not s[1])) > 0  # in place before the shift


@pytest.mark.gpu
def test_pooled_host_tokens_come_back_in_any_order_and_are_reused():
    """Step handles copying into the runner's pinned pool: each returns its own step's
    tokens (after the device has produced them), in any order and more than once; a read
    or dropped handle gives its buffer back, and a larger step grows the one it takes."""
    from atom.model_engine.step_handle import HostTokenPool, StepHandle

    device = torch.device("cuda")
    pool = HostTokenPool(device)
    handles = []
    for k in range(5):
        torch.cuda._sleep(2_000_000)  # the tokens exist only once the device gets there
        handles.append(StepHandle.of(torch.arange(k, k + 3, device=device) * 10, pool=pool))
    assert handles[4].result() == [40, 50, 60]
    assert handles[0].result() == [0, 10, 20] == handles[0].result()
    assert len(pool._free) == 2
    rows = StepHandle.of(torch.tensor([[7, 8], [9, 10]], device=device), pool=pool)
    assert len(pool._free) == 1
    assert [h.result() for h in handles[1:4]] == [[10, 20, 30], [20, 30, 40], [30, 40, 50]]
    assert rows.result() == [[7, 8], [9, 10]]
    unread = StepHandle.of(torch.ones(2, dtype=torch.int64, device=device), pool=pool)
    free = len(pool._free)
    del unread
    assert len(pool._free) == free + 1
    big = torch.randint(0, 50_000, (1000,), device=device)
    assert StepHandle.of(big, pool=pool).result() == big.tolist()
    assert StepHandle.of(big.int(), pool=pool).result() == big.tolist()  # not pooled
    assert len(pool._free) == 5
