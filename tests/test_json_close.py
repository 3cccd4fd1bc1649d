"""closing_suffix: every prefix of real JSON documents, closed, parses (and a complete value or
non-JSON text gets None)."""

from __future__ import annotations

import json

import pytest

from swiftlm.chat.json_close import closing_suffix

DOCS = [
    {"name": "Ada", "age": 36, "tags": ["math", "engines"], "ok": True, "none": None, "ratio": -1.5e-3},
    [1, 2.5, -3e2, {"a": [[], {}]}, 'x"y\\z', "\u00e9\u4e2d\ud83d\ude00", False],
    {"nested": {"deep": {"deeper": [{"k": "v"}, {"k2": [1, [2, [3]]]}]}}, "esc": 'line\nbreak\ttab \\ " /'},
    {"empty": {}, "arr": [], "s": "", "n": 0, "u": "\\u0041"},
]


@pytest.mark.parametrize("doc", DOCS)
@pytest.mark.parametrize("ascii_only", [True, False])
@pytest.mark.parametrize("indent", [None, 2])
def test_every_prefix_closes_to_valid_json(doc, ascii_only, indent):
    text = json.dumps(doc, ensure_ascii=ascii_only, indent=indent)
    for i in range(1, len(text)):
        prefix = text[:i]
        suffix = closing_suffix(prefix)
        assert suffix is not None, prefix
        json.loads(prefix + suffix)  # raises if not valid JSON
    assert closing_suffix(text) is None  # already complete


def test_not_json_or_complete():
    assert closing_suffix("hello {") is None
    assert closing_suffix("<tool_call>\n{") is None
    assert closing_suffix('{"a": 1} trailing') is None
    assert closing_suffix("   ") is None
    assert closing_suffix('{"a": nul') == "l}"
    assert closing_suffix('{"a": tr') == "ue}"
    assert closing_suffix('{"a"') == ":null}"
    assert closing_suffix('{"a":') == "null}"
    assert closing_suffix("[1,") == "null]"
    assert closing_suffix('{"a":1,') == '"":null}'


def test_structured_output_cut_by_max_tokens_still_parses(torch_llm):
    """The bundled model under a JSON grammar with a small max_tokens: every output parses and none
    is longer than max_tokens (without json_close most would be cut mid-structure)."""
    from swiftlm import SamplingParams
    from swiftlm.chat.structured import grammar_for

    grammar = grammar_for({"type": "json_object"})
    prompt = torch_llm.engine.chat_prompt([{"role": "user", "content": "Describe a cat as JSON."}])
    for mt in (12, 24):
        # seeds 0..3 as the four choices of one request (choice i: seed 0 + i), decoded in one batch
        outs = torch_llm.generate(prompt, SamplingParams(max_tokens=mt, temperature=0.8, seed=0, n=4, grammar=grammar))
        assert len(outs.outputs) == 4
        for o in outs.outputs:
            json.loads(o.text)
            assert len(o.token_ids) <= mt and o.finish_reason in ("length", "stop")


def test_repetition_guard_ends_a_loop():
    from swiftlm.stepper import _repeats

    block = [5, 6, 7]
    assert _repeats([1, 2] + block * 6, 6) and not _repeats([1, 2] + block * 5, 6)
    assert not _repeats([0, 1] * 20, 6)  # a period under 3 tokens (e.g. a zero vector) is not a loop
    assert _repeats(list(range(10)) * 6, 6)


def test_a_loop_is_closed_and_the_text_parses(torch_llm, monkeypatch):
    """The repetition guard's ending keeps every forced token's text (an end marked 'stop' on the
    last forced token must not drop it, as it would for EOS)."""
    from swiftlm import SamplingParams
    from swiftlm.chat.structured import grammar_for

    eng = torch_llm.engine
    monkeypatch.setattr(eng.stepper, "json_repeat_guard", 2)  # trip it early
    grammar = grammar_for({"type": "json_object"})
    prompt = eng.chat_prompt([{"role": "user", "content": "Nested JSON please."}])
    stops = 0
    # seeds 0..7 as the eight choices of one request (choice i: seed 0 + i), decoded together
    outs = torch_llm.generate(prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=0, n=8, grammar=grammar))
    assert len(outs.outputs) == 8
    for o in outs.outputs:
        json.loads(o.text)
        stops += o.finish_reason == "stop"
    assert stops  # the guard (or EOS after a complete object) ended some before the limit


def test_edges_of_the_state_machine():
    assert closing_suffix('  \n{"a"') == ":null}"  # leading whitespace is skipped
    assert closing_suffix('["\\') == 'n"]'  # an escape owed at the very first string character
    assert closing_suffix('["\\u1') == '000"]'
    assert closing_suffix("[1E") == "0]" and closing_suffix("[1e") == "0]" and closing_suffix("[1e+") == "0]"
    assert closing_suffix("[1.5E3") == "]" and closing_suffix("[-") == "0]"
    assert closing_suffix("[tx") is None  # no literal starts so
    assert closing_suffix("[1X") is None and closing_suffix("X{") is None and closing_suffix("[1 ?") is None
    assert closing_suffix("[true") == "]" and closing_suffix("[f") == "alse]"
    assert closing_suffix('{"a": [1, {"b": "c') == '"}]}'
    assert closing_suffix("]") is None and closing_suffix("[1]]") is None
