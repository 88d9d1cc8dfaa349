"""LLMEngine: add requests, step, abort.

A step is a chain of objects, each built once by its owner (protocols.py): the
scheduler's ScheduledBatch (with a verify step's drafts: the speculator's copy of it),
the runner's LaunchedStep, then the StepOutputs built here (step_outputs.py).
"""

from __future__ import annotations

import logging
import threading
import time

from atom import profiling
from atom.config import Config
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.context_length import fit_max_model_len, resolve_max_model_len
from atom.model_engine.distributed_runner import DistributedRunner
from atom.model_engine.failures import (
    RequestFailed,
    client_message,
    describe,
    is_device_fault,
)
from atom.model_engine.model_runner import ModelRunner
from atom.model_engine.protocols import LaunchedStep, StepRunner
from atom.model_engine.sampling.structured_output import GrammarBackend, accept_tokens
from atom.model_engine.scheduler import ScheduledBatch, Scheduler
from atom.model_engine.sequence import PLACEHOLDER_TOKEN, FinishReason, Sequence
from atom.model_engine.speculative.decoder import SpeculativeDecoder, make_decoder
from atom.model_engine.speculative.draft_model import build_draft_runner, draft_kv_block_bytes
from atom.model_engine.state_slots import StateSlots
from atom.model_engine.step_outputs import (
    EngineStats,
    RequestOutput,
    StepOutput,
    request_output,
    step_output,
)
from atom.models.default_model import default_model_path
from atom.models.loader import load_tokenizer, open_model, read_config
from atom.models.registry import model_class
from atom.sampling_params import SamplingParams, check_token_ids

logger = logging.getLogger(__name__)
_BATCH_STAGE = "the step (model forward or sampler)"
_DEVICE_FAULT = "the device failed"


