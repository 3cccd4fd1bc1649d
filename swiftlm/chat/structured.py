"""Structured output (``response_format`` json_object / json_schema) by constrained decoding.

llguidance compiles the schema to a grammar and, per step, computes the set of tokens that
keep the output a valid prefix; the sampler masks every other token before sampling (see
``sampler.sample_row``).  Chosen over xgrammar/outlines-core because it builds its token
trie straight from a ``tokenizers`` JSON (no transformers or torch on the MLX path), hands
the mask as plain bytes (fed to MLX or torch logits through the ops shim) and computes a
mask cheaply enough to run on every decode step (scripts/bench_structured.py times it).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from ..errors import InvalidRequest

_LOCK = threading.Lock()
_TOKENIZERS: dict[int, Any] = {}


def _lltokenizer(tokenizer: Any) -> Any:
    import llguidance

    key = id(tokenizer)
    with _LOCK:
        if key not in _TOKENIZERS:
            eos = sorted(tokenizer.eos_token_ids)
            _TOKENIZERS[key] = llguidance.LLTokenizer(
                tokenizer.tok.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos[0] if eos else None
            )
        return _TOKENIZERS[key]


def grammar_for(response_format: dict[str, Any]) -> str | None:
    """The llguidance grammar for an OpenAI ``response_format`` (None for plain text)."""
    import llguidance

    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise InvalidRequest(
                "'response_format.json_schema' must be an object with a 'schema' object", param="response_format"
            )
        schema = js.get("schema") or {"type": "object"}
    else:
        raise InvalidRequest(
            f"'response_format.type' {kind!r} is not one of text, json_object, json_schema", param="response_format"
        )
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except Exception as exc:  # llguidance raises ValueError on schemas it cannot compile
        raise InvalidRequest(f"invalid JSON schema: {exc}", param="response_format") from None
    is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_err:
        raise InvalidRequest(f"invalid JSON schema: {msgs[0] if msgs else 'rejected'}", param="response_format")
    return grammar


class Constraint:
    """A per-sequence grammar matcher: ``allowed()`` -> bool[vocab], ``consume(token)``."""

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(_lltokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidRequest(f"invalid grammar: {self.matcher.get_error()}", param="response_format")
        self.vocab_size = vocab_size
        self.n_tok = tokenizer.vocab_size

    def allowed(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.n_tok].astype(bool)
        if self.vocab_size > mask.shape[0]:  # model rows past the tokenizer's vocab are never allowed
            mask = np.concatenate([mask, np.zeros(self.vocab_size - mask.shape[0], dtype=bool)])
        return mask[: self.vocab_size]

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()
