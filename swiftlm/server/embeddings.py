"""POST /v1/embeddings (OpenAI wire format).

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists;
``encoding_format`` float (default) or base64 (little-endian float32, what the openai SDK asks
for); ``dimensions`` truncates and renormalises (for models trained for it). The vectors come
from the engine (``Engine.embed``: one job per request, run between decode steps)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import QueueFull
from ..errors import InvalidRequest
from .errors import APIError
from .wire import parse, read_json

MAX_INPUTS = 2048  # as OpenAI's embeddings endpoint


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input: Union[str, list[str], list[int], list[list[int]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def token_inputs(engine: Any, inp: Any) -> list[list[int]]:
    if isinstance(inp, str):
        inp = [inp]
    if not inp:
        raise APIError(400, "'input' is empty", param="input")
    if all(isinstance(x, int) for x in inp):  # one input given as token ids
        inp = [inp]
    if len(inp) > MAX_INPUTS:
        raise APIError(400, f"'input' has {len(inp)} items; at most {MAX_INPUTS} per request", param="input")
    out = []
    for x in inp:
        if isinstance(x, str):
            if not x:
                raise APIError(400, "'input' contains an empty string", param="input")
            out.append(engine.text_prompt(x))
        else:
            out.append(list(x))
    return out


def _encode(vec: Any, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return [float(v) for v in vec]


def routes(state: Any, chat: Any, needs_key: Callable[[], bool], guard: Callable) -> list[Route]:
    async def embeddings(request: Request) -> Response:
        body = await read_json(request, state.settings.max_body_bytes)
        req = parse(EmbeddingRequest, body)
        engine = chat.engine
        prompts = token_inputs(engine, req.input)
        try:
            vecs = await asyncio.wrap_future(engine.embed(prompts, req.dimensions))
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        except QueueFull as exc:
            raise APIError(503, str(exc), code="shutting_down") from None
        n = sum(len(p) for p in prompts)
        return JSONResponse(
            {
                "object": "list",
                "model": state.spec.name if state.spec else req.model,
                "data": [
                    {"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                    for i, v in enumerate(vecs)
                ],
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )

    return [Route("/v1/embeddings", guard(embeddings), methods=["POST"])]
