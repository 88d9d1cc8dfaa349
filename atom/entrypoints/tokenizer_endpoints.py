"""vLLM's tokenizer endpoints and model/version look-ups.

    POST /tokenize     {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}
    POST /detokenize   {"tokens": [ids]} -> {"prompt": text}
    GET  /v1/models/{id}  the served model, or 404 in OpenAI's shape
    GET  /version      {"version": atom's version}

Tokenization runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

import atom
from atom.entrypoints.openai_errors import NOT_FOUND, OpenAIError
from atom.entrypoints.openai_protocol import ChatMessage
from atom.entrypoints.sampling_request import UnicodeChecked


class TokenizeRequest(UnicodeChecked):  # a lone surrogate is a 400, not a tokenizer crash
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    # no messages: a chat template has nothing to render (a 400, not its IndexError)
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def add_tokenizer_routes(app: FastAPI, serving, model_card) -> None:
    """Routes over `serving` (OpenAIServing); `model_card()` is the /v1/models entry."""

    def tokenizer():
        if serving.tokenizer is None:
            raise OpenAIError("this model was loaded without a tokenizer")
        return serving.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        serving._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("send exactly one of prompt and messages", param="prompt")
        tok = tokenizer()
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text} for m in body.messages]
            ids = await asyncio.to_thread(serving._render_chat, messages)
        else:
            ids = await asyncio.to_thread(
                tok.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        return JSONResponse(
            {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": list(ids)}
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        serving._check_model(body.model)
        vocab = serving.llm.hf_config.vocab_size
        if not all(t < vocab for t in body.tokens):
            raise OpenAIError(f"token ids must be in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(tokenizer().decode, body.tokens)
        return JSONResponse({"prompt": text})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != serving.model_name:
            raise OpenAIError(
                f"the model `{model_id}` does not exist; this server serves `{serving.model_name}`",
                status=404,
                type=NOT_FOUND,
                param="model",
                code="model_not_found",
            )
        return JSONResponse(model_card())

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": atom.__version__})
