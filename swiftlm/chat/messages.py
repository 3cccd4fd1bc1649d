"""Normalise OpenAI-style chat messages into what chat templates expect."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest

ROLES = {"system", "developer", "user", "assistant", "tool"}


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, dict) or "type" not in part:
                raise InvalidRequest(f"{where}.content[{j}] must be an object with a 'type'", param=f"{where}.content")
            if part["type"] in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest(f"{where}.content[{j}].text must be a string", param=f"{where}.content")
                parts.append(text)
            elif part["type"] in ("image_url", "input_image"):
                raise InvalidRequest(f"{where}.content[{j}] is an image, but this model/server has no vision "
                                     "support (start with --vision and a vision-language model)", param=f"{where}.content")
            elif part["type"] == "input_audio":
                raise InvalidRequest(f"{where}.content[{j}] is audio, but this model/server has no audio "
                                     "support (start with --audio and an audio-language model)", param=f"{where}.content")
            else:
                raise InvalidRequest(f"{where}.content[{j}] has unsupported type {part['type']!r}", param=f"{where}.content")
        return "".join(parts)
    raise InvalidRequest(f"{where}.content must be a string, a list of parts or null", param=f"{where}.content")


def normalize_messages(messages: Any) -> list[dict]:
    """Validate roles and flatten content to strings.  'developer' is rendered as
    'system', which is what open-weight chat templates know."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", param=f"{where}.role")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _content_text(m.get("content"), where)
        out.append(msg)
    return out
