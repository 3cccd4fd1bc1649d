"""Prefix affinity for a router that sees HTTP requests, not tokens (Ray Serve's ingress).

A request's *prefix text* is the start of what the model will read: the system prompt and the messages' text in
order (chat, Anthropic messages, Responses), or the prompt (completions, Ollama generate).  A request whose prefix
text is longer than ``chars`` characters (default 256, about 64 tokens of English) has a key: the hash of its
first ``chars`` characters, with the function ``--data-parallel`` uses for its first 64 tokens.  Requests that share
the key (one conversation's turns, one agent's system prompt) go to one replica, whose prompt cache holds that
prefix.  Shorter requests have no key and go where the load is lowest.

Each replica's score for a key is a hash of (key, replica id); the key's home is the replica with the highest
score ("rendezvous" hashing).  Every router computes the same home without shared state, and adding or removing a
replica moves only the keys whose home it is or becomes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from ..distributed.replicas import prefix_key

AFFINITY_CHARS = 256


def _text(content: Any) -> str:
    """The text of a message's content: a string, or a list of parts (OpenAI / Anthropic text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                t = part.get("text", part.get("content"))
                out.append(t if isinstance(t, str) else "")
        return "".join(out)
    return ""


def prefix_text(body: Any) -> str:
    """The start of the prompt a request body asks for ("" for a body without one)."""
    if not isinstance(body, dict):
        return ""
    parts: list[str] = []
    for field in ("system", "instructions"):  # Anthropic's system, Responses' instructions
        if field in body:
            parts.append("system:" + _text(body[field]))
    msgs = body.get("messages")
    if msgs is None and isinstance(body.get("input"), list):  # Responses: a list of input items
        msgs = body["input"]
    if isinstance(msgs, list):
        for m in msgs:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}:{_text(m.get('content'))}")
    for field in ("prompt", "input"):  # completions, Ollama generate, Responses with a string input
        v = body.get(field)
        if isinstance(v, list) and v and isinstance(v[0], str):
            v = v[0]
        if isinstance(v, str):
            parts.append(v)
    return "\n".join(parts)


def affinity_key(body: Any, chars: int = AFFINITY_CHARS) -> str | None:
    """The request's affinity key (hex), or None when its prefix text is ``chars`` characters or shorter."""
    text = prefix_text(body)
    if chars <= 0 or len(text) <= chars:
        return None
    return prefix_key(text[:chars]).hex()


def score(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest()


def rank(key: str, replicas: Iterable[str]) -> list[str]:
    """Replica ids from the key's home to its last choice."""
    return sorted(replicas, key=lambda r: score(key, r), reverse=True)
