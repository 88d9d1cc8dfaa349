"""ModelRunner: builds the model and its KV cache, and runs one scheduled step.

It owns the RunnerSlots (one per pipeline stage / two-batch-overlap micro-batch:
`Config.num_micro_batches` = 1 or 2; each slot has its own buffers, publisher and page
table) and, on CUDA, the decode CUDA graphs captured on each slot's fixed buffers.

Under tensor parallelism every rank runs the same ModelRunner step on its shard of the
model (built with the rank's TensorParallelGroup); rank 0 alone samples. Without a group
(a caller building a ModelRunner directly) it is a single process: no store, no
process group.

Under pipeline parallelism (a PipelineGroup) the ModelRunner of each stage holds only
that stage's layers and KV cache, and its own runner slots (one per micro-batch, each
with its own buffers, publisher and page table). A step is split into micro-batches;
each stage runs them one after the other, receiving a micro-batch's activations from the
previous stage and sending its own on at once (atom/distributed/pipeline_parallel.py),
so stage s works on micro-batch k while stage s + 1 works on k - 1. The last stage
samples and sends the tokens back to the first, whose rank 0 answers the engine.
"""

from __future__ import annotations

import logging

import torch

from atom import envs, profiling
from atom.attention.family import kv_cache_torch_dtype
from atom.config import Config
from atom.distributed import PipelineGroup, TensorParallelGroup
from atom.forward_context import AttentionMetadata, forward_context
from atom.fusions import Fusions
from atom.kernels import gemv_policy
from atom.kernels.decode_kv_rows import DecodeKVRows
from atom.kernels.scatter import fill_placeholders, fill_placeholders_reference
from atom.model_engine import state_slots
from atom.model_engine.cpu_heap import keep_freed_memory_in_heap
from atom.model_engine.cpu_threads import set_cpu_threads
from atom.model_engine.cuda_graphs import DecodeGraphs, default_batch_sizes
from atom.model_engine.runner_slot import RunnerSlot
from atom.model_engine.sampling.logprobs import merge_step_logprobs
from atom.model_engine.sampling.sampler import ARGMAX_MAX_ROWS, Sampler
from atom.model_engine.sampling.state import SamplingState
from atom.model_engine.scheduler import ScheduledBatch, split_batch
from atom.model_engine.speculative.state_rollback import StateSnapshots, uses_state_snapshots
from atom.model_engine.speculative.verify import fill_device_drafts, verify_rows
from atom.model_engine.speculative.verify_graphs import VerifyGraphs
from atom.model_engine.step_handle import HostTokenPool, StepHandle
from atom.models.dummy_weights import random_init
from atom.models.parallel_layers import pack_cpu_weights
from atom.models.registry import model_class

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: Config,
        hf_config,
        weights,
        max_model_len: int,
        tp: TensorParallelGroup | None = None,
        extra_kv_block_bytes: int = 0,
        pp: PipelineGroup | None = None,
    ):
        self.config = config
        gemv_policy.configure(config.gemv_policy, config.cache_dir, config.gemv_trial_budget_s)
        # Bytes per block of a cache that shares these block ids (a speculative draft
        # model's): the budget is split so that both caches hold the same blocks.
        self.extra_kv_block_bytes = extra_kv_block_bytes
        self.tp = tp or TensorParallelGroup.single(config.device)
        self.pp = pp  # None: the whole model in this process (or its TP group)
        self.hf_config = hf_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cpu" and tp is None and pp is None:
            set_cpu_threads(
                config.cpu_threads
            )  # a single process: ranks share the cores on their own
        torch.manual_seed(config.seed)

        # The model's attention family (atom/attention/family.py): its KV cache, its
        # per-sequence state, its slots' backends, what it supports. Asked, never sniffed.
        self.family = model_class(hf_config).family(hf_config)
        self.model = self._build_model(weights)
        if self.device.type == "cpu" and config.cpu_linear == "packed":
            pack_cpu_weights(self.model)  # oneDNN's layout, once (atom/kernels/cpu_linear.py)
        if self.device.type == "cpu" and envs.cpu_malloc() == "heap":
            keep_freed_memory_in_heap()  # no page faults per step (atom/model_engine/cpu_heap.py)
        # Per-sequence state rows (the family's state contract: V4's window rings and
        # compressor rows, GDN's conv and delta-rule states...), one per running sequence;
        # the BlockManager hands them out (atom/model_engine/state_slots.py).
        self.num_state_slots = self.family.num_state_slots(config.max_num_seqs)
        # Speculative decoding: the family's declaration; with a state-snapshot rollback
        # the state rows get backup rows (state_rollback.py).
        self.speculation = self.family.speculation
        self.snapshot_state = uses_state_snapshots(config, self.speculation, self.num_state_slots)
        self.state_snapshots: StateSnapshots | None = None
        self.sampler = Sampler(greedy_argmax=config.fusions.greedy_argmax)
        # Penalties, logit_bias, min_tokens state of running requests, shared by the slots.
        self.sampling_state = SamplingState(config.max_num_seqs, hf_config.vocab_size, self.device)
        max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.slots = [
            RunnerSlot(
                index=index,
                max_num_seqs=config.max_num_seqs,
                max_num_tokens=config.max_num_batched_tokens,
                max_blocks_per_seq=max_blocks_per_seq,
                block_size=self.block_size,
                vocab_size=hf_config.vocab_size,
                device=self.device,
                h2d_backend=config.h2d_backend,
                h2d_checked=config.h2d_checked,
                backend=self.family.backend(),
                max_sampling_rows=verify_rows_per_step(config),
                sampling_state=self.sampling_state,
            )
            for index in range(self._num_slots())
        ]
        # CPU decode attention's K / V rows of each slot's batch, kept across decode steps
        # instead of gathered at every layer (atom/kernels/decode_kv_rows.py)
        self.cpu_decode_rows = [
            DecodeKVRows() if self.device.type == "cpu" else None for _ in self.slots
        ]
        self.graph_greedy = self._graphs_hold_greedy_tokens()
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self._last_sampled: torch.Tensor | None = None  # source of placeholder fix-ups
        # pinned memory and events the steps' tokens come back through (reused)
        self._host_tokens = HostTokenPool(self.device) if self.device.type == "cuda" else None
        self.graphs: list[DecodeGraphs] | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            sizes = config.cuda_graph_batch_sizes or default_batch_sizes(config.max_num_seqs)
            sizes = [s for s in sizes if s <= config.max_num_seqs]
            # the batch-1 graph's warm-up forward decides the GEMV policy's sites
            gemv_policy.current_policy().start_engine()
            self.graphs = [self._decode_graphs(slot, sizes) for slot in self.slots]
            for graphs in self.graphs:
                graphs.capture()
            logger.info("GEMV policy: %s", gemv_policy.current_policy().summary())
        self.verify_graphs: list[VerifyGraphs] | None = None
        # (a family whose multi-token steps read the host has none: it verifies eagerly)
        multi_token_rows = self._multi_token_graph_rows()
        if self.graphs is not None and self.speculation.verify_graphs and multi_token_rows:
            self.verify_graphs = self._capture_verify_graphs(sizes, multi_token_rows)
        self.eager_forwards = 0  # forwards run outside CUDA graphs (tests, benchmarks)

    # -- what a subclass (the draft runner, speculative/draft_runner.py) decides ------------
    def _num_slots(self) -> int:
        """Runner slots: one per micro-batch."""
        return self.config.num_micro_batches

    def _graphs_hold_greedy_tokens(self) -> bool:
        """Whether the decode graphs may hold their greedy tokens (_decode_graphs): only
        where no step's tokens are read after the next replay of its graph; not with
        speculation, whose draft launches keep their device tokens until the verify step."""
        return self.config.speculative_method is None

    def _multi_token_graph_rows(self) -> int | None:
        """Tokens per sequence of the multi-token CUDA graphs (verify_graphs.py): k + 1 for
        a speculating target's verify steps; None: no such graphs."""
        if self.config.speculative_method is None:
            return None
        return self.config.num_speculative_tokens + 1

    def _replays_short_steps(self) -> bool:
        """Whether steps without drafts may replay the multi-token graphs: a target whose
        rejected drafts roll back by state snapshot recomputes the kept tokens in them."""
        return self.snapshot_state

    def set_fusions(self, fusions: Fusions) -> None:
        """Switch the fused kernels (atom/fusions.py) of this runner: the sampler's argmax
        and the decode CUDA graphs, captured again. For A/B benchmarks in one process
        (benchmarks/decode_profile.py); call it while no request is running."""
        self.config.fusions = fusions
        self.sampler = Sampler(greedy_argmax=fusions.greedy_argmax)
        if self.verify_graphs is not None:
            raise NotImplementedError("set_fusions with speculative decoding's verify graphs")
        if self.graphs is not None:
            sizes = self.graphs[0].batch_sizes
            self.graphs = None  # the old graphs and their memory pool go first
            torch.cuda.synchronize()
            self.graphs = [self._decode_graphs(slot, sizes) for slot in self.slots]
            for graphs in self.graphs:
                graphs.capture()

    def _decode_graphs(self, slot: RunnerSlot, sizes: list[int]) -> DecodeGraphs:
        """A slot's decode graphs; with `graph_greedy` those of <= ARGMAX_MAX_ROWS rows hold
        the greedy tokens too (the sampler's argmax captured after the LM head)."""
        if not self.graph_greedy:
            return DecodeGraphs(self.model, slot, sizes, self.config.fusions)
        return DecodeGraphs(
            self.model, slot, sizes, self.config.fusions, self.sampler.argmax, ARGMAX_MAX_ROWS
        )

    def shutdown(self) -> None:
        """Nothing to stop: a local runner starts no process (StepRunner)."""

    def h2d_totals(self) -> tuple[int, int]:
        """Cumulative host-to-device copies and bytes of step metadata over the slots."""
        publishers = [slot.publisher for slot in self.slots]
        return sum(p.copies for p in publishers), sum(p.bytes for p in publishers)

    # -- set-up ----------------------------------------------------------------------------
    def _capture_verify_graphs(self, sizes: list[int], rows: int) -> list[VerifyGraphs]:
        """Speculative decoding: graphs of steps of up to `rows` tokens per sequence (the
        target's verify steps: k + 1; the draft's catch-up steps: 2)."""
        tokens = max(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        sizes = [s for s in sizes if s * rows <= tokens and s <= 64]
        graphs = []
        for slot in self.slots:
            verify = VerifyGraphs(self.model, slot, sizes, rows, self.config.fusions)
            verify.capture()
            graphs.append(verify)
        return graphs

    def _build_model(self, weights) -> torch.nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                cls = model_class(self.hf_config)
                stage = {} if self.pp is None else {"pp": self.pp}
                model = cls(self.hf_config, self.max_model_len, self.tp, **stage)
        finally:
            torch.set_default_dtype(previous)
        with torch.no_grad():
            if weights is None:
                random_init(model)
            else:
                model.load_weights(weights)
        return model.eval()

    def kv_block_bytes(self) -> int:
        return self.family.kv_block_bytes(self.model, self.block_size, self._kv_cache_dtype())

    def _kv_cache_dtype(self) -> torch.dtype:
        return kv_cache_torch_dtype(self.config.kv_cache_dtype, self.dtype)

    def _allocate_kv_cache(self) -> int:
        block_bytes = self.kv_block_bytes() + self.extra_kv_block_bytes
        cache_dtype = self._kv_cache_dtype()
        contract = []
        if self.num_state_slots:
            contract = self.family.state_contract(self.model, cache_dtype)
        state_bytes = state_slots.state_bytes(contract, self.num_state_slots)
        if self.snapshot_state:  # one backup row per slot (no scratch row)
            state_bytes += state_bytes // (self.num_state_slots + 1) * self.num_state_slots
        if self.config.num_kvcache_blocks is not None:
            num_blocks = self.config.num_kvcache_blocks
        elif self.device.type == "cuda":
            reserved = state_bytes + self.sampling_state.device_bytes()
            num_blocks = self._blocks_from_free_memory(block_bytes, reserved=reserved)
        else:
            num_blocks = (self.config.kv_cache_memory_bytes - state_bytes) // block_bytes
        # Every rank (of every pipeline stage) must hold the same blocks.
        num_blocks = (self.pp or self.tp).min_across(num_blocks)
        if num_blocks < 1:
            raise RuntimeError(
                f"no room for a single KV block ({block_bytes} bytes); raise "
                "--gpu-memory-utilization or the CPU KV budget, or lower --max-num-batched-tokens"
            )
        self.kv_cache = self.family.allocate_kv_cache(
            self.model, num_blocks, self.block_size, cache_dtype, self.device
        )
        # Every per-sequence state tensor, laid out by the one allocator.
        self.state = state_slots.allocate_state(contract, self.num_state_slots, self.device)
        if self.snapshot_state:
            self.state_snapshots = StateSnapshots(self.state, self.num_state_slots)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s (%.2f GiB)",
            num_blocks,
            self.block_size,
            self.config.kv_cache_dtype,
            num_blocks * block_bytes / 2**30,
        )
        return num_blocks

    @torch.inference_mode()
    def _blocks_from_free_memory(self, block_bytes: int, reserved: int = 0) -> int:
        """Size the cache from what is left after a peak-sized forward (profiling run)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        dense = AttentionMetadata(None, None, None, None, num_tokens, False)
        with forward_context(dense, self.config.fusions):
            hidden = self.model(input_ids, positions)
        self.model.compute_logits(hidden[: self.config.max_num_seqs])
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        activations = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = total * self.config.gpu_memory_utilization - used - activations - reserved
        del hidden
        torch.cuda.empty_cache()
        return max(0, int(budget // block_bytes))

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Queue the forward and sampling of `batch`; the tokens arrive through the handle.

        Nothing here waits for the device except the producer check on the slot's staging
        memory (its previous copies ran long ago in practice), so the host can schedule
        the next step while this one runs. With two micro-batches the batch is split in
        two halves, each run on its own slot; their tokens are joined in batch order.
        """
        previous = self._last_sampled
        self.sampling_state.begin_step(batch.seqs)
        parts = split_batch(batch, len(self.slots))
        if self.pp is not None:
            return self._launch_stage(batch, parts, previous)
        results = [self._launch_part(index, part, previous) for index, part in enumerate(parts)]
        return self._handle(results)

    def _handle(self, results) -> StepHandle:
        """The step's handle from each micro-batch's (tokens, logprobs), in batch order."""
        logprobs, offset = [], 0
        for part_tokens, part_logprobs in results:
            logprobs.append((part_logprobs, offset))
            offset += 0 if part_tokens is None else len(part_tokens)
        logprobs = merge_step_logprobs(logprobs)
        tokens = [t for t, _ in results if t is not None]
        if not tokens:
            return StepHandle(None, None, logprobs)
        sampled = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
        if self.tp.world_size > 1:
            if not self.config.async_scheduling and not self.tp.is_first:
                return StepHandle(None, None)  # rank 0 alone answers the engine
            sampled = self._share_sampled(sampled)
        self._last_sampled = sampled
        return StepHandle.of(sampled, logprobs, self._host_tokens)

    @property
    def answers_engine(self) -> bool:
        """The one rank that sends each step's tokens to the engine."""
        return self.tp.is_first and (self.pp is None or self.pp.is_first)

    def _launch_stage(self, batch: ScheduledBatch, parts, previous) -> StepHandle:
        """This pipeline stage's share of a step: every micro-batch in turn (see the
        module docstring). Returns the step's tokens on the first stage, none elsewhere."""
        pp = self.pp
        # (tokens, logprobs) per micro-batch; logprobs are refused under pipeline
        # parallelism (LLMEngine._engine_params), so only the tokens matter here.
        results = [self._launch_part(index, part, previous) for index, part in enumerate(parts)]
        tokens = [t for t, _ in results]
        num_sampled = sum(batch.samples(i) for i in range(len(batch.seqs)))
        # Sampled tokens reach the first stage: its rank 0 answers the engine, and with
        # asynchronous scheduling every rank of it fills placeholders from them.
        shared = self.config.async_scheduling or self.tp.is_first
        sampled = None
        if pp.is_last and num_sampled:
            tokens = [t for t in tokens if t is not None]
            sampled = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
            if self.tp.world_size > 1:
                sampled = self._share_sampled(sampled)
            if shared and not pp.is_first:
                pp.send_tokens_to_first(sampled)
        pp.wait_sends()
        if pp.is_first and num_sampled and shared and not pp.is_last:
            sampled = pp.recv_tokens_from_last(num_sampled)
        if sampled is None or (not self.answers_engine and not self.config.async_scheduling):
            return StepHandle(None, None)
        self._last_sampled = sampled
        return StepHandle.of(sampled, pool=self._host_tokens)

    def _forward(self, input_ids, positions, num_tokens: int) -> torch.Tensor | None:
        """The model's hidden states; under pipeline parallelism this stage's layers, fed
        by the previous stage and sent on to the next (None on a stage that is not last)."""
        pp = self.pp
        if pp is None:
            return self.model(input_ids, positions)
        intermediate = None
        if not pp.is_first:
            hidden_size = self.hf_config.hidden_size
            intermediate = pp.recv_activations(num_tokens, hidden_size, self.dtype)
        out = self.model(input_ids, positions, intermediate)
        if pp.is_last:
            return out
        pp.send_activations(*out)
        return None

    def _share_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled tokens on every rank (tensor parallelism, asynchronous
        scheduling: the next step may fill input ids from them on the device).

        Without asynchronous scheduling sampled tokens reach the other ranks as plain
        token ids in the next step's message, and rank 0 keeps them to itself.
        """
        if not self.config.async_scheduling:
            return tokens
        return self.tp.broadcast_from_first(tokens)

    def _launch_part(self, index: int, batch: ScheduledBatch, previous):
        """(sampled tokens or None, StepLogprobs or None) of one micro-batch."""
        slot = self.slots[index]
        graphs = self.graphs[index] if self.graphs else None
        graph_size = (
            graphs.padded_size(len(batch.seqs)) if (graphs and batch.is_decode_only) else None
        )
        with profiling.stage("prepare"):
            slot.wait_for_transfers()
            step = slot.prepare(batch, padded_seqs=graph_size)
        # Published and flushed before any consumer kernel is queued.
        inputs = slot.publish(step)
        input_ids = inputs.input_ids
        drafts = inputs.draft_token_ids  # speculative steps only
        # Log-probabilities, grammars, penalties...: None unless a request asks for them.
        plan = inputs.sampling_plan
        prompt = None

        verify_size = self._verify_graph_size(index, batch, step, plan)
        with profiling.stage("forward"):
            if inputs.placeholders is not None and (self.pp is None or self.pp.is_first):
                dst, src = inputs.placeholders
                if dst is None:  # in place: input_ids[:n] = previous[:n], one device copy
                    assert previous.dim() == 1, "one token per sampled row"
                    n = step.num_placeholders
                    input_ids[:n].copy_(previous[:n])
                elif input_ids.is_cuda:  # one kernel: input_ids[dst] = previous[src]
                    fill_placeholders(input_ids, dst, src, previous)
                else:
                    fill_placeholders_reference(input_ids, dst, src, previous)
            if batch.device_drafts is not None:
                fill_device_drafts(input_ids, drafts, batch.device_drafts, step.num_seqs)
            greedy_tokens = None
            if graph_size is not None:
                assert plan is None or not plan.has_prompt_logprobs, "prompt logprobs in a graph"
                logits = graphs.run(graph_size, step.num_seqs)
                greedy_tokens = graphs.greedy_tokens(graph_size, step.num_seqs)
            elif verify_size is not None:
                logits = self.verify_graphs[index].run(
                    verify_size, step.num_seqs, step.num_tokens, inputs.logits_indices
                )
            else:
                self.eager_forwards += 1
                decode_rows = self.cpu_decode_rows[index]
                with forward_context(inputs.metadata, self.config.fusions, decode_rows):
                    hidden = self._forward(input_ids, inputs.positions, step.num_tokens)
                if hidden is None:  # a pipeline stage that is not the last
                    return None, None
                if plan is not None:
                    prompt = plan.prompt_logprobs(self.model, hidden)
                if not step.sampling_seqs:
                    return None, None if plan is None else plan.step_logprobs(None, prompt)
                if inputs.logits_indices is not None:
                    hidden = hidden[inputs.logits_indices]
                with forward_context(inputs.metadata, self.config.fusions):  # the LM head's GEMV
                    logits = self.model.compute_logits(hidden)
        with profiling.stage("sample"):
            if logits is None:  # a tensor-parallel rank > 0: rows that rank 0 will fill
                rows = len(step.sampling_seqs)
                return torch.empty(rows, dtype=torch.int64, device=self.device), None
            if drafts is not None:  # [2, rows]: emitted token and acceptance of each row
                verified = verify_rows(logits, inputs.sampling, drafts)
                if batch.device_drafts is not None:  # [3, rows]: and the drafts, for the host
                    verified = torch.cat((verified, drafts.unsqueeze(0)))
                return verified, None
            if plan is None:
                if greedy_tokens is not None and inputs.sampling.all_greedy:
                    return greedy_tokens, None  # the graph's own argmax
                return self.sampler(logits, inputs.sampling), None
            return plan.sample(self.sampler, logits, inputs.sampling, prompt)

    def _verify_graph_size(self, index: int, batch: ScheduledBatch, step, plan) -> int | None:
        """The multi-token graph size a step replays at, or None (eager): a verify step
        (target), a catch-up step (draft runner) or, where rejected drafts roll back by
        state snapshot, a recompute step (target: the kept tokens and the bonus token)
        whose sequences have at most the graph's tokens each, and that samples."""
        if self.verify_graphs is None or batch.is_decode_only or not step.sampling_seqs:
            return None
        short_steps = self._replays_short_steps()
        if plan is not None or (batch.draft_token_ids is None and not short_steps):
            return None
        return self.verify_graphs[index].fits(step.num_seqs, step.max_seqlen_q)


def verify_rows_per_step(config: Config) -> int | None:
    """Logits rows a step may sample with speculative decoding (None: one per sequence)."""
    if config.speculative_method is None:
        return None
    return config.max_num_seqs * (config.num_speculative_tokens + 1)
