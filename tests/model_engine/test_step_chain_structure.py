"""The step chain's structure (issue 31, part 3), checked over the source and on objects:

- every attribute of a Sequence is declared in `Sequence.__init__` (no field appears
  from outside: an ast scan of atom/ for attribute writes on sequence-named objects);
- a ScheduledBatch cannot be changed after it is built;
- each runner, step handle and model class provides its protocol (protocols.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from atom.model_engine import protocols
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.data_parallel import _Runners
from atom.model_engine.distributed_runner import DistributedRunner, RemoteStepHandle
from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import FinishReason, Sequence
from atom.model_engine.speculative.decoder import SpeculativeDecoder
from atom.model_engine.speculative.draft_runner import DraftModelRunner
from atom.model_engine.speculative.proposers import NgramProposer
from atom.model_engine.step_handle import StepHandle
from atom.models.registry import MODELS
from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm

ROOT = Path(__file__).resolve().parents[2]
# Names the package gives a Sequence (or an object standing in for one: a rank's
# MirroredSequence, the draft's _DraftView) where it writes its attributes.
SEQUENCE_NAMES = {"seq", "sequence", "s", "target", "draft_seq"}


def _init_attributes(cls_name: str, path: Path) -> set[str]:
    """The `self.X` that `cls_name.__init__` assigns."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return {
                        target.attr
                        for statement in ast.walk(item)
                        for target in _targets(statement)
                        if isinstance(target.value, ast.Name) and target.value.id == "self"
                    }
    raise AssertionError(f"no {cls_name}.__init__ in {path}")


def _targets(node: ast.AST) -> list[ast.Attribute]:
    """The attribute targets an assignment statement writes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    found = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def test_sequence_attributes_are_declared_in_init():
    declared = _init_attributes("Sequence", ROOT / "atom/model_engine/sequence.py")
    assert {"prompt", "generator", "grammar", "pending_token"} <= declared
    undeclared = []
    for path in sorted((ROOT / "atom").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _targets(node):
                owner = target.value
                if (
                    isinstance(owner, ast.Name)
                    and owner.id in SEQUENCE_NAMES
                    and target.attr not in declared
                ):
                    undeclared.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner.id}.{target.attr}")  # fmt: skip
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in SEQUENCE_NAMES
            ):
                undeclared.append(f"{path.relative_to(ROOT)}:{node.lineno} setattr")
    assert not undeclared, f"Sequence attributes created outside Sequence.__init__: {undeclared}"


def test_scheduled_batch_is_built_once():
    scheduler = Scheduler(
        BlockManager(num_blocks=8, block_size=4),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=32,
        eos_token_ids=set(),
    )
    seq = Sequence([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4))
    scheduler.add(seq)
    batch = scheduler.schedule(needs_sampling_plan=False)
    assert batch.sampled == [(seq, 3)] and batch.needs_sampling_plan is False
    for field, value in [("step", 2), ("draft_token_ids", [[7]]), ("needs_sampling_plan", True)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(batch, field, value)
    scheduler.on_launch(batch)
    assert scheduler.on_complete(batch, [9]) == [(seq, [9])]
    scheduler.finish(seq, FinishReason.ABORT)


def test_proposals_ride_on_the_speculators_copy_of_the_batch():
    scheduler = Scheduler(
        BlockManager(num_blocks=16, block_size=4),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        eos_token_ids=set(),
    )
    decoder = SpeculativeDecoder(NgramProposer(1, 3), num_speculative_tokens=2, max_model_len=64)
    scheduler.lookahead = decoder.lookahead
    seq = Sequence([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_tokens=8))
    scheduler.add(seq)
    prompt = scheduler.schedule()
    assert decoder.propose(prompt) is prompt  # nothing to draft: the batch itself
    scheduler.on_launch(prompt)
    scheduler.on_complete(prompt, [7])
    batch = scheduler.schedule()
    assert batch.num_draft_tokens == [2] and batch.sampled == [(seq, 9)]
    verify = decoder.propose(batch)
    assert verify is not batch and batch.draft_token_ids is None
    assert verify.draft_token_ids == [[5, 6]] and verify.sampled == batch.sampled
    scheduler.on_launch(verify)
    emitted = decoder.on_verified(verify, [[5, 6, 9], [1, 0, 0]])  # keeps draft 1 only
    assert emitted == [[5, 6]] and verify.draft_token_ids == [[5, 6]]
    assert scheduler.on_complete(verify, emitted) == [(seq, [5, 6])]
    scheduler.finish(seq, FinishReason.ABORT)


def _protocol_members(protocol) -> tuple[set[str], set[str]]:
    """(methods, data members) of `protocol` and the protocols it extends."""
    methods, data = set(), set()
    for base in protocol.__mro__:
        if base.__module__ == protocols.__name__:
            methods |= {
                name
                for name, value in vars(base).items()
                if callable(value) and not name.startswith("_")
            }
            data |= set(vars(base).get("__annotations__", {}))
    return methods, data


@pytest.mark.parametrize(
    "cls, protocol",
    [
        (ModelRunner, protocols.StepRunner),
        (DraftModelRunner, protocols.StepRunner),
        (DistributedRunner, protocols.StepRunner),
        (_Runners, protocols.RunnerTotals),
        (StepHandle, protocols.LaunchedStep),
        (RemoteStepHandle, protocols.LaunchedStep),
    ],
)
def test_classes_provide_their_protocol(cls, protocol):
    """Each method of the protocol is there, with the protocol's parameters."""
    methods, data = _protocol_members(protocol)
    assert methods, protocol
    for name in methods:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} lacks {protocol.__name__}.{name}"
        expected = list(inspect.signature(getattr(protocol, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got[: len(expected)] == expected, (cls.__name__, name, got, expected)
    for name in data:  # a property, or set in the class's (or a base's) __init__
        declared = set()
        for klass in cls.__mro__[:-1]:
            declared |= {n for n, v in vars(klass).items() if isinstance(v, property)}
            if "__init__" in vars(klass):
                source = Path(inspect.getsourcefile(klass))
                declared |= _init_attributes(klass.__name__, source)
        assert name in declared, f"{cls.__name__} lacks {protocol.__name__}.{name}"


@pytest.mark.parametrize("cls", sorted(set(MODELS.values()), key=lambda c: c.__name__))
def test_model_classes_are_causal_lms(cls):
    """Each method and property of CausalLM (`__call__`: nn.Module's, over `forward`)."""
    methods, _ = _protocol_members(protocols.CausalLM)
    for name in methods | {"forward"}:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
    properties = [n for n, v in vars(protocols.CausalLM).items() if isinstance(v, property)]
    assert properties == ["attention_layers"]
    for name in properties:
        assert isinstance(inspect.getattr_static(cls, name), property), (cls.__name__, name)


def test_built_runner_model_and_handle_match_the_protocols(tiny_model_dirs):
    llm = build_llm(tiny_model_dirs["llama"])
    runner = llm.engine.model_runner
    assert isinstance(runner, ModelRunner)
    assert isinstance(runner, protocols.StepRunner)
    assert isinstance(runner.model, protocols.CausalLM)
    assert isinstance(StepHandle(None, None), protocols.LaunchedStep)
    assert isinstance(_Runners([llm.engine]), protocols.RunnerTotals)
