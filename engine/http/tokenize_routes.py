"""vLLM's POST /tokenize and POST /detokenize, for clients that count tokens before they send."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.http.completions import chat_prompt_ids
from engine.http.errors import APIError
from engine.http.openai_routes import check_model, ignored_header, state_of
from engine.http.schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = state_of(request)
    if body.model is not None:
        check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    engine = state.engine
    if body.messages is not None:
        ids = chat_prompt_ids(state, body.messages, body.add_generation_prompt)
    else:
        tokenizer = engine.tokenizer
        ids = await asyncio.wrap_future(engine.run_io(lambda: tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]))
    payload = {"count": len(ids), "max_model_len": engine.info.max_length, "tokens": list(ids)}
    payload["token_strs"] = engine.tokenizer.convert_ids_to_tokens(list(ids)) if body.return_token_strs else None
    return JSONResponse(payload, headers=ignored_header(body))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = state_of(request)
    if body.model is not None:
        check_model(state, body.model)
    vocab = state.engine.info.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    text = await asyncio.wrap_future(state.engine.run_io(state.engine.tokenizer.decode, body.tokens))
    return JSONResponse({"prompt": text}, headers=ignored_header(body))
