"""Streaming detokenisation (never broken UTF-8) and stop strings across token boundaries."""

from __future__ import annotations

import pytest

from swiftlm.detokenizer import IncrementalDetokenizer, StopMatcher
from swiftlm.registry import resolve
from swiftlm.tokenizer import load_gguf_tokenizer

TEXTS = [
    "Hello, world! Ünïcödé — naïve café.",
    "Emoji: 🦙🚀👩‍👩‍👧 and CJK: 你好，世界。日本語のテキスト。",
    "  leading spaces\n\ttabs and 12345 digits\r\n",
    "مرحبا بالعالم 🌍 Здравствуй мир",
]


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(resolve(None).gguf_meta)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_is_valid_utf8(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    for p in pieces:
        assert "\ufffd" not in p
        p.encode("utf-8")


def test_multibyte_char_split_over_tokens_is_held_back(tok):
    ids = tok.encode("🦙")
    assert len(ids) > 1  # byte-level BPE splits this emoji
    d = IncrementalDetokenizer(tok)
    assert [d.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "🦙"


def _run(stops, chunks):
    m = StopMatcher(stops)
    out, stopped = "", False
    for c in chunks:
        t, stopped = m.feed(c)
        out += t
        if stopped:
            break
    if not stopped:
        out += m.flush()
    return out, stopped


@pytest.mark.parametrize("chunks", [["Hello EN", "D there"], ["Hello E", "N", "D", " there"], ["Hello END there"]])
def test_stop_string_across_chunks(chunks):
    assert _run(["END"], chunks) == ("Hello ", True)


def test_partial_stop_prefix_is_released_when_it_does_not_match():
    assert _run(["END"], ["Hello E", "nd of it"]) == ("Hello End of it", False)
    assert _run(["END"], ["tail E"]) == ("tail E", False)


def test_earliest_of_several_stops_wins():
    assert _run(["xyz", "b"], ["a", "bcxyz"]) == ("a", True)


def test_special_tokens_are_skipped_unless_asked(tok):
    ids = tok.encode("<|im_end|>hi")
    assert len(ids) == 2
    d = IncrementalDetokenizer(tok)
    assert d.skip is True and d.add(ids[0]) == "" and d.add(ids[1]) == "hi"
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert d.add(ids[0]) == "<|im_end|>" and d.add(ids[1]) == "hi"


def test_flush_returns_an_unfinished_sequence_and_resets_the_window(tok):
    ids = tok.encode("a🦙")
    d = IncrementalDetokenizer(tok)
    assert [d.add(i) for i in ids[:-1]] == ["a"] + [""] * (len(ids) - 2)
    assert d.flush() == "\ufffd"  # the held bytes, as the full decode shows them
    assert (d.prefix, d.read) == (len(ids) - 1, len(ids) - 1)
    assert d.flush() == ""
    assert d.add(tok.encode("b")[0]) == "b"
    d = IncrementalDetokenizer(tok)
    assert d.flush() == ""


def test_stop_matcher_feed_and_flush_contract():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""
    m = StopMatcher(["", "END"])
    assert m.stops == ["END"] and m.stopped is False
    assert m.feed("abc") == ("abc", False)  # nothing that could start a stop: nothing held
    assert m.feed("xEN") == ("x", False) and m.pending == "EN"
    assert m.flush() == "EN" and m.flush() == ""
    assert m.feed("zz") == ("zz", False)
    m = StopMatcher(["END"])
    assert m.feed("aENDbEND") == ("a", True)  # the first occurrence
    assert m.stopped is True
    assert m.feed("more") == ("", True)
    assert m.flush() == ""
    m = StopMatcher(["ab", "b"])
    assert m.feed("xa") == ("x", False) and m.feed("b") == ("", True)
