"""The GGUF-built tokenizer (tokenizers library only) against transformers' GGUF tokenizer."""

from __future__ import annotations

import pytest

from swiftlm.registry import resolve
from swiftlm.tokenizer import load_gguf_tokenizer

NO_DIGITS = [
    "What is the capital of France?",
    "Hello, world! Ünïcödé — naïve café.",
    "  two spaces, a tab\tand\nnewlines\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "Emoji 🦙 and 你好",
]


@pytest.fixture(scope="module")
def ours():
    return load_gguf_tokenizer(resolve(None).gguf_meta)


@pytest.fixture(scope="module")
def theirs(bundled_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(bundled_gguf.parent), gguf_file=bundled_gguf.name)


@pytest.mark.slow
@pytest.mark.parametrize("text", NO_DIGITS)
def test_same_ids_as_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_chat_template_renders_like_transformers(ours, theirs):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == theirs.apply_chat_template(
            msgs, add_generation_prompt=gen, tokenize=False
        )


def test_digits_are_split_one_by_one(ours):
    # SmolLM2's own HF tokenizer (and llama.cpp's 'smollm' pre-tokenizer) isolate every digit;
    # transformers' GGUF converter does not, which is why the comparison above avoids digits.
    ids = ours.encode("12345")
    assert [ours.decode([i]) for i in ids] == list("12345")


def test_special_tokens_and_eos(ours):
    assert ours.encode("<|im_end|>") == [2]
    assert ours.eos_token_ids == {2}
    assert ours.decode([1, 2], skip_special_tokens=True) == ""
