"""Normalise OpenAI-style chat messages into what chat templates expect."""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidRequest

ROLES = {"system", "developer", "user", "assistant", "tool"}


def _content_text(content: Any, where: str, media: tuple[Any, list] | None = None) -> str:
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
            elif part["type"] in ("image_url", "input_image", "input_audio"):
                parts.append(_media_part(part, f"{where}.content[{j}]", media))
            else:
                raise InvalidRequest(
                    f"{where}.content[{j}] has unsupported type {part['type']!r}", param=f"{where}.content"
                )
        return "".join(parts)
    raise InvalidRequest(f"{where}.content must be a string, a list of parts or null", param=f"{where}.content")


def _media_part(part: dict, where: str, media: tuple[Any, list] | None) -> str:
    """Decode an image/audio part into the request's media list; the text gets a marker that
    ``media.expand`` replaces with the model's placeholder tokens after the template ran."""
    image = part["type"] != "input_audio"
    if media is None:
        what = "an image" if image else "audio"
        flag = "--vision and a vision-language model" if image else "--audio and an audio-language model"
        raise InvalidRequest(
            f"{where} is {what}, but this model/server takes text only (start with {flag})", param=where
        )
    from ..media import collect_part
    from ..media.processor import MARKER

    policy, bag = media
    kind = "image" if image else "audio"
    limit = policy.max_images if image else policy.max_audio_clips
    if sum(1 for it in bag if it.kind == kind) >= limit:
        flag = "--max-images" if image else "--max-audio-clips"
        raise InvalidRequest(
            f"{where}: too many {'images' if image else 'audio clips'} in one request (the limit is {limit}, {flag})",
            param=where,
        )
    bag.append(collect_part(part, where, policy))
    return MARKER.format(len(bag) - 1)


def normalize_messages(messages: Any, media: tuple[Any, list] | None = None) -> list[dict]:
    """Validate roles and flatten content to strings.  'developer' is rendered as
    'system', which is what open-weight chat templates know.  ``media``: (MediaPolicy, list) to
    accept image/audio parts: decoded items are appended to the list, markers left in the text."""
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
        msg["content"] = _content_text(m.get("content"), where, media)
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise InvalidRequest(
                    f"{where} has role 'tool' but no 'tool_call_id' string", param=f"{where}.tool_call_id"
                )
        if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
            raise InvalidRequest(f"{where}.reasoning_content must be a string", param=f"{where}.reasoning_content")
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """Check an assistant message's ``tool_calls`` and turn each ``arguments`` JSON string into
    the object chat templates expect (they write it back with ``tojson``)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                f"{where}.tool_calls[{j}] must have a 'function' with a 'name'", param=f"{where}.tool_calls"
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise InvalidRequest(
                    f"{where}.tool_calls[{j}].function.arguments is not valid JSON", param=f"{where}.tool_calls"
                ) from None
        if not isinstance(args, dict):
            raise InvalidRequest(
                f"{where}.tool_calls[{j}].function.arguments must be a JSON object", param=f"{where}.tool_calls"
            )
        out.append(
            {"id": c.get("id") or f"call_{j}", "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out