class LLMEngine:
    def __init__(
        self, config: Config | None = None, model_runner: StepRunner | None = None, **kwargs
    ):
        """`model_runner`: one already started (a data-parallel replica's ranks)."""
        self.config = config = config or Config(**kwargs)
        if config.node_rank > 0:
            raise ValueError(
                f"node_rank {config.node_rank} hosts tensor-parallel ranks only; run it with "
                "atom.model_engine.distributed_runner.serve_node (the offline script does)"
            )
        self.model_path = config.model or default_model_path()
        if config.load_format == "dummy":
            source, hf, weights = None, read_config(self.model_path), None
        else:
            source = open_model(self.model_path)
            hf, weights = source.hf_config, source.weights()
        self.hf_config = hf
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(source or open_model(self.model_path))
        self.max_model_len = resolve_max_model_len(config, hf)
        draft_hf = self._draft_hf_config() if config.speculative_method == "draft" else None
        self.model_runner: StepRunner
        if model_runner is not None:
            self.model_runner = model_runner
        elif config.ranks_per_replica > 1:  # spawned ranks load their own weight shards
            self.model_runner = DistributedRunner(config, self.model_path, hf, self.max_model_len)
        else:
            extra = 0
            if draft_hf is not None:
                extra = draft_kv_block_bytes(
                    draft_hf, config.block_size, config.torch_dtype.itemsize
                )
            self.model_runner = ModelRunner(
                config, hf, weights, self.max_model_len, extra_kv_block_bytes=extra
            )
        try:
            self.max_model_len = fit_max_model_len(
                config, self.max_model_len, self.model_runner.num_kvcache_blocks
            )
        except ValueError:
            self.shutdown()
            raise
        # The model's attention family (atom/attention/family.py) says what it supports.
        family = model_class(hf).family(hf)
        num_state_slots = family.num_state_slots(config.max_num_seqs)
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and not family.supports.prefix_caching:
            logger.info(
                "prefix caching is off for %s: its per-sequence state (sliding window, "
                "compressor, recurrent state) is not cached with the blocks",
                getattr(hf, "model_type", "this model"),
            )
            prefix_caching = False
        self.block_manager = BlockManager(
            self.model_runner.num_kvcache_blocks,
            config.block_size,
            prefix_caching,
            StateSlots(num_state_slots) if num_state_slots else None,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self._eos_token_ids(),
        )
        self.speculator: SpeculativeDecoder | None = None
        if config.speculative_method is not None:
            draft_runner = None
            if draft_hf is not None:
                draft_runner = build_draft_runner(
                    config, draft_hf, self.model_runner.num_kvcache_blocks, self.max_model_len
                )
            snapshots = self.model_runner.state_snapshots
            self.speculator = make_decoder(config, self.max_model_len, draft_runner, snapshots)
            self.scheduler.lookahead = self.speculator.lookahead
        self.requests: dict[int, Sequence] = {}
        self.stats = EngineStats()
        self.async_scheduling = config.async_scheduling
        # launched but not yet read
        self._in_flight: tuple[ScheduledBatch, LaunchedStep] | None = None
        self._grammar_backend: GrammarBackend | None = None  # made on first use
        # The server builds it on its compile pool while the engine thread may ask too.
        self._grammar_lock = threading.Lock()
        self._num_structured = 0  # live structured-output requests
        self._num_planned = 0  # live requests whose params need a SamplingPlan
        # Groups of requests of a failed step, each retried in a step of its own until
        # the request that makes the step fail is alone (failures.py); empty: normal steps.
        self._suspects: list[list[Sequence]] = []

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any) and free the rendezvous port."""
        self.model_runner.shutdown()

    # -- speculative decoding (atom/model_engine/speculative) -------------------------------
    def _draft_hf_config(self):
        path = self.config.speculative_model
        draft_hf = read_config(path)
        if draft_hf.vocab_size != self.hf_config.vocab_size:
            raise ValueError(
                f"the draft model {path} has a vocabulary of {draft_hf.vocab_size} tokens, "
                f"the target {self.hf_config.vocab_size}: speculation needs the same vocabulary"
            )
        family = model_class(draft_hf).family(draft_hf)
        if not family.supports.draft_model:
            # The draft's KV shares the target's block ids and is rolled back by position
            # (draft_model.py): per-sequence state or a latent cache would need their own.
            raise ValueError(
                f"speculative_model {path} is a {getattr(draft_hf, 'model_type', family.name)} "
                f"model (attention backend {family.name!r}); speculative_method='draft' needs a "
                "draft of the Llama family (Llama, Qwen2: paged multi-head attention). "
                "DeepSeek and Qwen3-Next models can be the target, not the draft"
            )
        if getattr(draft_hf, "max_position_embeddings", self.max_model_len) < self.max_model_len:
            raise ValueError(
                f"the draft model {path} serves {draft_hf.max_position_embeddings} positions, "
                f"fewer than max_model_len {self.max_model_len}; lower --max-model-len"
            )
        return draft_hf

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine runs without a tokenizer: pass token ids, not text")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> int:
        """Validate and queue a request; returns its id. Raises ValueError on bad input."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        token_ids = self.tokenize(prompt)
        if not token_ids or (isinstance(prompt, str) and not prompt):
            raise ValueError("prompt is empty")
        check_token_ids("prompt", token_ids, self.hf_config.vocab_size)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than max_model_len - 1 "
                f"({self.max_model_len - 1}) leaves room to generate"
            )
        blocks = self.block_manager.blocks_for(len(token_ids) + 1)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt needs {blocks} KV blocks but the cache has {self.block_manager.num_blocks}"
            )
        params = self._engine_params(params)
        seq = Sequence(token_ids, params, prompt if isinstance(prompt, str) else None)
        if params.structured:
            backend = self.grammar_backend()
            compiled = params.compiled_grammar or backend.compile(params)
            seq.grammar = backend.matcher(compiled)
            self._num_structured += 1
        self._num_planned += params.needs_sampling_plan
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        self.stats.requests += 1
        return seq.seq_id

    def _engine_params(self, params: SamplingParams) -> SamplingParams:
        """Checks of options the engine itself serves; fills `all_stop_token_ids`."""
        if params.n != 1:
            raise ValueError(
                "the engine takes one sample per request: add n requests with "
                "SamplingParams.for_sample(i) (LLM.generate and the server do)"
            )
        if params.needs_sampling_plan and (
            self.speculator is not None or self.config.pipeline_parallel_size > 1
        ):
            raise ValueError(
                "logprobs, prompt_logprobs, structured output, penalties, logit_bias "
                "and min_tokens are not supported with speculative decoding or "
                "pipeline parallelism yet"
            )
        extras = params.logprobs is not None or params.prompt_logprobs is not None
        if isinstance(self.model_runner, DistributedRunner) and (extras or params.structured):
            raise ValueError(
                "logprobs, prompt_logprobs and structured output are not supported with "
                "tensor, pipeline or data parallelism yet"
            )
        if params.structured and self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        params.check_token_ids(self.hf_config.vocab_size)
        if params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= self.scheduler.eos_token_ids
            params.all_stop_token_ids = sorted(stops)
        return params

    def grammar_backend(self) -> GrammarBackend:
        """The xgrammar compiler over this engine's tokenizer (compiles are cached, the
        cache bounded by ATOM_GRAMMAR_CACHE_MB). Made once, under a lock: two first
        callers on two threads share one."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer")
                self._grammar_backend = GrammarBackend(
                    self.tokenizer,
                    self.hf_config.vocab_size,
                    self.scheduler.eos_token_ids,
                    cache_limit_bytes=self.config.grammar_cache_bytes,
                )
            return self._grammar_backend

    def abort(self, seq_id: int) -> bool:
        """Stop a request and free its blocks; False if it was unknown or already done."""
        seq = self.requests.pop(seq_id, None)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._release(seq)
        return True

    def _release(self, seq: Sequence) -> None:
        """A finished or aborted request gives back what it holds besides KV blocks."""
        self._num_planned -= seq.sampling_params.needs_sampling_plan
        if seq.grammar is not None:
            seq.grammar = None
            self._num_structured -= 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule and launch one step; return what the step before it produced.

        With asynchronous scheduling (CUDA default) step N+1 is scheduled and launched
        before step N's tokens are read, so the host works while the device computes;
        otherwise each step completes before `step` returns.

        A failure is contained (atom/model_engine/failures.py): the requests it is traced
        to finish with reason "error" (their StepOutput carries the message) and the
        others go on. Only a device fault, or an error in the engine's own bookkeeping
        (scheduler, block manager), is raised.
        """
        start = time.perf_counter()
        outputs = []
        speculator = self.speculator
        if self._in_flight is not None and speculator is not None:
            if speculator.needs_tokens(self._in_flight[0]):  # proposals need them now
                outputs = self._complete_in_flight()
        if self._in_flight is not None and (self._num_structured or self._suspects):
            # A grammar's next mask needs the token in flight: no overlap for now. While
            # failed requests are isolated, every step completes before the next.
            outputs += self._complete_in_flight()
        only = self._suspect_group()
        with profiling.stage("schedule"):
            batch = self.scheduler.schedule(only, needs_sampling_plan=self._num_planned > 0)
        if only is not None and batch is None:
            self._suspects.pop(0)  # none of them can run now: they rejoin the others
        launched = None
        if batch is not None:
            now = time.monotonic()
            for seq in batch.grown or ():  # newly admitted sequences are among them
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
            try:
                if self.speculator is not None:
                    with profiling.stage("propose"):
                        batch = self.speculator.propose(batch)  # with its drafts
                launched = (batch, self.model_runner.launch(batch))
            except Exception as error:  # noqa: BLE001 - contained below, or raised
                return outputs + self._launch_failed(batch, error, only is not None)
            self.scheduler.on_launch(batch)
        # a verify step completes at once: the next step's proposals need its tokens
        keep_in_flight = (
            launched is not None
            and self.async_scheduling
            and batch.draft_token_ids is None
            and not self._suspects
        )
        in_flight, self._in_flight = self._in_flight, None  # not left set if it raises
        if in_flight is not None:
            completed, read = self._complete_or_fail(in_flight, launched)
            outputs += completed
            if not read:
                launched = None  # its requests failed with the step it depended on
        if launched is not None and not keep_in_flight:
            outputs += self._complete_or_fail(launched)[0]
            if only is not None:
                self._suspects.pop(0)  # the group ran without failing: acquitted
        if launched is not None:
            if keep_in_flight:
                self._in_flight = launched
            self.stats.record(batch, time.perf_counter() - start)
        return outputs

    def _complete_in_flight(self) -> list[StepOutput]:
        in_flight, self._in_flight = self._in_flight, None
        return self._complete_or_fail(in_flight)[0]

    def _complete_or_fail(self, step, later=None) -> tuple[list[StepOutput], bool]:
        """Read `step`'s tokens: (outputs, True). If that fails (not a device fault), the
        step's tokens are lost: its requests fail, and so do those of `later` (the step
        launched after it, whose inputs come from them), neither retried: (outputs, False)."""
        try:
            return self._complete(*step), True
        except Exception as error:
            if is_device_fault(error):
                self._fail([step[0]] + ([later[0]] if later else []), _DEVICE_FAULT)
                raise
            logger.exception("reading a step's tokens failed; failing its requests")
            batches = [step[0]] + ([later[0]] if later else [])
            return self._fail(batches, client_message("reading the step's tokens", error)), False

    def _launch_failed(self, batch, error: Exception, isolating: bool) -> list[StepOutput]:
        """The launch of `batch` raised (nothing of it was counted as computed): fail the
        requests it is traced to; the others run again from where they were.
        `isolating`: `batch` was the first group of `_suspects`."""
        if is_device_fault(error):
            self._fail([batch] + ([self._in_flight[0]] if self._in_flight else []), _DEVICE_FAULT)  # fmt: skip
            raise error
        outputs = []
        if self._in_flight is not None:  # the step before: its tokens are good
            outputs = self._complete_in_flight()
        # A half-launched step may have assigned or counted sampling-state rows: rebuilt.
        state = self.model_runner.sampling_state
        if state is not None:
            state.release(s.seq_id for s in batch.seqs)
        live = [s for s in batch.seqs if not s.is_finished]
        if isolating:
            self._suspects.pop(0)  # the group being isolated failed: split below
        if isinstance(error, RequestFailed):
            culprits = [s for s in live if s.seq_id in set(error.seq_ids)]
            return outputs + self._fail_seqs(culprits, client_message(error.stage, error.cause))
        if len(live) <= 1 or not self._can_isolate():
            logger.error("a step failed; failing its %d request(s)", len(live), exc_info=error)
            return outputs + self._fail_seqs(live, client_message(_BATCH_STAGE, error))
        # Batch-wide (the forward, the sampler): retry the requests in halves, each step
        # alone, until the one that makes the step fail is alone (then it fails).
        logger.warning(
            "a step of %d requests failed (%s); isolating the request it is traced to",
            len(live),
            describe(error),
            exc_info=error,
        )
        half = len(live) // 2
        self._suspects[:0] = [live[:half], live[half:]]
        return outputs

    def _can_isolate(self) -> bool:
        """Whether a failed step may be retried in parts: one process (no ranks that went
        ahead with the step), no speculative state that the step advanced, and no
        per-sequence state (a recurrent state, a window ring) that a half-run forward may
        have advanced; paged KV is rewritten in place by the retry."""
        return (
            self.speculator is None
            and not isinstance(self.model_runner, DistributedRunner)
            and self.block_manager.state_slots is None
        )

    def _suspect_group(self) -> set[Sequence] | None:
        """The running requests of the group being isolated, or None (a normal step)."""
        while self._suspects:
            group = {s for s in self._suspects[0] if not s.is_finished}
            if group:
                return group
            self._suspects.pop(0)
        return None

    def _fail(self, batches, message: str) -> list[StepOutput]:
        """Finish every live request of `batches` with reason "error"."""
        seqs = {id(s): s for batch in batches for s in batch.seqs if not s.is_finished}
        return self._fail_seqs(list(seqs.values()), message)

    def _fail_seqs(self, seqs, message: str) -> list[StepOutput]:
        """Finish `seqs` with reason "error": their blocks, state slot, sampling-state row
        and grammar are freed, the placeholders of tokens that will never arrive dropped.
        Returns their last StepOutputs (no tokens; `error` says why)."""
        outputs = []
        for seq in seqs:
            if seq.is_finished:
                continue
            while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
                seq.token_ids.pop()
            seq.pending_token = None
            self.scheduler.finish(seq, FinishReason.ERROR)
            self.requests.pop(seq.seq_id, None)
            self._release(seq)
            logger.warning("request %d failed: %s", seq.seq_id, message)
            outputs.append(
                StepOutput(seq.seq_id, [], True, FinishReason.ERROR.value, error=message)
            )
        state = self.model_runner.sampling_state
        if state is not None and outputs:
            state.release(o.seq_id for o in outputs)
        return outputs

    def _complete(self, batch: ScheduledBatch, handle: LaunchedStep) -> list[StepOutput]:
        tokens = handle.result()
        if batch.draft_token_ids is not None:  # rows of a verify step: accept, roll back
            tokens = self.speculator.on_verified(batch, tokens)
        # Log-probabilities, grammars: refused with speculation (_engine_params), so a
        # verify step has neither and `tokens` is one per sampled row below.
        step_logprobs = handle.logprobs()
        sampled_logprobs = {}
        if step_logprobs is not None:
            for seq, first, entries in step_logprobs.prompt_entries():
                if seq.prompt_logprobs is not None:  # a preempted prompt may come again
                    seq.prompt_logprobs.update(enumerate(entries, start=first))
            rows = step_logprobs.sampled(tokens)
            sampled_logprobs = {id(batch.sampled[row][0]): lp for row, lp in rows.items()}
        failed = []
        if self._num_structured:
            live = [(s, t) for (s, _), t in zip(batch.sampled, tokens, strict=True)]
            refused, failure = accept_tokens([(s, t) for s, t in live if not s.is_finished])
            for seq in refused:
                logger.warning("request %d: the grammar refused token", seq.seq_id)
            if failure is not None:  # its matcher raised: that request fails, not the step
                ids = set(failure.seq_ids)
                message = client_message(failure.stage, failure.cause)
                failed = self._fail_seqs([s for s, _ in live if s.seq_id in ids], message)
        outputs = failed
        for seq, new in self.scheduler.on_complete(batch, tokens):
            if seq.is_finished:
                self.requests.pop(seq.seq_id, None)
                self._release(seq)
            self.stats.generated_tokens += len(new)
            logprob = sampled_logprobs[id(seq)] if seq.logprobs is not None else None
            outputs.append(step_output(seq, new, logprob))
        return outputs

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def output_of(self, seq: Sequence) -> RequestOutput:
        return request_output(seq, self.decode(seq.output_token_ids))
