"""The chat service (swiftlm/server/chat_service.py) on its own, for what the route tests cannot see: a
submission the engine refuses part-way frees the choices already admitted; the templated and the raw
(Ollama ``raw``) preparations build the same sampling parameters; error fields are renamed per route."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swiftlm.engine import QueueFull
from swiftlm.errors import InvalidRequest
from swiftlm.sampling import SamplingParams
from swiftlm.server.chat_service import ChatService, renamed
from swiftlm.server.errors import APIError
from swiftlm.server.schemas import ChatCompletionRequest


class RefusingEngine:
    """Admits ``admit`` sequences, then raises ``exc``; records what was cancelled."""

    def __init__(self, admit: int, exc: Exception):
        self.admit, self.exc = admit, exc
        self.submitted: list[int] = []
        self.cancelled: list[int] = []

    def submit(self, prompt, params, sink):
        if len(self.submitted) == self.admit:
            raise self.exc
        self.submitted.append(100 + len(self.submitted))
        return self.submitted[-1]

    def cancel(self, seq_id):
        self.cancelled.append(seq_id)


@pytest.mark.parametrize(
    "exc, status, code, param",
    [(QueueFull("queue is full"), 429, "queue_full", None), (InvalidRequest("no", param="seed"), 400, None, "seed")],
)
def test_a_refused_choice_cancels_the_choices_already_submitted(exc, status, code, param):
    engine = RefusingEngine(admit=2, exc=exc)
    service = ChatService(SimpleNamespace(engine=engine))
    with pytest.raises(APIError) as err:
        service.submit([1, 2, 3], SamplingParams(max_tokens=4), 4, sink=None)
    assert (err.value.status, err.value.code, err.value.param) == (status, code, param)
    assert str(err.value) == str(exc)
    assert engine.cancelled == engine.submitted == [100, 101]


def test_submit_returns_one_sequence_per_choice():
    engine = RefusingEngine(admit=10, exc=QueueFull("unused"))
    assert ChatService(SimpleNamespace(engine=engine)).submit([1], SamplingParams(max_tokens=4), 3, None) == [
        100,
        101,
        102,
    ]
    assert engine.cancelled == []


def test_raw_and_templated_requests_get_the_same_sampling_parameters(fake_llm):
    service = ChatService(SimpleNamespace(engine=fake_llm.engine, settings=fake_llm.settings))
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 10**6,  # beyond the context: cut to what fits
            "temperature": 0.7,
            "top_k": 5,
            "seed": 11,
            "stop": "\n\n",
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    job = asyncio.run(service.prepare(req, clamp_max_tokens=True))
    raw = service.prepare_raw(job.plan.text, req)
    ctx = fake_llm.engine.ctx_size
    assert job.params.max_tokens == ctx - len(job.prompt)
    assert raw.params.max_tokens == ctx - len(raw.prompt)
    assert (raw.params.temperature, raw.params.top_k, raw.params.seed, raw.params.stop) == (0.7, 5, 11, ["\n\n"])
    assert (raw.params.logprobs, raw.params.top_logprobs) == (True, 2)
    same_room = SamplingParams(**{**vars(raw.params), "max_tokens": job.params.max_tokens})
    assert same_room == job.params
    with pytest.raises(APIError) as err:  # not clamped: refused, naming the field
        asyncio.run(service.prepare(req))
    assert (err.value.status, err.value.param) == (400, "max_tokens")


def test_error_fields_are_renamed_for_the_route():
    def param(p, rename):
        return renamed(APIError(400, "x", param=p), rename).param

    rename = {"messages": "input", "response_format": "text"}
    assert param("messages[2].content", rename) == "input[2].content"
    assert param("messages", rename) == "input"
    assert param("response_format.json_schema", rename) == "text.json_schema"
    assert param("seed", rename) == "seed"
    assert param(None, rename) is None
    assert param("messages[0]", None) == "messages[0]"
