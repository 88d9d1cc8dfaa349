"""A RunnerSlot's shape (issue 31): its attributes are declared in `__init__`, its buffers
are a declared StepBuffers, and one `publish` returns a frozen StepInputs.

The structure checks read the source (ast, nothing imported); the publication checks run
a small batch on CPU and compare with values computed by hand.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.sampling.buffers import SamplingBuffers
from atom.model_engine.scheduler import ScheduledBatch
from atom.model_engine.sequence import Sequence
from atom.model_engine.step_buffers import StepBuffers, StepInputs
from atom.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def _class(path: str, name: str) -> ast.ClassDef:
    tree = ast.parse((ROOT / path).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _self_assignments(node: ast.AST):
    """(attribute, line) of every `self.<x> = ...` / `self.<x>: T = ...` under `node`."""
    for child in ast.walk(node):
        if isinstance(child, ast.Assign):
            targets = child.targets
        elif isinstance(child, ast.AnnAssign):
            targets = [child.target]
        else:
            continue
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                    and isinstance(t.ctx, ast.Store)
                ):
                    yield t.attr, t.lineno


def test_runner_slot_attributes_are_created_in_init_only():
    source = (ROOT / "atom/model_engine/runner_slot.py").read_text()
    tree = ast.parse(source)
    calls = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
    ]
    assert not calls, f"setattr in runner_slot.py, lines {calls}: declare the attribute"
    slot = _class("atom/model_engine/runner_slot.py", "RunnerSlot")
    outside = []
    for method in slot.body:
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) and method.name != "__init__":
            outside += [f"self.{a} (line {line})" for a, line in _self_assignments(method)]
    assert not outside, f"RunnerSlot assigns {outside} outside __init__"


@pytest.mark.parametrize(
    "path, name", [("atom/model_engine/page_table.py", "PageTable"),
                   ("atom/model_engine/sampling/plan.py", "SamplingPlan")],
)  # fmt: skip
def test_page_table_and_sampling_plan_do_not_hold_the_slot(path, name):
    """They get their own buffers and the publisher, never the slot."""
    cls = _class(path, name)
    names = {a.arg for f in ast.walk(cls) if isinstance(f, ast.FunctionDef) for a in f.args.args}
    attrs = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)}
    assert "slot" not in names and "slot" not in attrs


def test_step_buffers_declare_every_staged_buffer():
    for cls in (StepBuffers, SamplingBuffers, StepInputs):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    slot = RunnerSlot(0, 4, 32, 8, 4, 100, CPU, h2d_checked=True)
    b = slot.buffers
    declared = {f.name for f in dataclasses.fields(StepBuffers)} - {"sampling", "family"}
    declared |= {f.name for f in dataclasses.fields(SamplingBuffers)} - {"publisher"}
    declared |= set(b.family)
    assert declared - {"slot_mapping"} == set(slot.h2d.buffers)
    assert b.context_lens is slot.h2d["context_lens"]
    assert b.sampling.publisher is slot.publisher is slot.page_table.publisher
    assert slot.page_table.moves is b.page_moves and slot.page_table.deltas is b.page_deltas


def _seq(tokens, computed, blocks, temperature=0.0):
    seq = Sequence(list(tokens), SamplingParams(temperature=temperature))
    seq.num_computed_tokens = computed
    seq.block_table = list(blocks)
    return seq


@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_publish_returns_the_step_inputs_of_a_prefill(backend):
    """Sequence A prefills its 6 tokens (and samples), B computes tokens 4..6 of 10 (a
    chunk: no sample). Block size 4: A in blocks 0, 1; B in blocks 2, 3, 4."""
    slot = RunnerSlot(0, 4, 32, 8, 4, 1000, CPU, h2d_backend=backend, h2d_checked=True)
    a = _seq(range(10, 16), 0, [0, 1])
    b = _seq(range(100, 110), 4, [2, 3, 4])
    batch = ScheduledBatch([a, b], [6, 3], 0, layout=1, grown=[], step=1)
    step = slot.prepare(batch)
    inputs = slot.publish(step)
    assert isinstance(inputs, StepInputs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.input_ids = None
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 104, 105, 106]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6]
    meta = inputs.metadata
    assert meta.context_lens.tolist() == [6, 7]
    assert meta.cu_seqlens_q.tolist() == [0, 6, 9]
    assert meta.max_seqlen_q == 6 and not meta.is_decode
    assert meta.block_tables[0, :2].tolist() == [0, 1]
    assert meta.block_tables[1, :3].tolist() == [2, 3, 4]
    # derived on the device by the flush: block * 4 + position % 4
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 14]
    assert inputs.logits_indices.tolist() == [5]  # A's last token alone samples
    assert inputs.sampling.all_greedy
    assert inputs.placeholders is None and inputs.draft_token_ids is None
    assert inputs.sampling_plan is None
    assert slot.page_table.gpu_revision == slot.page_table.cpu_revision == 1


@pytest.mark.parametrize("backend", ["direct", "packed"])
def test_publish_returns_the_step_inputs_of_a_decode(backend):
    slot = RunnerSlot(0, 4, 32, 16, 16, 1000, CPU, h2d_backend=backend, h2d_checked=True)
    seqs = [
        _seq(range(40), 39, [0, 1, 2], temperature=0.5),
        _seq(range(1, 41), 39, [5, 6, 7], temperature=0.9),
    ]
    batch = ScheduledBatch(seqs, [1, 1], 2, layout=1, grown=[], step=1)
    inputs = slot.publish(slot.prepare(batch))
    assert inputs.input_ids.tolist() == [39, 40]
    assert inputs.positions.tolist() == [39, 39]
    assert inputs.metadata.context_lens.tolist() == [40, 40]
    assert inputs.metadata.cu_seqlens_q is None and inputs.metadata.is_decode
    assert inputs.metadata.slot_mapping.tolist() == [2 * 16 + 7, 7 * 16 + 7]
    assert inputs.logits_indices is None  # every row samples
    sampling = inputs.sampling
    assert not sampling.all_greedy and sampling.temperature is None
    assert sampling.temperatures.tolist() == pytest.approx([0.5, 0.9])
    assert sampling.top_k is None and sampling.top_p is None
    assert inputs.event is slot.buffers.temperatures.last_transfer


def test_publish_returns_placeholders_drafts_and_the_sampling_plan():
    """Asynchronous scheduling and logprobs: row 0 takes token 1 of the last step and row 1
    token 0 (not in place: the (dst, src) pairs are published); only row 1 wants logprobs."""
    slot = RunnerSlot(0, 4, 32, 16, 16, 1000, CPU, h2d_checked=True)
    seqs = [_seq(range(40), 39, [0, 1, 2]), _seq(range(1, 41), 39, [5, 6, 7])]
    seqs[1].sampling_params = SamplingParams(temperature=0.0, logprobs=2)
    seqs[0].pending_token = (0, 1)
    seqs[1].pending_token = (0, 0)
    batch = ScheduledBatch(seqs, [1, 1], 2, layout=1, grown=[], step=1)
    inputs = slot.publish(slot.prepare(batch))
    dst, src = inputs.placeholders
    assert dst.tolist() == [0, 1] and src.tolist() == [1, 0]
    plan = inputs.sampling_plan
    assert plan is not None and plan.logprob_rows == [1]
    assert plan.logprob_index.tolist() == [1]
    assert inputs.draft_token_ids is None and inputs.sampling.all_greedy


def test_publish_returns_the_drafts_of_a_verify_step():
    """Speculative verification: A (context 8, 2 drafts) reads its last 3 rows; row j is
    checked against draft j + 1, its last row against nothing (-1)."""
    slot = RunnerSlot(0, 4, 32, 8, 4, 1000, CPU, h2d_checked=True)
    a = _seq(range(10, 18), 7, [0, 1, 2])
    batch = ScheduledBatch(
        [a], [3], 0, layout=1, grown=[], step=1, num_draft_tokens=[2], draft_token_ids=[[50, 51]]
    )
    inputs = slot.publish(slot.prepare(batch))
    assert inputs.input_ids.tolist() == [17, 50, 51]
    assert inputs.positions.tolist() == [7, 8, 9]
    assert inputs.draft_token_ids.tolist() == [50, 51, -1]
    assert inputs.logits_indices is None  # every row is a verify row
    assert inputs.metadata.context_lens.tolist() == [10]
