"""Tool-call and reasoning parsers on recorded outputs of each format, fed in arbitrary
chunk splits: the result must not depend on where the stream was cut."""

from __future__ import annotations

import json
import random

import pytest

from swiftlm.chat.plan import ChatOutputParser
from swiftlm.chat.reasoning import ReasoningSplitter
from swiftlm.chat.tool_calls import ToolCallParser, detect_format, merge, parse_all

NAMES = {"get_weather", "search"}

# (format, model output, expected content, expected calls as (name, arguments dict))
CASES = [
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "l\'été à Paris", "n": 3}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"}), ("search", {"q": "l'été à Paris", "n": 3})],
    ),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    (
        "llama3",
        '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "",
        [("search", {"q": "x"}), ("get_weather", {"city": "Oslo"})],
    ),
    ("llama3", "The answer is {not json} really.", "The answer is {not json} really.", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "search", "arguments": {"q": "y"}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("search", {"q": "y"})],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "", [("get_weather", {"city": "Rome"})]),
    (
        "gemma",
        'I will check.\n```tool_code\nget_weather(city="Paris")\n```',
        "I will check.\n",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "gemma",
        '[get_weather(city="Paris"), search(q="z", n=2)]',
        "",
        [("get_weather", {"city": "Paris"}), ("search", {"q": "z", "n": 2})],
    ),
]

# malformed: must come back as content, byte for byte
MALFORMED = [
    ("hermes", 'a <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> b'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),  # cut off
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # unknown function
    ("hermes", '<tool_call>["not", "an", "object"]</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"'),  # cut off
    ("llama3", '{"title": "a JSON answer, not a call"}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": "not json"}]'),
    ("mistral", "[TOOL_CALLS]get_weather{no args marker}"),
    ("gemma", "```tool_code\nimport os; os.system('x')\n```"),
    ("gemma", "```tool_code\nget_weather(__import__('os'))\n```"),
    ("gemma", "[1, 2, 3] is a list"),
]


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)]
    for _ in range(12):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def _run(fmt: str, chunks: list[str]) -> list:
    p = ToolCallParser(fmt, NAMES)
    pieces = []
    for c in chunks:
        pieces += p.feed(c)
    return merge(pieces + p.finish())


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_recorded_outputs_in_any_chunking(fmt, text, content, calls):
    rng = random.Random(len(text))
    for chunks in _splits(text, rng):
        pieces = _run(fmt, chunks)
        got_content = "".join(v for k, v in pieces if k == "content")
        got_calls = [(v.name, json.loads(v.arguments)) for k, v in pieces if k == "tool_call"]
        assert got_content == content, chunks
        assert got_calls == calls, chunks


