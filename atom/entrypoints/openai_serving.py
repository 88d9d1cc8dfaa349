"""The two generation endpoints: /v1/completions and /v1/chat/completions.

A request is checked in full (model, prompt length, sampling values) before anything
reaches the engine, so a refused request never holds a KV block. Responses are either
one JSON body or Server-Sent Events (`data: {chunk}` lines, then `data: [DONE]`).

Tokenization and chat templating run on worker threads, not on the event loop: a
megabytes-long prompt takes seconds to tokenize, and /health and every open stream
must keep answering meanwhile. A request's prompts join the engine in one command, up
to its share of the engine; the rest follow as its earlier samples finish (sample_runs.py:
admission, merged deltas, collected answers and event streams).

What one request may ask is bounded (request_limits.py: prompts, prompts x n, samples
queued server-wide, json_schema size, depth and counts, compile time), and a client that
leaves while its request is still being prepared or admitted aborts it at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from atom.entrypoints.async_engine import (
    AsyncEngine,
)
from atom.entrypoints.chat_output import ChatFormat
from atom.entrypoints.generation import special_marker_ids
from atom.entrypoints.grammar_compile import GrammarCompilePool
from atom.entrypoints.logprobs_format import CompletionLogprobs, TokenTexts, chat_logprobs
from atom.entrypoints.metrics import RequestMetrics
from atom.entrypoints.openai_errors import NOT_FOUND, OpenAIError
from atom.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from atom.entrypoints.reasoning import prompt_opens_reasoning
from atom.entrypoints.request_limits import AdmissionBudget, Reservation, ServerLimits
from atom.entrypoints.sample_runs import (
    SampleRuns,
    Usage,
    sse,
    unless_disconnected,
)
from atom.model_engine.grammar_limits import check_schema
from atom.model_engine.sampling.structured_output import InvalidGrammarError
from atom.sampling_params import SamplingParamError, SamplingParams, check_token_ids

logger = logging.getLogger(__name__)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        metrics: RequestMetrics | None = None,
        limits: ServerLimits | None = None,
    ):
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.admission = AdmissionBudget(self.limits.max_queued_samples)
        # One request's samples in the engine at once (request_limits.py).
        self.samples_in_engine = self.limits.max_samples_in_engine_per_request or max(
            1, engine.engine.config.max_num_seqs
        )
        self.metrics = metrics
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        # The text of one token id never changes: one cache for every request's logprobs.
        self.token_texts = TokenTexts(self.tokenizer)
        self.model_name = model_name
        self.max_model_len = self.llm.max_model_len
        self._tokenizer_threads = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="atom-tokenizer"
        )
        # Tool calls and reasoning in chat answers (chat_output.py); create_app sets the
        # server's --tool-call-parser / --reasoning-parser.
        self.chat_format = ChatFormat(self._chat_template())
        grammar = self.limits.grammar
        self.grammar_pool = GrammarCompilePool(grammar.compile_threads, grammar.compile_timeout_s)
        self.runs = SampleRuns(engine, self.tokenizer, self.samples_in_engine, metrics)

    async def start(self) -> None:
        """Build the grammar backend before serving (a fraction of a second), so neither
        a first structured request nor the engine thread ever builds it."""
        if self.tokenizer is None:
            return
        try:
            await asyncio.wrap_future(self.grammar_pool.submit(self.llm.grammar_backend))
        except Exception:  # noqa: BLE001 - structured requests will report it
            logger.exception("could not build the grammar backend (xgrammar)")

    def close(self) -> None:
        """Drop queued tokenization and compile work (the server is stopping)."""
        self._tokenizer_threads.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.close()

    async def _off_loop(self, function: Callable, *args):
        """`function(*args)` on a tokenizer thread (the Rust tokenizer releases the GIL)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_threads, function, *args)

    # -- /v1/completions -------------------------------------------------------------------
    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        self._check_model(request.model)
        reservation = self._reserve(len(request.prompts), request.n)
        return await self._reserved(
            reservation, request.stream, self._completions(request, raw, reservation)
        )

    async def _reserved(self, reservation: Reservation, stream: bool, respond) -> Response:
        """Await `respond` (the request's handler) holding `reservation`: given back on any
        failure, after a plain answer, or (a stream) when its body ends."""
        try:
            response = await respond
        except BaseException:
            reservation.release()
            raise
        if not stream:
            reservation.release()
        return response

    async def _completions(
        self, request: CompletionRequest, raw: Request, reservation: Reservation
    ) -> Response:
        stop = self._stop_strings(request)
        prompt_ids, _, streams = await unless_disconnected(raw, self._prepare_completion(request))
        echo_only = request.echo and request.max_tokens == 0
        n = request.n
        echoes = [
            self._echo_text(p, ids) if request.echo else ""
            for p, ids in zip(request.prompts, prompt_ids, strict=True)
            for _ in range(n)
        ]
        echo_ids = [ids for ids in prompt_ids for _ in range(n)]
        usage = Usage(sum(len(ids) for ids in prompt_ids))
        head = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name)
        texts = self.token_texts
        k = request.logprobs

        if request.stream:

            async def events() -> AsyncIterator[str]:
                formats = [CompletionLogprobs(texts, k or 0) for _ in streams]
                pending = [bool(e) for e in echoes]  # echo text still to send, per choice
                if k is None:  # without logprobs the echo goes first, as it is
                    for index, echo in enumerate(echoes):
                        if echo:
                            yield sse(_completion_chunk(head, index, echo, None))
                    pending = [False] * len(echoes)
                async for index, delta in self.runs.merged_deltas(streams, stop, usage):
                    text, token_ids, entries = delta.text, delta.token_ids, delta.logprobs
                    if echo_only:
                        text, token_ids, entries = "", [], []
                    if pending[index]:
                        pending[index] = False
                        text = echoes[index] + text
                        token_ids = echo_ids[index] + token_ids
                        entries = list(delta.prompt_logprobs or []) + list(entries or [])
                    logprobs = None
                    if k is not None:
                        logprobs = formats[index].body(token_ids, entries or [])
                    reason = "length" if echo_only and delta.finish_reason else delta.finish_reason
                    yield sse(_completion_chunk(head, index, text, reason, logprobs))
                if request.include_usage:
                    yield sse(
                        {**head, "object": "text_completion", "choices": [], "usage": usage.body()}
                    )

            return self.runs.event_stream(events(), streams, reservation)

        results = await self.runs.collect(streams, stop, usage, raw)
        choices = []
        for index, result in enumerate(results):
            text, token_ids, entries = result.text, result.token_ids, result.logprobs
            if echo_only:
                text, token_ids, entries, result.finish_reason = "", [], [], "length"
            logprobs = None
            if k is not None:
                if request.echo:
                    token_ids = echo_ids[index] + token_ids
                    entries = list(result.prompt_logprobs or []) + entries
                logprobs = CompletionLogprobs(texts, k).body(token_ids, entries)
            choices.append(
                {
                    "index": index,
                    "text": echoes[index] + text,
                    "logprobs": logprobs,
                    "finish_reason": result.finish_reason,
                }
            )
        return JSONResponse(
            {**head, "object": "text_completion", "choices": choices, "usage": usage.body()}
        )

    # -- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(request.model)
        if self.tokenizer is None:
            raise OpenAIError("this model was loaded without a tokenizer: chat is unavailable")
        reservation = self._reserve(1, request.n)
        return await self._reserved(
            reservation, request.stream, self._chat(request, raw, reservation)
        )

    async def _chat(
        self, request: ChatCompletionRequest, raw: Request, reservation: Reservation
    ) -> Response:
        stop = self._stop_strings(request)
        k = request.top_logprobs or 0

        async def prepare():
            messages = request.template_messages(self._chat_template())
            ids = await self._off_loop(self._render_chat, messages, request.template_options())
            params = self._sampling_params(
                request,
                len(ids),
                request.requested_max_tokens,
                prompt_param="messages",
                logprobs=k if request.logprobs else None,
            )
            await self._check_grammar(params, "tools" if request.structured_by_tools else None)
            return ids, await self.runs.add([ids], [params])

        ids, streams = await unless_disconnected(raw, prepare())
        usage = Usage(len(ids))
        head = dict(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name
        )
        # Each choice's reader of reasoning and tool calls (chat_output.py).
        opens_reasoning = self.chat_format.reasoning is not None and self._opens_reasoning(ids)
        outputs = [self.chat_format.output(request, opens_reasoning) for _ in range(request.n)]
        keep = special_marker_ids(self.tokenizer, outputs[0].markers)
        texts = self.token_texts

        def logprobs_of(entries) -> dict | None:
            if not request.logprobs:
                return None
            return {"content": chat_logprobs(texts, k, entries or [])}

        if request.stream:

            async def events() -> AsyncIterator[str]:
                for index in range(len(streams)):
                    role = {"role": "assistant", "content": ""}
                    yield sse(_chat_chunk(head, role, None, index=index))
                async for index, delta in self.runs.merged_deltas(streams, stop, usage, keep):
                    output = outputs[index]
                    parsed = output.delta(delta.text, final=delta.finish_reason is not None)
                    if parsed or (request.logprobs and delta.logprobs):
                        parsed = parsed or {"content": ""}
                        yield sse(
                            _chat_chunk(head, parsed, None, logprobs_of(delta.logprobs), index)
                        )
                    if delta.finish_reason:
                        reason = output.finish_reason(delta.finish_reason)
                        yield sse(_chat_chunk(head, {}, reason, index=index))
                if request.include_usage:
                    yield sse(
                        {
                            **head,
                            "object": "chat.completion.chunk",
                            "choices": [],
                            "usage": usage.body(),
                        }
                    )

            return self.runs.event_stream(events(), streams, reservation)

        results = await self.runs.collect(streams, stop, usage, raw, keep)
        choices = [
            {
                "index": index,
                "message": outputs[index].message(result.text),
                "logprobs": logprobs_of(result.logprobs),
                "finish_reason": outputs[index].finish_reason(result.finish_reason),
            }
            for index, result in enumerate(results)
        ]
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": choices, "usage": usage.body()}
        )

    # -- checks ----------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                status=404,
                type=NOT_FOUND,
                param="model",
                code="model_not_found",
            )

    def _reserve(self, prompts: int, n: int) -> Reservation:
        """Check prompts x n against --max-samples-per-request (400) and hold them in the
        admission budget (503 when the server already holds --max-queued-samples)."""
        samples = prompts * n
        limit = self.limits.max_samples_per_request
        if samples > limit:
            raise OpenAIError(
                f"{prompts} prompt(s) x n={n} asks for {samples} samples; this server takes "
                f"at most {limit} per request (--max-samples-per-request)",
                param="n",
            )
        return self.admission.reserve(samples)

    async def _prepare_completion(self, request: CompletionRequest):
        """Tokenize, check and admit a completion's prompts: (prompt ids, params, choices)."""
        prompt_ids = await self._off_loop(self._all_prompt_ids, request.prompts)
        # echo with max_tokens 0: the prompt (and its logprobs) only; one token is
        # generated and dropped, as vLLM does.
        echo_only = request.echo and request.max_tokens == 0
        options = dict(logprobs=request.logprobs, best_of=request.best_of)
        if request.echo and request.logprobs is not None:
            options["prompt_logprobs"] = request.logprobs
        # Omitted: OpenAI's default (16); explicit null: the rest of the context (vLLM).
        max_tokens = 1 if echo_only else request.max_tokens
        params = [
            self._sampling_params(request, len(ids), max_tokens, **options) for ids in prompt_ids
        ]
        await self._check_grammar(params[0])
        for each in params[1:]:  # the same schema: one compile serves every prompt
            each.compiled_grammar = params[0].compiled_grammar
        return prompt_ids, params, await self.runs.add(prompt_ids, params)

    def _stop_strings(self, request) -> list[str]:
        stop = request.stop_strings
        if stop and self.tokenizer is None:
            raise OpenAIError("stop strings need a tokenizer; this model has none", param="stop")
        return stop

    def _all_prompt_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [self._prompt_ids(prompt) for prompt in prompts]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise OpenAIError(
                    "this model was loaded without a tokenizer: send token ids", param="prompt"
                )
            return self.llm.tokenize(prompt)
        try:
            check_token_ids("prompt", prompt, self.llm.hf_config.vocab_size)
        except SamplingParamError as error:
            raise OpenAIError(str(error), param=error.param) from None
        return prompt

    def _render_chat(self, messages: list[dict], options: dict | None = None) -> list[int]:
        """`options`: the template's other arguments (tools, add_generation_prompt...)."""
        options = options or {"add_generation_prompt": True}
        try:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **options)
        except (jinja2.TemplateError, ValueError) as error:  # e.g. "roles must alternate"
            raise OpenAIError(
                f"the chat template refused the messages: {error}", param="messages"
            ) from None
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _sampling_params(
        self,
        request,
        prompt_len: int,
        max_tokens: int | None,
        prompt_param: str = "prompt",
        **options,
    ) -> SamplingParams:
        """Check the prompt and max_tokens against max_model_len; None = all that is left."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise OpenAIError(
                f"the prompt has {prompt_len} tokens, but this model's context is {limit} "
                f"tokens (max_model_len), which must also leave room to generate",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise OpenAIError(
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds this "
                f"model's context of {limit} tokens (max_model_len); ask for at most "
                f"{limit - prompt_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            params = request.sampling_params(max_tokens, **options)
            params.check_token_ids(self.llm.hf_config.vocab_size)  # before the engine sees them
        except ValueError as error:  # SamplingParamError names the field
            raise OpenAIError(str(error), param=getattr(error, "param", None)) from None
        return params

    def _chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def _opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends inside `<think>` (reasoning.py)."""
        return prompt_opens_reasoning(self.tokenizer.decode(prompt_ids[-8:]))

    async def _check_grammar(self, params: SamplingParams, param: str | None = None) -> None:
        """An invalid json_schema, or one over the grammar limits, is a 400 (naming `param`,
        default response_format) before anything is queued. Checked and compiled on the
        grammar pool, within its timeout; the engine's compile of the same schema is then a
        handed to the engine with the params, so its thread never compiles."""
        if not params.structured:
            return
        if self.tokenizer is None:
            raise OpenAIError("structured output needs the model's tokenizer")
        limits = self.limits.grammar

        def compile_checked():
            if params.json_schema is not None:
                check_schema(params.json_schema, limits)
            return self.llm.grammar_backend().compile(params)

        try:
            params.compiled_grammar = await self.grammar_pool.run(compile_checked)
        except InvalidGrammarError as error:
            raise OpenAIError(str(error), param=param or "response_format") from None

    def _echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.llm.decode(ids)


def _completion_chunk(
    head: dict, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**head, "object": "text_completion", "choices": [choice]}


def _chat_chunk(
    head: dict, delta: dict, finish_reason: str | None, logprobs: dict | None = None, index: int = 0
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**head, "object": "chat.completion.chunk", "choices": [choice]}
