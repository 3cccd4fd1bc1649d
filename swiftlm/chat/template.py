"""Jinja chat templates (the HF convention), rendered in a sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from ..errors import InvalidRequest


class TemplateError(InvalidRequest):
    pass


def _raise(message: str) -> None:
    raise TemplateError(f"chat template: {message}", param="messages")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        from jinja2 import TemplateError as JinjaError

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError:
            raise
        except JinjaError as exc:
            raise TemplateError(f"chat template failed to render these messages: {exc}", param="messages") from exc
        except (TypeError, KeyError, ValueError) as exc:
            raise TemplateError(f"chat template failed to render these messages: {exc}", param="messages") from exc