@pytest.mark.parametrize("fmt,text", MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_calls_come_back_as_content(fmt, text):
    rng = random.Random(7)
    for chunks in _splits(text, rng):
        pieces = _run(fmt, chunks)
        assert all(k == "content" for k, _ in pieces), pieces
        assert "".join(v for _, v in pieces) == text


def test_content_streams_before_a_call_and_marker_prefixes_are_held():
    p = ToolCallParser("hermes", NAMES)
    assert p.feed("Hello <tool") == [("content", "Hello ")]  # "<tool" may open a call: held
    assert p.feed("box> world") == [("content", "<toolbox> world")]  # it did not
    assert p.feed('<tool_call>{"name": "search", ') == []
    out = p.feed('"arguments": {}}</tool_call>')
    assert [k for k, _ in out] == ["tool_call"] and out[0][1].name == "search"


def test_each_call_gets_a_unique_openai_id():
    pieces = parse_all("hermes", '<tool_call>{"name": "search", "arguments": {}}</tool_call>' * 3, NAMES)
    ids = [v.id for _, v in pieces]
    assert len(set(ids)) == 3 and all(i.startswith("call_") for i in ids)
    assert pieces[0][1].to_openai()["function"] == {"name": "search", "arguments": "{}"}


def test_format_detection_from_templates():
    assert detect_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_format("[TOOL_CALLS] {{ x }}") == "mistral"
    assert detect_format("<|python_tag|>") == "llama3"
    assert detect_format("```tool_code") == "gemma"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


REASONING = [
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", None, "The user wants 2+2.\n", "It is 4."),
    ("[THINK]short[/THINK]Answer.", None, "short", "Answer."),
    ("◁think▷k◁/think▷v", None, "k", "v"),
    ("No thinking here, <think> is just text.", None, "", "No thinking here, <think> is just text."),
    ("still reasoning</think>done", "<|im_start|>assistant\n<think>\n", "still reasoning", "done"),
    ("cut off in the middle of thou", "<|im_start|>assistant\n<think>\n", "cut off in the middle of thou", ""),
]


@pytest.mark.parametrize("text,prompt,reasoning,content", REASONING)
def test_reasoning_split_in_any_chunking(text, prompt, reasoning, content):
    for chunks in _splits(text, random.Random(3)):
        r = ReasoningSplitter.for_prompt(prompt) if prompt else ReasoningSplitter()
        pieces = []
        for c in chunks:
            pieces += r.feed(c)
        pieces = merge(pieces + r.finish())
        assert "".join(v for k, v in pieces if k == "reasoning") == reasoning, chunks
        assert "".join(v for k, v in pieces if k == "content") == content, chunks


def test_reasoning_then_tool_call():
    text = '<think>Need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    for chunks in _splits(text, random.Random(5)):
        p = ChatOutputParser(ReasoningSplitter(), ToolCallParser("hermes", NAMES))
        pieces = []
        for c in chunks:
            pieces += p.feed(c)
        pieces = merge(pieces + p.finish())
        assert [k for k, _ in pieces] == ["reasoning", "tool_call"], pieces
        assert pieces[0][1] == "Need the weather." and pieces[1][1].name == "get_weather"


def test_reasoning_finish_hands_back_what_is_held():
    r = ReasoningSplitter(("<think>", "</think>"))
    assert r.feed("abc</thi") == [("reasoning", "abc")]
    assert r.finish() == [("reasoning", "</thi")] and r.finish() == []
    r = ReasoningSplitter()
    assert r.feed("<thi") == [] and r.finish() == [("content", "<thi")]
    r = ReasoningSplitter()
    assert r.feed("<think>a</think>\n\n") == [("reasoning", "a")] and r.state == "after"
    assert r.finish() == []  # only the blank lines after the reasoning: nothing
    r = ReasoningSplitter()
    assert r.feed("<think>\n\n  x\n</think>\n\nanswer\n\n") == [("reasoning", "  x\n"), ("content", "answer\n\n")]
    r = ReasoningSplitter()
    assert (
        r.feed("<think>\n") == [] and r.feed("\nx") == [("reasoning", "x")] and r.feed("\ny") == [("reasoning", "\ny")]
    )
    r = ReasoningSplitter()
    assert (
        r.feed("hi") == [("content", "hi")] and r.state == "content" and r.feed(" <think>") == [("content", " <think>")]
    )
    r = ReasoningSplitter(("<think>", "</think>"))
    assert r.feed("a</think>b</think>c") == [("reasoning", "a"), ("content", "b</think>c")]
    r = ReasoningSplitter(("<think>", "</think>"))
    assert r.feed("a</thinx") == [("reasoning", "a</thinx")]


def test_reasoning_for_prompt_detects_an_open_block():
    assert ReasoningSplitter.for_prompt("<|im_start|>assistant\n<think>\n  ").state == "reasoning"
    assert ReasoningSplitter.for_prompt("<think>").pair == ("<think>", "</think>")
    assert ReasoningSplitter.for_prompt("x [THINK]\n").pair == ("[THINK]", "[/THINK]")
    assert ReasoningSplitter.for_prompt("<think>a</think>\n").state == "start"
    assert ReasoningSplitter.for_prompt("<think>a</think><think>\n").state == "reasoning"
    assert ReasoningSplitter.for_prompt("<think>\nhello").state == "start"  # text after the marker
    assert ReasoningSplitter.for_prompt("</think><think>").state == "reasoning"
    assert ReasoningSplitter.for_prompt("no markers").pair is None
    assert ReasoningSplitter.for_prompt("  <think>\n").state == "reasoning"
