"""What a RunnerSlot publishes: only what a consumer reads, uniform sampling on the host."""

from dataclasses import replace

import pytest
import torch

from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _decode_batch(temperatures, context=40, block_size=16, step=1):
    seqs = []
    for i, temperature in enumerate(temperatures):
        seq = Sequence(list(range(context)), SamplingParams(temperature=temperature))
        seq.num_computed_tokens = context - 1
        seq.block_table = list(range(i * 4, i * 4 + -(-context // block_size)))
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * len(seqs), len(seqs), layout=1, grown=[], step=step)


def _slot(backend):
    return RunnerSlot(0, 8, 64, 8, 16, 1000, CPU, h2d_backend=backend, h2d_checked=True)


def _step(slot, batch, padded_seqs=None):
    step = slot.prepare(batch, padded_seqs=padded_seqs)
    inputs = slot.publish(step)
    if padded_seqs is not None:  # what the decode CUDA graph runs before the forward
        slot.backend.derive_views(slot, padded_seqs, padded_seqs, is_decode=True)
    model_inputs = (inputs.input_ids, inputs.positions, inputs.metadata)
    return step, model_inputs, inputs.sampling, inputs.logits_indices, inputs.event


@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_decode_step_publishes_only_what_its_consumers_read(backend):
    slot = _slot(backend)
    batch = _decode_batch([0.0, 0.0, 0.0])
    step, (ids, positions, metadata), sampling, logits_indices, event = _step(
        slot, batch, padded_seqs=4
    )
    sent = {name for name, b in slot.h2d.buffers.items() if b.last_transfer is event}
    assert sent == {"input_ids", "positions", "context_lens", "page_deltas"}
    assert metadata.cu_seqlens_q is None and logits_indices is None and sampling.all_greedy
    # the padded row reads its pad values (CUDA-graph replay at batch size 4)
    assert metadata.slot_mapping.tolist() == [39, 103, 167, -1]
    assert metadata.context_lens.tolist() == [40, 40, 40, 0]
    assert positions.tolist() == [39, 39, 39, 0]
    if backend == "packed":
        assert (slot.publisher.copies, slot.publisher.kernels) == (1, 1)
    # the next decode step of the same batch: the page table sends nothing
    for seq in batch.seqs:
        seq.num_computed_tokens += 1
        seq.token_ids.append(7)
    batch = replace(batch, step=2)
    *_, event = _step(slot, batch, padded_seqs=4)
    sent = {name for name, b in slot.h2d.buffers.items() if b.last_transfer is event}
    assert sent == {"input_ids", "positions", "context_lens"}
    assert slot.page_table.cpu_revision == slot.page_table.gpu_revision == 1


@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_uniform_temperature_stays_on_the_host(backend):
    slot = _slot(backend)
    step, _, sampling, _, event = _step(slot, _decode_batch([0.7, 0.7]))
    assert step.uniform_temperature == 0.7
    assert sampling.temperature == 0.7 and sampling.temperatures is None
    assert slot.buffers.temperatures.last_transfer is not event
    step, _, sampling, _, event = _step(slot, _decode_batch([0.7, 0.0]))
    assert step.uniform_temperature is None
    assert sampling.temperatures.tolist() == pytest.approx([0.7, 0.0])
    assert slot.buffers.temperatures.last_transfer is event


def test_uniform_temperature_samples_like_per_row_temperatures():
    from atom.model_engine.sampling.sampler import Sampler, SamplingTensors

    logits = torch.randn(3, 50)
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    uniform = SamplingTensors(all_greedy=False, temperature=0.8, generators=generators)
    tokens = Sampler()(logits, uniform)
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    per_row = SamplingTensors(
        all_greedy=False, temperatures=torch.full((3,), 0.8), generators=generators
    )
    assert torch.equal(tokens, Sampler()(logits, per_row))


@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_sampling_plan_publishes_new_rows_once_then_nothing(backend):
    """Penalties, logit_bias and logprobs: the first step uploads the state rows' builds
    and the row map through the publisher; the next step of the same batch uploads none of
    it (the state follows the sampled tokens on the device)."""
    slot = _slot(backend)
    batch = _decode_batch([0.0, 0.0, 0.0])
    options = dict(presence_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 2.0})
    batch.seqs[0].sampling_params = SamplingParams(temperature=0.0, logprobs=2, **options)
    batch.seqs[1].sampling_params = SamplingParams(temperature=0.0, min_tokens=2, **options)
    sampling = {
        "sampling_state_rows", "state_build_ints", "state_build_floats", "state_build_entries",
        "state_build_values", "logprob_rows", "token_bitmask", "prompt_logprob_rows",
        "prompt_logprob_targets",
    }  # fmt: skip

    def step():
        prepared = slot.prepare(batch)
        inputs = slot.publish(prepared)
        plan, event = inputs.sampling_plan, inputs.event
        sent = {name for name, b in slot.h2d.buffers.items() if b.last_transfer is event}
        return plan, sent & sampling

    plan, sent = step()
    assert sent == sampling - {"token_bitmask", "prompt_logprob_rows", "prompt_logprob_targets"}
    assert plan.state_rows.tolist()[2] == 0 and len(set(plan.state_rows.tolist())) == 3
    assert plan.logprob_index.tolist() == [0]
    for seq in batch.seqs:
        seq.num_computed_tokens += 1
        seq.token_ids.append(7)
    batch = replace(batch, step=2)
    again, sent = step()
    assert sent == set() and again.builds is None
    assert again.state_rows.tolist() == plan.state_rows.tolist()
