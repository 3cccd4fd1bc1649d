"""Streaming detokenisation that never emits broken UTF-8, and stop-string matching
across token boundaries."""

from __future__ import annotations

from .tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decode a growing token list into text deltas.

    Text is decoded over a short window (``prefix``..end) and compared with the window
    without the new tokens, so tokenizers that strip a leading space or merge bytes
    across tokens still give the exact same concatenated text as a full decode.  A delta
    ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token
    completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = 0  # pragma: no mutate (None slices the same as 0)
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix : self.read])
        now = self._decode(self.tokens[self.prefix :])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            delta = now[len(before) :]
            self.prefix, self.read = self.read, len(self.tokens)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an unfinished byte sequence at the very end)."""
        before = self._decode(self.tokens[self.prefix : self.read])
        now = self._decode(self.tokens[self.prefix :])
        self.prefix = self.read = len(self.tokens)
        return now[len(before) :] if len(now) > len(before) else ""


class StopMatcher:
    """Hold back text that could be the start of a stop string; report the first match.

    ``feed`` returns (text safe to emit, stopped).  Once stopped, the stop string and
    everything after it are dropped.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""  # pragma: no mutate (never read once stopped: flush returns "")
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.stopped else out
