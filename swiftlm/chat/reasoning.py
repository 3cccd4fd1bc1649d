"""Split a thinking model's output into reasoning and answer, while streaming.

Markers: ``<think>…</think>`` (Qwen3, DeepSeek-R1, SmolLM3), ``[THINK]…[/THINK]`` (Magistral),
``◁think▷…◁/think▷`` (Kimi), ``<seed:think>…</seed:think>`` (Seed-OSS).  A template that opens
the thinking block itself (its generation prompt ends in ``<think>``) makes the output start
inside reasoning; ``ReasoningSplitter.for_prompt`` detects that from the rendered prompt.
"""

from __future__ import annotations

from .tool_calls import Piece

MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("◁think▷", "◁/think▷"), ("<seed:think>", "</seed:think>"))


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, open_pair: tuple[str, str] | None = None):
        """``open_pair``: the prompt already opened this thinking block."""
        self.pair = open_pair
        self.state = "reasoning" if open_pair else "start"
        self.buf = ""
        self.fresh = True

    @classmethod
    def for_prompt(cls, prompt_text: str) -> ReasoningSplitter:
        tail = prompt_text.rstrip()
        for start, end in MARKERS:
            i = tail.rfind(start)
            if i >= 0 and tail.find(end, i) < 0 and not tail[i + len(start) :].strip():
                return cls((start, end))
        return cls()

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                pair = next((p for p in MARKERS if stripped.startswith(p[0])), None)
                if pair:
                    self.pair, self.state = pair, "reasoning"
                    self.buf = stripped[len(pair[0]) :].lstrip("\n")
                    continue
                if stripped and not any(p[0].startswith(stripped) for p in MARKERS):
                    self.state = "content"
                    continue
                return out
            if self.state == "reasoning":
                assert self.pair is not None
                end = self.pair[1]
                if self.fresh:  # the newline(s) right after the opening marker are layout
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        return out
                    self.fresh = False
                j = self.buf.find(end)
                if j >= 0:
                    if j:
                        out.append(("reasoning", self.buf[:j]))
                    self.buf = self.buf[j + len(end) :]
                    self.state = "after"
                    continue
                hold = _held(self.buf, end)
                emit = self.buf[: len(self.buf) - hold]
                if emit:
                    out.append(("reasoning", emit))
                self.buf = self.buf[len(self.buf) - hold :]
                return out
            if self.state == "after":  # drop the blank lines between reasoning and answer
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.state = "content"
            if self.buf:
                out.append(("content", self.buf))
            self.buf = ""
            return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.buf:
            kind = "reasoning" if self.state == "reasoning" else "content"
            if self.state != "after":
                out.append((kind, self.buf))
        self.buf = ""
        return out
