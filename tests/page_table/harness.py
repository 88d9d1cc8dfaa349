"""Drive real Scheduler/BlockManager steps through RunnerSlots' page tables, no model."""

from __future__ import annotations

import random

import numpy as np
import torch

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import FinishReason, Sequence
from atom.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_SEQS = 8
MAX_MODEL_LEN = 160


class PageTableHarness:
    def __init__(self, device="cpu", backend="direct", num_slots=1, num_blocks=64, seed=0):
        self.device = torch.device(device)
        self.block_manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=48,
            max_model_len=MAX_MODEL_LEN,
            eos_token_ids=set(),
        )
        self.slots = [
            RunnerSlot(
                index,
                MAX_SEQS,
                48,
                MAX_MODEL_LEN // BLOCK_SIZE,
                BLOCK_SIZE,
                100,
                self.device,
                h2d_backend=backend,
                h2d_checked=True,
            )
            for index in range(num_slots)
        ]
        self.steps = 0
        self.rng = random.Random(seed)

    # -- scheduler-facing operations --------------------------------------------------------
    def add(self, prompt_len: int, max_tokens: int, shared_prefix: bool = False) -> None:
        base = [1] * 8 if shared_prefix else []
        prompt = base + [self.rng.randrange(2, 100) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add(Sequence(prompt[: MAX_MODEL_LEN - max_tokens], params))

    def finish(self, index: int) -> None:
        running = self.scheduler.running
        if running:
            self.scheduler.finish(running[index % len(running)], FinishReason.ABORT)

    def preempt(self) -> None:
        if self.scheduler.running:
            self.scheduler._preempt(self.scheduler.running[-1])

    def reorder(self, seed: int) -> None:
        random.Random(seed).shuffle(self.scheduler.running)

    def step(self):
        """One scheduled step on the next slot (slots take turns).

        Returns (slot, block tables of the batch as launched), or (None, None)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None, None
        slot = self.slots[self.steps % len(self.slots)]
        self.steps += 1
        prepared = slot.prepare(batch)
        slot.publish(prepared)
        tables = [list(seq.block_table) for seq in batch.seqs]
        self.scheduler.on_launch(batch)
        tokens = [self.rng.randrange(2, 100) for _ in batch.sampled]
        self.scheduler.on_complete(batch, tokens)
        return slot, tables


def assert_mirror_matches(slot, block_tables) -> None:
    """Every valid id of the device mirror equals the rebuild (block tables at launch)."""
    mirror = slot.page_table.device_rows.cpu().numpy()
    expected = rebuild_from_tables(block_tables, mirror.shape[1])
    for row, table in enumerate(block_tables):
        got = mirror[row, : len(table)]
        assert np.array_equal(got, expected[row, : len(table)]), (
            f"slot {slot.index} row {row}: mirror {got.tolist()} != rebuild {table}"
        )
    assert slot.page_table.gpu_revision == slot.page_table.cpu_revision


def rebuild_from_tables(block_tables, width: int) -> np.ndarray:
    """The page table rebuilt from scratch (nano-vllm style): the reference."""
    rows = np.full((len(block_tables), width), -1, dtype=np.int32)
    for row, table in enumerate(block_tables):
        rows[row, : len(table)] = table
    return rows
