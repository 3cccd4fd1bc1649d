"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (issue 19).

Routes are built by ``routes(state, chat, needs_key)``; ``chat`` is the app's ``OpenAIRoutes``
(the shared request-to-engine path), ``needs_key()`` says whether an API key is required."""

from __future__ import annotations

from typing import Any, Callable

from starlette.routing import Route


def routes(state: Any, chat: Any, needs_key: Callable[[], bool]) -> list[Route]:
    return []
