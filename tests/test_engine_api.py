"""The Python API and the engine, once per backend: the real model for quality, a tiny random
checkpoint (fp32, deterministic) for mechanics."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import BACKENDS, needs_mlx, needs_torch

from swiftlm import SamplingParams
from swiftlm.errors import InvalidRequest


@pytest.mark.parametrize(
    "which", [pytest.param("mlx_llm", marks=needs_mlx), pytest.param("torch_llm", marks=needs_torch)]
)
def test_paris(request, which):
    llm = request.getfixturevalue(which)
    out = llm.generate(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=16, temperature=0)
    )
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its answer with <|im_end|>
    assert out.usage["prompt_tokens"] == len(out.prompt_token_ids) and out.usage["completion_tokens"] == len(
        out.token_ids
    )


def test_stream_equals_generate_and_length_finish(tiny_llm):
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = tiny_llm.generate("The quick brown fox", p)
    deltas = list(tiny_llm.stream("The quick brown fox", p))
    assert "".join(d.text for d in deltas) == full.text
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    assert deltas[-1].finish_reason == "length"
    assert full.text == tiny_llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_is_caught_and_stripped(tiny_llm):
    tok = tiny_llm.tokenizer
    base = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    pieces = [tok.decode([t]) for t in base.token_ids]
    # pick a stop string made of the end of token 5 and the start of token 6
    i = next(k for k in range(4, 19) if len(pieces[k].strip()) >= 2 and len(pieces[k + 1].strip()) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    prefix_text = "".join(pieces[: i + 1])
    out = tiny_llm.generate(
        "Once upon a time", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.index(stop)]
    assert stop not in out.text and len(out.text) <= len(prefix_text)


def test_seeded_requests_reproduce_and_do_not_disturb_each_other(tiny_llm):
    p1 = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    p2 = SamplingParams(max_tokens=16, temperature=1.0, seed=22, ignore_eos=True)
    solo1 = tiny_llm.generate("Hello", p1).token_ids
    solo2 = tiny_llm.generate("Goodbye now", p2).token_ids
    assert solo1 == tiny_llm.generate("Hello", p1).token_ids
    # both at once from two threads: the engine interleaves them (parallel=4)
    res = {}
    ts = [
        threading.Thread(target=lambda k, pr, pp: res.__setitem__(k, tiny_llm.generate(pr, pp).token_ids), args=a)
        for a in ((1, "Hello", p1), (2, "Goodbye now", p2))
    ]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert res == {1: solo1, 2: solo2}
    # batch API too
    outs = tiny_llm.generate(["Hello", "Goodbye now"], p1)
    assert outs[0].token_ids == solo1


def test_batch_of_prompts_and_n(tiny_llm):
    outs = tiny_llm.generate(["a b c", "x y z"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(outs) == 2 and all(len(o.token_ids) == 4 for o in outs)
    # the random model puts ~0.99 of its mass on one token at temperature 1; at temperature 10 the
    # distribution over 49K tokens is nearly flat, so three seeds agreeing on 4 tokens is ~impossible
    p = SamplingParams(max_tokens=4, temperature=10.0, seed=5, n=3, ignore_eos=True)
    one = tiny_llm.generate("a b c", p)
    assert [o.index for o in one.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in one.outputs}) == 3  # different seeds per choice
    # choice i is the request with seed 5 + i, whichever batch it ran in
    for i in range(3):
        solo = tiny_llm.generate("a b c", SamplingParams(max_tokens=4, temperature=10.0, seed=5 + i, ignore_eos=True))
        assert solo.token_ids == one.outputs[i].token_ids


def test_logprobs_through_the_api(tiny_llm):
    out = tiny_llm.generate("hi", SamplingParams(max_tokens=3, temperature=0, top_logprobs=2, ignore_eos=True))
    lps = out.outputs[0].logprobs
    assert len(lps) == 3
    for lp, tok in zip(lps, out.token_ids):
        assert lp.token == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert len(lp.top) == 2


def test_invalid_params_raise_before_running(tiny_llm):
    with pytest.raises(InvalidRequest) as e:
        tiny_llm.generate("hi", SamplingParams(top_p=2.0))
    assert e.value.param == "top_p"
    with pytest.raises(InvalidRequest):
        tiny_llm.generate([{"role": "wizard", "content": "x"}])


def test_stream_cancel_frees_the_slot(tiny_llm):
    eng = tiny_llm.engine
    it = tiny_llm.stream("count", SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    next(it), next(it)
    it.close()  # the caller stops iterating
    for _ in range(200):
        if eng.stats.requests_active == 0:
            break
        threading.Event().wait(0.02)
    assert eng.stats.requests_active == 0 and not eng.live_requests


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_llm(tiny_llama, backend):
    from swiftlm import AsyncLLM

    async def main():
        llm = AsyncLLM(str(tiny_llama), backend=backend)
        try:
            p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            full = await llm.generate("hello", p)
            chunks = [d async for d in llm.stream("hello", p)]
            return full, chunks
        finally:
            llm.close()

    full, chunks = asyncio.run(main())
    assert "".join(c.text for c in chunks) == full.text and len(full.token_ids) == 6
